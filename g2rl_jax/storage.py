"""One storage layer for every path a run reads or writes: a local path or a URL (gs://bucket/dir first; any scheme
etils `epath` and fsspec support), through the same calls.

    storage.check_writable("gs://my-bucket/runs/demo", "run.output_dir")  # one line for a missing bucket, ...
    run = storage.path("gs://my-bucket/runs/demo")                         # an etils epath.Path
    storage.write_text(run / "config.yaml", text)                          # whole, or not at all
    storage.append_text(run / "metrics.jsonl", line)                       # GCS: a conditional compose onto it
    storage.create_exclusive(run / "run.lock", record)                     # GCS: ifGenerationMatch=0

The choice: etils `epath`, the path type Orbax takes for its checkpoint directories and JAX's persistent compilation
cache uses for non-local directories, with fsspec's gcsfs behind it for gs:// (epath's own backend for gs:// when
TensorFlow is absent). So the checkpoints, the compile cache and every file the project writes itself go through one
client, one set of credentials and one emulator setting (STORAGE_EMULATOR_HOST). gcsfs is the optional extra
`pip install -e ".[gcs]"`; a gs:// path without it is one line naming the extra. The clients' retries, timeouts and
the checks at start that keep an unreachable endpoint from hanging a run: g2rl_jax/storage_clients.py.

What an object store does not have, done here once:
- append, exactly once: `append_text` writes the new bytes as a small part object (named for host, pid and a
  random id) and composes [object, part] onto the object (one compose request, whatever the object's size), so
  metrics.jsonl and the TensorBoard events grow as one object. Every append is conditional on the version its writer
  last saw (a first write on the object's absence, ifGenerationMatch=0; a compose on its generation; locally the
  same under an flock), so a retried request never doubles a line and another writer's change raises
  `ObjectChanged` instead of being overwritten; `Appender` and `Mirror` buffer and flush every
  $G2RL_JAX_FLUSH_SECONDS (and when told); `remove_orphan_parts` deletes the parts a killed writer left (these live
  in storage_append.py and are re-exported here);
- write rates: GCS allows about one update per second per object name; this process's gcsfs client waits out the
  rest of the second before updating an object again (storage_clients.py), so it is never answered 429;
- an atomic create-if-absent (the run lock): a write with the precondition ifGenerationMatch=0, refused (412) when
  the object exists; locally, a complete file hard-linked into place;
- rename: a copy and a delete (`move`), not atomic; used only to set a corrupt checkpoint aside, where a partial move
  is harmless (the step is found corrupt again on the next start);
- directories: none; `makedirs` does nothing for a URL.
A model directory in a bucket is copied once to the local cache (`local_copy`, in storage_copies.py and re-exported
here): safetensors are memory-mapped and read slice by slice, which a local file does at disk speed and an object
store only with a request per slice.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Union
from urllib.parse import quote

from etils import epath

from g2rl_jax.control import fence
from g2rl_jax.errors import ConfigError
from g2rl_jax.storage_append import (  # noqa: F401 - part of this module's interface
    ABSENT,
    FLUSH_ENV,
    PART,
    UPDATE_INTERVAL_S,
    Appended,
    Appender,
    Mirror,
    ObjectChanged,
    Version,
    append_bytes,
    append_text,
    flush_seconds,
    remove_orphan_parts,
    version,
)

PathLike = Union[str, os.PathLike]
EXTRAS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}  # scheme -> (the client module, the extra that has it)
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class StorageError(ConfigError):
    """A path that cannot be used (no client for its scheme, a missing bucket, no credentials, no permission); the
    message names the path and what to do."""


class StorageUnreachable(StorageError):
    """A start's check of a URL that the store did not serve (a refused or dropped connection, no answer, 429/5xx
    after the retries): one line as any StorageError; the trainer exits with the storage's code (relaunch later)."""


def scheme(p: PathLike) -> str | None:
    """'gs' for gs://bucket/x, None for a local path."""
    match = _URL.match(str(p))
    return match.group(1).lower() if match else None


def is_url(p: PathLike) -> bool:
    return scheme(p) is not None


def require_client(p: PathLike, key: str = "") -> None:
    """StorageError (one line naming the extra) when `p` is a URL whose client library is not installed."""
    which = scheme(p)
    if which not in EXTRAS:
        return
    module, extra = EXTRAS[which]
    try:
        importlib.import_module(module)
    except ImportError:
        where = f"{key}: " if key else ""
        raise StorageError(f"{where}{str(p)!r} is a {which}:// path, which needs the {module} package: "
                           f"pip install -e \".[{extra}]\" (or pip install {module})") from None
    from g2rl_jax import storage_clients

    storage_clients.configure()  # timeouts, retries, the emulator's variables: once per process


