"""Appending to objects, exactly once, within GCS's write rates (re-exported by g2rl_jax.storage, which documents the
layer). GCS allows about one update (upload, compose, delete) per second per object name.

Exactly once: every append is conditional on the object's version its writer last saw (`Version`: the generation and
the size), so a retried request never doubles a line and two writers never overwrite each other.
- On GCS the first write of an object is an upload conditional on its absence (ifGenerationMatch=0); every later
  one uploads the new bytes as a part object (named for this host, pid and a random id: no two writers collide) and
  composes [object, part] onto the object with ifGenerationMatch=<the generation last seen> (one request, atomic,
  whatever the size), the part deleted afterwards. A precondition that fails (412) after a retry may mean that the
  first attempt landed and only its reply was lost: the object is then read back, and if it is the version seen
  plus exactly these bytes at its end, the append counts as done; otherwise another writer changed it.
- Locally the same guarantee with an flock: the file is opened for appending (created exclusively for a first
  write), locked, and written only if it is still the file last seen (device, inode, size, modification time).
Another writer's change raises `ObjectChanged`: a writer that holds a file (`Appender`, `Mirror`) stops writing
to it; a one-off `append_bytes` without an expected version re-reads the object and appends again.

- `Appender` (a growing text file: metrics.jsonl, eval's records) and `Mirror` (a local directory's growing files:
  TensorBoard's events) buffer and flush every $G2RL_JAX_FLUSH_SECONDS and when told; each flush's part is deleted
  at the next, a second or more after its upload;
- `remove_orphan_parts`: the parts a killed writer left, deleted at the next start;
- `_update` / `_since_update`: this process's last update of each object, which the paced gcsfs client
  (storage_clients.py) and the writers here consult so that no object is updated twice within a second.
"""
from __future__ import annotations

import contextlib
import dataclasses
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
ONE_OFF_TRIES = 5  # a one-off append meeting other writers' appends reads the object again this many times at most
_UPDATED: dict[str, float] = {}  # URL -> when this process last updated it (monotonic seconds)
_UPDATED_LOCK = threading.Lock()


class ObjectChanged(RuntimeError):
    """Another writer changed (or deleted, or created) an object since this writer last saw it; nothing was
    written. For a run's files this means another trainer holds the run now."""


@dataclasses.dataclass(frozen=True)
class Version:
    """An object as a writer last saw it: its generation ("0": absent; locally device:inode:mtime) and size."""

    generation: str
    size: int


ABSENT = Version("0", 0)


@dataclasses.dataclass(frozen=True)
class Appended:
    version: Version  # the object with these bytes appended
    part: str         # the compose part's URL, left for the caller with delete_part=False ("" when there was none)


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


# ------------------------------------------------------------------------------------------------ versions
def _local_version(st: os.stat_result) -> Version:
    return Version(f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}", st.st_size)


def version(p: PathLike) -> Version:
    """The version of `p` now (ABSENT when there is none): one metadata request on an object store."""
    if storage.is_url(p):
        fs, key = storage._fs(p)
        try:
            info = fs.info(key)
        except FileNotFoundError:
            return ABSENT
        return Version(str(info["generation"]), int(info["size"]))
    try:
        return _local_version(os.stat(storage.path(p)))
    except FileNotFoundError:
        return ABSENT


def _changed(p: PathLike, expected: Version, now: Version | None = None) -> ObjectChanged:
    seen = "absent" if expected == ABSENT else f"generation {expected.generation}, {expected.size} bytes"
    found = "" if now is None else f" (now {'absent' if now == ABSENT else f'{now.generation}, {now.size} bytes'})"
    return ObjectChanged(f"{p} was changed by another writer since this one last wrote it ({seen}){found}; "
                         "nothing was written")


