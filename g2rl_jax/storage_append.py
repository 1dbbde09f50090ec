"""Appending to objects within GCS's write rates (re-exported by g2rl_jax.storage, which documents the layer):
GCS allows about one update (upload, compose, delete) per second per object name.

- `append_bytes` / `append_text`: the new bytes as a part object named for this host, pid and a random id (no two
  writers collide), composed onto the object (one request, atomic, whatever its size), the part then deleted;
- `Appender` (a growing text file: metrics.jsonl, eval's records) and `Mirror` (a local directory's growing files:
  TensorBoard's events) buffer and flush every $G2RL_JAX_FLUSH_SECONDS and when told; each flush's part is deleted
  at the next, a second or more after its upload;
- `remove_orphan_parts`: the parts a killed writer left, deleted at the next start;
- `_update` / `_since_update`: this process's last update of each object, which the paced gcsfs client
  (storage_clients.py) and the writers here consult so that no object is updated twice within a second.
Locally an append is an ordinary append, written through at once.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Union

PathLike = Union[str, os.PathLike]


UPDATE_INTERVAL_S = 1.0  # GCS: about one update (upload, compose, delete) per second per object name
FLUSH_ENV = "G2RL_JAX_FLUSH_SECONDS"  # how often buffered files (metrics, events, eval records) reach a bucket
PART = ".part."  # in a compose part's name: .NAME.part.HOST.PID.ID
_UPDATED: dict[str, float] = {}  # URL -> when this process last updated it (monotonic seconds)
_UPDATED_LOCK = threading.Lock()


def flush_seconds() -> float:
    """Seconds between flushes of a buffered file to an object store: $G2RL_JAX_FLUSH_SECONDS (default 5, at
    least UPDATE_INTERVAL_S)."""
    raw = os.environ.get(FLUSH_ENV) or "5"
    try:
        return max(float(raw), UPDATE_INTERVAL_S)
    except ValueError:
        raise storage.StorageError(f"{FLUSH_ENV}={raw!r} is not a number of seconds; set it to e.g. 5") from None


def _since_update(p: PathLike) -> float:
    with _UPDATED_LOCK:
        return time.monotonic() - _UPDATED.get(str(p), -float("inf"))


@contextlib.contextmanager
def _update(p: PathLike):
    """Around one update of object `p` by a client other than gcsfs (whose own requests are paced the same way:
    storage_clients.py): first wait out the rest of UPDATE_INTERVAL_S since this process last updated it (a 429
    avoided, not retried), then note when this update ended."""
    wait = UPDATE_INTERVAL_S + 0.05 - _since_update(p)
    if wait > 0:
        time.sleep(wait)
    try:
        yield
    finally:
        with _UPDATED_LOCK:
            _UPDATED[str(p)] = time.monotonic()


def append_bytes(p: PathLike, data: bytes, *, known_to_exist: bool | None = None, delete_part: bool = True) -> str:
    """Append `data` to `p` (created when absent). On an object store: the new bytes as a part object (named for
    this host, process and a random id, so no two writers collide), composed onto `p` (GCS compose: atomic, one
    request whatever the size of `p`), the part then deleted (a second after its upload: see `_update`), or with
    delete_part=False left for the caller to delete later; returns the part's URL ("" when there was none). A
    caller that knows whether `p` exists passes `known_to_exist` and saves a request. Writers that append often
    buffer with `Appender`."""
    if not storage.is_url(p):
        with storage.fence.guard(p), open(storage.path(p), "ab") as fh:  # the run's lease held (control/fence.py)
            fh.write(data)
        return ""
    fs, key = storage._fs(p)
    if not (fs.exists(key) if known_to_exist is None else known_to_exist):
        fs.pipe_file(key, data)
        return ""
    url = str(p)
    part = f"{url.rsplit('/', 1)[0]}/.{url.rsplit('/', 1)[-1]}{PART}{socket.gethostname()}.{os.getpid()}." \
           f"{uuid.uuid4().hex[:8]}"
    fs.pipe_file(storage._fs(part)[1], data)
    try:
        fs.merge(key, [key, storage._fs(part)[1]])
    finally:
        if delete_part:
            storage.remove(part)
    return part


def append_text(p: PathLike, text: str, **kw) -> None:
    append_bytes(p, text.encode("utf-8"), **kw)


def remove_orphan_parts(directory: PathLike, *, older_than: float = 0.0) -> list[str]:
    """Delete the compose parts under `directory` (`.NAME.part.HOST.PID.ID`) that a writer killed between its
    upload and its delete left behind: all but this process's own, and only those written more than `older_than`
    seconds ago (0 where the caller holds the directory, e.g. under the run lock). Returns their names. Nothing to
    do locally (a local append needs no part)."""
    if not storage.is_url(directory):
        return []
    fs, key = storage._fs(directory)
    mine = f"{PART}{socket.gethostname()}.{os.getpid()}."
    now, gone = time.time(), []
    try:
        found = fs.ls(key, detail=True)
    except FileNotFoundError:
        return []
    for info in found:
        name = info["name"].rsplit("/", 1)[-1]
        if not name.startswith(".") or PART not in name or mine in name:
            continue
        written = info.get("updated") or info.get("timeCreated")
        age = now - _iso_seconds(written) if written else float("inf")
        if age >= older_than:
            try:
                fs.rm_file(info["name"])
            except FileNotFoundError:  # its writer (or another start) deleted it meanwhile
                continue
            gone.append(name)
    return gone


def _iso_seconds(stamp) -> float:
    import datetime

    if isinstance(stamp, datetime.datetime):
        return stamp.timestamp()
    return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


class Appender:
    """A file grown one `write` at a time. Locally each write goes through at once (the file flushed). On an object
    store the writes are buffered and appended together (one part upload, one compose, one delete) when `interval`
    seconds (`flush_seconds()`) have passed since the last flush, and at `flush()` and `close()`: the object is
    updated about once per interval whatever the write rate, and a kill loses what was written since the last
    flush."""

    def __init__(self, p: PathLike, *, interval: float | None = None):
        self.path = storage.path(p)
        self._url = storage.is_url(p)
        self._interval = flush_seconds() if interval is None else max(interval, UPDATE_INTERVAL_S)
        self._exists = storage.exists(p) if self._url else True
        self._file = None if self._url else open(self.path, "a", encoding="utf-8")
        self._pending: list[str] = []
        self._flushed = -float("inf")  # the first write goes out at once
        self._part = ""  # the last flush's part, deleted at the next (a delete a second after its upload)

    def write(self, text: str) -> None:
        if self._file is not None:
            with storage.fence.guard(self.path):  # the run's lease held (control/fence.py)
                self._file.write(text)
                self._file.flush()
            return
        self._pending.append(text)
        if time.monotonic() - self._flushed >= self._interval and _since_update(self.path) >= UPDATE_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Append what is buffered now (waiting out the rest of a second since the object's last update)."""
        if self._pending:
            text, self._pending = "".join(self._pending), []
            if self._part:
                storage.remove(self._part)
            self._part = append_bytes(self.path, text.encode("utf-8"), known_to_exist=self._exists,
                                      delete_part=False)
            self._exists, self._flushed = True, time.monotonic()

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.flush()
        if self._part:
            storage.remove(self._part)
            self._part = ""
        if self._file is not None:
            self._file.close()