def path(p: PathLike, key: str = "") -> epath.Path:
    """`p` as an epath.Path (a local path, or a URL with its client installed; `key` names the config key or flag
    in the error)."""
    require_client(p, key)
    return epath.Path(p) if is_url(p) else epath.Path(os.path.expanduser(os.fspath(p)))


def _fs(p: PathLike):
    """(fsspec filesystem, path within it) of a URL."""
    import fsspec

    require_client(p)
    return fsspec.core.url_to_fs(str(p))


# ------------------------------------------------------------------------------------------------ reading
def read_bytes(p: PathLike) -> bytes:
    return path(p).read_bytes()


def read_text(p: PathLike) -> str:
    return read_bytes(p).decode("utf-8")


def exists(p: PathLike) -> bool:
    return path(p).exists()


def is_file(p: PathLike) -> bool:
    return path(p).is_file()


def is_dir(p: PathLike) -> bool:
    return path(p).is_dir()


def names(p: PathLike) -> list[str]:
    """The names directly under directory `p` ([] when there is none; on an object store a "directory" is gone as
    soon as another process deletes its last object, even between two calls)."""
    try:
        return sorted(child.name for child in path(p).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


# ------------------------------------------------------------------------------------------------ writing
def makedirs(p: PathLike) -> None:
    """Create directory `p` and its parents (nothing to do on an object store)."""
    if not is_url(p):
        path(p).mkdir(parents=True, exist_ok=True)


def write_bytes(p: PathLike, data: bytes) -> None:
    """Replace `p` whole: locally a temporary file renamed over it, on an object store one upload (an object
    appears complete or not at all). A reader never sees half a file."""
    target = path(p)
    if is_url(p):
        target.write_bytes(data)  # each request through the fence (storage_clients.py)
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with fence.guard(target):  # the run's lease held (control/fence.py): no file, not even the temporary, without
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, target)


def write_text(p: PathLike, text: str) -> None:
    write_bytes(p, text.encode("utf-8"))


# ------------------------------------------------------------------------------------------------ small versioned files
# What the run lock needs of a store: a read that returns the bytes with their generation, and a create, an overwrite
# and a delete each conditional on the generation read (GCS: the precondition ifGenerationMatch, 412 when it fails).
# Locally the generation is a digest of the bytes (callers that must tell every write apart write distinct bytes: the
# lock's records carry a fresh nonce), and an overwrite or delete compares and acts under an flock on a sidecar
# `.<name>.mutex` file (released by the kernel when its holder dies; the sidecar is never deleted).
def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def _header(headers, name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name.lower()), None)


def _gcs_upload(p: PathLike, data: bytes, if_generation: str) -> str | None:
    """One upload of `data` to URL `p` with ifGenerationMatch=`if_generation` ('0': only if absent): the new
    generation, or None when the precondition failed. An upload whose reply was lost and that the client retried
    meets its own bytes and counts as done."""
    fs, key = _fs(p)
    bucket, name = key.split("/", 1)
    body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{json.dumps({'name': name})}\n--==0==\n"
            "Content-Type: application/octet-stream\n\n").encode() + data + b"\n--==0==--"
    from g2rl_jax import storage_append

    try:  # paced as gcsfs's own updates (the object's name is in the multipart body, which gcsfs's pacing cannot see)
        with storage_append._update(p):
            reply = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="multipart",
                            headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body,
                            json_out=True, ifGenerationMatch=if_generation)
    except FileExistsError:  # 412 Precondition Failed (or a 429 with the precondition failing: storage_paced.py)
        return _own_upload(p, data)
    return str(reply["generation"])


def _own_upload(p: PathLike, data: bytes) -> str | None:
    """After a refused conditional upload: the generation of `p` if it holds our own bytes (a retry of an upload
    that had landed), else None."""
    try:
        now, generation_now = read_versioned(p)
    except FileNotFoundError:
        return None
    return generation_now if now == data else None


