"""`python -m g2rl_jax.bench chaos`: a chaos soak. A run in a bucket (fake-gcs-server on loopback behind the proxy
that behaves as GCS, bench/gcs_proxy.py) meets at least --faults faults at random moments, at least --during-save of
them while a checkpoint is being written, and the soak, as a supervisor following control/exits.py's action table,
relaunches what ended until the run finishes; the finished run is then compared with the same run uninterrupted, and
a fresh run starts until every fault was served.

Faults (--kinds):
  kill      kill -9 of one process of the launch (the trainer, the second trainer process, the rollout process)
  stop      SIGSTOP of the whole launch once it holds the lease; a new launch (other hosts) takes the run over once
            the lease lapsed; then SIGCONT: the thawed holder must stop by itself, writing nothing
  outage    every request dropped for --outage-s seconds
  late      replies delayed 1-5 s (30% of requests) for --window-s seconds
  lost      replies dropped after the server applied the update, or a 503 instead of them (30% of updates)
  storm429  429 to half the requests for --window-s seconds
  storm503  503 to half the requests for --window-s seconds
Layouts (--layout): one (one trainer process), two (two trainer processes joined by jax.distributed, gloo), sides
(one process per side: mesh.rollout_processes=1, rollout.max_staleness=1); chaos_launch.py starts them.

Reported: per kind its count, how many came during a save, and their outcomes (absorbed: the run went on; the exit
codes and the supervisor's action; a thawed holder's exit); totals of lost records, doubled records (metrics.jsonl
lines and TensorBoard events), steps whose metrics differ from the uninterrupted run's, writes by a fenced-out holder
(the proxy's log: a write by a launch after another launch took the run's lease), and human steps (a relaunch the
supervisor would not have made: an exit whose action is "stop", a process that hung); and each relaunch's seconds to
its "resumed from the checkpoint" line and to its first step after it. `python -m g2rl_jax.bench preempt` is this
soak with kill -9 only, on one process (bench/preempt.py). The checks: bench/chaos_checks.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from g2rl_jax import cli, storage
from g2rl_jax.bench import chaos_checks
from g2rl_jax.bench.chaos_launch import LAYOUTS, ROOT, Launch, Saves, layout, unshare_prefix
from g2rl_jax.control.exits import FINISHED, STOP, action

KINDS = ("kill", "stop", "outage", "late", "lost", "storm429", "storm503")
STORAGE = ("outage", "late", "lost", "storm429", "storm503")
PEER_S = 180.0  # a launch with a process ended and others still running this long: hung (jax's heartbeat is 100 s)
SETTLE_S = 20.0  # a storage fault the launch outlived by this long after its window was absorbed


def parse_args(argv, prog: str = "python -m g2rl_jax.bench chaos"):
    p = cli.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=LAYOUTS, default="two", help="the run's processes (default two)")
    p.add_argument("--faults", type=int, default=30, help="faults to serve, at least (default 30)")
    p.add_argument("--during-save", type=int, default=5, help="of them while a checkpoint is written (default 5)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds drawn from (default {','.join(KINDS)})")
    p.add_argument("--steps", type=int, default=6, help="run.total_steps of each run (default 6)")
    p.add_argument("--eval-every", type=int, default=2, help="run.eval_every (default 2; 0: no validation)")
    p.add_argument("--lease", type=float, default=12.0, help="run.lock_lease_seconds (default 12)")
    p.add_argument("--outage-s", type=float, default=30.0, help="an outage's seconds (default 30)")
    p.add_argument("--window-s", type=float, default=15.0, help="a storm's or a slow window's seconds (default 15)")
    p.add_argument("--after-checkpoint", action="store_true",
                   help="each fault the moment a launch committed a new checkpoint (with --kinds kill --faults 1 "
                        "--layout one --lease 60: a relaunch's time to resume with the default lease)")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults and their moments")
    p.add_argument("--keep", action="store_true", help="keep the launches' logs (the directory is printed)")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        p.error(f"--kinds: unknown {unknown}; choose from {','.join(KINDS)}")
    if args.during_save > args.faults:
        p.error(f"--during-save {args.during_save} is more than --faults {args.faults}")
    return Options(**{**vars(args), "kinds": kinds})


@dataclasses.dataclass(frozen=True)
class Options:
    layout: str = "two"
    faults: int = 30
    during_save: int = 5
    kinds: tuple[str, ...] = KINDS
    steps: int = 6
    eval_every: int = 2
    lease: float = 12.0
    outage_s: float = 30.0
    window_s: float = 15.0
    after_checkpoint: bool = False
    seed: int = 0
    keep: bool = False


@dataclasses.dataclass
class Fault:
    kind: str
    at_save: bool  # scheduled to come while a checkpoint is written
    during_save: bool = False  # came while one was
    launch: int = 0
    outcome: str | None = None
    settle_at: float = float("inf")  # a storage fault: absorbed if its launch still runs then


class Soak:
    """The supervisor and the fault injector of one soak (see the module docstring)."""

    def __init__(self, opts: Options, root: Path, emulator, model: str, evalset: str):
        self.opts, self.root, self.emulator, self.proxy = opts, root, emulator, emulator.proxy
        self.rng = random.Random(opts.seed)
        self.prefix = unshare_prefix()
        self.env = {**os.environ, "PYTHONPATH": ROOT, storage.CACHE_ENV: str(root / "cache"),
                    "G2RL_JAX_FLUSH_SECONDS": "2"}
        self.layout = layout(opts.layout, [
            f"model.path={model}", f"run.total_steps={opts.steps}", "run.checkpoint_every=1", "run.keep_checkpoints=2",
            f"run.eval_every={opts.eval_every}", f"data.eval_datasets={evalset}", "data.eval_samples=2",
            "data.prompts_per_step=4", "rollout.num_samples=4", "algorithm.mini_batch_size=8",
            "algorithm.micro_batch_size=8", f"run.lock_lease_seconds={opts.lease:g}",
            f"run.compilation_cache_dir={os.environ.get('JAX_COMPILATION_CACHE_DIR') or root / 'jax_cache'}"])
        self.launches: dict[int, Launch] = {}
        self.launch_of: dict[int, int] = {}  # pid -> launch
        self.proxy.who = self._who
        self.faults: list[Fault] = []
        self.human: list[str] = []
        self.totals = Counter()
        self.resume_s: list[float] = []
        self.first_step_s: list[float] = []
        self.span = 0.0

    # -------------------------------------------------------------------------------------------- launches
    def _who(self, pid: int | None) -> int | None:
        """The launch whose process (or a child of it) `pid` is."""
        while pid and pid > 1:
            if pid in self.launch_of:
                return self.launch_of[pid]
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    pid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return None
        return None

    def _launch(self, out: str) -> Launch:
        number = len(self.launches) + 1
        launch = Launch(number, self.layout, out, self.env, self.root, self.prefix)
        self.launches[number] = launch
        self.launch_of.update({pid: number for pid in launch.pids})
        return launch

    def _lock_writes(self, launch: Launch) -> list:
        """The successful writes of `launch`'s run lock (by any launch), from the proxy's log."""
        from g2rl_jax.control.runlock import LOCK_FILE

        lock = f"{launch.out.removeprefix('gs://')}/{LOCK_FILE}"
        return [r for r in list(self.proxy.log) if r.obj == lock and r.kind == "upload" and 200 <= r.status < 300]

    def _lock_taken_by_other(self, launch: Launch, since: float) -> bool:
        return any(r.who not in (None, launch.number) and r.t > since for r in self._lock_writes(launch))

    def _holds_lock(self, launch: Launch) -> bool:
        """`launch` holds the lease and knows it: it wrote the run lock and renewed it since (a renewal is conditional
        on the generation its take wrote). A stop fault freezes a holder, not a launch still starting: one frozen
        after its take reached the store but before its reply did is still starting, and, thawed, finds the run
        held by the launch that took it meanwhile (refused at its start: exit 2)."""
        return sum(r.who == launch.number and r.t >= launch.started for r in self._lock_writes(launch)) >= 2

    # -------------------------------------------------------------------------------------------- the reference
    def reference(self) -> tuple[list[dict], Counter]:
        """The uninterrupted run: its metrics lines and TensorBoard events; sets the span faults are drawn from."""
        from g2rl_jax.train.metrics import metric_lines

        out = self.emulator.url("reference")
        launch = self._launch(out)
        while not launch.ended():
            time.sleep(0.2)
        self.span = launch.ended_at - launch.started
        if launch.codes()[0] != 0:
            raise RuntimeError(f"the uninterrupted run failed ({launch.codes()}):\n{launch.log()[-3000:]}")
        return metric_lines(out), chaos_checks.event_counts(f"{out}/tensorboard")

    # -------------------------------------------------------------------------------------------- faults
    def _schedule(self) -> list[Fault]:
        kinds = [self.opts.kinds[i % len(self.opts.kinds)] for i in range(self.opts.faults)]
        self.rng.shuffle(kinds)
        at_save = set(self.rng.sample(range(self.opts.faults), self.opts.during_save))
        return [Fault(kind, i in at_save or self.opts.after_checkpoint) for i, kind in enumerate(kinds)]

    def _inject(self, fault: Fault, launch: Launch, saves: Saves) -> Launch:
        """Serve `fault` to `launch`; returns the launch that holds the run now (a new one after a stop)."""
        from g2rl_jax.bench.gcs_faults import Rule
        from g2rl_jax.storage_clients import UPDATES

        fault.launch, fault.during_save = launch.number, saves.saving(launch.started)
        launch.faults.append(fault)
        self.faults.append(fault)
        window = self.opts.outage_s if fault.kind == "outage" else self.opts.window_s
        rule = {"outage": lambda: Rule("drop"),
                "late": lambda: Rule("late", rate=0.3, seconds=self.rng.uniform(1.0, 5.0)),
                "lost": lambda: Rule(self.rng.choice(("lost", "lost503")), rate=0.3, kinds=UPDATES),
                "storm429": lambda: Rule("429", rate=0.5), "storm503": lambda: Rule("503", rate=0.5)}.get(fault.kind)
        if rule is not None:
            self.proxy.plan.add(rule(), seconds=window)
            fault.settle_at = time.monotonic() + window + SETTLE_S
        elif fault.kind == "kill":
            launch.victim = self.rng.randrange(len(launch.procs))
            launch.signal(signal.SIGKILL, [launch.victim])
        else:  # stop: frozen past the lease; a new launch (other hosts) takes over
            launch.signal(signal.SIGSTOP)
            launch.frozen_at = time.monotonic()
            return self._launch(launch.out)
        return launch

    # -------------------------------------------------------------------------------------------- outcomes
    def _ended(self, launch: Launch) -> str:
        """The supervisor's reading of an ended launch: 'finished', 'relaunch' or 'stop' (a human step, noted)."""
        codes = launch.codes()
        if codes[0] == 0 and all(action(c) != STOP for c in codes):
            verdict = FINISHED
        else:
            actions = [action(c) for i, c in enumerate(codes) if i != launch.victim]
            verdict = STOP if STOP in actions else "relaunch"
        if verdict == STOP:
            said = "; ".join(f"process {i}: {_last_line(launch.log(i))}" for i in range(len(codes)))
            self.human.append(f"launch {launch.number} ended with exit codes {codes}: a supervisor stops ({said})")
        label = f"{'finished' if verdict == FINISHED else verdict}: exit {codes}" + (
            f", process {launch.victim} killed" if launch.victim is not None else "")
        for fault in launch.faults:
            fault.outcome = fault.outcome or ("absorbed" if verdict == FINISHED else label)
        return verdict

    def _tend_frozen(self, old: Launch) -> bool:
        """A launch stopped by a stop fault: thawed once another launch took its lease (or a generous deadline
        passed), then watched until it ends by itself; True once it is done with."""
        now = time.monotonic()
        fault = old.faults[-1]
        if old.thawed_at is None:
            if now - old.frozen_at >= self.opts.lease and (self._lock_taken_by_other(old, old.frozen_at) or
                                                            now - old.frozen_at > 3 * self.opts.lease + 600):
                old.signal(signal.SIGCONT)
                old.thawed_at = now
            return False
        if old.ended():
            fault.outcome = f"thawed holder exited {old.codes()} by itself"
            said = "; ".join(_last_line(old.log(i)) for i in range(len(old.codes())))
            print(f"[{now - self.t0:.0f} s] launch {old.number}, thawed, exited {old.codes()}: {said}", flush=True)
            return True
        if now - old.thawed_at > 2 * self.opts.lease + 120:
            old.kill()
            fault.outcome = "thawed holder hung: killed by hand"
            self.human.append(f"launch {old.number} (thawed) still ran {now - old.thawed_at:.0f} s after SIGCONT")
            return True
        return False

    # -------------------------------------------------------------------------------------------- one run
    def run(self, out: str, pending: list[Fault]) -> None:
        """Launch on `out` and serve the pending faults until the run finishes."""
        saves = Saves(self.proxy, out)
        launch, fresh, frozen = self._launch(out), True, []
        fire_at, committed = self._moment(fresh), 0
        resumed_at = None
        while True:
            now = time.monotonic()
            frozen = [o for o in frozen if not self._tend_frozen(o)]
            for fault in self.faults:
                if fault.outcome is None and now > fault.settle_at and not self.launches[fault.launch].ended():
                    fault.outcome = "absorbed"
            if launch.ended():
                verdict = self._ended(launch)
                if verdict == FINISHED:
                    if fresh and not launch.faults:  # a whole warm launch (compiled programs cached): the new span
                        self.span = launch.ended_at - launch.started
                    break
                launch, fresh, resumed_at = self._launch(out), False, None
                fire_at, committed = self._moment(fresh), saves.newest()
                continue
            partial = launch.some_ended_since()
            if partial is not None and now - partial > PEER_S:
                self.human.append(f"launch {launch.number}: processes still ran {PEER_S:.0f} s after another ended "
                                  f"({launch.codes()}); killed by hand")
                launch.kill()
                continue
            resumed_at = self._time_resume(launch, fresh, saves, resumed_at)
            if pending and not self._storage_window() and launch.frozen_at is None and launch.victim is None:
                fault = pending[0]
                due = (saves.newest() > committed if self.opts.after_checkpoint else
                       saves.saving(launch.started) if fault.at_save else now - launch.started >= fire_at)
                due = due and (fault.kind != "stop" or self._holds_lock(launch))
                if due:
                    pending.pop(0)
                    old = launch
                    launch = self._inject(fault, launch, saves)
                    print(f"[{now - self.t0:.0f} s] fault {len(self.faults)}/{self.opts.faults} {fault.kind}"
                          f"{' during a save' if fault.during_save else ''} on launch {old.number}", flush=True)
                    if launch is not old:
                        frozen.append(old)
                        fresh, resumed_at = False, None
                    fire_at = self._moment(fresh, now - launch.started)
            time.sleep(0.1)
        for old in frozen:  # a run that finished while a thawed holder still ran
            while not self._tend_frozen(old):
                time.sleep(0.2)

    def _moment(self, fresh: bool, elapsed: float = 0.0) -> float:
        """Seconds after a launch's start for its next fault, `elapsed` seconds after it: uniform over what is left
        of a launch-to-end span (a relaunch's one lease longer: it first waits out the killed holder's lease)."""
        life = self.span + (0.0 if fresh else self.opts.lease)
        return elapsed + self.rng.uniform(0, max(life - elapsed, 10.0))

    def _storage_window(self) -> bool:
        return any(f.kind in STORAGE and f.outcome is None for f in self.faults)

    def _time_resume(self, launch: Launch, fresh: bool, saves: Saves, resumed_at):
        """A relaunch's seconds to its "resumed from the checkpoint of step N" line, then to its first checkpoint
        written after it (its first step: checkpoint_every=1)."""
        if fresh or launch.faults or launch.frozen_at is not None:
            return resumed_at
        now = time.monotonic()
        if resumed_at is None and int(now * 5) != int((now - 0.1) * 5):  # the log read 5 times a second
            said = launch.log()
            if "resumed from the checkpoint of step " in said:
                self.resume_s.append(now - launch.started)
                return int(said.split("resumed from the checkpoint of step ")[1].split()[0])
        if resumed_at is not None and resumed_at >= 0:
            saves.update()  # read here too: once every fault was served nothing else reads the proxy's log
        if resumed_at is not None and resumed_at >= 0 and any(
                s > resumed_at and t >= launch.started for s, t in saves.written.items()):
            self.first_step_s.append(now - launch.started)
            return -1  # measured
        return resumed_at

    # -------------------------------------------------------------------------------------------- the soak
    def soak(self) -> dict:
        from g2rl_jax.control.runlock import LOCK_FILE
        from g2rl_jax.train.metrics import metric_lines

        self.t0 = time.monotonic()
        want, want_events = self.reference()
        print(f"uninterrupted run: {self.opts.steps} steps, {self.span:.0f} s from launch to end; layout "
              f"{self.opts.layout}; hosts by {' '.join(self.prefix) if self.prefix else 'none (one hostname)'}; lease "
              f"{self.opts.lease:g} s", flush=True)
        pending, runs = self._schedule(), 0
        while pending:
            runs += 1
            out = self.emulator.url(f"runs/{runs}")
            self.run(out, pending)
            got = chaos_checks.compare(metric_lines(out), want)
            events = chaos_checks.event_counts(f"{out}/tensorboard")
            got["doubled_events"] = chaos_checks.event_doubles(events)
            got["lost_events"] = sum(1 for key in want_events if key not in events)
            self.totals.update(got)
            print(f"[{time.monotonic() - self.t0:.0f} s] run {runs} finished: {got}", flush=True)
        fenced = [r for n in range(1, runs + 1) for r in chaos_checks.fenced_writes(
            list(self.proxy.log), self.emulator.url(f"runs/{n}").removeprefix("gs://"), LOCK_FILE)]
        return self.report(runs, fenced)

    def report(self, runs: int, fenced: list) -> dict:
        by_kind: dict[str, Counter] = {}
        for fault in self.faults:
            by_kind.setdefault(fault.kind, Counter())[fault.outcome or "unresolved"] += 1
        print(f"\nchaos soak, layout {self.opts.layout}: {len(self.faults)} faults "
              f"({sum(f.during_save for f in self.faults)} during a save), {runs} runs, {len(self.launches)} launches")
        print("| fault | count | during a save | outcomes |\n|---|---|---|---|")
        for kind, outcomes in sorted(by_kind.items()):
            during = sum(f.during_save for f in self.faults if f.kind == kind)
            print(f"| {kind} | {sum(outcomes.values())} | {during} | "
                  + "; ".join(f"{n} {what}" for what, n in outcomes.most_common()) + " |")
        totals = {"lost_records": self.totals["lost"] + self.totals["lost_events"],
                  "doubled_records": self.totals["doubled"] + self.totals["doubled_events"],
                  "metrics_differing": self.totals["differ"], "fenced_out_writes": len(fenced),
                  "human_steps": len(self.human)}
        print("| total | count |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in totals.items()))
        for line in self.human:
            print(f"human step: {line}")
        for r in fenced[:20]:
            print(f"fenced-out write: launch {r.who} {r.kind} {r.obj} ({r.t - self.t0:.1f} s)")
        result = {**totals, "faults": len(self.faults), "during_save": sum(f.during_save for f in self.faults),
                  "by_kind": {k: dict(v) for k, v in by_kind.items()}, "runs": runs, "launches": len(self.launches),
                  "uninterrupted_s": round(self.span, 1),
                  "relaunch_to_resume_s_median": round(statistics.median(self.resume_s), 1) if self.resume_s else None,
                  "relaunch_to_first_step_s_median":
                      round(statistics.median(self.first_step_s), 1) if self.first_step_s else None}
        print(json.dumps(result), flush=True)
        return result


def _last_line(log: str) -> str:
    """A process's last line that is not a progress bar's or a runtime's note."""
    lines = [line.strip() for line in log.replace("\r", "\n").splitlines()]
    said = [line for line in lines if line and "/step" not in line and not line.startswith(("I1", "W1", "E1"))]
    return said[-1][:300] if said else ""


def _assets(root: Path) -> tuple[str, str]:
    """The demo-size random policy and a 4-problem validation set."""
    from g2rl_jax.bench.storage import _model_dir

    evalset = root / "eval.jsonl"
    storage.write_text(evalset, "".join(json.dumps({"problem": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                                        for a, b in ((12, 30), (7, 8), (55, 21), (40, 40))))
    return _model_dir(str(root / "model"), 32, 1), str(evalset)


def soak(opts: Options) -> int:
    from g2rl_jax.bench.gcs_emulator import GcsEmulator

    root = Path(tempfile.mkdtemp(prefix="g2rl_jax_chaos_"))
    try:
        with GcsEmulator(bucket="chaos") as emulator:
            model, evalset = _assets(root)
            result = Soak(opts, root, emulator, model, evalset).soak()
            if opts.keep:  # every request the proxy served, for reading the launches' logs against
                storage.write_text(root / "proxy.jsonl", "".join(json.dumps(dataclasses.asdict(r)) + "\n"
                                                                 for r in list(emulator.proxy.log)))
        keys = ("lost_records", "doubled_records", "metrics_differing", "fenced_out_writes", "human_steps")
        return 1 if any(result[k] for k in keys) else 0
    finally:
        if opts.keep:
            print(f"the launches' logs: {root}/launch<N>.<process>.log; the proxy's: {root}/proxy.jsonl")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    return soak(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
