"""launch/tpu.sh on a fake cloud: `setup` against the images' Python 3.10, `create` waiting for ACTIVE, `status`, and
`watch`, the supervisor, in every row of its table (docs/tpu_vm.md): a resource created by hand then watched, a setup
that fails once, the trainer exiting 2, 3, 4 and 5 (stop with one line), 75 and 143 (relaunch), a preemption
mid-run, a run already finished; with fake trainers (tests/fake_trainer.py, no JAX) and, once, a real trainer
(tiny random Qwen3, as test_train.py) brought back after a preemption. Every test counts the gcloud calls: one
poll per --interval, never more.

tests/fake_gcloud.py plays the queued resource (scripted states per created generation, SUSPENDED once preempted)
and runs `tpu-vm ssh --command` with bash as worker 0 of the current VM: its own HOME (a recreated VM has an empty
disk) and PATH: fakes of `git` (a checkout whose g2rl_jax/ and configs/ are this repository's), `uv` (its managed
CPython is this interpreter; `pip install` sleeps FAKE_SETUP_SECONDS, and fails the first FAKE_SETUP_FAILS times)
and `python3`, a shim that reports 3.10 as the TPU images' Ubuntu 22.04 does. The environment's python runs the fake
trainer when FAKE_TRAINER is set, else the real one. gs://b/... is a local directory, so a trainer writes there as
to a bucket.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import assets, overrides  # noqa: F401 - assets is a fixture

from g2rl_jax.train.metrics import read_metrics

from _helpers import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import tpu_states  # noqa: E402 - launch/ is not a package: its scripts import each other by name
import tpu_watch  # noqa: E402

TPU = [sys.executable, "-S", str(ROOT / "launch" / "tpu.py")]  # -S: the standard library only, as on a laptop
BASE = ["--name", "g", "--zone", "z"]

RECORD = """import json, os, shlex, sys, time
def record(name, argv):
    with open(os.path.join(os.environ.get("FAKE_DIR", {default!r}), "calls.jsonl"), "a") as fh:
        fh.write(json.dumps({{"time": time.time(), "argv": shlex.join([name, *argv]), "cwd": os.getcwd()}}) + "\\n")
"""
UV = """#!{python} -S
{record}
import shutil, pathlib
args = sys.argv[1:]
record("uv", args)
if args[0] == "venv":
    managed = args[args.index("--python-preference") + 1] == "only-managed" if "--python-preference" in args else False
    interpreter = {python!r} if managed and os.environ.get("FAKE_UV_SYSTEM") != "1" else shutil.which("python3")
    bin_dir = pathlib.Path(args[-1]) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text(
        '#!/bin/sh\\nif [ -n "$FAKE_TRAINER" ] && [ "$1 $2" = "-m g2rl_jax.train" ]; then shift 2; '
        f'exec {{interpreter}} -S {trainer} "$@"; fi\\nexec {{interpreter}} "$@"\\n')
    (bin_dir / "python").chmod(0o755)
elif args[:2] == ["pip", "install"]:
    time.sleep(float(os.environ.get("FAKE_SETUP_SECONDS", "0")))
    failures = pathlib.Path(os.environ.get("FAKE_DIR", ".")) / "setup_failures"
    if (failures.stat().st_size if failures.exists() else 0) < int(os.environ.get("FAKE_SETUP_FAILS", "0")):
        with open(failures, "a") as fh:
            fh.write("x")
        sys.exit("fake uv: pip install failed (the network, say)")
"""
PYTHON3_310 = """#!{python} -S
{record}
import pathlib, shutil
args = sys.argv[1:]
record("python3", args)
if args[:3] == ["-m", "pip", "install"] and args[-1] == "uv":  # pip install --user uv: ~/.local/bin/uv
    home_bin = pathlib.Path(os.environ["HOME"]) / ".local" / "bin"
    home_bin.mkdir(parents=True, exist_ok=True)
    shutil.copy({uv!r}, home_bin / "uv")
elif args == ["--version"]:
    print("Python 3.10.12")
elif args[:1] == ["-c"]:
    sys.version_info, sys.version = (3, 10, 12, "final", 0), "3.10.12 (the image's python3)"
    exec(compile(args[1], "<string>", "exec"), {{"__name__": "__main__"}})
else:
    sys.exit("python3 (3.10) shim: not meant for the project")
