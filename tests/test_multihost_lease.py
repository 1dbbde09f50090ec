"""A multi-host run whose run lock is taken over: process 0 holds the lease, and when its renewal finds the lock
replaced it stops with one line. Every other process must stop with that line too, at once, not stall at its next
collective waiting for process 0 (control/stop.py: the line goes through the run's key-value channel). Two real
jax.distributed processes (CPU, gloo) running tests/lease_multihost_worker.py."""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

from g2rl_jax import storage
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.runlock import LOCK_FILE

from _helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_process_stops_with_one_line_when_process_0_loses_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    coordinator = f"127.0.0.1:{_free_port()}"
    worker = str(ROOT / "tests" / "lease_multihost_worker.py")
    logs = [open(tmp_path / f"{i}.err", "w") for i in range(2)]  # noqa: SIM115 - closed below
    procs = [subprocess.Popen([sys.executable, worker, coordinator, str(i), str(run_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=logs[i], text=True) for i in range(2)]
    try:
        for proc in procs:  # (gloo prints its own line first)
            assert any(line.strip() == "running" for line in iter(proc.stdout.readline, "")), proc.returncode
        # another trainer takes the run over (as a relaunch does once the lease lapsed)
        storage.write_text(run_dir / LOCK_FILE, json.dumps({"host": "vm-b", "pid": 1, "since": "now",
                                                            "renewed": time.time(), "lease_seconds": 3.0}) + "\n")
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
