"""Ending a run at once with one line, on every process of a multi-host run.

- `stop_everywhere(line, code, gone)`: print `line`, tell the other processes (jax.distributed's key-value store),
  give them up to ACK_S to say they stop too (not those `gone`, which the line is about), and end this process
  (os._exit: no cleanup that could wait on a store that no longer answers; the checkpoints already committed stand, a
  save in flight is discarded at the next start). The fence closes first (control/fence.py): nothing of the run is
  written in the seconds the stop takes.
- `PeerWatch`: in every process of a multi-host run, a thread that ends the process with that same line when
  another process called `stop_everywhere` (a lost run lock on process 0, a storage failure on any), so none stalls
  at the next collective waiting for a process that is gone.

Which failure ends a run, and with which code, is decided where it is raised (g2rl_jax/control/errors.py).
"""
from __future__ import annotations

import os
import sys
import threading
import time

from g2rl_jax.control import fence

STOP_KEY = "g2rl_jax/stop"  # in jax.distributed's key-value store: "<exit code>\n<line>"
ACK_KEY = "g2rl_jax/stopped/"  # + process index: that process has the line and ends now
ACK_S = 5.0  # how long a stopping process waits for the others to have the line
POLL_MS = 1000  # a watcher's wait for the stop key, between looks at its own stop event
COORDINATOR_LAST_S = 1.0  # process 0 holds the coordination service: it ends this long after the others have the line
_STOPPING = threading.Lock()  # the first caller of stop_everywhere prints; any other waits for the exit


# ------------------------------------------------------------------------------------------------ every process
def distributed_client():
    """jax.distributed's client when this is one process of several, else None."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    client = distributed.global_state.client
    if client is None or (distributed.global_state.num_processes or 1) < 2:
        return None
    return client


def _end(code: int, me: int | None) -> None:
    """os._exit(code); process 0 of several first waits COORDINATOR_LAST_S, since its exit takes jax.distributed's
    coordination service down and a process still on its way out would be aborted by JAX's client (SIGABRT and a
    stack trace instead of the one line and its exit code)."""
    sys.stdout.flush()
    if me == 0:  # meanwhile this process's own collectives fail (the others are gone): their errors are not the line
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        time.sleep(COORDINATOR_LAST_S)
    os._exit(code)


def print_own_line(line: str) -> None:
    """`line` on stderr on a line of its own: a progress bar still drawn there (tqdm ends its line only when the bar
    closes, and this process ends without closing it) is ended first."""
    bars = sys.modules.get("tqdm")
    if bars is not None and len(getattr(bars.tqdm, "_instances", ())):  # tqdm drops disabled bars from the set
        print(file=sys.stderr)
    print(line, file=sys.stderr, flush=True)


def awaited_acks(me: int, count: int, gone: tuple[int, ...] = ()) -> list[int]:
    """The processes whose answer a stopping process `me` of `count` waits for: process 0 every other; another
    process process 0 alone (it ends COORDINATOR_LAST_S after its answer, and JAX's client then aborts every process
    still there: the rest have the line from their PeerWatch); none of those `gone` (a process whose lease lapsed is
    dead, or too stuck to renew it and so to answer: waiting for it would only cost ACK_S)."""
    return [i for i in (range(count) if me == 0 else [0]) if i != me and i not in gone]


def stop_everywhere(line: str, code: int, gone: tuple[int, ...] = ()) -> None:
    """Print `line` on stderr and end this process with `code`; in a multi-host run the other processes are told
    first (PeerWatch ends them with the same line) and given up to ACK_S to have it, but those known `gone` (the
    line is about them). Never returns."""
    fence.close(line)  # from now on this process writes nothing of the run
    if not _STOPPING.acquire(blocking=False):  # another thread of this process is stopping it already
        time.sleep(ACK_S + 10)
        os._exit(code)
    print_own_line(line)
    client, me = distributed_client(), None
    if client is not None:
        from jax._src import distributed

        me, count = distributed.global_state.process_id, distributed.global_state.num_processes
        try:
            client.key_value_set(STOP_KEY, f"{code}\n{line} (process {me})")
        except Exception:  # noqa: BLE001 - another process published first (ALREADY_EXISTS), or the service is gone
            pass
        deadline = time.monotonic() + ACK_S
        for other in awaited_acks(me, count, gone):
            try:
                client.blocking_key_value_get(f"{ACK_KEY}{other}", max(int((deadline - time.monotonic()) * 1000), 1))
            except Exception:  # noqa: BLE001 - no answer in time: that process ends by itself, or has ended
                break
    _end(code, me)


class PeerWatch:
    """While entered (the training loop), a daemon thread of a multi-host run's process waits for STOP_KEY and
    ends the process with the line another process published (nothing in a one-process run)."""

    def __init__(self):
        self._client = None
        self._done = threading.Event()
        self._thread = None

    def __enter__(self) -> PeerWatch:
        self._client = distributed_client()
        if self._client is not None:
            self._done.clear()
            self._thread = threading.Thread(target=self._watch, name="peer-stop-watch", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        from jax._src import distributed

        while not self._done.is_set():
            try:
                value = self._client.blocking_key_value_get(STOP_KEY, POLL_MS)
            except Exception as err:  # noqa: BLE001 - no stop yet (DEADLINE_EXCEEDED); anything else: no service
                if "DEADLINE_EXCEEDED" in str(err):
                    continue
                return
            code, _, line = value.partition("\n")
            fence.close(line)
            if not _STOPPING.acquire(blocking=False):  # this process is stopping by itself
                return
            print_own_line(line)
            me = distributed.global_state.process_id
            try:
                self._client.key_value_set(f"{ACK_KEY}{me}", "1")
            except Exception:  # noqa: BLE001 - the stopping process may be gone already
                pass
            _end(int(code), me)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
