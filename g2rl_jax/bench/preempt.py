"""`python -m g2rl_jax.bench preempt`: kill -9 a trainer at random moments, at least --kills times, each relaunch as
another host, on a gs:// run (fake-gcs-server on loopback) or a local one, and count what the kills cost.

Each launch runs `python -m g2rl_jax.train` as host vm-<n> (`unshare -u`, where it works) with a short lease
(--lease) and is killed with SIGKILL after a delay drawn uniformly from [0, the launch-to-end time of the
uninterrupted run, then of the last launch that ran a run from start to end] (so kills land in the start, the lock's
wait, the compile, mid-step and mid-save), unless it ended first. The next launch takes the run over once the lease
lapses, with no manual step (the window a relaunch's kill is drawn from is one lease longer: the relaunch waits
that out first). With --after-checkpoint each launch is killed instead the moment it has committed a new
checkpoint. A run that reaches run.total_steps is checked against an uninterrupted run of the same
config, and a fresh run directory starts, until --kills kills.
Reported: kills, launches, how many kills landed mid-save (a step directory without commit_success), lost steps (a
reference step missing from the finished run's metrics.jsonl), duplicated steps, and steps whose deterministic
metrics differ from the reference; and each relaunch's seconds from launch to its "resumed from the checkpoint" line
(the lock taken over and the state read: what a preemption costs in time, with this lease, before the steps since
the last checkpoint are computed again), and to its first step after that (the compile included). A launch that
fails is printed with its log's tail.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from g2rl_jax import cli, storage

ROOT = str(Path(__file__).resolve().parents[2])
DETERMINISTIC = ("accuracy", "reward", "loss", "kl", "entropy", "response_length", "novelty", "grad_norm")


def parse_args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench preempt", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="kill -9 at least this many launches (default 20)")
    p.add_argument("--steps", type=int, default=6, help="run.total_steps of each run (default 6)")
    p.add_argument("--lease", type=float, default=9.0, help="run.lock_lease_seconds (default 9, the smallest)")
    p.add_argument("--local", action="store_true", help="a local run directory instead of the emulator's bucket")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--after-checkpoint", action="store_true",
                   help="kill each launch the moment it has committed a new checkpoint, not at a random moment (with "
                        "--kills 1 --lease 60: a relaunch's time to resume with the default lease)")
    return p.parse_args(argv)


def _model_dir(root: Path) -> str:
    from g2rl_jax.bench.storage import _model_dir as build

    return build(str(root / "model"), 32, 1)


# the trainer, printing the traceback of an error it reports in one line (a loop that finds one should say where)
TRAIN = ("import sys, traceback\nimport g2rl_jax.cli as cli\none_line = cli.fail\n"
         "def fail(command, err):\n    traceback.print_exception(err)\n    return one_line(command, err)\n"
         "cli.fail = fail\nfrom g2rl_jax.train.command import main\nsys.exit(main(sys.argv[1:]))\n")


def _cmd(model: str, out: str, steps: int, lease: float) -> list[str]:
    return [sys.executable, "-c", TRAIN, "--config", os.path.join(ROOT, "configs", "demo.yaml"),
            f"run.output_dir={out}", f"model.path={model}", f"run.total_steps={steps}", "run.checkpoint_every=1",
            "run.keep_checkpoints=2", "run.eval_every=0", "data.prompts_per_step=4", "rollout.num_samples=4",
            "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=8", f"run.lock_lease_seconds={lease:g}"]


def _unshare() -> list[str] | None:
    for prefix in (["unshare", "-u"], ["unshare", "-r", "-u"]):
        try:
            if subprocess.run([*prefix, "sh", "-c", "hostname vm-x"], capture_output=True).returncode == 0:
                return prefix
        except FileNotFoundError:
            return None
    return None


def _as_host(prefix, host: str, cmd: list[str]) -> list[str]:
    return [*prefix, "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd] if prefix else cmd


def _metrics(out: str) -> list[dict]:
    from g2rl_jax.train.metrics import read_metrics

    return read_metrics(out)


def _committed(out: str) -> int:
    """The newest committed checkpoint's step, 0 when none (on GCS a step directory holding commit_success.txt;
    locally Orbax renames a step's directory into place only once it is complete)."""
    ckpts = f"{out}/checkpoints"
    local = not storage.is_url(out)
    return max((int(n) for n in storage.names(ckpts)
                if n.isdigit() and (local or storage.exists(f"{ckpts}/{n}/commit_success.txt"))), default=0)


def _saving(out: str) -> bool:
    ckpts = f"{out}/checkpoints"
    return any(n.isdigit() and not storage.exists(f"{ckpts}/{n}/commit_success.txt") for n in storage.names(ckpts))


