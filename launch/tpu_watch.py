"""The run's supervisor on Cloud TPU VMs, for launch/tpu.py: `create`'s wait for ACTIVE, `status`, and `watch`,
which brings a run up from any state and keeps it going through preemptions without a human.

`watch` is one poll loop, every --interval seconds: the queued resource's state (`gcloud compute tpus
queued-resources describe`) and, while it is ACTIVE, the trainer's state read from the workers themselves (one ssh
running tpu.py's `probe_script`: each worker's setup mark, its trainer's pid file and whether that process runs,
its exit file), then the action launch/tpu_states.py's TABLE gives for the pair (docs/tpu_vm.md prints it). An exit
code is read through the run-control table (g2rl_jax/control/exits.py): stop with one line where relaunching cannot
help, relaunch at once or after a backoff where it can, a bounded number of times. Every event is a timestamped
line on stdout and in --log. Standard library only, like tpu.py.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import time

from tpu_states import ACTIVE, ADVICE, GONE, ROW_OF, TABLE, Trainer, exit_summary, exits, trainer_state

STRAGGLER_POLLS = 3  # polls a slice may show some trainers ended and others running before the rest are stopped
BACKOFF_CAP = 32  # a backoff grows to at most this many --backoff
REPEAT_S = 300  # an unchanged state line is said again this often


class Log:
    """Timestamped lines to stdout and (append) to a file."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(line + "\n")


def describe_command(args, target: list[str]) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", args.name, *target,
            "--format=value(state.state)"]


def queued_state(args, target: list[str]) -> str:
    """The queued resource's state (ACTIVE, WAITING_FOR_RESOURCES, SUSPENDED, ...), NOT_FOUND when it does not
    exist, UNKNOWN when gcloud failed otherwise (the network, credentials): the caller asks again later."""
    done = subprocess.run(describe_command(args, target), capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip() or "UNKNOWN"
    return GONE if "NOT_FOUND" in done.stderr else "UNKNOWN"


def wait_active(args, target: list[str], say, timeout: float, interval: float) -> bool:
    """Poll until ACTIVE (True); False, after saying why, on a failed state or after `timeout` seconds."""
    t0, last, said = time.monotonic(), None, 0.0
    while True:
        state = queued_state(args, target)
        waited = time.monotonic() - t0
        if state == ACTIVE:
            say(f"queued resource {args.name}: ACTIVE after {waited:.0f} s")
            return True
        if state in ("FAILED", "SUSPENDED", GONE) and waited > 0:
            say(f"queued resource {args.name}: {state} while waiting for ACTIVE; see `gcloud compute tpus "
                f"queued-resources describe {args.name}`")
            return False
        if state != last or waited - said >= 300:  # a line per change, and one every 5 minutes
            say(f"queued resource {args.name}: {state}, waiting for ACTIVE ({waited:.0f} s of {timeout:.0f} s)")
            last, said = state, waited
        if waited + interval > timeout:
            say(f"queued resource {args.name}: not ACTIVE after {timeout:.0f} s (still {state}); raise --wait-timeout "
                "or try another zone")
            return False
        time.sleep(interval)


def run_dir(args) -> str | None:
    """Where `train` writes the run: a run.output_dir= override, else BUCKET/runs/NAME."""
    for item in getattr(args, "overrides", []):
        if item.startswith("run.output_dir="):
            return item.split("=", 1)[1].rstrip("/")
    return f"{args.bucket.rstrip('/')}/runs/{args.name}" if getattr(args, "bucket", None) else None


def storage_commands(directory: str) -> dict[str, list[str]]:
    """The bucket reads: the metrics' last 8 KiB, the checkpoints' listing, summary.json's presence."""
    return {"metrics": ["gcloud", "storage", "cat", "-r", "-8192", f"{directory}/metrics.jsonl"],
            "checkpoints": ["gcloud", "storage", "ls", f"{directory}/checkpoints/"],
            "summary": ["gcloud", "storage", "ls", f"{directory}/summary.json"]}


def last_step(directory: str) -> int | None:
    """The last step in the run's metrics.jsonl (its final 8 KiB, read with gcloud storage), None if none yet."""
    done = subprocess.run(storage_commands(directory)["metrics"], capture_output=True, text=True)
    steps = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):  # the first line of the window is cut
            continue
    return max(steps, default=None)


def checkpoints(directory: str) -> list[int]:
    """The checkpoint steps under the run's checkpoints/ (`gcloud storage ls`)."""
    done = subprocess.run(storage_commands(directory)["checkpoints"], capture_output=True, text=True)
    names = [line.rstrip("/").rsplit("/", 1)[-1] for line in done.stdout.splitlines()] if done.returncode == 0 else []
    return sorted(int(n) for n in names if n.isdigit())


