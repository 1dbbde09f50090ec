"""A multi-host run whose run lock is taken over: process 0 holds the lease, and when its renewal finds the lock
replaced it stops with one line. Every other process must stop with that line too, at once, not stall at its next
collective waiting for process 0 (control/stop.py: the line goes through the run's key-value channel). And a launch
frozen whole past its lease and taken over: once thawed, process 1 (which holds no lease: it follows process 0's,
control/lease.py's Follower) writes nothing under the run directory, locally and on a GCS server. Two real
jax.distributed processes (CPU, gloo) running tests/lease_multihost_worker.py."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from g2rl_jax import storage
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.runlock import LOCK_FILE

from _helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, run_dir, *extra):
    """The two processes of one launch, and their stderr logs (open: the caller closes them)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    coordinator = f"127.0.0.1:{_free_port()}"
    worker = str(ROOT / "tests" / "lease_multihost_worker.py")
    logs = [open(tmp_path / f"{i}.err", "w") for i in range(2)]  # noqa: SIM115 - closed by the caller
    procs = [subprocess.Popen([sys.executable, worker, coordinator, str(i), str(run_dir), *extra], env=env,
                              stdout=subprocess.PIPE, stderr=logs[i], text=True) for i in range(2)]
    return procs, logs


def _taken_over(run_dir) -> None:
    """Another trainer's record in the lock, as a relaunch's takeover once the lease lapsed writes it."""
    storage.write_text(f"{run_dir}/{LOCK_FILE}", json.dumps({"host": "vm-b", "pid": 1, "since": "now",
                                                             "renewed": time.time(), "lease_seconds": 3.0}) + "\n")


def test_every_process_stops_with_one_line_when_process_0_loses_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    procs, logs = _launch(tmp_path, run_dir)
    try:
        for proc in procs:  # (gloo prints its own line first)
            assert any(line.strip() == "running" for line in iter(proc.stdout.readline, "")), proc.returncode
        _taken_over(run_dir)
        t0 = time.monotonic()
        for proc in procs:
            proc.wait(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        for proc, log in zip(procs, logs):
            proc.kill()
            log.close()
    for i, proc in enumerate(procs):
        stderr = (tmp_path / f"{i}.err").read_text()
        lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("I0", "W0", "E0"))]
        assert proc.returncode == Exit.LEASE_LOST, (i, stderr[-3000:])
        assert lines[-1].startswith(f"run lock lost: {run_dir / LOCK_FILE} was taken over (pid 1 on host 'vm-b'"), \
            (i, lines[-1])
        assert "Traceback" not in stderr, (i, stderr[-3000:])
    assert seconds < 15, seconds  # a renewal every second (lease 3 s), then the line through the key-value store


@pytest.fixture(params=["local", "gcs"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs").url(f"followed/{request.node.name.replace('[', '_').rstrip(']')}")


def test_a_thawed_launch_whose_lease_was_taken_writes_nothing_on_any_process(tmp_path, run_dir):
    """Both processes frozen (SIGSTOP) for two leases while process 1 writes an object every 0.5 s; the run taken
    over meanwhile. Process 1 is thawed first, process 0 a lease later: from the thaw on, process 1 writes no object
    (the fence refuses its next write: it follows process 0's lease, which it sees taken), and both exit with the
    lease-lost code. (Only process 0 used to arm the fence: process 1 of a thawed launch wrote into the run.)"""
    procs, logs = _launch(tmp_path, run_dir, "write")
    written = []
    try:
        for proc in procs:
            assert any(line.strip() == "running" for line in iter(proc.stdout.readline, "")), proc.returncode
        for line in iter(procs[1].stdout.readline, ""):  # process 1 writes (on GCS once it saw a renewal)
            if line.startswith("wrote 2"):
                break
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        time.sleep(2 * 3.0)  # two leases
        _taken_over(run_dir)
        before = sorted(storage.names(f"{run_dir}/p1"))
        procs[1].send_signal(signal.SIGCONT)
        time.sleep(3.0)  # process 1 alone for a lease: its writes wait for a renewal or meet the new record
        procs[0].send_signal(signal.SIGCONT)
        for proc in procs:
            proc.wait(timeout=60)
        written = procs[1].stdout.read().split()
    finally:
        for proc, log in zip(procs, logs):
            proc.kill()
            log.close()
    after = sorted(storage.names(f"{run_dir}/p1"))
    assert after == before, (before, after)
    for i, proc in enumerate(procs):
        assert proc.returncode == Exit.LEASE_LOST, (i, (tmp_path / f"{i}.err").read_text()[-3000:])
    assert written[-2:] == ["refused", str(int(Exit.LEASE_LOST))], written  # its next write, refused


def test_a_launch_whose_lease_is_lost_as_its_run_ends_exits_with_the_lease_lost(tmp_path):
    """Both processes frozen for two leases while process 0's main thread waits for its last save; the run taken
    over; both thawed. Process 0's lease thread stops the run (exit 3), giving process 1 up to 5 s to have the line,
    while the main thread, its last write refused, returns from the run: process 0 ends with the lease's code, not
    the main thread's 0 ("done": a supervisor would count the run finished), as the chaos soak (one process per side)
    saw before train/command.py waited for the stop (control/stop.py's `await_stop`)."""
    run_dir = str(tmp_path / "run")
    procs, logs = _launch(tmp_path, run_dir, "end")
    try:
        for proc in procs:
            assert any(line.strip() == "running" for line in iter(proc.stdout.readline, "")), proc.returncode
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        time.sleep(2 * 3.0)  # two leases
        _taken_over(run_dir)
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
        for proc in procs:
            proc.wait(timeout=60)
        said = procs[0].stdout.read()
    finally:
        for proc, log in zip(procs, logs):
            proc.kill()
            log.close()
    for i, proc in enumerate(procs):
        assert proc.returncode == Exit.LEASE_LOST, (i, proc.returncode, (tmp_path / f"{i}.err").read_text()[-3000:])
    assert "done" not in said and not storage.exists(f"{run_dir}/summary.json"), said
