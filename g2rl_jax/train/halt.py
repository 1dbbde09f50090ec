"""Ending a run at once with one line, on every process of a multi-host run.

- `storage_failure(err, run_dir)`: the one line for an error a storage client raised in the middle of a run on a
  bucket (a server gone, a closed port, a server that stopped answering or keeps refusing): the URL and the likely
  cause (g2rl_jax/storage_clients.py's `explain`), and what is kept. None for anything else, which keeps its
  traceback. `exit_if_storage_failed` ends the process with that line (exit STORAGE_FAILED_EXIT).
- `stop_everywhere(line, code, gone)`: print `line`, tell the other processes (jax.distributed's key-value store),
  give them up to ACK_S to say they stop too (not those `gone`, which the line is about), and end this process
  (os._exit: no cleanup that could wait on a store that no longer answers; the checkpoints already committed stand, a
  save in flight is discarded at the next start).
- `StoreTracebacksOff`: while the loop runs, the tracebacks that gcsfs and Orbax (through absl) log for a storage
  failure are left out of their records (each stays one line): the line above says what failed.
- `PeerWatch`: in every process of a multi-host run, a thread that ends the process with that same line when
  another process called `stop_everywhere` (a lost run lock on process 0, a storage failure on any), so none stalls
  at the next collective waiting for a process that is gone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

STORAGE_FAILED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): the storage failed; the same command may be run again later
STOP_KEY = "g2rl_jax/stop"  # in jax.distributed's key-value store: "<exit code>\n<line>"
ACK_KEY = "g2rl_jax/stopped/"  # + process index: that process has the line and ends now
ACK_S = 5.0  # how long a stopping process waits for the others to have the line
POLL_MS = 1000  # a watcher's wait for the stop key, between looks at its own stop event
COORDINATOR_LAST_S = 1.0  # process 0 holds the coordination service: it ends this long after the others have the line
_CLIENT_MODULES = ("gcsfs", "fsspec", "aiohttp", "tensorstore", "google.auth", "google.cloud", "etils.epath",
                   "g2rl_jax.storage")
# what tensorstore's (and gRPC's) statuses say when the store failed, not the program
_STORE_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                   "CURL error", "Couldn't connect", "Timeout was reached", "Connection refused")
PEER_LOST_EXIT = 76  # EX_PROTOCOL (sysexits.h): another process of the run is gone; relaunch all to resume
# what gloo's TCP transport says when the process at the other end of a collective is gone (died, killed)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
_STOPPING = threading.Lock()  # the first caller of stop_everywhere prints; any other waits for the exit


def error_chain(err: BaseException):
    """`err` and the errors it was raised from or during."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _raised_in_a_client(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(_CLIENT_MODULES):
            return True
        tb = tb.tb_next
    return False


def _store_error(err: BaseException) -> bool:
    """Whether `err` says that a storage client could not do its request (not a bug of the program)."""
    if isinstance(err, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if type(err).__module__.startswith(("aiohttp", "gcsfs", "google")):
        return True
    text = str(err)
    return _raised_in_a_client(err) or any(status in text for status in _STORE_STATUSES)


def unreachable(err: BaseException) -> bool:
    """Whether `err` (or an error it came from) says the store could not be reached or refused the request (a
    connection, a timeout, a gRPC/tensorstore status such as UNAVAILABLE): not a damaged object, which reads as a
    missing file or bad bytes."""
    return any(isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError))
               or any(status in str(e) for status in _STORE_STATUSES) for e in error_chain(err))


def storage_failure(err: BaseException, run_dir, step: int) -> str | None:
    """The one line for `err`, raised after step `step` (the last one finished) of the run in `run_dir`, when a
    storage client raised it and the run directory is a URL; None otherwise (a bug, a local disk: the traceback
    stays)."""
    from g2rl_jax import storage, storage_clients

    if not storage.is_url(run_dir):
        return None
    cause = next((e for e in error_chain(err) if _store_error(e)), None)
    if cause is None:
        return None
    text = " ".join(f"{type(e).__module__} {e}" for e in error_chain(err))
    client = "tensorstore" if "tensorstore" in text or _STORE_STATUSES[0] in text else "gcsfs"
    return (f"run.output_dir: the storage failed after step {step}: "
            f"{storage_clients.explain(run_dir, cause, client)}. Kept: the checkpoints already committed in "
            f"{storage.path(run_dir) / 'checkpoints'} (a save in flight is discarded at the next start) and the "
            "metrics flushed before; run the same command again once the storage answers: it resumes from the "
            "newest committed checkpoint")


def exit_if_storage_failed(err: BaseException, run_dir, step: int) -> None:
    """End every process of the run with `storage_failure`'s line (exit STORAGE_FAILED_EXIT) when `err` is one;
    return otherwise. In a notebook (a kernel that must survive) it raises StorageError with the line instead."""
    line = storage_failure(err, run_dir, step)
    if line is None:
        return
    if "ipykernel" in sys.modules:
        from g2rl_jax.storage import StorageError

        raise StorageError(line) from None
    stop_everywhere(f"train error: {line}", STORAGE_FAILED_EXIT)


def peer_gone(err: BaseException) -> str | None:
    """The gloo error in `err` (or an error it came from) that says a process this one ran a collective with is
    gone, first line only; None for any other error."""
    for e in error_chain(err):
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "Gloo" in text and any(s in text for s in _PEER_GONE):
            return text[text.index("Gloo"):]
    return None


def exit_if_peer_gone(err: BaseException, step: int | None = None) -> None:
    """In a run of several processes, end every process with one line and PEER_LOST_EXIT when `err` says that a
    process this one ran a collective with is gone (`peer_gone`), the training side after step `step`; return
    otherwise (the caller's own handling goes on)."""
    gone = peer_gone(err)
    if gone is None or distributed_client() is None:
        return
    after = "" if step is None else f" after step {step}"
    stop_everywhere(f"a process of this run is gone{after} ({gone}): it died (kill -9, a lost VM) or was "
                         "ended. The checkpoints committed stand: end every process that still runs, and relaunch "
                         "every process with the same command to resume from the newest", PEER_LOST_EXIT)


class NoStoreTraceback(logging.Filter):
    """Drops the traceback of a log record whose error is a storage failure (the caller reports it in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if err is not None and any(_store_error(e) for e in error_chain(err)):
            record.exc_info = record.exc_text = None
        return True


class StoreTracebacksOff:
    """While entered, records of the storage clients' loggers (gcsfs's "out of retries", Orbax's failed save
    thread) carry no traceback when their error is a storage failure; other records are untouched."""

    LOGGERS = ("gcsfs", "fsspec", "absl")

    def __init__(self):
        self._filter = NoStoreTraceback()

    def __enter__(self) -> StoreTracebacksOff:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)


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
