"""Local copies of what a run reads from a bucket, and local scratch directories for URLs (part of g2rl_jax.storage,
which re-exports these): a model directory in a bucket is copied once to the local cache (`local_copy`), because
safetensors are memory-mapped and read slice by slice, which a local file does at disk speed and an object store
only with a request per slice; TensorBoard's and W&B's writers, which write only local files, get a directory kept
per URL (`scratch_dir`)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from g2rl_jax import storage

CACHE_ENV = "G2RL_JAX_CACHE"  # where bucket copies and local staging live (default ~/.cache/g2rl_jax)


def cache_dir() -> Path:
    """The local cache root: $G2RL_JAX_CACHE, else ~/.cache/g2rl_jax."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "g2rl_jax")


def scratch_dir(url: storage.PathLike, purpose: str) -> Path:
    """A local directory kept for `url` (per URL and `purpose`), for tools that only write local files
    (TensorBoard's event writer, W&B's offline files)."""
    digest = hashlib.sha256(str(url).encode()).hexdigest()[:16]
    out = cache_dir() / purpose / digest
    out.mkdir(parents=True, exist_ok=True)
    return out


def _manifest(url: str) -> dict[str, list]:
    """{relative name: [size, generation, crc32c]} of every object under `url`."""
    fs, key = storage._fs(url)
    found = fs.find(key, detail=True)
    return {name[len(key):].lstrip("/"): [info.get("size"), str(info.get("generation") or info.get("etag")),
                                         info.get("crc32c")]
            for name, info in sorted(found.items()) if info.get("type") != "directory"}


MANIFEST = ".g2rl_jax_manifest.json"


def copy_key(url: str, manifest: dict) -> str:
    """The name of the cache directory of `url`'s objects as `manifest` lists them: a digest of both, so another
    version of any object is another directory."""
    return hashlib.sha256(json.dumps([url, manifest], sort_keys=True).encode()).hexdigest()[:24]


def local_copy(url: storage.PathLike, key: str) -> str:
    """A local directory holding the files under `url` (a model directory or a PEFT adapter in a bucket): the cache
    directory `copies/<copy_key>` named by the URL and its objects' names, sizes and generations. A copy is made
    in a temporary directory beside it and renamed into place whole, so processes copying the same objects at once
    share the one that lands first and never delete a copy another may be reading (a changed object lands in
    another directory; old ones stay until the cache is cleared). A local path is returned as it is.
    FileNotFoundError naming `key` when nothing is there."""
    if not storage.is_url(url):
        return os.fspath(url)
    storage.require_client(url, key)
    url = str(url).rstrip("/")
    manifest = _manifest(url)
    if not manifest:
        raise FileNotFoundError(f"{key}: nothing found at {url}; copy the directory there first (gcloud storage cp "
                                "-r DIR URL) or fix the path")
    target = cache_dir() / "copies" / copy_key(url, manifest)
    if (target / MANIFEST).is_file():
        return str(target)
    size = sum(s or 0 for s, *_ in manifest.values())
    print(f"{key}: copying {url} ({len(manifest)} files, {size / 1e6:.1f} MB) to {target}", file=sys.stderr,
          flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fs, root = storage._fs(url)
        for name in manifest:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{root}/{name}", str(tmp / name))
        (tmp / MANIFEST).write_text(json.dumps({"url": url, "objects": manifest}))  # last: marks the copy whole
        os.rename(tmp, target)  # atomic; refused when another process's copy landed first
    except OSError:
        if not (target / MANIFEST).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
