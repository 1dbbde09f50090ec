"""The verifier pool's handles on its processes (see `bounded.py` for the pool and `workers.py` for their side):
`Template`, the subprocess that forks checkers and reaps them, and `Checker`, one forked checker, with `Lines`,
a pipe read line by line against a deadline.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from g2rl_jax.rewards.workers import PARENT_ENV

SRC_ROOT = str(Path(__file__).resolve().parents[2])  # on the template's PYTHONPATH
_SPAWNERS: dict[int, ThreadPoolExecutor] = {}  # per pid (a forked child needs its own thread)
_SPAWNERS_LOCK = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    """This process's spawner: one thread that lives as long as the process and starts every template."""
    with _SPAWNERS_LOCK:
        if os.getpid() not in _SPAWNERS:
            _SPAWNERS[os.getpid()] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-spawner")
        return _SPAWNERS[os.getpid()]


class Lines:
    """Lines read from a pipe with a deadline; a partial line is kept for the next call."""

    def __init__(self, fd: int):
        self.fd, self.closed, self._buf = fd, False, b""

    def read(self, timeout: float) -> bytes | None:
        """The next line, or None if none is complete within timeout seconds (0: poll) or the pipe closed."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if self.closed or not select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                self.closed = True
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.strip()


class Template:
    """The template subprocess: forks checkers on request (`spawn`) and kills and reaps them (`kill`)."""

    def __init__(self, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC_ROOT, os.environ.get("PYTHONPATH")])))
        env[PARENT_ENV] = str(os.getpid())
        self.argv = list(argv)
        self._control, theirs = socket.socketpair()
        popen = lambda: subprocess.Popen(  # noqa: E731
            self.argv, stdin=theirs, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        spawner = threading.current_thread().name.startswith("verifier-spawner")
        try:
            self.proc = popen() if spawner else _spawner().submit(popen).result()
        finally:
            theirs.close()
        self._lines = Lines(self.proc.stdout.fileno())
        self._lock = threading.Lock()  # one request at a time on the control socket
        self._to_reap: list[int] = []

    def wait_ready(self, timeout: float) -> str:
        """'' once the template said `ready` (waiting up to timeout seconds), else why it did not."""
        line = self._lines.read(timeout)
        if line == b"ready":
            return ""
        if line is not None:
            return f"said {line[:80]!r} instead of 'ready'"
        if self._lines.closed:
            try:  # its output closed: it is exiting (start-up time, not a check's)
                return f"exited (status {self.proc.wait(timeout=5.0)}) before saying 'ready'"
            except subprocess.TimeoutExpired:
                return "closed its output without saying 'ready'"
        return f"did not say 'ready' within {timeout:.0f}s of being spawned"

    def _ask(self, message: bytes, fds: list[int]) -> bytes | None:
        with self._lock:
            try:
                socket.send_fds(self._control, [message], fds)
                reply = b""
                while not reply.endswith(b"\n"):
                    chunk = self._control.recv(64)
                    if not chunk:
                        return None
                    reply += chunk
            except OSError:
                return None
        return reply.strip()

    def fork(self) -> Checker | str:
        """A new checker, or why none could be forked."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        reply = self._ask(b"spawn", [in_r, out_w])
        os.close(in_r)
        os.close(out_w)
        if reply is None or not reply.isdigit():
            os.close(in_w)
            os.close(out_r)
            return f"could not fork a checker ({(reply or b'the template is gone').decode(errors='replace')})"
        return Checker(self, int(reply), in_w, out_r)

    def signal(self, pid: int) -> None:
        """SIGKILL checker pid now; it is reaped later (`reap`). Safe from pid reuse: the template reaps a checker
        only when asked, so until then the pid stays this checker's (while the template lives)."""
        if self.proc.poll() is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        with self._lock:
            self._to_reap.append(pid)

    def reap(self) -> None:
        """Have the template reap the checkers killed so far."""
        with self._lock:
            pids, self._to_reap = self._to_reap, []
        for pid in pids:
            self._ask(f"kill {pid}".encode(), [])

    def close(self) -> None:
        self.proc.kill()  # first: a request in flight then ends (end of file) and frees the socket
        self.proc.wait()
        with self._lock:
            self._control.close()
        self.proc.stdout.close()


class Checker:
    """One checker (a fork of the template) speaking the line protocol of `workers._serve`."""

    def __init__(self, template: Template, pid: int, fd_in: int, fd_out: int):
        self.template, self.pid, self.killed = template, pid, False
        self._kill_lock = threading.Lock()  # one kill request per pid: a reaped pid may be reused by a new fork
        self._stdin = os.fdopen(fd_in, "wb")
        self._lines = Lines(fd_out)

    @property
    def closed(self) -> bool:
        return self._lines.closed

    def ask(self, request: list, timeout: float) -> bytes | None:
        """Send one request; its reply line, or None if none came within timeout (or the checker is gone)."""
        try:
            self._stdin.write(json.dumps(request).encode() + b"\n")
            self._stdin.flush()
        except (BrokenPipeError, OSError):
            self._lines.closed = True
            return None
        return self._lines.read(timeout)

    def reply(self, timeout: float) -> bytes | None:
        """The reply to the request sent last, if it comes within timeout more seconds."""
        return self._lines.read(timeout)

    def answer(self, request: list, timeout: float) -> bytes | None:
        """`ask`, past a `slow` line: the reply within timeout seconds, however much CPU it took."""
        start, line = time.monotonic(), self.ask(request, timeout)
        return self.reply(max(0.0, timeout - (time.monotonic() - start))) if line == b"slow" else line

    def kill(self) -> None:
        """Kill the process (any thread may); a thread waiting on its reply then sees the pipe close."""
        with self._kill_lock:
            if not self.killed:
                self.killed = True
                self.template.signal(self.pid)

    def close(self) -> None:
        """Kill it and close this side's pipe ends: only the thread that holds the checker (or none) may."""
        self.kill()
        for close in (self._stdin.close, lambda: os.close(self._lines.fd)):
            try:
                close()
            except OSError:
                pass
