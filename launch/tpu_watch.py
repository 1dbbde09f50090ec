"""The queued resource's life, for launch/tpu.py: wait for it to be ACTIVE, `status`, and `watch`, the loop that
brings a preempted spot run back without a human.

`watch` polls `gcloud compute tpus queued-resources describe` every --interval seconds. ACTIVE: it reads the run's
last step from the bucket (`gcloud storage cat -r -8192 RUN/metrics.jsonl`), and the trainer's exit status that the
train line leaves in <dir>/<log-dir>/worker-0.exit (over ssh): 0 with summary.json in the bucket is the end; any
other status relaunches `train` on the same VM (a lock left by a host that is gone is taken over once its
run.lock_lease_seconds lapse). SUSPENDED, FAILED or a queued resource that is gone (NOT_FOUND) is a preemption
(SUSPENDING is waited out: the VM's trainer is using its SIGTERM grace): delete it, create it again, wait for
ACTIVE, `setup`, `train`; the run resumes from its checkpoint in the bucket and reads its compiled programs back
from the bucket's cache. Every event is a timestamped line on stdout and
in --log. Standard library only, like tpu.py.
"""
from __future__ import annotations

import json
import subprocess
import time

ACTIVE = "ACTIVE"
GONE = "NOT_FOUND"  # describe failed with NOT_FOUND: deleted, or never created
PREEMPTED = ("SUSPENDED", "FAILED", GONE)  # the VM is gone: recreate it (SUSPENDING: its trainer's grace runs)
WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")


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


def last_step(directory: str) -> int | None:
    """The last step in the run's metrics.jsonl (its final 8 KiB, read with gcloud storage), None if none yet."""
    done = subprocess.run(["gcloud", "storage", "cat", "-r", "-8192", f"{directory}/metrics.jsonl"],
                          capture_output=True, text=True)
    steps = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):  # the first line of the window is cut
            continue
    return max(steps, default=None)


def checkpoints(directory: str) -> list[int]:
    """The checkpoint steps under the run's checkpoints/ (`gcloud storage ls`)."""
    done = subprocess.run(["gcloud", "storage", "ls", f"{directory}/checkpoints/"], capture_output=True, text=True)
    names = [line.rstrip("/").rsplit("/", 1)[-1] for line in done.stdout.splitlines()] if done.returncode == 0 else []
    return sorted(int(n) for n in names if n.isdigit())


def finished(directory: str) -> bool:
    """summary.json is written when the run reaches run.total_steps."""
    return subprocess.run(["gcloud", "storage", "ls", f"{directory}/summary.json"], capture_output=True).returncode == 0


def trainer_exit(args, ssh) -> int | None:
    """Worker 0's trainer exit status from the file the train line writes, None while it runs (or unreadable)."""
    done = subprocess.run(ssh(args, f"cat {args.dir}/{args.log_dir}/worker-0.exit 2>/dev/null || true", "0"),
                          capture_output=True, text=True)
    text = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return int(text[0]) if text and text[0].lstrip("-").isdigit() else None


def status(args, target: list[str]) -> int:
    print(f"queued resource {args.name}: {queued_state(args, target)}")
    directory = run_dir(args)
    if directory is None:
        print("run: pass --bucket gs://BUCKET/DIR (as given to create) to see the run's last step")
        return 0
    step, ckpts = last_step(directory), checkpoints(directory)
    print(f"run {directory}: last step {step if step is not None else 'none yet'}, checkpoints "
          f"{', '.join(map(str, ckpts)) or 'none'}{', finished' if finished(directory) else ''}")
    return 0


def watch(args, target: list[str], steps) -> int:
    """The keep-alive loop; `steps` maps create/delete/setup/train to the command lists tpu.py builds, and
    `call(cmds)` runs them (0 or the failing status)."""
    say, directory = Log(args.log), run_dir(args)
    recoveries, seen_step, started, seen_state = 0, None, False, None
    say(f"watching queued resource {args.name} (run {directory}), every {args.interval:g} s")

    def launch(fresh: bool) -> bool:
        for name in (("create",) if fresh else ()):
            if steps.call(steps.build(name)):
                return False
        if not wait_active(args, target, say, args.wait_timeout, args.poll_seconds):
            return False
        for name in ("setup", "train"):
            t0 = time.monotonic()
            if steps.call(steps.build(name)):
                say(f"{name} failed")
                return False
            say(f"{name} done in {time.monotonic() - t0:.1f} s")
        return True

    while True:
        state = queued_state(args, target)
        action = None
        if state == GONE and not started:
            action = "start"
        elif state in PREEMPTED:
            action = "recreate"
        elif state in WAITING:
            action = "wait"
        elif state == ACTIVE:
            step = last_step(directory)
            if step != seen_step:
                say(f"ACTIVE, run at step {step}")
                seen_step = step
            code = trainer_exit(args, steps.ssh)
            if code == 0 and finished(directory):
                say(f"the run finished (step {step}); {directory}/summary.json is written")
                if args.delete_when_done:
                    steps.call(steps.build("delete"))
                return 0
            if code is not None:
                say(f"the trainer exited with status {code} on an ACTIVE VM")
                action = "relaunch"
        elif state != seen_state:
            say(f"queued resource {args.name}: {state}")
        seen_state = state
        if action is not None and recoveries >= args.max_recoveries:
            say(f"giving up after {recoveries} recoveries (--max-recoveries); the run is in {directory}")
            return 1
        started = True
        if action == "start":
            say(f"queued resource {args.name} does not exist: create, setup, train")
            launch(fresh=True)
        elif action == "recreate":
            recoveries += 1
            say(f"preemption: queued resource {args.name} is {state}; recovery {recoveries}: delete, create, "
                "setup, train")
            if state != GONE and steps.call(steps.build("delete")):
                say("delete failed; trying again at the next poll")
            elif launch(fresh=True):
                say(f"recovery {recoveries}: the run is relaunched from {directory}")
        elif action == "wait":  # created (by create --no-wait, or an earlier watch) but not ACTIVE: nothing runs yet
            launch(fresh=False)
        elif action == "relaunch":
            recoveries += 1
            say(f"recovery {recoveries}: train again on the same VM")
            steps.call(steps.build("train"))
        time.sleep(args.interval)

