"""The failures that end a run at once with one line, on every process of a multi-host run (the stop itself, its
key and its watcher: control/stop.py).

- `storage_failure(err, run_dir)`: the one line for an error a storage client raised in the middle of a run on a
  bucket (a server gone, a closed port, a server that stopped answering or keeps refusing): the URL and the likely
  cause (g2rl_jax/storage_clients.py's `explain`), and what is kept. None for anything else, which keeps its
  traceback. `exit_if_storage_failed` ends every process with that line (exit STORAGE_FAILED_EXIT,
  stop.stop_everywhere).
- `peer_gone(err)`: gloo's line when a process this one ran a collective with is gone; `exit_if_peer_gone` ends
  every process with it (exit PEER_LOST_EXIT).
- `StoreTracebacksOff`: while the loop runs, the tracebacks that gcsfs and Orbax (through absl) log for a storage
  failure are left out of their records (each stays one line): the line above says what failed.
"""
from __future__ import annotations

import asyncio
import logging
import sys

from g2rl_jax.control import stop

STORAGE_FAILED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): the storage failed; the same command may be run again later
_CLIENT_MODULES = ("gcsfs", "fsspec", "aiohttp", "tensorstore", "google.auth", "google.cloud", "etils.epath",
                   "g2rl_jax.storage")
# what tensorstore's (and gRPC's) statuses say when the store failed, not the program
_STORE_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                   "CURL error", "Couldn't connect", "Timeout was reached", "Connection refused")
PEER_LOST_EXIT = 76  # EX_PROTOCOL (sysexits.h): another process of the run is gone; relaunch all to resume
# what gloo's TCP transport says when the process at the other end of a collective is gone (died, killed)
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


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
    stop.stop_everywhere(f"train error: {line}", STORAGE_FAILED_EXIT)


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
    if gone is None or stop.processes() is None:
        return
    after = "" if step is None else f" after step {step}"
    stop.stop_everywhere(f"a process of this run is gone{after} ({gone}): it died (kill -9, a lost VM) or was "
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
