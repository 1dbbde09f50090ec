"""The fence: no change to a run's state leaves this process unless it holds the run's lease at that moment.

The run lock (control/runlock.py) `arm`s its run directory with its lease holder (control/lease.py; on the other
processes of a multi-host run, a Follower of process 0's lease); from then on,
until `disarm`, every change under that directory but the lock's own objects passes the fence first:

- on an object store, each update request of the paced gcsfs client (storage_clients.py: every upload, compose,
  copy, delete, patch; each attempt of each retry), right before it is sent: `check_async` / `check`. The holder's
  clock decides: held (its last confirmed renewal's send + lease - margin is still ahead), or the request waits for
  a renewal to confirm, or raises the verdict. GCS has no precondition on another object, so the lock's generation
  fences the lock's own writes and the clock fences the rest;
- on an object store, each request tensorstore (Orbax's array writer, with its own HTTP client) sends: it goes
  through a forwarder on loopback that checks the fence before the request's first byte and before each MiB of its
  body (control/fence_proxy.py: `check_streams`), and cuts a refused request off mid-way;
- locally, each write, delete and move of g2rl_jax.storage, each local append (storage_append.py), and Orbax's
  commit (the rename of a step's temporary directory) and its deletes of old steps (train/checkpoint.py): `guard`,
  which takes the lock's mutex (the flock every change of the lock takes), reads the lock and lets the change through
  only while the lock holds this process's record (process 0's, on a follower). A takeover takes the same mutex, so
  no change slips between the check and the write: the lock's content is the fencing token.

`close(line)`: this process decided to stop (a lost lease, a failure on its way to the exit code): nothing more is
written under an armed directory, whatever the lease says, through the seconds the stop takes (control/stop.py waits
for the other processes).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

from g2rl_jax.control.errors import LeaseLost

_ARMED: dict[str, Armed] = {}  # run directory (a URL, or a resolved local path) -> what fences it
_CLOSED: list[str] = []  # the line this process stops with, once it decided to
_DEPTH = threading.local()  # guards held by this thread (a guarded change may call another)


class Armed:
    """One run directory's fence: its lock file and the lease holder that holds it."""

    def __init__(self, run_dir: str, lock_path: str, holder, owns):
        self.run_dir, self.lock_path, self.holder, self.owns = run_dir, lock_path, holder, owns
        self.url = "://" in run_dir


def _key(path) -> str:
    text = os.fspath(path) if not isinstance(path, str) else path
    if "://" in text:
        return text.rstrip("/")
    return os.path.realpath(os.path.expanduser(text))


def arm(run_dir, lock_path, holder, owns) -> None:
    """Fence the run directory `run_dir` with `holder` (control/lease.py: the Holder of its lock `lock_path`, or a
    Follower of it); `owns(record)`: whether the lock's record names the process whose lease this one writes under.
    On an object store, tensorstore's requests go through the fence from now on (control/fence_proxy.py)."""
    _CLOSED.clear()  # a new run of this process (a notebook's next cell)
    armed = Armed(_key(run_dir), _key(lock_path), holder, owns)
    if armed.url:
        from g2rl_jax.control import fence_proxy

        fence_proxy.start()
    _ARMED[armed.run_dir] = armed


def disarm(run_dir) -> None:
    _ARMED.pop(_key(run_dir), None)


def close(line: str) -> None:
    """This process stops: refuse every fenced change from now on."""
    if not _CLOSED:
        _CLOSED.append(line)


def closed() -> bool:
    """Whether this process decided to stop (`close`)."""
    return bool(_CLOSED)


def _armed_for(path) -> Armed | None:
    """The fence of the armed run directory that holds `path`, None if none does or `path` is its lock (or the
    lock's own temporary and mutex files, `.run.lock.*`)."""
    key = _key(path)
    for run, armed in _ARMED.items():
        if key == run or key.startswith(run + "/"):
            name = key.rsplit("/", 1)[-1]
            lock_name = armed.lock_path.rsplit("/", 1)[-1]
            if key == armed.lock_path or name.startswith(f".{lock_name}."):
                return None
            return armed
    return None


def _refused(armed: Armed) -> LeaseLost:
    return LeaseLost(f"{_CLOSED[0]} (a change under {armed.run_dir} was refused: this process is stopping)",
                     armed.holder.verdict.code if armed.holder.verdict is not None else LeaseLost.code)


def check(path) -> None:
    """Return when a change of `path` may go out now (not under an armed directory, or its lease held); wait for a
    renewal past the margin; raise LeaseLost otherwise."""
    armed = _armed_for(path)
    if armed is None:
        return
    if _CLOSED:
        raise _refused(armed)
    armed.holder.wait_held()


async def check_async(path) -> None:
    """`check` for a coroutine on the storage client's event loop, which must not block: the renewals go through
    the same loop."""
    armed = _armed_for(path)
    if armed is None:
        return
    give_up = time.monotonic() + armed.holder.give_up_s
    while True:
        if _CLOSED:
            raise _refused(armed)
        if armed.holder.verdict is not None:
            raise armed.holder.verdict
        if armed.holder.held():
            return
        if time.monotonic() >= give_up:
            raise armed.holder.not_seen()
        await asyncio.sleep(0.05)


def check_streams() -> None:
    """`check` for a request whose object this process cannot see (tensorstore's, through control/fence_proxy.py):
    every run directory armed on an object store must let a change out now."""
    for armed in list(_ARMED.values()):
        if armed.url:
            if _CLOSED:
                raise _refused(armed)
            armed.holder.wait_held()


@contextlib.contextmanager
def guard(path):
    """Around one change of `path` (see the module docstring): on an object store `check`; locally the lock's mutex
    held and the lock found to be this process's for the change's duration. Re-entrant within a thread."""
    armed = _armed_for(path)
    depth = getattr(_DEPTH, "n", 0)
    if armed is None or depth:
        _DEPTH.n = depth + 1
        try:
            yield
        finally:
            _DEPTH.n = depth
        return
    if _CLOSED:
        raise _refused(armed)
    if armed.url:
        armed.holder.wait_held()
        yield
        return
    from g2rl_jax import storage
    from g2rl_jax.control import runlock

    with storage._local_mutex(storage.path(armed.lock_path)):
        record = runlock.read_record(armed.lock_path)
        if armed.holder.verdict is not None:
            raise armed.holder.verdict
        if record is None or not armed.owns(record):
            raise LeaseLost(runlock.lost_line(armed.lock_path, record))
        _DEPTH.n = 1
        try:
            yield
        finally:
            _DEPTH.n = 0
