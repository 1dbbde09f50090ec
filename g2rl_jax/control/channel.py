"""The one key-value channel between the processes of a run, over jax.distributed's key-value store: the sides'
samples, versions and start (train/sides_store.py), the stop and its answers (control/stop.py), the rollout blocks'
exchange (train/ahead.py), the weight sync's acknowledgements (train/weight_sync.py), the rollout processes' leases.

    ch = channel.default()                                   # this process's channel (after jax.distributed starts)
    ch.put("sides/start", (step, position, pending))          # JSON plus arrays (control/wire.py), never pickle
    ch.get("sides/start", kinds=..., schema=..., timeout_s=math.inf, ended=stop.ended)
    ch.look(key, ...)    # the value, or None while nobody set it        ch.delete(key)    ch.increment(key, 1)

Format. Every key lives under `g2rl/`. A value is control/wire.py's bytes (the JSON of its structure, then its
arrays as an .npz). A small one (at most INLINE_BYTES) sits in base64 inside the key's manifest, a JSON object
`{"g2rl": 1, "inline": ...}`. A larger one goes first in chunks of CHUNK_BYTES under
`<key>/.chunk/<nonce>/<i>` (each packed with zlib's fastest level when that pays: `_pack`), then the manifest
`{"g2rl": 1, "bytes": N, "chunk": C, "chunks": n, "nonce": ..., "crc32": ...}` is set last, so a value is visible
whole or not at all, and a key set again (a new nonce) never mixes with the chunks of the last.

A get. It waits for the manifest (a few hundred bytes) in polls of POLL_S, asking `ended()` between polls whether
the writer has ended (then it raises Ended, unless the key was set just before). Once the manifest is there every
chunk exists, so each chunk is fetched with all the time the get has left, never a poll: a transfer is never cut off
and started again, whatever its size and the link's speed (a get of the whole value in polls of 1 s never finished
once the value needed more than 1 s to cross). A chunk once received is kept: a get that runs out of its bound
raises Late naming the key and what had arrived, and the next get of that key fetches only the rest. One bound,
`timeout_s`, covers the whole get (math.inf: until `ended()` says the writer is gone). Errors are typed where the
store raises them, from the status code that leads JAX's message: Late, Ended, Exists (a put of a key already set),
StoreGone (the coordinator does not answer), wire.Refused (bytes this version did not write: a planted pickle too).

Measured MB/s between two processes: `python -m g2rl_jax.bench channel` (docs/async.md).
"""
from __future__ import annotations

import base64
import json
import math
import secrets
import threading
import time
import zlib
from typing import Any

from g2rl_jax.control import wire

PREFIX = "g2rl"
CHUNK_BYTES = 4 << 20  # bench channel: 4 MB chunks move as fast as larger ones, and each crosses in milliseconds
INLINE_BYTES = 32 << 10  # at most this much rides in the manifest itself
PACK_SAMPLE = 256 << 10  # the part of a chunk whose zlib says whether the chunk is worth packing
POLL_S = 1.0  # a wait for a key, between looks at `ended()`
CHUNK_WAIT_S = 600.0  # the most a chunk (written before its manifest) may take to arrive once its manifest has
_MANIFEST_MAX = 4096  # a manifest (not inline) is far smaller: anything longer is not ours


class Late(RuntimeError):
    """A get's bound passed before its value arrived whole; the message names the key and what had arrived."""


class Ended(Exception):
    """The writer ended (`ended()` gave `reason`) before it set the key."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class Exists(KeyError):
    """A put without `overwrite` of a key another process set first."""


class StoreGone(RuntimeError):
    """jax.distributed's key-value store does not answer: the process holding its coordinator (process 0) is gone
    or unreachable."""


class _NotYet(Exception):
    """A blocking get's wait ran out (DEADLINE_EXCEEDED): the key is not set yet, or its transfer was cut off."""


class _Missing(Exception):
    """A look at a key nobody set (NOT_FOUND)."""


def status(err: BaseException) -> str:
    """The gRPC status code of an error JAX's client raised: the word its message starts with (DEADLINE_EXCEEDED,
    NOT_FOUND, ALREADY_EXISTS, UNAVAILABLE, ...)."""
    return str(err).split(":", 1)[0].strip()


def client():
    """jax.distributed's client, whose key-value store every process of the run shares (None before it starts)."""
    from jax._src import distributed

    return distributed.global_state.client


def _pack(chunk: memoryview) -> bytes:
    """A chunk as sent: b"z" and its zlib (level 1) when that saves a quarter or more of a sample of it, else b"r"
    and its bytes. (JAX's client gzips whatever it sends, at 5 to 30 MB/s of token ids and floats on one core;
    zlib's fastest level first leaves it a third as much of those to gzip, and incompressible bytes, random floats,
    are sent as they are.)"""
    sample = bytes(chunk[:PACK_SAMPLE])
    if len(zlib.compress(sample, 1)) <= 0.75 * len(sample):
        return b"z" + zlib.compress(chunk, 1)
    return b"r" + bytes(chunk)