"""
GIT = """#!{python} -S
{record}
args = sys.argv[1:]
record("git", args)
if args[0] == "clone":  # a checkout whose code is this repository's
    os.makedirs(os.path.join(args[-1], ".git"))
    for name in ("g2rl_jax", "configs"):
        os.symlink(os.path.join({root!r}, name), os.path.join(args[-1], name))
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def fake_uv(bindir: Path, python: str) -> Path:
    """A fake `uv` in bindir (also used by test_launch.py): venv makes <dir>/bin/python run `python` (its 'managed'
    CPython; the python3 on PATH instead with FAKE_UV_SYSTEM=1); pip install sleeps FAKE_SETUP_SECONDS."""
    record = RECORD.format(default=str(bindir.parent))
    _script(bindir / "uv", UV.format(python=python, record=record, trainer=str(ROOT / "tests" / "fake_trainer.py")))
    return bindir / "uv"


@pytest.fixture
def cloud(tmp_path):
    """(env for tpu.py, calls(), fake dir): gcloud on PATH; the workers' PATH has git, python3 (3.10) and no uv."""
    fake, bindir, worker_bin = tmp_path / "fake", tmp_path / "bin", tmp_path / "worker_bin"
    for d in (fake, bindir, worker_bin, tmp_path / "bucket"):
        d.mkdir()
    _script(bindir / "gcloud", f"#!/bin/sh\nexec {sys.executable} -S {ROOT / 'tests' / 'fake_gcloud.py'} \"$@\"\n")
    record = RECORD.format(default=str(fake))
    uv = fake_uv(tmp_path, sys.executable)  # not on any PATH: the python3 shim's `pip install uv` copies it
    _script(worker_bin / "python3", PYTHON3_310.format(python=sys.executable, record=record, uv=str(uv)))
    _script(worker_bin / "git", GIT.format(python=sys.executable, record=record, root=str(ROOT)))
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_DIR": str(fake),
           "FAKE_BUCKET": str(tmp_path / "bucket"), "FAKE_SHIM_PATH": f"{worker_bin}:/usr/bin:/bin",
           "FAKE_STATES": json.dumps([[["ACTIVE", 1]]])}

    def calls(prefix: str = "") -> list[dict]:
        path = fake / "calls.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if r["argv"].startswith(prefix)]

    return env, calls, fake


