"""launch/tpu.sh on a fake cloud: `setup` against the images' Python 3.10, `create` waiting for ACTIVE, `status`, and
`watch` bringing back a spot run after a preemption, with a real trainer (tiny random Qwen3, as test_train.py).

tests/fake_gcloud.py plays the queued resource (scripted states per created generation, SUSPENDED once preempted)
and runs `tpu-vm ssh --command` with bash as worker 0 of the current VM: its own HOME (a recreated VM has an empty
disk) and PATH: fakes of `git` (a checkout whose g2rl_jax/ and configs/ are this repository's), `uv` (its managed
CPython is this interpreter; `pip install` sleeps FAKE_SETUP_SECONDS) and `python3`, a shim that reports 3.10 as the
TPU images' Ubuntu 22.04 does. gs://b/... is a local directory, so the trainer writes there as to a bucket.
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
TPU = [sys.executable, str(ROOT / "launch" / "tpu.py")]
BASE = ["--name", "g", "--zone", "z"]

RECORD = """import json, os, shlex, sys, time
def record(name, argv):
    with open(os.path.join(os.environ.get("FAKE_DIR", {default!r}), "calls.jsonl"), "a") as fh:
        fh.write(json.dumps({{"time": time.time(), "argv": shlex.join([name, *argv]), "cwd": os.getcwd()}}) + "\\n")
"""
UV = """#!{python}
{record}
import shutil, pathlib
args = sys.argv[1:]
record("uv", args)
if args[0] == "venv":
    managed = args[args.index("--python-preference") + 1] == "only-managed" if "--python-preference" in args else False
    interpreter = {python!r} if managed and os.environ.get("FAKE_UV_SYSTEM") != "1" else shutil.which("python3")
    bin_dir = pathlib.Path(args[-1]) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\\nexec {{interpreter}} "$@"\\n')
    (bin_dir / "python").chmod(0o755)
elif args[:2] == ["pip", "install"]:
    time.sleep(float(os.environ.get("FAKE_SETUP_SECONDS", "0")))
"""
PYTHON3_310 = """#!{python}
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
GIT = """#!{python}
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
    _script(bindir / "uv", UV.format(python=python, record=record))
    return bindir / "uv"


@pytest.fixture
def cloud(tmp_path):
    """(env for tpu.py, calls(), fake dir): gcloud on PATH; the workers' PATH has git, python3 (3.10) and no uv."""
    fake, bindir, worker_bin = tmp_path / "fake", tmp_path / "bin", tmp_path / "worker_bin"
    for d in (fake, bindir, worker_bin, tmp_path / "bucket"):
        d.mkdir()
    _script(bindir / "gcloud", f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'fake_gcloud.py'} \"$@\"\n")
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
    ([["ACCEPTED", 0.3], ["WAITING_FOR_RESOURCES", 0.6], ["PROVISIONING", 0.3], ["ACTIVE", 1]], 0,
     ["queued resource g: ACCEPTED, waiting for ACTIVE", "queued resource g: WAITING_FOR_RESOURCES, waiting for",
      "queued resource g: PROVISIONING, waiting for", "queued resource g: ACTIVE after"]),
    ([["WAITING_FOR_RESOURCES", 0.3], ["FAILED", 1]], 1, ["queued resource g: FAILED while waiting for ACTIVE"]),
    ([["WAITING_FOR_RESOURCES", 100]], 1, ["queued resource g: not ACTIVE after 1 s (still WAITING_FOR_RESOURCES)"]),
])
def test_create_waits_for_active(cloud, states, code, lines):
    env, calls, fake = cloud
    env["FAKE_STATES"] = json.dumps([states])
    timeout = "1" if code else "30"
    out = tpu(["create", *BASE, "--accelerator-type", "v5p-8", "--force", "--poll-seconds", "0.1", "--wait-timeout",
               timeout], env)
    assert out.returncode == code, out.stdout + out.stderr
    for line in lines:
        assert line in out.stdout, out.stdout
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
    ov = [o for o in overrides(assets, "unused", steps=6) if not o.startswith("run.output_dir=")]
    log = tmp_path / "watch.log"
    proc = subprocess.Popen(
        [*TPU, "watch", *BASE, "--accelerator-type", "v5litepod-4", "--spot", "--bucket", "gs://b/d", "--repo", "r",
         "--config", "configs/qwen3_1p7b_g2rl.yaml", "--interval", "0.5", "--poll-seconds", "0.2", "--log", str(log),
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
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["checkpoint_found"] for h in history] == [None, stopped]
    assert (run / "summary.json").exists()
    text = log.read_text()
    for line in ("watching queued resource g", "preemption: queued resource g is SUSPENDED; recovery 1",
                 "recovery 1: the run is relaunched from gs://b/d/runs/g", "the run finished (step 6)"):
        assert line in text and line in output, text
    verbs = [c["argv"].split()[4] if "queued-resources" in c["argv"] else c["argv"].split()[1]
             for c in calls("gcloud") if "describe" not in c["argv"] and "storage" not in c["argv"]]
    ssh = [c for c in calls("gcloud compute tpus tpu-vm ssh") if "worker-0.exit" not in c["argv"]]
    assert [v for v in verbs if v in ("create", "delete")] == ["create", "delete", "create", "delete"]  # + cleanup
    assert len(ssh) == 4 and all("--worker=all" in c["argv"] for c in ssh)  # setup, train; setup, train
    assert [("uv venv" in c["argv"], ".venv/bin/python -m g2rl_jax.train" in c["argv"]) for c in ssh] == \
        [(True, False), (False, True)] * 2
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