def _unpack(raw: bytes, size: int, where: str) -> bytes:
    """The `size` bytes of a chunk `_pack` sent; Refused for anything else (never more than `size` unpacked)."""
    refused = wire.Refused(f"{where}: a chunk that is not what its manifest describes; refused, nothing in it was run")
    if raw[:1] == b"r" and len(raw) == size + 1:
        return raw[1:]
    if raw[:1] != b"z":
        raise refused
    unpack = zlib.decompressobj()
    try:
        data = unpack.decompress(memoryview(raw)[1:], size)
    except zlib.error:
        raise refused from None
    if len(data) != size or not unpack.eof or unpack.unconsumed_tail:
        raise refused
    return data


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


class Channel:
    """Keys and values over jax.distributed's client (see the module docstring); `pack=False` sends every chunk as
    it is (bench channel compares)."""

    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES, poll_s: float = POLL_S, pack: bool = True):
        self.chunk_bytes, self.poll_s, self.pack = chunk_bytes, poll_s, pack
        self._partial: dict[str, tuple[str, dict[int, bytes]]] = {}  # key -> (nonce, chunks received)
        self._lock = threading.Lock()
        self.chunks_fetched = 0  # chunks this channel has transferred (each once: see get)

    @property
    def kv(self):
        kv = client()
        if kv is None:
            raise RuntimeError("the key-value channel needs jax.distributed (parallel.initialize_distributed) first")
        return kv

    @staticmethod
    def full(key: str) -> str:
        return f"{PREFIX}/{key}"

    def _call(self, key: str, fn, *args, waits: bool = False):
        """`fn(*args)` of the store, its failures typed by their status code where they are raised (a deadline is
        _NotYet for a call that `waits` for a key, else the store not answering)."""
        import jax

        try:
            return fn(*args)
        except jax.errors.JaxRuntimeError as err:
            code = status(err)
            if code == "ALREADY_EXISTS":
                raise Exists(key) from None
            if code == "DEADLINE_EXCEEDED" and waits:
                raise _NotYet(key) from None
            if code == "NOT_FOUND":
                raise _Missing(key) from None
            raise StoreGone(f"jax.distributed's key-value store did not answer for key {self.full(key)} ({code}): "
                            "the process holding its coordinator (process 0) is gone or unreachable") from err

    # -------------------------------------------------------------------------------------------- writing
    def put(self, key: str, value, *, overwrite: bool = False) -> None:
        """Set `key` to `value` (control/wire.py's values); Exists if it is set and not `overwrite`."""
        if any(part.startswith(".") for part in key.split("/")):
            raise ValueError(f"channel key {key!r}: no part may start with '.' (the chunks' own)")
        payload = wire.encode(value)
        full = self.full(key)
        if len(payload) <= INLINE_BYTES:
            manifest = {"g2rl": 1, "inline": base64.b64encode(payload).decode("ascii")}
        else:
            nonce, count = secrets.token_hex(8), math.ceil(len(payload) / self.chunk_bytes)
            view = memoryview(payload)
            for i in range(count):
                part = view[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]
                chunk = _pack(part) if self.pack else b"r" + bytes(part)
                self._call(key, self.kv.key_value_set_bytes, f"{full}/.chunk/{nonce}/{i}", chunk)
            manifest = {"g2rl": 1, "bytes": len(payload), "chunk": self.chunk_bytes, "chunks": count, "nonce": nonce,
                        "crc32": zlib.crc32(payload)}
        self._call(key, self.kv.key_value_set_bytes, full, json.dumps(manifest).encode(), overwrite)

    def delete(self, key: str) -> None:
        """Remove `key`, its chunks and every key under it."""
        self._call(key, self.kv.key_value_delete, self.full(key))
        with self._lock:
            self._partial.pop(self.full(key), None)

    def increment(self, key: str, by: int) -> int:
        """Add `by` to the counter `key` (0 when unset) and return it: a number, no value to decode."""
        return int(self._call(key, self.kv.key_value_increment, self.full(key), by))

    # -------------------------------------------------------------------------------------------- reading
    def _where(self, key: str) -> str:
        return f"key {self.full(key)} of jax.distributed's key-value store"

    def _manifest(self, key: str, raw: bytes) -> dict[str, Any]:
        refused = wire.Refused(f"{self._where(key)}: not a value this version writes (JSON and arrays: a pickle, or "
                               "another program's bytes); refused, nothing in it was run")
        if len(raw) > _MANIFEST_MAX + 2 * INLINE_BYTES:
            raise refused
        try:
            m = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise refused from None
        if type(m) is not dict or m.get("g2rl") != 1:
            raise refused
        if set(m) == {"g2rl", "inline"} and type(m["inline"]) is str:
            return m
        ints = ("bytes", "chunk", "chunks", "crc32")
        if (set(m) != {"g2rl", "nonce", *ints} or type(m["nonce"]) is not str or not m["nonce"].isalnum()
                or any(type(m[k]) is not int or m[k] < 0 for k in ints)
                or m["chunk"] < 1 or m["chunks"] != math.ceil(m["bytes"] / m["chunk"])):
            raise refused
        return m

    def _wait_manifest(self, key: str, deadline: float, ended) -> bytes:
        full = self.full(key)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Late(f"{self._where(key)}: nothing arrived (no process set it) within the bound")
            try:
                return self._call(key, self.kv.blocking_key_value_get_bytes, full, _ms(min(self.poll_s, left)),
                                  waits=True)
            except _NotYet:
                pass
            reason = ended() if ended is not None else None
            if reason is not None:
                raw = self._try(key, full)
                if raw is None:  # not set before the writer ended
                    raise Ended(reason)
                return raw

    def _try(self, key: str, full: str) -> bytes | None:
        try:
            return self._call(key, self.kv.key_value_try_get_bytes, full)
        except _Missing:
            return None

    def _payload(self, key: str, manifest: dict[str, Any], deadline: float) -> bytes:
        """The value's bytes: inline, or every chunk, each fetched once with all the time left (see the module
        docstring); the chunks received are kept for the next get of the key if the bound passes."""
        if "inline" in manifest:
            try:
                return base64.b64decode(manifest["inline"], validate=True)
            except ValueError:
                raise wire.Refused(f"{self._where(key)}: its inline value is not base64; refused") from None
        full, nonce, count = self.full(key), manifest["nonce"], manifest["chunks"]
        with self._lock:
            held, parts = self._partial.get(full, (nonce, {}))
            parts = parts if held == nonce else {}
            self._partial[full] = (nonce, parts)
        for i in range(count):
            while i not in parts:
                left = deadline - time.monotonic()
                if left <= 0:
                    got = sum(len(p) for p in parts.values())
                    raise Late(f"{self._where(key)}: {len(parts)} of its {count} chunks ({got / 1e6:.1f} of "
                               f"{manifest['bytes'] / 1e6:.1f} MB) arrived within the bound; the next get of it "
                               "fetches only the rest")
                wait = min(left, CHUNK_WAIT_S)
                try:
                    raw = self._call(key, self.kv.blocking_key_value_get_bytes, f"{full}/.chunk/{nonce}/{i}",
                                     _ms(wait), waits=True)
                except _NotYet:  # cut off by the bound (the loop says so), or absent though its manifest is there
                    if wait == CHUNK_WAIT_S:
                        raise Late(f"{self._where(key)}: chunk {i} of {count} is not in the store "
                                   f"{CHUNK_WAIT_S:g} s after its manifest (deleted, or a manifest planted)") from None
                    continue
                self.chunks_fetched += 1
                size = min(manifest["chunk"], manifest["bytes"] - i * manifest["chunk"])
                parts[i] = _unpack(raw, size, self._where(key))
        payload = b"".join(parts[i] for i in range(count))
        with self._lock:
            self._partial.pop(full, None)
        if len(payload) != manifest["bytes"] or zlib.crc32(payload) != manifest["crc32"]:
            raise wire.Refused(f"{self._where(key)}: its chunks do not add up to the value its manifest describes; "
                               "refused, nothing in it was run")
        return payload

    def get(self, key: str, *, timeout_s: float, kinds=(), schema=Any, ended=None):
        """The value of `key` once a process has set it, checked against `schema` (control/wire.py), within
        `timeout_s` seconds in all (math.inf: no bound). `ended()`, asked between polls, returns None while the
        writer may still set the key, else a reason: the get then raises Ended(reason), unless the key was set
        before. Late, Ended, StoreGone or wire.Refused otherwise."""
        deadline = time.monotonic() + timeout_s
        manifest = self._manifest(key, self._wait_manifest(key, deadline, ended))
        return wire.decode(self._payload(key, manifest, deadline), kinds, schema, self._where(key))

    def look(self, key: str, *, kinds=(), schema=Any, timeout_s: float = CHUNK_WAIT_S):
        """The value of `key` (checked as `get` checks it), None while nobody has set it."""
        raw = self._try(key, self.full(key))
        if raw is None:
            return None
        manifest = self._manifest(key, raw)
        return wire.decode(self._payload(key, manifest, time.monotonic() + timeout_s), kinds, schema,
                           self._where(key))


_default: Channel | None = None


def default() -> Channel:
    """This process's channel over jax.distributed's client (one per process: the chunks a get received are kept
    in it)."""
    global _default
    if _default is None:
        _default = Channel()
    return _default