def tpu(args, env, timeout=120):
    return subprocess.run([*TPU, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _activate(env, fake, states=(("ACTIVE", 1),)) -> None:
    env["FAKE_STATES"] = json.dumps([list(map(list, states))])
    assert tpu(["create", *BASE, "--accelerator-type", "v5litepod-4", "--force", "--no-wait"], env).returncode == 0


# ----------------------------------------------------------------------------------------------------- setup
def test_setup_makes_a_3_11_env_and_never_uses_the_images_python_3_10(cloud):
    env, calls, fake = cloud
    _activate(env, fake)
    out = tpu(["setup", *BASE, "--repo", "https://example.com/g2rl_jax.git"], env)
    assert out.returncode == 0, out.stdout + out.stderr
    version = f"python {sys.version.split()[0]} jax"  # what the environment's python printed after the install
    assert version in out.stdout and sys.version_info >= (3, 11)
    assert [c["argv"] for c in calls("python3")] == ["python3 -m pip install --user --quiet uv"]  # uv, nothing else
    assert [c["argv"] for c in calls("uv")] == [
        "uv venv --allow-existing --python-preference only-managed --python 3.11 .venv",
        "uv pip install --python .venv/bin/python -e '.[tpu,gcs]'"]
    checkout = fake / "vm-0" / "g2rl_jax"
    assert all(c["cwd"] == str(checkout) for c in calls("uv"))
    assert sys.executable in (checkout / ".venv" / "bin" / "python").read_text()


def test_setup_refuses_an_env_on_python_3_10(cloud):
    """A uv that took the image's python3 for the environment: the version check stops setup before any install."""
    env, calls, fake = cloud
    _activate(env, fake)
    out = tpu(["setup", *BASE, "--repo", "r"], {**env, "FAKE_UV_SYSTEM": "1"})
    assert out.returncode == 1
    assert "setup: ~/g2rl_jax/.venv is not Python 3.11+" in out.stderr
    assert not calls("uv pip")


# ----------------------------------------------------------------------------------------------------- create
@pytest.mark.parametrize("states,code,lines", [
    (["ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"], 0,
     ["queued resource g: ACCEPTED, waiting for ACTIVE", "queued resource g: WAITING_FOR_RESOURCES, waiting for",
      "queued resource g: PROVISIONING, waiting for", "queued resource g: ACTIVE after"]),
    (["WAITING_FOR_RESOURCES", "FAILED"], 1, ["queued resource g: FAILED while waiting for ACTIVE"]),
    (["WAITING_FOR_RESOURCES"], 1, ["queued resource g: not ACTIVE after 1 s (still WAITING_FOR_RESOURCES)"]),
])
def test_create_waits_for_active(cloud, tmp_path, states, code, lines):
    """Each state is held until create has said it (a gate file per state, the last one held), so every state is
    seen whatever the machine's load."""
    env, calls, fake = cloud
    gates = {name: tmp_path / f"gate-{name}" for name in states[:-1]}
    env["FAKE_STATES"] = json.dumps([[[name, str(gates[name])] for name in states[:-1]] + [[states[-1], 100]]])
    timeout = "1" if len(states) == 1 else "60"
    proc = subprocess.Popen([*TPU, "create", *BASE, "--accelerator-type", "v5p-8", "--force", "--poll-seconds", "0.1",
                             "--wait-timeout", timeout], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output = ""
    for line in proc.stdout:  # open each state's gate once create has reported the state
        output += line
        for name, gate in gates.items():
            if f"queued resource g: {name}, waiting" in line:
                gate.touch()
    assert proc.wait(timeout=60) == code, output
    for line in lines:
        assert line in output, output
    assert len(calls("gcloud compute tpus queued-resources describe g --zone z")) >= 2


def test_status_shows_the_state_and_the_runs_last_step(cloud, tmp_path):
    env, calls, fake = cloud
    out = tpu(["status", *BASE, "--bucket", "gs://b/d"], env)
    assert out.stdout.splitlines() == ["queued resource g: NOT_FOUND",
                                       "run gs://b/d/runs/g: last step none yet, checkpoints none"]
    _activate(env, fake)
    run = tmp_path / "bucket" / "b" / "d" / "runs" / "g"
    for step in (3, 4):
        (run / "checkpoints" / str(step)).mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(5)))
    out = tpu(["status", *BASE, "--bucket", "gs://b/d"], env)
    assert out.stdout.splitlines() == ["queued resource g: ACTIVE",
                                       "trainer: never started (worker 0), workers not set up",
                                       "run gs://b/d/runs/g: last step 4, checkpoints 3, 4"]
    assert calls("gcloud storage cat -r -8192 gs://b/d/runs/g/metrics.jsonl")
    out = tpu(["status", *BASE], env)
    assert "pass --bucket" in out.stdout


def test_watch_needs_a_bucket(cloud):
    env, calls, fake = cloud
    out = tpu(["watch", *BASE, "--accelerator-type", "v5p-8", "--repo", "r", "--config", "c.yaml"], env)
    assert out.returncode == 2 and "watch needs --bucket gs://BUCKET/DIR" in out.stderr and not calls()


# ----------------------------------------------------------------------------------------------------- watch
PROVISION_S, SETUP_S = 1.0, 0.5  # the fake cloud's queue time of a recreated resource and setup's install time
INTERVAL, BACKOFF = 0.2, 0.4  # watch's poll and first backoff in these tests
WATCH = ["watch", *BASE, "--accelerator-type", "v5litepod-4", "--spot", "--bucket", "gs://b/d", "--repo", "r",
         "--config", "configs/demo.yaml", "--interval", str(INTERVAL), "--backoff", str(BACKOFF)]
RUN = ("bucket", "b", "d", "runs", "g")  # the run directory under tmp_path


def _preempt(fake: Path) -> float:
    """What a spot preemption does: the queued resource turns SUSPENDED and the VM's processes get SIGTERM."""
    state_file = fake / "state.json"
    state = json.loads(state_file.read_text())
    state["preempted"] = time.time()
    state_file.write_text(json.dumps(state))
    t = time.time()
    for pgid in state["groups"]:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return t


def _wait(condition, timeout, what, proc):
    t0 = time.time()
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"watch ended ({proc.returncode}) before {what}: {proc.stdout.read()[-4000:]}")
        assert time.time() - t0 < timeout, f"no {what} in {timeout} s"
        time.sleep(0.05)
    return time.time()


