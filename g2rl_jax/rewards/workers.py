"""The verifier's worker processes, their side: a template process that forks checkers, and the checkers' loop.

The template (`template()`, started by `bounded.py` as a plain `python` subprocess) imports sympy once, caps its
address space, warms the parser with one check, says `ready` on stdout and then only forks: each request on its
control socket (fd 0, a Unix socket) is `spawn` with two pipe ends attached (SCM_RIGHTS), answered with the pid of
a new checker that serves on those pipes, or `kill PID`, answered `ok` once that checker is killed and reaped (so a
checker's pid is never reused while the pool may still signal it). A fork takes milliseconds where a fresh
interpreter takes a second of CPU to import sympy, so killing a checker is cheap. Every checker starts from the
template's state, which never ran a request: a killed check leaves nothing behind.

Checkers answer one JSON request per line: `["eq", pred, gold]` -> `1`/`0`; `["fp", answer]` -> a JSON
fingerprint or null (`compare.fingerprint`, for maj@k); `["fn", spec, response, example]` -> `{"value": x}` or
`{"error": "..."}` (a user reward function, see `custom.py`); `["load", spec]` -> the same, value null.

Every process here dies with its parent (the template with the pool's process, a checker with the template): on
Linux through PR_SET_PDEATHSIG (the kernel sends SIGKILL at once), and on every platform through a watchdog thread
that SIGKILLs its own process once the parent pid changes (an orphan is re-parented), every `WATCHDOG_PERIOD_S`.
The environment variable `G2RL_VERIFIER_WATCHDOG_ONLY=1` skips PR_SET_PDEATHSIG, as on macOS (used by tests).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

WORKER_MEMORY_BYTES = 4 << 30  # address-space cap of the template and so of every checker
WATCHDOG_PERIOD_S = 0.2        # how often a process checks that its parent is alive
SLICE_S = 0.02                 # CPU seconds a request may use before its checker says `slow` (the fast lane's slice)
SLICE_WALL_S = 0.5             # ... or wall-clock seconds, for a request that waits without using CPU
SLICE_POLL_S = 0.005           # how often a busy checker looks at its CPU time
PARENT_ENV = "G2RL_VERIFIER_PARENT_PID"
WATCHDOG_ONLY_ENV = "G2RL_VERIFIER_WATCHDOG_ONLY"


def die_with_parent(parent: int) -> None:
    """SIGKILL this process as soon as process `parent` (its parent now) is gone: PR_SET_PDEATHSIG on Linux unless
    WATCHDOG_ONLY_ENV is set, and on every platform a daemon thread that watches the parent pid."""
    if sys.platform.startswith("linux") and os.environ.get(WATCHDOG_ONLY_ENV) != "1":
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


class _Slice:
    """Says `slow` (one line, before the reply) once the request being answered has used SLICE_S of CPU time: CPU,
    not wall-clock, so a fast check on a busy machine is never taken for a slow one. A request that waits (a
    reward function that sleeps) says it after SLICE_WALL_S."""

    def __init__(self, out):
        self.out, self.lock, self.busy, self.cpu0, self.wall0 = out, threading.Lock(), threading.Event(), None, 0.0
        threading.Thread(target=self._watch, name="slice", daemon=True).start()

    def _watch(self) -> None:
        while self.busy.wait():
            time.sleep(SLICE_POLL_S)
            with self.lock:
                if self.cpu0 is not None and (time.process_time() - self.cpu0 >= SLICE_S
                                              or time.monotonic() - self.wall0 >= SLICE_WALL_S):
                    self.cpu0 = None
                    self.busy.clear()
                    self.out.write(b"slow\n")
                    self.out.flush()

    def start(self) -> None:
        with self.lock:
            self.cpu0, self.wall0 = time.process_time(), time.monotonic()
            self.busy.set()

    def reply(self, line: bytes) -> None:
        with self.lock:
            self.cpu0 = None
            self.busy.clear()
            self.out.write(line + b"\n")
            self.out.flush()


def _serve(inp, out) -> None:
    """A checker's loop: one JSON request per input line, one reply per output line (after a `slow` line if it
    used up its slice), until its input closes."""
    slice_ = _Slice(out)
    for line in inp:
        slice_.start()
        try:
            reply = _answer(json.loads(line))
        except Exception as err:  # noqa: BLE001 -- a malformed request gets an error reply, never a crash
            reply = json.dumps({"error": f"bad request: {type(err).__name__}: {err}"}).encode()
        slice_.reply(reply)


def _checker(control: socket.socket, template_pid: int, fd_in: int, fd_out: int) -> None:
    """In a fresh fork of the template: serve on the two pipe ends, then exit (never returns)."""
    try:
        control.close()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # drop the template's stdout (its `ready` pipe to the pool)
        die_with_parent(template_pid)  # (not getppid(): the template may already be gone)
        _serve(os.fdopen(fd_in, "rb"), os.fdopen(fd_out, "wb"))
    finally:
        os._exit(0)


def template() -> None:
    """The template process's main: fork a checker per `spawn`, kill and reap one per `kill PID`, until fd 0 closes."""
    import resource
    die_with_parent(int(os.environ.get(PARENT_ENV, "0")) or os.getppid())
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    from g2rl_jax.rewards.compare import equivalent_canonical
    equivalent_canonical("x^{2}+2x", "x(x+2)")  # the parser and sympy warmed once, for every checker
    control, template_pid = socket.socket(fileno=0), os.getpid()
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    while True:
        msg, fds, _, _ = socket.recv_fds(control, 64, 2)
        if not msg:
            return  # the pool closed its end
        if msg.startswith(b"spawn") and len(fds) == 2:
            try:
                pid = os.fork()
            except OSError as err:
                pid, why = -1, err
            if pid == 0:
                _checker(control, template_pid, *fds)
            for fd in fds:
                os.close(fd)
            control.sendall(f"{pid}\n".encode() if pid > 0 else f"error {why}\n".encode())
        elif msg.startswith(b"kill "):
            pid = int(msg.split()[1])
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            control.sendall(b"ok\n")
        else:
            for fd in fds:
                os.close(fd)
            control.sendall(b"error bad request\n")
