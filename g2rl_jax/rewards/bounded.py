"""Time-bounded checks in worker processes, scheduled so that a slow check never holds up the fast ones queued
behind it, whatever the order they come in.

Checkers are forks of one template process per pool (`workers.py`): a plain `python` subprocess (not a
`multiprocessing` child, so it can be started from any thread, from daemonic pool workers and from other worker
processes) that imports sympy once, runs with a capped address space, and forks a checker in milliseconds. The
pool waits for a checker's answer with `select` and a deadline; a checker that misses it is killed (SIGKILL) and
the check scores False. A filler thread keeps `max_workers` idle checkers forked and warmed, and has the template
reap killed ones. Start-up of the template (importing sympy) is never counted against a check's bound; a template
that does not start within `WORKER_START_TIMEOUT_S` makes the check score False with one warning once some
template has started in this process; if none ever has, the installation is broken and the check raises
`RuntimeError`.

Two lanes (the design that makes queue order irrelevant):
  fast  `max_workers` slots; every check starts here. A checker says `slow` once its check has used
        `workers.SLICE_S` (20 ms) of CPU time: CPU, so a fast check on a busy machine is not mistaken for a slow one
        (or `workers.SLICE_WALL_S`, 0.5 s, of wall-clock time: a reward function that sleeps uses no CPU). Most
        checks answer before that.
  slow  `max_workers` slots for the checks that said `slow`. When the slow lane has room, the checker moves there
        with its check and keeps computing until `timeout` from the check's start. When it is full, the checker
        is killed and the check queues for the slow lane, where it restarts from scratch on a fresh checker with
        its full `timeout` (a fork of the template: the state every checker starts from, so the verdict is the
        one an uninterrupted check gives).
A fast check thus waits at most for the checks ahead of it to use up their slices, never for their bounds. At
most `3 * max_workers` checkers live at once (fast, slow, idle), each under the address-space cap.

Every process dies with its parent (the template with this process, a checker with the template): see
`workers.py`. The template is spawned from one long-lived spawner thread, since on Linux the death signal
follows the thread that spawned a child (`processes.py`: the pool's handles on the template and checkers).

One pool per process (re-created after `fork`), sized to the CPU count; threads share it.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

from g2rl_jax.rewards.processes import SRC_ROOT, Checker, Template
from g2rl_jax.rewards.workers import WORKER_MEMORY_BYTES

WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take a while
TEMPLATE_ARGV = [sys.executable, "-c", "from g2rl_jax.rewards.workers import template; template()"]
_LOG = logging.getLogger(__name__)


def _command(argv: list[str]) -> str:
    return " ".join(repr(a) if " " in a else a for a in argv)


class BoundedPool:
    """Checks in a fast lane of `max_workers` slots (a CPU slice each) and a slow lane of `max_workers` more; see the
    module docstring. `restarted` counts the checks that restarted in the slow lane."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self.restarted = 0
        self._fast = threading.BoundedSemaphore(max_workers)
        self._slow = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._template_lock = threading.Lock()
        self._template: Template | None = None
        self._idle: list[Checker] = []
        self._all: list[Checker] = []
        self._generation = 0  # bumped by close(): checks in flight then score False
        self._wake = threading.Event()  # the filler thread has work: an idle checker was taken, or one was killed
        self._filler: threading.Thread | None = None
        self._busy_fast = 0  # checkers answering in the fast lane: with the idle ones, the filler's target
        self._ever_ready = False  # some template has started: a later failure to start is not a broken install
        self._warned = False

    def _started_template(self) -> Template | None:
        """The running template, started (and waited for) if there is none; None if it cannot start."""
        with self._template_lock:
            if self._template is not None and self._template.proc.poll() is None:
                return self._template
            if self._template is not None:
                self._template.close()
                self._template = None
            try:
                template = Template(TEMPLATE_ARGV)
            except OSError as err:
                return self._start_failed(f"could not be spawned ({err})", _command(TEMPLATE_ARGV))
            why = template.wait_ready(WORKER_START_TIMEOUT_S)
            if why:
                template.close()
                return self._start_failed(why, _command(template.argv))
            self._ever_ready, self._template = True, template
            return template

    def _take(self, generation: int) -> Checker | None:
        """An idle checker, else a new fork; None when none can be had (the check then scores False) or the pool
        was closed since the check began (its generation)."""
        with self._lock:
            if self._generation != generation:
                return None
            worker = self._idle.pop() if self._idle else None
        self._wake.set()  # refill the idle checkers
        if worker is not None:
            return worker
        template = self._started_template()
        if template is None:
            return None
        self._start_filler(generation)
        worker = template.fork()
        if isinstance(worker, str):
            with self._template_lock:  # the template is broken: the next check starts a new one
                if self._template is template:
                    template.close()
                    self._template = None
            return self._start_failed(worker, _command(template.argv))
        with self._lock:
            self._all.append(worker)
        return worker

    def _start_filler(self, generation: int) -> None:
        name = f"verifier-filler-{generation}"  # one per generation: a closed pool's filler ends
        with self._lock:
            if self._filler is None or not self._filler.is_alive() or self._filler.name != name:
                self._filler = threading.Thread(target=self._fill, args=(generation,), name=name, daemon=True)
                self._filler.start()

    def _fill(self, generation: int) -> None:
        """Background thread: reap killed checkers and keep max_workers idle ones forked and warmed (a fresh fork's
        first check pays its copy-on-write page faults: here, not in a check's slice). Ends with the generation."""
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            with self._lock:
                if self._generation != generation:
                    return
                template, missing = self._template, self.max_workers - len(self._idle) - self._busy_fast
            if template is None:
                continue
            template.reap()
            for _ in range(missing):
                worker = template.fork()
                if isinstance(worker, str):
                    break
                warm = worker.answer(["eq", "x+x", "2x"], WORKER_START_TIMEOUT_S) == b"1"
                with self._lock:
                    keep = warm and self._generation == generation and len(self._idle) < self.max_workers
                    if keep:
                        self._all.append(worker)
                        self._idle.append(worker)
                if not keep:
                    worker.close()

    def _start_failed(self, why: str, command: str) -> None:
        hint = (f"check that `PYTHONPATH={SRC_ROOT} {command}` prints 'ready' in a shell (g2rl_jax and sympy must "
                "import; its error shows there), "
                f"and that memory ({WORKER_MEMORY_BYTES >> 30} GiB address space per worker) and process limits "
                "(ulimit -u) allow two worker processes per core")
        if not self._ever_ready:
            raise RuntimeError(f"no verifier worker process could start: the first one {why}; {hint}")
        if not self._warned:
            self._warned = True
            _LOG.warning("a verifier worker process %s, so its check scores -1 (not verified), as will any later "
                         "check whose worker cannot start (warned once); %s", why, hint)
        return None

    def _discard(self, worker: Checker) -> None:
        """Kill a checker this thread holds and close its pipes (the filler reaps it)."""
        worker.close()
        self._wake.set()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)

    def _finish(self, worker: Checker, reply: bytes | None) -> bytes | None:
        """Keep a checker that answered (up to max_workers idle ones, with what they imported, e.g. a reward
        function's module), kill one that did not."""
        with self._lock:
            keep = reply is not None and worker in self._all and len(self._idle) < self.max_workers
            if keep:
                self._idle.append(worker)
        if not keep:
            self._discard(worker)
        return reply

    def check(self, pred: str, gold: str, timeout: float) -> bool:
        """Whether canonical answers pred and gold are equivalent; False if the check exceeds timeout, or if no
        checker can be had (after some template has started; RuntimeError if none ever could)."""
        return self.request(["eq", pred, gold], timeout) == b"1"

    def request(self, request: list, timeout: float) -> bytes | None:
        """A checker's reply line to `request`, or None if it took longer than timeout seconds of computing (the
        checker is then killed), the checker died, or none could be had. A CPU slice in the fast lane, then the slow
        lane (module docstring)."""
        generation = self._generation
        with self._fast:
            worker = self._take(generation)
            if worker is None:
                return None
            with self._lock:
                self._busy_fast += 1
            try:
                start = time.monotonic()
                reply = worker.ask(request, timeout)
                if reply != b"slow":  # its answer within the slice, or nothing within timeout (then killed)
                    return self._finish(worker, reply)
                moved = self._slow.acquire(blocking=False)
                if not moved:
                    self._discard(worker)  # the fast slot is freed now; the check restarts in the slow lane
            finally:
                with self._lock:
                    self._busy_fast -= 1
        if moved:
            try:
                return self._finish(worker, worker.reply(max(0.0, timeout - (time.monotonic() - start))))
            finally:
                self._slow.release()
        with self._slow:
            with self._lock:
                self.restarted += 1
            worker = self._take(generation)
            return None if worker is None else self._finish(worker, worker.answer(request, timeout))

    def close(self) -> None:
        """Kill every checker and the template; checks in flight score False, later ones start a new template."""
        with self._lock:
            self._generation += 1
            self._wake.set()  # the filler of this generation ends
            busy = [w for w in self._all if w not in self._idle]
            idle, self._all, self._idle = self._idle, [], []
        for worker in idle:
            worker.close()
        for worker in busy:  # their threads close the pipes when the reply does not come
            worker.kill()
        with self._template_lock:
            if self._template is not None:
                self._template.close()
                self._template = None


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