def finished(directory: str) -> bool:
    """summary.json is written when the run reaches run.total_steps."""
    return subprocess.run(storage_commands(directory)["summary"], capture_output=True).returncode == 0


def status(args, target: list[str], steps) -> int:
    """The queued resource's state, the trainer's (while ACTIVE) and the run's last step and checkpoints."""
    if args.dry_run:
        for cmd in status_commands(args, target, steps):
            print(steps.line(cmd))
        return 0
    state = queued_state(args, target)
    print(f"queued resource {args.name}: {state}")
    if state == ACTIVE:
        trainer = trainer_state(steps.capture(steps.build("probe")[0]))
        print(f"trainer: {exit_summary(trainer)}" + (", workers not set up" if trainer.column == "bare" else "")
              if trainer.workers else "trainer: not readable (the workers did not answer over ssh)")
    directory = run_dir(args)
    if directory is None:
        print("run: pass --bucket gs://BUCKET/DIR (as given to create) to see the run's last step")
        return 0
    step, ckpts = last_step(directory), checkpoints(directory)
    print(f"run {directory}: last step {step if step is not None else 'none yet'}, checkpoints "
          f"{', '.join(map(str, ckpts)) or 'none'}{', finished' if finished(directory) else ''}")
    return 0


def status_commands(args, target, steps) -> list[list[str]]:
    """What `status` runs (the probe only while ACTIVE; the bucket's reads only with --bucket)."""
    directory = run_dir(args)
    reads = [] if directory is None else list(storage_commands(directory).values())
    return [describe_command(args, target), *steps.build("probe"), *reads]


# ----------------------------------------------------------------------------------------------- watch
@dataclasses.dataclass
class Memory:
    """What `watch` remembers between polls."""

    started: bool = False  # the queued resource existed, or this watch created it: a later NOT_FOUND is a preemption
    recovering: bool = False  # a recovery's delete is done and its VM not yet ACTIVE (a create then is the same one)
    ours: bool = False  # this VM's trainer was started or seen running by this watch: its stop codes are final
    recoveries: int = 0  # preemptions recovered (delete, create), in all
    relaunches: int = 0  # trainer relaunches in a row without a new step between them
    relaunch_step: int | None = None  # the run's step at the last relaunch
    tries: int = 0  # create, delete, setup or train commands failed in a row
    served: tuple | None = None  # (action, try): the backoff before that try of that action was waited out
    sleep: float | None = None  # the next wait, when a backoff replaces --interval
    stuck: tuple | None = None  # (what, since): a wait in progress, bounded by --wait-timeout
    said: tuple | None = None  # (line, when) of the last state line
    straggling: int = 0  # polls in a row with some of a slice's trainers ended and others running
    step: int | None = -1  # the run's last step, from the bucket (None: no step yet; -1: not read yet)


def backoff(args, n: int) -> float:
    """The wait before the n-th try in a row (n >= 1): --backoff, doubling, at most BACKOFF_CAP times --backoff."""
    return args.backoff * min(2 ** (n - 1), BACKOFF_CAP)