class Mirror:
    """Keeps the files of a fresh local directory `local_dir` (for a tool that writes only local files, e.g.
    TensorBoard's event writer) copied to directory `dst`: `sync()` appends to each object the bytes its local file
    gained since the last sync, so a growing events file costs one compose per sync, not a rewrite; a sync sooner
    than `flush_seconds()` after the last one does nothing unless forced (`sync(force=True)`, `close()`)."""

    def __init__(self, dst: PathLike, purpose: str):
        self.local_dir, self.dst = Path(tempfile.mkdtemp(prefix=f"g2rl_jax_{purpose}_")), storage.path(dst)
        self._sent: dict[str, int] = {}
        self._interval, self._synced = flush_seconds(), -float("inf")
        self._parts: list[str] = []  # the last sync's parts, deleted at the next

    def close(self) -> None:
        """A last sync; the local copy is then deleted."""
        self.sync(force=True)
        for part in self._parts:
            storage.remove(part)
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def sync(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._synced < self._interval:
            return
        self._synced = time.monotonic()
        for file in sorted(f for f in self.local_dir.iterdir() if f.is_file()):
            size, sent = file.stat().st_size, self._sent.get(file.name, 0)
            if size > sent:
                while self._parts:
                    storage.remove(self._parts.pop())
                with open(file, "rb") as fh:
                    fh.seek(sent)
                    part = append_bytes(self.dst / file.name, fh.read(size - sent), known_to_exist=sent > 0,
                                        delete_part=False)
                self._parts += [part] if part else []
                self._sent[file.name] = size


from g2rl_jax import storage  # noqa: E402 - last: g2rl_jax.storage imports this module's names at its top
