"""Time-bounded equivalence checks in a pool of persistent worker processes.

Each worker is a plain `python` subprocess (not a `multiprocessing` child, so it can be started from any thread,
from daemonic pool workers and from other worker processes) that imports sympy once, answers one check per line
on its stdin/stdout pipes, and runs with a capped address space. The parent waits for an answer with
`select` and a deadline; a worker that misses the deadline is killed (SIGKILL) and the check scores False.

A replacement is spawned right after the kill, without waiting for it: it imports sympy in the background, so the
next check usually finds it ready. A check that takes a worker still starting waits for its `ready` line (start-up
is never counted against a check's bound). A worker that does not start within `WORKER_START_TIMEOUT_S` of its
spawn makes its check score False with one warning, once some worker has started in this process; if none ever
has, the installation is broken and the check raises `RuntimeError`.

One pool per process (re-created after `fork`), sized to the CPU count; threads share it.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER_MEMORY_BYTES = 4 << 30   # address-space cap of one worker
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take a while
WORKER_ARGV = [sys.executable, "-c", "from g2rl_jax.rewards.bounded import serve; serve()"]
_SRC_ROOT = str(Path(__file__).resolve().parents[2])
_LOG = logging.getLogger(__name__)


class _Worker:
    """One checker subprocess speaking the line protocol of `serve`; spawning it does not wait for it to start."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_SRC_ROOT, os.environ.get("PYTHONPATH")])))
        self.argv = list(WORKER_ARGV)
        self.start_deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        self.ready = False
        self.failure = ""  # why it did not start, once known
        self.closed = False  # its output pipe reached end of file
        self._buf = b""
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)

    def _read_line(self, timeout: float) -> bytes | None:
        """The next output line, or None if none is complete within timeout seconds (0: poll) or the pipe closed.
        A partial line is kept for the next call."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._buf:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 64)
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.strip()

    def poll_ready(self, wait: bool) -> bool:
        """Whether the worker has said `ready`; with wait, waits until its start deadline, and a worker not ready
        by then (or one that exited or said something else) gets a `failure`."""
        if self.ready or self.failure:
            return self.ready
        line = self._read_line(max(0.0, self.start_deadline - time.monotonic()) if wait else 0.0)
        if line == b"ready":
            self.ready = True
        elif line is not None:
            self.failure = f"said {line[:80]!r} instead of 'ready'"
        elif self.closed:
            try:  # its output closed: it is exiting (start-up time, not a check's)
                self.failure = f"exited (status {self.proc.wait(timeout=5.0)}) before saying 'ready'"
            except subprocess.TimeoutExpired:
                self.failure = "closed its output without saying 'ready'"
        elif wait:
            self.failure = f"did not say 'ready' within {WORKER_START_TIMEOUT_S:.0f}s of being spawned"
        return self.ready

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


def _command(argv: list[str]) -> str:
    return " ".join(repr(a) if " " in a else a for a in argv)


class BoundedPool:
    """At most `max_workers` concurrent checks, each bounded by its timeout."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # started or still starting, none busy
        self._all: list[_Worker] = []
        self._ever_ready = False  # some worker has started: a later failure to start is not a broken install
        self._warned = False

    def _spawn(self) -> _Worker:
        """A new worker process, registered but not waited for; OSError if the process cannot be created."""
        worker = _Worker()
        with self._lock:
            self._all.append(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)

    def _replace(self) -> None:
        """Spawn a worker now, for a later check; if even that fails, the next check spawns one itself."""
        try:
            worker = self._spawn()
        except OSError:
            return
        with self._lock:
            self._idle.append(worker)

    def _take(self) -> _Worker | None:
        """A ready worker: an idle ready one, else a starting one (waited for), else a new one. None when the one
        taken cannot start (the check then scores False); RuntimeError if no worker has ever started."""
        with self._lock:
            worker = next((w for w in reversed(self._idle) if w.poll_ready(wait=False)), None)
            if worker is None and self._idle:
                worker = min(self._idle, key=lambda w: w.start_deadline)  # the one spawned first
            if worker is not None:
                self._idle.remove(worker)
        try:
            worker = worker or self._spawn()
        except OSError as err:
            return self._start_failed(f"could not be spawned ({err})", _command(WORKER_ARGV))
        if worker.poll_ready(wait=True):
            self._ever_ready = True
            return worker
        self._discard(worker)
        result = self._start_failed(worker.failure, _command(worker.argv))
        self._replace()  # try again in the background for the next check
        return result

    def _start_failed(self, why: str, command: str) -> None:
        hint = (f"check that `PYTHONPATH={_SRC_ROOT} {command}` prints 'ready' in a shell (g2rl_jax and sympy must "
                "import; its error shows there), "
                f"and that memory ({WORKER_MEMORY_BYTES >> 30} GiB address space per worker) and process limits "
                "(ulimit -u) allow one worker process per core")
        if not self._ever_ready:
            raise RuntimeError(f"no verifier worker process could start: the first one {why}; {hint}")
        if not self._warned:
            self._warned = True
            _LOG.warning("a verifier worker process %s, so its check scores -1 (not verified), as will any later "
                         "check whose worker cannot start (warned once); %s", why, hint)
        return None

    def check(self, pred: str, gold: str, timeout: float) -> bool:
        """Whether canonical answers pred and gold are equivalent; False if the check exceeds timeout, or if its
        worker cannot start (after some worker has; RuntimeError if none ever could)."""
        with self._slots:
            worker = self._take()
            if worker is None:
                return False
            verdict = worker.ask(pred, gold, timeout)
            if verdict is None:
                self._discard(worker)
                self._replace()
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