class Watch:
    """One `watch`. `poll()` reads the queued resource and (when ACTIVE) the trainer and does what TABLE says; it
    returns None to go on, else watch's exit status: 0 when the run finished, the trainer's code when it stopped with
    one relaunching cannot help, 1 when a limit ran out; each end is one line saying why."""

    def __init__(self, args, target: list[str], steps):
        self.args, self.target, self.steps = args, target, steps
        self.say, self.directory, self.m, self.action = Log(args.log), run_dir(args), Memory(), ""

    def run(self) -> int:
        a = self.args
        self.say(f"watching queued resource {a.name} (run {self.directory}), every {a.interval:g} s")
        while (end := self.poll()) is None:
            wait, self.m.sleep = (a.interval if self.m.sleep is None else self.m.sleep), None
            time.sleep(wait)
        return end

    def poll(self) -> int | None:
        state = queued_state(self.args, self.target)
        row = ROW_OF.get(state, "unknown")
        trainer = trainer_state(self.steps.capture(self.steps.build("probe")[0])) if row == "active" \
            else Trainer("unread")
        self.action = TABLE[row, trainer.column]
        if row not in ("gone", "unknown"):
            self.m.started = True
        if row == "active":
            self.m.recovering = False
        if self.action != "wait":
            self.m.stuck = None
        return getattr(self, "on_" + self.action.replace("-", "_"))(state, trainer)

    # ------------------------------------------------------------------------------------------ helpers
    def state_line(self, line: str) -> None:
        """Say `line` when it differs from the last one, or every REPEAT_S seconds."""
        now = time.monotonic()
        if self.m.said is None or self.m.said[0] != line or now - self.m.said[1] >= REPEAT_S:
            self.say(line)
            self.m.said = (line, now)

    def backed_off(self, n: int, what: str) -> bool:
        """True when this poll's action may run its n-th try in a row now (the first at once; later ones once their
        backoff was waited out: the loop sleeps it, then polls again). Says `what` once per try."""
        if n == 0 or self.m.served == (self.action, n):
            self.m.served = None
            self.say(what)
            return True
        delay = backoff(self.args, n)
        self.say(f"{what}: in {delay:g} s (backoff)")
        self.m.served, self.m.sleep = (self.action, n), delay
        return False

    def command(self, name: str) -> bool:
        """Run step `name` (create, delete, setup, train); False, after counting the failure, when it failed."""
        t0 = time.monotonic()
        rc = self.steps.call(self.steps.build(name))
        if rc == 0:
            self.say(f"{name} done in {time.monotonic() - t0:.1f} s")
            self.m.tries = 0
            return True
        self.m.tries += 1
        self.say(f"{name} failed (status {rc}; its output is above): {self.m.tries} of --max-tries "
                 f"{self.args.max_tries} in a row")
        return False

    def tried(self, name: str) -> int | None:
        """After a failed command: go on (None), or give up once --max-tries failed in a row."""
        if self.m.tries >= self.args.max_tries:
            return self.give_up(f"{name} failed {self.m.tries} times in a row (--max-tries); fix what its output "
                                "says, then run watch again")
        return None

    def give_up(self, why: str) -> int:
        self.say(f"giving up: {why}; the run is in {self.directory}")
        self.delete_if_asked()
        return 1

    def delete_if_asked(self) -> None:
        if self.args.delete_when_done:
            self.say(f"--delete-when-done: deleting queued resource {self.args.name}")
            self.steps.call(self.steps.build("delete"))

    # ------------------------------------------------------------------------------------------ actions
    def on_wait(self, state: str, trainer: Trainer) -> int | None:
        what = state if state != ACTIVE else "ACTIVE, but its workers did not answer over ssh"
        now = time.monotonic()
        if self.m.stuck is None or self.m.stuck[0] != what:
            self.m.stuck = (what, now)
        waited = now - self.m.stuck[1]
        if waited > self.args.wait_timeout:
            return self.give_up(f"queued resource {self.args.name} has been {what} for {waited:.0f} s "
                                f"(--wait-timeout {self.args.wait_timeout:g}); raise --wait-timeout, or try another "
                                "zone")
        self.state_line(f"queued resource {self.args.name}: {what}; waiting")
        return None

    def on_create(self, state: str, trainer: Trainer) -> int | None:
        recovery = self.m.started and not self.m.recovering  # gone without our delete: taken away, or deleted
        if recovery and self.m.recoveries >= self.args.max_recoveries:
            return self.give_up(f"{self.m.recoveries} recoveries (--max-recoveries)")
        what = (f"preemption: queued resource {self.args.name} is gone (NOT_FOUND); recovery "
                f"{self.m.recoveries + 1}: create" if recovery else
                f"queued resource {self.args.name} does not exist: create")
        if not self.backed_off(self.m.tries, what):
            return None
        if recovery:
            self.m.recoveries += 1
            self.m.recovering = True
        self.m.ours, self.m.relaunches = False, 0
        if self.command("create"):
            self.m.started = True
            return None
        return self.tried("create")

    def on_recreate(self, state: str, trainer: Trainer) -> int | None:
        if self.m.recoveries >= self.args.max_recoveries:
            return self.give_up(f"{self.m.recoveries} recoveries (--max-recoveries)")
        if not self.backed_off(self.m.tries, f"preemption: queued resource {self.args.name} is {state}; recovery "
                               f"{self.m.recoveries + 1}: delete, create"):
            return None
        if not self.command("delete"):
            return self.tried("delete")
        self.m.recoveries += 1
        self.m.recovering, self.m.ours, self.m.relaunches = True, False, 0
        if self.command("create"):
            self.say(f"recovery {self.m.recoveries}: setup and train follow once the queued resource is ACTIVE")
            return None
        return self.tried("create")

    def on_setup(self, state: str, trainer: Trainer) -> int | None:
        if not self.backed_off(self.m.tries, "ACTIVE, the workers are not set up: setup, then train"):
            return None
        if not self.command("setup"):
            return self.tried("setup")
        return self.start()

    def on_train(self, state: str, trainer: Trainer) -> int | None:
        if not self.backed_off(self.m.tries, "ACTIVE and set up, no trainer started yet: train"):
            return None
        return self.start()

    def start(self) -> int | None:
        if self.command("train"):
            self.m.ours = True
            return None
        return self.tried("train")

    def on_watch(self, state: str, trainer: Trainer) -> int | None:
        self.m.ours = True
        step = last_step(self.directory)
        if step != self.m.step:
            self.say(f"ACTIVE, the trainer runs, the run is at step {step if step is not None else 'none yet'}")
            self.m.step = step
        self.m.straggling = self.m.straggling + 1 if trainer.straggling else 0
        if self.m.straggling >= STRAGGLER_POLLS:
            self.say(f"on the slice some trainers ended and others still run ({exit_summary(trainer)}) for "
                     f"{self.m.straggling} polls: stopping the rest (SIGTERM)")
            self.steps.call(self.steps.build("stop"))
            self.m.straggling = 0
        return None

    def on_finish(self, state: str, trainer: Trainer) -> int | None:
        summary = f"{self.directory}/summary.json"
        written = "is written" if finished(self.directory) else "is missing (see the worker's log)"
        self.say(f"the run finished: the trainer exited 0 ({exit_summary(trainer)}); {summary} {written}")
        self.delete_if_asked()
        return 0

    def on_stop(self, state: str, trainer: Trainer) -> int | None:
        code = trainer.code
        if not self.m.ours:  # it stopped before this watch began: the cause may have been fixed since
            self.m.ours = True
            self.say(f"the trainer had stopped with exit {code} before this watch began: starting it again, once")
            return self.start()
        tails = self.steps.capture(self.steps.build("tail")[0]) or ""
        for line in tails.splitlines():
            self.say(f"  {line}")
        last = next((line.strip() for line in reversed(tails.splitlines()) if line.strip()), "(no log line)")
        self.say(f"stopped: the trainer exited {code} ({exit_summary(trainer)}): {ADVICE[exits.Exit(code)]}; "
                 f"relaunching cannot help. Its last line: {last}")
        self.delete_if_asked()
        return code

    def on_relaunch(self, state: str, trainer: Trainer) -> int | None:
        return self.relaunch(trainer, at_once=True)

    def on_relaunch_backoff(self, state: str, trainer: Trainer) -> int | None:
        return self.relaunch(trainer, at_once=False)

    def relaunch(self, trainer: Trainer, at_once: bool) -> int | None:
        self.m.step = step = last_step(self.directory)
        if step is not None and (self.m.relaunch_step is None or step > self.m.relaunch_step):
            self.m.relaunches = 0  # the last relaunched run made progress (perhaps all between two polls)
        n = self.m.relaunches + 1
        if n > self.args.max_relaunches:
            return self.give_up(f"the trainer ended {n} times in a row without a new step (--max-relaunches "
                                f"{self.args.max_relaunches}), the last time {exit_summary(trainer)}")
        what = (f"the trainer exited {trainer.code} ({exit_summary(trainer)}): relaunch {n} of "
                f"{self.args.max_relaunches}")
        if not self.backed_off(0 if at_once else n, what):
            return None
        self.m.relaunches, self.m.relaunch_step = n, self.m.step
        return self.start()


