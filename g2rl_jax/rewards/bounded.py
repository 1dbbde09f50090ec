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

A slow check does not hold up the checks queued behind it: once a check has run `STRAGGLER_AFTER_S` it hands
its slot to the next check and finishes (or times out) in a straggler lane of at most `max_workers` more
processes, so fast checks keep flowing while up to `max_workers` slow ones run out their bound.

Workers die with their parent: a watchdog thread in each worker kills it (SIGKILL of itself) as soon as its
parent process is gone (SIGKILL, SIGTERM, a crash: the worker's parent pid changes), checking every
`WATCHDOG_PERIOD_S`; on Linux the kernel also delivers SIGKILL at once through PR_SET_PDEATHSIG, which is why
workers are spawned from one long-lived spawner thread (the death signal follows the spawning thread).

Requests are JSON lines `[op, ...]`: `["eq", pred, gold]` -> `1`/`0`; `["fp", answer]` -> a JSON fingerprint or
null (`compare.fingerprint`, for maj@k); `["fn", spec, response, example]` -> a JSON
`{"value": x}` or `{"error": "..."}` (a user reward function, see `custom.py`); `["load", spec]` -> the same,
value null, to check that a function imports.

One pool per process (re-created after `fork`), sized to the CPU count; threads share it.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORKER_MEMORY_BYTES = 4 << 30   # address-space cap of one worker
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take a while
WORKER_ARGV = [sys.executable, "-c", "from g2rl_jax.rewards.bounded import serve; serve()"]
STRAGGLER_AFTER_S = 0.25        # a check running longer yields its slot to the next queued check
WATCHDOG_PERIOD_S = 0.2         # how often a worker checks that its parent is alive
PARENT_ENV = "G2RL_VERIFIER_PARENT_PID"
_SPAWNERS: dict[int, ThreadPoolExecutor] = {}  # per pid (a forked child needs its own thread)
_SPAWNERS_LOCK = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    """This process's spawner: one thread that lives as long as the process and starts every worker."""
    with _SPAWNERS_LOCK:
        pid = os.getpid()
        if pid not in _SPAWNERS:
            _SPAWNERS[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-spawner")
        return _SPAWNERS[pid]
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
        env[PARENT_ENV] = str(os.getpid())
        popen = lambda: subprocess.Popen(  # noqa: E731
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        spawner = threading.current_thread().name.startswith("verifier-spawner")
        self.proc = popen() if spawner else _spawner().submit(popen).result()

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

    def send(self, request: list) -> bool:
        """Write one request line; False if the worker is gone."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.closed = True
            return False
        return True

    def reply(self, timeout: float) -> bytes | None:
        """The reply line to the request sent last, or None if none came within timeout (or the worker died)."""
        return self._read_line(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


def _command(argv: list[str]) -> str:
    return " ".join(repr(a) if " " in a else a for a in argv)


class BoundedPool:
    """At most `max_workers` concurrent checks, each bounded by its timeout, plus up to `max_workers` stragglers;
    `spares` idle workers are kept started ahead of need, so a check whose slot a straggler freed (or whose worker
    was killed) does not wait for a new worker to import sympy."""

    def __init__(self, max_workers: int, spares: int = 0):
        self.max_workers = max_workers
        self.spares = spares
        self._slots = threading.BoundedSemaphore(max_workers)
        self._stragglers = threading.BoundedSemaphore(max_workers)  # checks past STRAGGLER_AFTER_S, off the slots
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
            missing = self.spares - len(self._idle) if len(self._all) < 2 * self.max_workers + self.spares else 0
        for _ in range(missing):  # keep `spares` idle workers starting or ready
            self._replace()
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
        reply = self.request(["eq", pred, gold], timeout)
        return reply == b"1"

    def request(self, request: list, timeout: float) -> bytes | None:
        """A worker's reply line to `request`, or None if it took longer than timeout seconds (the worker is then
        killed and replaced), the worker died, or no worker could start (after some worker has; RuntimeError if
        none ever could). Past STRAGGLER_AFTER_S the request moves to the straggler lane when it has room."""
        self._slots.acquire()
        holding_slot = True
        try:
            worker = self._take()
            if worker is None or not worker.send(request):
                if worker is not None:
                    self._discard(worker)
                    self._replace()
                return None
            start, replaced = time.monotonic(), False
            reply = worker.reply(min(timeout, STRAGGLER_AFTER_S))
            if reply is None and not worker.closed and timeout > STRAGGLER_AFTER_S:
                if self._stragglers.acquire(blocking=False):  # the slot goes to the next check in the queue
                    self._slots.release()
                    holding_slot = False
                    self._replace()  # with a worker of its own, started now
                    replaced = True
                    try:
                        reply = worker.reply(max(0.0, timeout - (time.monotonic() - start)))
                    finally:
                        self._stragglers.release()
                else:
                    reply = worker.reply(max(0.0, timeout - (time.monotonic() - start)))
            if reply is None:
                self._discard(worker)
                if not replaced:  # a straggler's replacement was started when it left its slot
                    self._replace()
                return None
            with self._lock:
                surplus = sum(w.ready for w in self._idle) >= self.max_workers + self.spares  # enough ready ones
                if not surplus:
                    self._idle.append(worker)
            if surplus:
                self._discard(worker)
            return reply
        finally:
            if holding_slot:
                self._slots.release()

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
            cores = os.cpu_count() or 2
            _POOL, _POOL_PID = BoundedPool(cores, spares=min(cores, 2)), os.getpid()
        return _POOL


@atexit.register
def _close_pool() -> None:
    if _POOL is not None and _POOL_PID == os.getpid():
        _POOL.close()


def _die_with_parent() -> None:
    """Exit (SIGKILL of this process) as soon as the parent that spawned it is gone: PR_SET_PDEATHSIG on Linux,
    and on every platform a daemon thread that watches the parent pid (an orphan is re-parented)."""
    parent = int(os.environ.get(PARENT_ENV, "0")) or os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the watchdog below still applies

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCHDOG_PERIOD_S)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent:  # the parent died before the death signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _answer(request: list) -> bytes:
    """The reply line (without newline) to one request."""
    op = request[0]
    if op == "eq":
        from g2rl_jax.rewards.compare import equivalent_canonical
        try:
            return b"1" if equivalent_canonical(request[1], request[2]) else b"0"
        except Exception:  # noqa: BLE001 -- any failure inside sympy means "not verified", never a crash
            return b"0"
    if op == "fp":
        from g2rl_jax.rewards.compare import fingerprint
        try:
            return json.dumps(fingerprint(request[1])).encode()
        except Exception:  # noqa: BLE001 -- no fingerprint: compared pair by pair instead
            return b"null"
    if op in ("fn", "load"):
        from g2rl_jax.rewards.custom import call_in_worker
        return json.dumps(call_in_worker(op, *request[1:])).encode()
    return json.dumps({"error": f"unknown request {op!r}"}).encode()


def serve() -> None:
    """Worker main loop: one JSON request per input line, one reply per output line, until stdin closes."""
    import resource
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    import g2rl_jax.rewards.compare  # noqa: F401 -- sympy imported before `ready`
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            reply = _answer(json.loads(line))
        except Exception as err:  # noqa: BLE001 -- a malformed request gets an error reply, never a crash
            reply = json.dumps({"error": f"bad request: {type(err).__name__}: {err}"}).encode()
        out.write(reply + b"\n")
        out.flush()
