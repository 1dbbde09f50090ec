"""Time-bounded equivalence checks in a pool of persistent worker processes.

Each worker is a plain `python` subprocess (not a `multiprocessing` child, so it can be started from any thread,
from daemonic pool workers and from other worker processes) that imports sympy once, answers one check per line
on its stdin/stdout pipes, and runs with a capped address space. The parent waits for an answer with
`select` and a deadline; a worker that misses the deadline is killed (SIGKILL) and the check scores False. A
replacement is started lazily on the next check, and its start-up time is not counted against any check.

One pool per process (re-created after `fork`), sized to the CPU count; threads share it.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER_MEMORY_BYTES = 4 << 30   # address-space cap of one worker
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take a while
_SRC_ROOT = str(Path(__file__).resolve().parents[2])


class _Worker:
    """One checker subprocess speaking the line protocol of `serve`."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_SRC_ROOT, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from g2rl_jax.rewards.bounded import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        if self._read_line(WORKER_START_TIMEOUT_S) != b"ready":
            self.kill()
            raise RuntimeError(
                f"verifier worker did not start within {WORKER_START_TIMEOUT_S:.0f}s "
                f"({sys.executable} -c 'from g2rl_jax.rewards.bounded import serve'); check that g2rl_jax and "
                "sympy import in a fresh interpreter")

    def _read_line(self, timeout: float) -> bytes | None:
        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 64)
            if not chunk:
                return None
            buf += chunk
        return buf.strip()

    def ask(self, pred: str, gold: str, timeout: float) -> bool | None:
        """The worker's verdict, or None if it missed the deadline or died."""
        try:
            self.proc.stdin.write(json.dumps([pred, gold]).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        reply = self._read_line(timeout)
        return None if reply not in (b"1", b"0") else reply == b"1"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


class BoundedPool:
    """At most `max_workers` concurrent checks, each bounded by its timeout."""

    def __init__(self, max_workers: int):
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        worker = _Worker()
        with self._lock:
            self._all.append(worker)
        return worker

    def check(self, pred: str, gold: str, timeout: float) -> bool:
        """Whether canonical answers pred and gold are equivalent; False if the check exceeds timeout."""
        with self._slots:
            worker = self._take()
            verdict = worker.ask(pred, gold, timeout)
            if verdict is None:
                worker.kill()
                with self._lock:
                    self._all.remove(worker)
                return False
            with self._lock:
                self._idle.append(worker)
            return verdict

    def close(self) -> None:
        with self._lock:
            workers, self._all, self._idle = self._all, [], []
        for worker in workers:
            worker.kill()


_POOL: BoundedPool | None = None
_POOL_PID = -1
_POOL_LOCK = threading.Lock()


def get_pool() -> BoundedPool:
    """This process's pool (a forked child gets its own, never its parent's workers)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL, _POOL_PID = BoundedPool(os.cpu_count() or 2), os.getpid()
        return _POOL


@atexit.register
def _close_pool() -> None:
    if _POOL is not None and _POOL_PID == os.getpid():
        _POOL.close()


def serve() -> None:
    """Worker main loop: one JSON `[pred, gold]` per input line, `1`/`0` per output line, until stdin closes."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    from g2rl_jax.rewards.compare import equivalent_canonical
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            pred, gold = json.loads(line)
            ok = equivalent_canonical(pred, gold)
        except Exception:  # noqa: BLE001 -- any failure inside sympy means "not verified", never a crash
            ok = False
        out.write(b"1\n" if ok else b"0\n")
        out.flush()