def watch(args, target: list[str], steps) -> int:
    """The supervisor (see the module docstring); with --dry-run it prints what it would run, and runs nothing."""
    return dry_run(args, target, steps) if args.dry_run else Watch(args, target, steps).run()


def dry_run(args, target: list[str], steps) -> int:
    """Print the poll loop and every command `watch` may run, by the action that runs it; run nothing."""
    line, reads = steps.line, storage_commands(run_dir(args))
    print(f"# watch --dry-run: nothing runs. One poll every --interval {args.interval:g} s:")
    print(line(describe_command(args, target)))
    print("# while the queued resource is ACTIVE, the workers' setup and trainer:")
    print(line(steps.build("probe")[0]))
    print("# while the trainer runs, the run's last step:")
    print(line(reads["metrics"]))
    print("# then what docs/tpu_vm.md's table says (backoffs from --backoff, doubling; limits --max-tries, "
          "--max-relaunches, --max-recoveries, --wait-timeout):")
    for action, names in (("create", ("create",)), ("delete, create (a preemption)", ("delete", "create")),
                          ("setup, train", ("setup", "train")), ("train, or relaunch", ("train",)),
                          ("a straggling slice", ("stop",)), ("end: stop (the workers' last log lines)", ("tail",)),
                          ("end: done", ("summary",)), *((("at the end (--delete-when-done)", ("delete",)),)
                                                         if args.delete_when_done else ())):
        print(f"# {action}:")
        for name in names:
            for cmd in [reads["summary"]] if name == "summary" else steps.build(name):
                print(line(cmd))
    return 0
