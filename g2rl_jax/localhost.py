"""Several processes of one job on this machine, joined by jax.distributed (CPU, gloo collectives): the launcher the
benchmarks and the tests share.

    with Processes(lambda i, port: [*cmd, *distributed_args(i, port, 2)], devices=1) as procs:
        procs.wait(timeout=600)               # exit codes (None: still running when the time was up)
        procs.log(0)                          # process 0's stdout and stderr
    run(lambda i, port: [...], timeout=600)   # start, wait, kill what still runs: [(exit code or None, log)]

Each process gets JAX on CPU with `devices` fake devices (XLA_FLAGS: the caller's flags with that device count);
`port` is the coordinator's, free when chosen. Logs go to files, not pipes: a full pipe would stall a process while
the other waits for it at a collective. Leaving the block kills what still runs and waits for it.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with JAX on CPU and `devices` fake CPU devices."""
    env = dict(os.environ if base is None else base, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+ ?", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {flags}".strip()
    return env


def distributed_args(process_id: int, port: int, num_processes: int, *, transfers: bool = False) -> list[str]:
    """The trainer's `distributed.*` overrides for process `process_id` of `num_processes` on this machine; with
    `transfers`, a free port for JAX's socket transfers too (one process per side: mesh.rollout_processes)."""
    args = [f"distributed.coordinator_address=127.0.0.1:{port}", f"distributed.num_processes={num_processes}",
            f"distributed.process_id={process_id}"]
    return [*args, f"distributed.transfer_address=127.0.0.1:{free_port()}"] if transfers else args


class Processes:
    """`command(process_id, port)` started for every process id at once (see the module docstring)."""

    def __init__(self, command: Callable[[int, int], list[str]], *, processes: int = 2, devices: int = 1,
                 env: Callable[[int], dict[str, str]] | dict[str, str] | None = None):
        self.port = free_port()
        self._stack = contextlib.ExitStack()
        self._logs = [self._stack.enter_context(tempfile.TemporaryFile()) for _ in range(processes)]
        self.procs: list[subprocess.Popen] = []
        try:
            for i, log in enumerate(self._logs):
                base = env(i) if callable(env) else env
                self.procs.append(subprocess.Popen(command(i, self.port), env=cpu_env(devices, base), stdout=log,
                                                   stderr=subprocess.STDOUT))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self, timeout: float, which: list[int] | None = None) -> list[int | None]:
        """Wait until the processes `which` (default: all) have ended or `timeout` seconds have passed; every
        process's exit code, None for one still running."""
        deadline = time.monotonic() + timeout
        for i in range(len(self.procs)) if which is None else which:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[i].wait(timeout=max(deadline - time.monotonic(), 0))
        return [p.poll() for p in self.procs]

    def log(self, i: int) -> str:
        """Process i's stdout and stderr so far."""
        self._logs[i].flush()
        self._logs[i].seek(0)
        return self._logs[i].read().decode(errors="replace")

    def close(self) -> None:
        """Kill what still runs, wait for it, drop the logs."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._stack.close()


def run(command: Callable[[int, int], list[str]], *, timeout: float, processes: int = 2, devices: int = 1,
        env: Callable[[int], dict[str, str]] | dict[str, str] | None = None) -> list[tuple[int | None, str]]:
    """Start the processes, wait for all of them (at most `timeout` seconds from the start), kill what still runs;
    each process's (exit code, None when it was still running, and its log)."""
    with Processes(command, processes=processes, devices=devices, env=env) as procs:
        codes = procs.wait(timeout)
        return [(code, procs.log(i)) for i, code in enumerate(codes)]