def kind(call: dict) -> str:
    """A recorded gcloud call as what it is to watch: describe, probe, setup, train, tail, create, delete, read."""
    argv = call["argv"]
    if "queued-resources" in argv:
        return argv.split()[4]
    if "storage" in argv.split()[:3]:
        return "read"
    for marker, name in (("g2rl-worker", "probe"), ("uv venv", "setup"), (".venv/bin/python -m g2rl_jax.train",
                                                                          "train"), ("tail -n", "tail")):
        if marker in argv:
            return name
    return argv


def assert_paced(calls: list[dict], interval: float = INTERVAL) -> None:
    """No busy polling: one describe a poll, polls at least `interval` apart, and at most one probe and one read
    of the run's metrics in each poll."""
    times = [c["time"] for c in calls if kind(c) == "describe"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps and min(gaps) >= 0.9 * interval, gaps
    polls: list[list[str]] = []
    for c in calls:
        if kind(c) == "describe":
            polls.append([])
        elif polls:
            polls[-1].append(kind(c))
    assert all(p.count("probe") <= 1 and p.count("read") <= 2 for p in polls), polls


def _watch(env, tmp_path, *extra, timeout=120):
    return tpu([*WATCH, "--log", str(tmp_path / "watch.log"), *extra], env, timeout=timeout)


def _fake_trainers(env, tmp_path, specs) -> None:
    """The workers' trainer is tests/fake_trainer.py playing `specs`, one a launch; setup's check of the
    environment imports a stub jax (the real one costs a second and more of CPU per setup)."""
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "jax.py").write_text('__version__ = "(a stub: the fake trainer needs no jax)"\n')
    env.update(FAKE_TRAINER=json.dumps(specs), PYTHONPATH=str(stub))


def _steps(tmp_path) -> list[int]:
    return [r["step"] for r in read_metrics(tmp_path.joinpath(*RUN))]