@contextlib.contextmanager
def _local_mutex(target: Path):
    import fcntl

    with open(target.with_name(f".{target.name}.mutex"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def read_versioned(p: PathLike) -> tuple[bytes, str]:
    """(bytes, generation) of small file `p`, read in one request (the generation is that of those bytes);
    FileNotFoundError when there is none."""
    if is_url(p):
        fs, key = _fs(p)
        bucket, name = key.split("/", 1)
        headers, data = fs.call("GET", "b/{}/o/{}", bucket, name, alt="media")
        return data, str(_header(headers, "x-goog-generation"))
    data = path(p).read_bytes()
    return data, _digest(data)


def generation(p: PathLike) -> str:
    """A token that changes whenever `p` is rewritten (with other bytes, locally)."""
    return read_versioned(p)[1]


def create_exclusive(p: PathLike, text: str) -> str | None:
    """Create `p` holding `text` if no `p` exists: its generation, or None (and nothing written) if one does.
    Atomic: of two creators exactly one succeeds, and a reader sees the whole text or no file."""
    data = text.encode("utf-8")
    if is_url(p):
        return _gcs_upload(p, data, "0")
    target = path(p)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    try:
        with fence.guard(target):
            os.link(tmp, target)  # fails if `target` exists; a complete file appears at once
    except FileExistsError:
        return None
    finally:
        tmp.unlink()
    return _digest(data)


def replace_if_generation(p: PathLike, text: str, expected: str) -> str | None:
    """Overwrite `p` with `text` only if its generation is still `expected`: the new generation, or None (nothing
    written) when `p` changed or is gone meanwhile."""
    data = text.encode("utf-8")
    if is_url(p):
        return _gcs_upload(p, data, expected)
    target = path(p)
    with _local_mutex(target):
        try:
            if _digest(target.read_bytes()) != expected:
                return None
        except FileNotFoundError:
            return None
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return _digest(data)


def remove_if_generation(p: PathLike, expected: str) -> bool:
    """Delete `p` only if its generation is still `expected`; False when it changed or is gone."""
    if is_url(p):
        fs, key = _fs(p)
        bucket, name = key.split("/", 1)
        try:
            fs.call("DELETE", "b/{}/o/{}", bucket, name, ifGenerationMatch=expected)
        except (FileExistsError, FileNotFoundError):  # 412 (or a 429 with the precondition failing), 404
            return False
        return True
    target = path(p)
    with _local_mutex(target):
        try:
            if _digest(target.read_bytes()) != expected:
                return False
        except FileNotFoundError:
            return False
        target.unlink()
    return True


def remove(p: PathLike, *, missing_ok: bool = True) -> None:
    try:
        if is_url(p):
            fs, key = _fs(p)
            fs.rm_file(key)  # one object, no glob expansion of the name (the request fenced: storage_clients.py)
        else:
            with fence.guard(p):
                path(p).unlink()
    except FileNotFoundError:
        if not missing_ok:
            raise


def rmtree(p: PathLike) -> None:
    target = path(p)
    with fence.guard(target):
        if target.exists():
            target.rmtree()


def move(src: PathLike, dst: PathLike) -> None:
    """Move file or directory `src` to `dst` (a `dst` that exists is deleted first). Locally one rename; on an
    object store a copy, then the delete of `src` (not atomic: see the module docstring)."""
    rmtree(dst)
    if not is_url(src):
        with fence.guard(dst), fence.guard(src):
            os.replace(path(src), path(dst))
        return
    fs, key = _fs(src)
    fs.mv(key, _fs(dst)[1], recursive=True)


def upload_tree(local_dir: PathLike, dst: PathLike) -> None:
    """Copy the files under local directory `local_dir` to `dst` (a URL, or another local directory)."""
    root = Path(local_dir)
    for file in sorted(f for f in root.rglob("*") if f.is_file()):
        write_bytes(path(dst) / file.relative_to(root).as_posix(), file.read_bytes())


# ------------------------------------------------------------------------------------------------ checks
def check_writable(directory: PathLike, key: str, probe_name: str = ".write_test") -> None:
    """StorageError naming `key`, the path and the fix when `directory` cannot be written (through both clients
    for gs://, each within a bounded time: g2rl_jax/storage_clients.py)."""
    from g2rl_jax import storage_clients

    storage_clients.check_writable(directory, key, probe_name)


def check_readable(p: PathLike, key: str) -> None:
    """StorageError naming `key` when URL `p` cannot be reached within a bounded time (storage_clients.py)."""
    from g2rl_jax import storage_clients

    storage_clients.check_readable(p, key)


# the local copies of bucket directories, re-exported as part of this module's interface (storage_copies.py)
from g2rl_jax.storage_copies import CACHE_ENV, MANIFEST, cache_dir, copy_key, local_copy, scratch_dir  # noqa: E402, F401