# ------------------------------------------------------------------------------------------------ one append
def append_bytes(p: PathLike, data: bytes, *, expected: Version | None = None, delete_part: bool = True) -> Appended:
    """Append `data` to `p` exactly once (see the module docstring), conditional on `p` being `expected` (ABSENT:
    a first write, only if `p` does not exist); ObjectChanged when it is not. Without `expected` (a one-off append)
    the version is read first, and read again when another writer appended meanwhile. On an object store the part
    is deleted after the compose, or with delete_part=False left for the caller to delete later (a second after its
    upload: see `_update`). Writers that append often buffer with `Appender`."""
    if not data:
        return Appended(version(p) if expected is None else expected, "")
    if expected is not None:
        return (_gcs_append if storage.is_url(p) else _local_append)(p, data, expected, delete_part)
    for attempt in range(ONE_OFF_TRIES):
        try:
            return append_bytes(p, data, expected=version(p), delete_part=delete_part)
        except ObjectChanged:
            if attempt == ONE_OFF_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def append_text(p: PathLike, text: str, **kw) -> Appended:
    return append_bytes(p, text.encode("utf-8"), **kw)


def _local_append(p: PathLike, data: bytes, expected: Version, delete_part: bool) -> Appended:
    """Locally: append under an flock of the file, only if the file at `p` is still `expected`."""
    import fcntl

    target = storage.path(p)
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if expected == ABSENT else 0)
    try:
        fd = os.open(target, flags, 0o644)
    except (FileExistsError, FileNotFoundError):
        raise _changed(p, expected, version(p)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        now = _local_version(os.fstat(fd))
        if expected != ABSENT and now != expected or os.stat(target).st_ino != os.fstat(fd).st_ino:
            raise _changed(p, expected, version(p))
        view = memoryview(data)
        with storage.fence.guard(p):  # the run's lease held (control/fence.py)
            while view:
                view = view[os.write(fd, view):]
        return Appended(_local_version(os.fstat(fd)), "")
    finally:
        os.close(fd)  # the flock goes with it


def _part_url(p: PathLike) -> str:
    url = str(p)
    folder, name = url.rsplit("/", 1)
    return f"{folder}/.{name}{PART}{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _gcs_append(p: PathLike, data: bytes, expected: Version, delete_part: bool) -> Appended:
    """On GCS: a first write conditional on absence, else a part composed on with ifGenerationMatch."""
    if expected == ABSENT:
        generation = storage._gcs_upload(p, data, "0")  # a refused retry of our own landed upload counts as done
        if generation is None:
            raise _changed(p, expected, version(p))
        return Appended(Version(generation, len(data)), "")
    fs, key = storage._fs(p)
    part = _part_url(p)
    fs.pipe_file(storage._fs(part)[1], data)  # a name of its own: a retried upload writes the same bytes again
    try:
        return Appended(_compose(p, part, data, expected), part)
    finally:
        if delete_part:
            storage.remove(part)


def _compose(p: PathLike, part: str, data: bytes, expected: Version) -> Version:
    """Compose [p, part] onto p if p's generation is still expected's: the new version. A refused precondition
    after a retry whose first attempt landed (its reply lost) is told from another writer's change by what is stored:
    expected's size plus `data`, ending in `data`."""
    fs, key = storage._fs(p)
    bucket, name = key.split("/", 1)
    body = {"kind": "storage#composeRequest", "sourceObjects": [{"name": name}, {"name": storage._fs(part)[1]
                                                                                 .split("/", 1)[1]}],
            "destination": {"name": name, "bucket": bucket}}
    try:
        reply = fs.call("POST", "b/{}/o/{}/compose", bucket, name, ifGenerationMatch=expected.generation,
                        json=body, headers={"Content-Type": "application/json"}, json_out=True)
        return Version(str(reply["generation"]), int(reply["size"]))
    except FileExistsError:  # 412: landed on an earlier attempt, or another writer's
        pass
    except FileNotFoundError:  # 404: the object (a source) is gone: deleted by another writer
        raise _changed(p, expected, version(p)) from None
    landed = _tail(p, len(data))
    if landed is not None and landed[0].size == expected.size + len(data) and landed[1] == data:
        return landed[0]
    raise _changed(p, expected, None if landed is None else landed[0])


def _tail(p: PathLike, n: int) -> tuple[Version, bytes] | None:
    """(version, its last n bytes) of object p in one ranged read; None when it is absent."""
    fs, key = storage._fs(p)
    bucket, name = key.split("/", 1)
    try:
        headers, data = fs.call("GET", "b/{}/o/{}", bucket, name, alt="media", headers={"Range": f"bytes=-{n}"})
    except FileNotFoundError:
        return None
    span = storage._header(headers, "Content-Range")  # bytes FIRST-LAST/SIZE
    size = int(span.rsplit("/", 1)[1]) if span else len(data)
    return Version(str(storage._header(headers, "x-goog-generation")), size), data


# ------------------------------------------------------------------------------------------------ parts
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


# ------------------------------------------------------------------------------------------------ writers
class Appender:
    """A file grown one `write` at a time by one writer, each append conditional on the version this writer last
    wrote (ObjectChanged, and nothing written, once another writer changed the file). Locally each write goes
    through at once. On an object store the writes are buffered and appended together (one part upload, one
    compose, one delete) when `interval` seconds (`flush_seconds()`) have passed since the last flush, and at
    `flush()` and `close()`: the object is updated about once per interval whatever the write rate, and a kill loses
    what was written since the last flush."""

    def __init__(self, p: PathLike, *, interval: float | None = None):
        self.path = storage.path(p)
        self._url = storage.is_url(p)
        self._interval = flush_seconds() if interval is None else max(interval, UPDATE_INTERVAL_S)
        self._version = version(p)  # what the next append expects to find
        self._pending: list[str] = []
        self._flushed = -float("inf")  # the first write goes out at once
        self._part = ""  # the last flush's part, deleted at the next (a delete a second after its upload)

    def write(self, text: str) -> None:
        self._pending.append(text)
        if not self._url or (time.monotonic() - self._flushed >= self._interval
                             and _since_update(self.path) >= UPDATE_INTERVAL_S):
            self.flush()

    def flush(self) -> None:
        """Append what is buffered now (waiting out the rest of a second since the object's last update)."""
        if self._pending:
            text, self._pending = "".join(self._pending), []
            if self._part:
                storage.remove(self._part)
                self._part = ""
            done = append_bytes(self.path, text.encode("utf-8"), expected=self._version, delete_part=False)
            self._version, self._part, self._flushed = done.version, done.part, time.monotonic()

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.flush()
        if self._part:
            storage.remove(self._part)
            self._part = ""


class Mirror:
    """Keeps the files of a fresh local directory `local_dir` (for a tool that writes only local files, e.g.
    TensorBoard's event writer) copied to directory `dst`: `sync()` appends to each object the bytes its local file
    gained since the last sync (the first conditional on the object's absence, each later one on the version the last
    left), so a growing events file costs one compose per sync, not a rewrite; a sync sooner than `flush_seconds()`
    after the last one does nothing unless forced (`sync(force=True)`, `close()`)."""

    def __init__(self, dst: PathLike, purpose: str):
        self.local_dir, self.dst = Path(tempfile.mkdtemp(prefix=f"g2rl_jax_{purpose}_")), storage.path(dst)
        self._sent: dict[str, Version] = {}  # local name -> its object's version (its size: the bytes sent)
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
            size, sent = file.stat().st_size, self._sent.get(file.name, ABSENT)
            if size > sent.size:
                while self._parts:
                    storage.remove(self._parts.pop())
                with open(file, "rb") as fh:
                    fh.seek(sent.size)
                    done = append_bytes(self.dst / file.name, fh.read(size - sent.size), expected=sent,
                                        delete_part=False)
                self._parts += [done.part] if done.part else []
                self._sent[file.name] = done.version


from g2rl_jax import storage  # noqa: E402 - last: g2rl_jax.storage imports this module's names at its top
