#!/usr/bin/env python3
"""A fake `gcloud` for tests/test_tpu_watch.py: records every call and plays a queued resource's life.

Environment: FAKE_DIR (state.json, calls.jsonl, vm-<generation>/ homes), FAKE_BUCKET (the local directory a
gs://BUCKET maps to: gs://b/x is FAKE_BUCKET/b/x), FAKE_STATES (JSON: for each created generation of the queued
resource, [[state, seconds], ...]: the states it goes through after `create`, the last one held; seconds given as a
path: held until that file exists), FAKE_SHIM_PATH
(the PATH the fake ssh gives a worker). `tpu-vm ssh --command=C` runs C with bash on this machine as worker 0 of the
current VM: HOME is the VM's own directory (a recreated VM starts with an empty disk), in its own process group,
which `preempt()` in the test sends SIGTERM, as a preempted VM's shutdown does; gs:// in the command becomes
FAKE_BUCKET/, as if the bucket were mounted there.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

FAKE = Path(os.environ["FAKE_DIR"])
STATE = FAKE / "state.json"


def load() -> dict:
    return json.loads(STATE.read_text()) if STATE.exists() else {"generation": -1, "created": None, "groups": []}


def save(state: dict) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(STATE)


def current(state: dict) -> str:
    """The state now: SUSPENDED once preempted, else the scripted state for the time since `create`."""
    if state["created"] is None:
        return "NOT_FOUND"
    if state.get("preempted"):  # SUSPENDING while the VM's processes use their 30 s notice, then SUSPENDED
        alive = []
        for pgid in state["groups"]:
            try:
                os.killpg(pgid, 0)
                alive.append(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        return "SUSPENDING" if alive and time.time() - state["preempted"] < 30 else "SUSPENDED"
    script = json.loads(os.environ["FAKE_STATES"])[state["generation"]]
    elapsed = time.time() - state["created"]
    for name, seconds in script:
        if isinstance(seconds, str):  # held until that file exists (a test's gate)
            if not Path(seconds).exists():
                return name
            continue
        if elapsed < seconds:
            return name
        elapsed -= seconds
    return script[-1][0]


def local(url: str) -> Path:
    return Path(os.environ["FAKE_BUCKET"]) / url.removeprefix("gs://")


def main(argv: list[str]) -> int:
    with open(FAKE / "calls.jsonl", "a") as fh:
        fh.write(json.dumps({"time": time.time(), "argv": shlex.join(["gcloud", *argv])}) + "\n")
    state = load()
    if argv[:3] == ["compute", "tpus", "queued-resources"]:
        verb = argv[3]
        if verb == "describe":
            now = current(state)
            if now == "NOT_FOUND":
                print(f"ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND: {argv[4]}", file=sys.stderr)
                return 1
            print(now)
            return 0
        if verb == "create":
            if state["created"] is not None:
                print("ERROR: ALREADY_EXISTS", file=sys.stderr)
                return 1
            state.update(generation=state["generation"] + 1, created=time.time(), preempted=False, groups=[])
            save(state)
            return 0
        if verb == "delete":
            for pgid in state["groups"]:  # whatever still runs on the VM goes with it
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            state.update(created=None, groups=[])
            save(state)
            return 0
    if argv[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
        if current(state) != "ACTIVE":
            print("ERROR: the TPU VM is not running", file=sys.stderr)
            return 255
        command = next(a for a in argv if a.startswith("--command=")).removeprefix("--command=")
        command = command.replace("gs://", f"{os.environ['FAKE_BUCKET']}/")  # the worker sees the bucket mounted
        home = FAKE / f"vm-{state['generation']}"
        home.mkdir(exist_ok=True)
        env = {"PATH": os.environ["FAKE_SHIM_PATH"], "HOME": str(home), "TPU_WORKER_ID": "0",
               "G2RL_JAX_BUCKET": str(local("gs://b/d")), **{k: v for k, v in os.environ.items()
                                                             if k.startswith(("XLA_", "JAX_", "FAKE_", "PYTHON"))}}
        proc = subprocess.Popen(["bash", "-c", command], env=env, cwd=home, start_new_session=True)
        state["groups"].append(proc.pid)
        save(state)
        return proc.wait()
    if argv[:2] == ["storage", "cat"]:
        path = local(argv[-1])
        if not path.is_file():
            print(f"ERROR: {argv[-1]} not found", file=sys.stderr)
            return 1
        data = path.read_bytes()
        if "-r" in argv:
            data = data[int(argv[argv.index("-r") + 1]):]  # "-N": the last N bytes
        sys.stdout.write(data.decode())
        return 0
    if argv[:2] == ["storage", "ls"]:
        path = local(argv[-1].rstrip("/"))
        if path.is_file():
            print(argv[-1])
        elif path.is_dir():
            for child in sorted(path.iterdir()):
                print(f"{argv[-1].rstrip('/')}/{child.name}" + ("/" if child.is_dir() else ""))
        else:
            return 1
        return 0
    print(f"fake gcloud: unexpected call {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