def test_watch_a_resource_created_by_hand(cloud, tmp_path):
    """`create --no-wait`, then `watch`: it waits for ACTIVE, finds the workers bare (no setup mark, no trainer),
    sets up, trains, and ends when the trainer exits 0. The old watch polled such a slice forever."""
    env, calls, fake = cloud
    capacity, log = tmp_path / "capacity", tmp_path / "watch.log"  # the queue holds until the test says so
    _activate(env, fake, states=(("WAITING_FOR_RESOURCES", str(capacity)), ("ACTIVE", 1)))
    _fake_trainers(env, tmp_path, [{"steps": 3, "exit": 0}])
    proc = subprocess.Popen([*TPU, *WATCH, "--log", str(log)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: log.exists() and "WAITING_FOR_RESOURCES; waiting" in log.read_text(), 60, "the wait", proc)
        capacity.touch()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    output = proc.stdout.read()
    for line in ("queued resource g: WAITING_FOR_RESOURCES; waiting", "the workers are not set up: setup, then train",
                 "setup done", "train done", "the run finished: the trainer exited 0 (exit 0 (worker 0)); "
                 "gs://b/d/runs/g/summary.json is written"):
        assert line in output, output
    gcloud = calls("gcloud")
    assert [k for k in map(kind, gcloud) if k not in ("describe", "probe", "read")] == ["create", "setup", "train"]
    assert _steps(tmp_path) == [1, 2, 3]
    assert_paced([c for c in gcloud if c["time"] > gcloud[0]["time"]])  # watch's calls, after create's


def test_watch_retries_a_failed_setup(cloud, tmp_path):
    env, calls, fake = cloud
    env["FAKE_SETUP_FAILS"] = "1"
    _fake_trainers(env, tmp_path, [{"steps": 2, "exit": 0}])
    out = _watch(env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "queued resource g does not exist: create" in out.stdout
    assert "setup failed (status 1; its output is above): 1 of --max-tries 3 in a row" in out.stdout
    assert f"ACTIVE, the workers are not set up: setup, then train: in {BACKOFF:g} s (backoff)" in out.stdout
    gcloud = calls("gcloud")
    acts = [(kind(c), c["time"]) for c in gcloud if kind(c) not in ("describe", "probe", "read")]
    assert [k for k, _ in acts] == ["create", "setup", "setup", "train"]
    assert acts[2][1] - acts[1][1] >= BACKOFF
    assert_paced(gcloud)


@pytest.mark.parametrize("code,advice", [
    (2, "bad input (a config key, a dataset row, a path): fix what the line names"),
    (3, "another trainer holds the run's lease"),
    (4, "the accelerator ran out of memory: follow the planner's hint in the line"),
    (5, "the reward function (reward.function) raised"),
])
def test_watch_stops_where_relaunching_cannot_help(cloud, tmp_path, code, advice):
    """A trainer exit whose action is STOP ends watch with the trainer's code and one line: the code, what to do,
    and the trainer's own last line (the workers' last log lines are in the log); it is never relaunched. With
    --delete-when-done the resource is deleted (the old watch relaunched a bad config 20 times in 40 s)."""
    env, calls, fake = cloud
    line = f"train error: the fake trainer's one line for exit {code}"
    _fake_trainers(env, tmp_path, [{"steps": 1, "exit": code, "line": line}])
    out = _watch(env, tmp_path, *(["--delete-when-done"] if code == 4 else []))
    assert out.returncode == code, out.stdout + out.stderr
    final = [x for x in out.stdout.splitlines() if "stopped: " in x]
    assert len(final) == 1 and final[0].endswith(
        f"stopped: the trainer exited {code} (exit {code} (worker 0)): {final[0].split('): ', 1)[1]}")
    assert advice in final[0] and f"relaunching cannot help. Its last line: worker 0: {line}" in final[0]
    assert f"  worker 0: {line}" in (tmp_path / "watch.log").read_text()
    gcloud = calls("gcloud")
    acts = [k for k in map(kind, gcloud) if k not in ("describe", "probe", "read")]
    assert acts == ["create", "setup", "train", "tail"] + (["delete"] if code == 4 else [])
    assert_paced(gcloud)


def test_watch_relaunches_where_it_can(cloud, tmp_path):
    """75 (storage) is relaunched after a backoff, 143 (SIGTERM on a VM still ACTIVE) at once; the count of
    relaunches in a row starts again once the run made a step; the run then finishes."""
    env, calls, fake = cloud
    _fake_trainers(env, tmp_path, [{"steps": 2, "exit": 75}, {"steps": 1, "exit": 143}, {"steps": 2, "exit": 0}])
    out = _watch(env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"the trainer exited 75 (exit 75 (worker 0)): relaunch 1 of 5: in {BACKOFF:g} s (backoff)" in out.stdout
    assert "the trainer exited 143 (exit 143 (worker 0)): relaunch 1 of 5" in out.stdout
    gcloud = calls("gcloud")
    acts = [(kind(c), c["time"]) for c in gcloud if kind(c) not in ("describe", "probe", "read")]
    assert [k for k, _ in acts] == ["create", "setup", "train", "train", "train"]
    assert acts[3][1] - acts[2][1] >= BACKOFF + 2 * 0.05  # two steps, then the backoff
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]
    assert_paced(gcloud)


def test_watch_gives_up_after_relaunches_without_progress(cloud, tmp_path):
    env, calls, fake = cloud
    _fake_trainers(env, tmp_path, [{"steps": 0, "exit": 137}])
    out = _watch(env, tmp_path, "--max-relaunches", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert ("giving up: the trainer ended 3 times in a row without a new step (--max-relaunches 2), the last time "
            "exit 137 (worker 0); the run is in gs://b/d/runs/g") in out.stdout
    assert [kind(c) for c in calls("gcloud")].count("train") == 3
    assert_paced(calls("gcloud"))


@pytest.mark.parametrize("first", [0, 2])
def test_watch_takes_over_a_slice_started_by_hand(cloud, tmp_path, first):
    """A slice set up and trained by hand, whose trainer has ended: watch reads the exit file on the worker. Exit 0
    (the run finished): it ends at its first poll and starts nothing. Exit 2 from before watch began (the user
    may have fixed the config since): it starts the trainer again, once; that run finishes."""
    env, calls, fake = cloud
    _activate(env, fake)
    _fake_trainers(env, tmp_path, [{"steps": 2, "exit": first}, {"steps": 1, "exit": 0}])
    for args in (["setup", *BASE, "--repo", "r"], ["train", *BASE, "--config", "c.yaml", "--bucket", "gs://b/d"]):
        assert tpu(args, env).returncode == 0
    exit_file = fake / "vm-0" / "g2rl_jax" / "logs" / "worker-0.exit"
    deadline = time.time() + 30
    while not exit_file.exists() and time.time() < deadline:
        time.sleep(0.05)
    began = time.time()
    out = _watch(env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    watched = [kind(c) for c in calls("gcloud") if c["time"] > began]
    assert [k for k in watched if k not in ("describe", "probe", "read")] == ([] if first == 0 else ["train"])
    if first:
        assert "the trainer had stopped with exit 2 before this watch began: starting it again, once" in out.stdout
    assert _steps(tmp_path) == ([1, 2] if first == 0 else [1, 2, 3])


def test_watch_brings_back_a_preemption_mid_run(cloud, tmp_path):
    """A preemption while the (fake) trainer runs: SUSPENDED, the trainer exits 143 on its SIGTERM; watch deletes
    and recreates the resource, sets up the new (empty) VM and trains; the run continues from its last step."""
    env, calls, fake = cloud
    env["FAKE_STATES"] = json.dumps([[["ACTIVE", 1]], [["WAITING_FOR_RESOURCES", 0.4], ["ACTIVE", 1]]])
    _fake_trainers(env, tmp_path, [{"until": "SIGTERM"}, {"steps": 2, "exit": 0}])
    proc = subprocess.Popen([*TPU, *WATCH, "--log", str(tmp_path / "watch.log")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: len(_steps(tmp_path)) >= 2, 60, "step 2", proc)
        _preempt(fake)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        tpu(["delete", *BASE], env)
    output = proc.stdout.read()
    stopped = (fake / "vm-0" / "g2rl_jax" / "logs" / "worker-0.exit").read_text()
    assert stopped == "143\n"
    steps = _steps(tmp_path)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4
    for line in ("preemption: queued resource g is SUSPENDED; recovery 1: delete, create",
                 "recovery 1: setup and train follow once the queued resource is ACTIVE", "the run finished"):
        assert line in output, output
    gcloud = calls("gcloud")
    acts = [k for k in map(kind, gcloud) if k not in ("describe", "probe", "read")]
    assert acts[:7] == ["create", "setup", "train", "delete", "create", "setup", "train"]
    assert_paced(gcloud)


def test_dry_run_prints_the_poll_loop_and_calls_nothing(cloud):
    """`watch --dry-run` and `status --dry-run` print what they would run; a gcloud that records every call sees
    none (the old ones ran gcloud every poll and spent --max-recoveries on nothing)."""
    env, calls, fake = cloud
    out = tpu([*WATCH, "--dry-run"], env, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"# watch --dry-run: nothing runs. One poll every --interval {INTERVAL:g} s:"
    assert lines[1] == "gcloud compute tpus queued-resources describe g --zone z '--format=value(state.state)'"
    assert "g2rl-worker" in lines[3] and lines[5] == "gcloud storage cat -r -8192 gs://b/d/runs/g/metrics.jsonl"
    out = tpu(["status", *BASE, "--bucket", "gs://b/d", "--dry-run"], env, timeout=30)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 5
    assert calls() == [] and not (fake / "calls.jsonl").exists()


# ----------------------------------------------------------------------------------------- the table, in-process
REPORTS = [  # the probe's lines -> the trainer's column and the code that decided it
    ("", "unread", None),
    ("g2rl-worker 0 setup=none trainer=never", "bare", None),
    ("g2rl-worker 0 setup=ok trainer=never\ng2rl-worker 1 setup=none trainer=never", "bare", None),
    ("g2rl-worker 1 setup=ok trainer=never\ng2rl-worker 0 setup=ok trainer=never", "ready", None),
    ("some noise\ng2rl-worker 0 setup=ok trainer=running", "running", None),
    ("g2rl-worker 0 setup=ok trainer=exited:0\ng2rl-worker 1 setup=ok trainer=exited:0", "finished", 0),
    ("g2rl-worker 0 setup=ok trainer=exited:76\ng2rl-worker 1 setup=ok trainer=exited:4", "stopped", 4),
    ("g2rl-worker 0 setup=ok trainer=exited:143\ng2rl-worker 1 setup=ok trainer=exited:76", "ended", 143),
    ("g2rl-worker 0 setup=ok trainer=exited:76\ng2rl-worker 1 setup=ok trainer=lost", "failed", 137),
    ("g2rl-worker 0 setup=ok trainer=exited:75", "failed", 75),
    ("g2rl-worker 0 setup=ok trainer=exited:0\ng2rl-worker 1 setup=ok trainer=never", "failed", 137),
]


@pytest.mark.parametrize("text,column,code", REPORTS)
def test_the_trainer_is_read_from_the_workers_reports(text, column, code):
    trainer = tpu_states.trainer_state(text)
    assert (trainer.column, trainer.code) == (column, code)


def test_exit_summary_and_stragglers():
    text = "\n".join(f"g2rl-worker {w} setup=ok trainer={s}" for w, s in
                     enumerate(["exited:4", "running", "running", "lost"]))
    trainer = tpu_states.trainer_state(text)
    assert trainer.column == "running" and trainer.straggling == (4, 137)
    assert tpu_states.exit_summary(trainer) == ("exit 4 (worker 0); running (workers 1, 2); gone without an exit code "
                                                "(worker 3)")


def test_every_exit_code_has_a_column_and_every_stop_its_advice():
    exits = tpu_states.exits
    for code in [*exits.Exit, 137, 1234]:
        column = tpu_states.COLUMN_OF[exits.action(code)]
        assert tpu_states.TABLE["active", column]
        assert (exits.action(code) == exits.STOP) == (code in tpu_states.ADVICE)


def test_the_table_in_the_docs_is_the_code():
    doc = (ROOT / "docs" / "tpu_vm.md").read_text(encoding="utf-8")
    assert tpu_states.table_markdown() in doc
    assert len(tpu_states.TABLE) == len(tpu_states.ROWS) * len(tpu_states.COLUMNS)


class StubSteps:
    """tpu.py's Steps for an in-process Watch: scripted probe answers, every command recorded and successful."""

    def __init__(self, probes):
        self.probes, self.ran = list(probes), []

    def build(self, name):
        return [[name]]

    def call(self, cmds):
        self.ran += [c[0] for c in cmds]
        return 0

    def capture(self, cmd):
        self.ran.append(cmd[0])
        return self.probes.pop(0) if cmd[0] == "probe" else "worker 1: train error: the real cause\n"


def test_a_straggling_slice_is_stopped_then_the_code_that_failed_decides(monkeypatch, tmp_path):
    """Worker 0's trainer ended (exit 4) while worker 1's runs on: after STRAGGLER_POLLS polls watch stops the
    rest; then worker 0's code, not the 143 it caused, decides: stop, with exit 4."""
    import argparse

    monkeypatch.setattr(tpu_watch, "queued_state", lambda args, target: "ACTIVE")
    monkeypatch.setattr(tpu_watch, "last_step", lambda directory: 7)
    mixed = "g2rl-worker 0 setup=ok trainer=exited:4\ng2rl-worker 1 setup=ok trainer=running"
    ended = "g2rl-worker 0 setup=ok trainer=exited:4\ng2rl-worker 1 setup=ok trainer=exited:143"
    steps = StubSteps([mixed] * tpu_watch.STRAGGLER_POLLS + [ended])
    args = argparse.Namespace(name="g", bucket="gs://b/d", overrides=[], log=str(tmp_path / "log"), interval=0,
                              backoff=0, max_tries=3, max_relaunches=5, max_recoveries=20, wait_timeout=10,
                              delete_when_done=False)
    w = tpu_watch.Watch(args, [], steps)
    assert [w.poll() for _ in range(tpu_watch.STRAGGLER_POLLS)] == [None] * tpu_watch.STRAGGLER_POLLS
    assert steps.ran == ["probe"] * tpu_watch.STRAGGLER_POLLS + ["stop"]
    assert w.poll() == 4 and steps.ran[-1] == "tail"
    assert "Its last line: worker 1: train error: the real cause" in (tmp_path / "log").read_text()


WATCH_STEPS = 20


@pytest.mark.slow
def test_watch_brings_a_preempted_spot_run_back(cloud, assets, tmp_path):  # noqa: F811
    """watch creates the resource, sets up and trains; the test preempts the VM after step 2 (SUSPENDED, SIGTERM
    to the trainer); watch deletes and recreates the resource, sets up the new (empty) VM and trains again; the run
    resumes from its checkpoint in the bucket, reads its programs from the bucket's compile cache, and finishes;
    watch then sees the exit status 0 and summary.json, and ends. Prints the recovery time and its parts."""
    env, calls, fake = cloud
    env["FAKE_STATES"] = json.dumps([[["WAITING_FOR_RESOURCES", 0.5], ["ACTIVE", 1]],
                                     [["WAITING_FOR_RESOURCES", PROVISION_S], ["ACTIVE", 1]]])
    env["FAKE_SETUP_SECONDS"] = str(SETUP_S)
    env["XLA_FLAGS"] = xla_flags(8)
    # steps after the 2nd take ~0.4 s each on a loaded 2-core machine: 20 leave the preemption (noticed through the
    # metrics file, then SIGTERM from the fake cloud) ~7 s to land before the run would end by itself (with 6 it
    # once came too late: the trainer had finished and exited 0)
    ov = [o for o in overrides(assets, "unused", steps=WATCH_STEPS) if not o.startswith("run.output_dir=")]
    log = tmp_path / "watch.log"
    proc = subprocess.Popen(
        [*TPU, "watch", *BASE, "--accelerator-type", "v5litepod-4", "--spot", "--bucket", "gs://b/d", "--repo", "r",
         "--config", "configs/qwen3_1p7b_g2rl.yaml", "--interval", "0.5", "--log", str(log),
         "--env", "JAX_PLATFORMS=cpu", "--env", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0", *ov],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "bucket" / "b" / "d" / "runs" / "g"
    try:
        _wait(lambda: max((r["step"] for r in read_metrics(run)), default=0) >= 2, 900, "step 2", proc)
        t_preempt = _preempt(fake)
        first_log = fake / "vm-0" / "g2rl_jax" / "logs" / "worker-0.exit"
        _wait(first_log.exists, 60, "the preempted trainer's exit", proc)
        exited = time.time() - t_preempt
        stopped = max(r["step"] for r in read_metrics(run))
        t_step = _wait(lambda: max((r["step"] for r in read_metrics(run)), default=0) > stopped, 900,
                       "a step of the relaunched run", proc)
        assert proc.wait(timeout=900) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run([*TPU, "delete", *BASE], env=env, capture_output=True)  # kills what the fake VM still runs
    output = proc.stdout.read()
    assert first_log.read_text() == "143\n", (fake / "vm-0" / "g2rl_jax" / "logs" / "worker-0.log").read_text()[-3000:]
    assert exited < 25, "the trainer outlived its SIGTERM grace"
    assert [r["step"] for r in read_metrics(run)] == list(range(1, WATCH_STEPS + 1))
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["checkpoint_found"] for h in history] == [None, stopped]
    assert (run / "summary.json").exists()
    text = log.read_text()
    for line in ("watching queued resource g", "preemption: queued resource g is SUSPENDED; recovery 1",
                 "recovery 1: setup and train follow once the queued resource is ACTIVE",
                 "the run finished: the trainer exited 0"):
        assert line in text and line in output, text
    gcloud = calls("gcloud")
    acts = [k for k in map(kind, gcloud) if k not in ("describe", "probe", "read")]
    assert acts == ["create", "setup", "train", "delete", "create", "setup", "train", "delete"]  # + the cleanup
    ssh = [c for c in gcloud if kind(c) in ("setup", "train")]
    assert all("--worker=all" in c["argv"] for c in ssh)
    assert_paced(gcloud, 0.5)
    # the recovery, from the fake cloud's clock: preemption -> relaunched run's first step
    when = {name: next(c["time"] for c in calls(f"gcloud compute tpus {name}") if c["time"] > t_preempt)
            for name in ("queued-resources delete", "queued-resources create")}
    setup_call, train_call = (c["time"] for c in ssh[2:])
    parts = {"detect": when["queued-resources delete"] - t_preempt,
             "delete+create+ACTIVE": setup_call - when["queued-resources delete"],
             "setup": train_call - setup_call, "trainer start to first step": t_step - train_call}
    print(f"\nrecovery {t_step - t_preempt:.1f} s (provisioning modeled as {PROVISION_S} s, setup as {SETUP_S} s): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + f"; trainer exited {exited:.1f} s after SIGTERM")
    (tmp_path.parent / "recovery.json").write_text(json.dumps({"total": t_step - t_preempt, **parts}))
    assert shlex.split(ssh[3]["argv"])[-1].count("run.compilation_cache_dir") == 1