def _compare(got: list[dict], want: list[dict]) -> dict[str, int]:
    steps = [r["step"] for r in got]
    lost = sorted(set(r["step"] for r in want) - set(steps))
    by_step = {r["step"]: r for r in got}
    differ = [r["step"] for r in want if r["step"] in by_step and any(
        abs(by_step[r["step"]].get(k, float("nan")) - r[k]) > 1e-6 * max(1.0, abs(r[k])) for k in DETERMINISTIC
        if k in r)]
    return {"lost": len(lost), "duplicated": len(steps) - len(set(steps)), "differ": len(differ)}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    root = Path(tempfile.mkdtemp(prefix="g2rl_jax_preempt_"))
    emulator = None
    try:
        if not args.local:
            from g2rl_jax.bench.gcs_emulator import GcsEmulator

            emulator = GcsEmulator(bucket="preempt").start()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                   **{storage.CACHE_ENV: str(root / "cache")})
        prefix = _unshare()
        model = _model_dir(root)
        t0 = time.monotonic()
        ref = subprocess.run(_cmd(model, str(root / "reference"), args.steps, args.lease), env=env,
                             capture_output=True, text=True)
        span = time.monotonic() - t0
        if ref.returncode:
            print(ref.stderr[-3000:], file=sys.stderr)
            return 1
        want = _metrics(str(root / "reference"))
        print(f"uninterrupted run: {args.steps} steps, {span:.0f} s from launch to end; hosts by "
              f"{'unshare -u' if prefix else 'none (one hostname)'}; lease {args.lease:g} s; "
              f"{'fake-gcs-server' if emulator else 'local disk'}", flush=True)
        rng = random.Random(args.seed)
        kills = launches = mid_save = runs = 0
        totals = {"lost": 0, "duplicated": 0, "differ": 0}
        failures, resume_s, first_step_s = [], [], []
        while kills < args.kills:
            runs += 1
            out = emulator.url(f"runs/{runs}") if emulator else str(root / f"runs/{runs}")
            fresh = True  # the run's first launch: no lock to wait for
            while True:
                launches += 1
                before = len(_metrics(out))
                log, said = root / f"launch{launches}.err", root / f"launch{launches}.out"
                with open(log, "w") as err, open(said, "w") as stdout:
                    started = time.monotonic()
                    proc = subprocess.Popen(_as_host(prefix, f"vm-{launches}", _cmd(model, out, args.steps,
                                                                                      args.lease)),
                                            env=env, stdout=stdout, stderr=err)
                    # a relaunch first waits out the killed holder's lease: without it in the window, most kills
                    # would land before the first step and a run would never get past its start
                    life = span + (0.0 if fresh else args.lease)
                    delay = rng.uniform(0, life) if kills < args.kills and not args.after_checkpoint else None
                    watch = _committed(out) if kills < args.kills and args.after_checkpoint else None
                    polled, measured, resumed_at = 0.0, not before, None
                    while proc.poll() is None and (delay is None or time.monotonic() - started < delay):
                        if time.monotonic() - polled > 0.2:
                            polled = time.monotonic()  # a relaunch's time to its resume (lock taken, state read)
                            if not measured and "resumed from the checkpoint of step " in said.read_text():
                                resume_s.append(polled - started)
                                measured = True
                                resumed_at = int(said.read_text().split("resumed from the checkpoint of step ")[1]
                                                 .split()[0])
                            if resumed_at is not None and any(r["step"] > resumed_at for r in _metrics(out)):
                                first_step_s.append(polled - started)  # and to its first step after the resume
                                resumed_at = None
                            if watch is not None and _committed(out) > watch:
                                delay = polled - started  # a new checkpoint committed: kill now
                                break
                        time.sleep(0.01)
                    if proc.poll() is None:
                        saving = _saving(out)
                        proc.kill()
                        proc.wait()
                        kills, mid_save, fresh = kills + 1, mid_save + saving, False
                        print(f"[{time.monotonic() - t0:.0f} s] kill {kills}/{args.kills} (mid-save so far "
                              f"{mid_save}): run {runs} launch {launches} killed after {delay:.1f} s"
                              f"{' mid-save' if saving else ''}, {len(_metrics(out))} records", flush=True)
                        continue
                if proc.returncode != 0:
                    failures.append((launches, proc.returncode, log.read_text()[-2000:]))
                    print(f"[{time.monotonic() - t0:.0f} s] run {runs} launch {launches}: FAILED with exit "
                          f"{proc.returncode}:\n"
                          f"{log.read_text()[-2000:]}", flush=True)
                    break
                if not before:  # a whole warm launch (compiled programs cached): the span kills are drawn from
                    span = time.monotonic() - started
                got = _metrics(out)
                result = _compare(got, want)
                print(f"[{time.monotonic() - t0:.0f} s] run {runs} launch {launches}: finished; {result}; "
                      f"resumes so far {[round(r, 1) for r in resume_s]} s, first steps after them "
                      f"{[round(r, 1) for r in first_step_s]} s", flush=True)
                totals = {k: totals[k] + result[k] for k in totals}
                break
        print(json.dumps({"kills": kills, "launches": launches, "runs": runs, "mid_save_kills": mid_save,
                          "lost_steps": totals["lost"], "duplicated_steps": totals["duplicated"],
                          "steps_differing": totals["differ"], "failed_launches": len(failures),
                          "uninterrupted_s": round(span, 1), "relaunch_to_resume_s_median":
                          round(statistics.median(resume_s), 1) if resume_s else None,
                          "relaunch_to_first_step_s_median":
                          round(statistics.median(first_step_s), 1) if first_step_s else None}),
              flush=True)
        return 1 if failures or any(totals.values()) else 0
    finally:
        if emulator is not None:
            emulator.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
