"""One of the two jax.distributed processes of tests/test_channel.py (CPU, gloo, loopback). Process 1 writes, as a
rollout process does; process 0, which holds the store, reads, as the trainer does. Each check prints `ok NAME`.

    python tests/channel_worker.py COORDINATOR PROCESS_ID channel|refuse|sigterm MARKER

`channel`: a value of a few MB in 256 KB chunks arrives whole through gets that poll every millisecond (a get of
the whole value in such polls never arrives: it needs longer than one); a get whose bound passes while a chunk is
missing says which chunks arrived, and the next get fetches only the rest; an unset key's bound, the `ended` hook,
and the trainer's finish (control/stop.py) ending a get that waits on it with the trainer's code.
`refuse`: process 1 plants pickles in the store (one whole, one as a chunk behind a well-formed manifest), whose
unpickling would create MARKER; process 0's reads refuse each in one line, and its read of the sides' start stops
both processes with that line and exit code 2.
`sigterm`: both run the training loop's frame (lifecycle.StopSignal, a step in progress, collectives that need both)
and print `running`; the test sends SIGTERM to process 1, which abandons its untimed step: the stop path ends process
0 too, with the abandon's line and exit code 143.
"""
import json
import pickle
import sys
import time

import numpy as np

from g2rl_jax import parallel
from g2rl_jax.config import DistributedConfig
from g2rl_jax.control import channel, stop, wire

coordinator, me, mode, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
parallel.initialize_distributed(DistributedConfig(coordinator_address=coordinator, num_processes=2, process_id=me))
CHUNK = 256 << 10
ch = channel.Channel(chunk_bytes=CHUNK, poll_s=0.001)
kv = channel.client()
WRITER, READER = 1, 0


class Planted:
    """What an attacker writes: unpickling it creates the marker file."""

    def __reduce__(self):
        return (open, (marker, "w"))


def value():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 151_000, (64, 4096)).astype(np.int32)
    ids[:, 3000:] = 0
    return {"ids_BxT": ids, "logp": rng.standard_normal(2 ** 19).astype(np.float32),  # 2 MB of floats, incompressible
            "rows": [list(range(i, i + 100)) for i in range(200)], "texts": [f"row {i}" * 50 for i in range(200)],
            "version": np.int64(7), "pair": (1, 2.5), "by_step": {3: "three"}}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def chunk_keys(key: str) -> tuple[str, list[str]]:
    manifest = json.loads(kv.key_value_try_get_bytes(ch.full(key)))
    return manifest, [f"{ch.full(key)}/.chunk/{manifest['nonce']}/{i}" for i in range(manifest["chunks"])]


def ok(name: str) -> None:
    print(f"ok {name}", flush=True)


def channel_checks() -> None:
    if me == WRITER:
        ch.put("big", value())
        ch.put("held", value())
        manifest, keys = chunk_keys("held")
        kept = kv.key_value_try_get_bytes(keys[5])
        kv.key_value_delete(keys[5])  # chunk 5 is missing while the reader's first get runs
        ch.put("held/ready", True)
        ch.get("held/first-get-done", timeout_s=120)
        kv.key_value_set_bytes(keys[5], kept)
        ch.put("held/restored", True)
        ch.get("done", timeout_s=120)
        stop.finish(3, 2)
        ch.get("finish/seen", timeout_s=120)
        return
    with stop.Watch():
        # a value that needs longer than one poll (1 ms) arrives, each chunk fetched once
        t0 = time.monotonic()
        got = ch.get("big", timeout_s=120)
        seconds = time.monotonic() - t0
        manifest, keys = chunk_keys("big")
        assert same(got, value()), "the value that arrived differs from the value sent"
        assert manifest["chunks"] >= 10 and ch.chunks_fetched == manifest["chunks"], (manifest, ch.chunks_fetched)
        ok(f"chunked: {manifest['bytes']} bytes in {manifest['chunks']} chunks, {seconds:.3f} s, 1 ms polls")
        # the bound passes while chunk 5 is missing: the error says what arrived; the next get fetches the rest only
        ch.get("held/ready", timeout_s=120)
        before = ch.chunks_fetched
        try:
            ch.get("held", timeout_s=1.0)
            raise AssertionError("a get with a missing chunk returned")
        except channel.Late as err:
            manifest, _ = chunk_keys("held")
            assert f"key g2rl/held of jax.distributed's key-value store: 5 of its {manifest['chunks']} chunks" in \
                str(err), err
            assert ch.chunks_fetched - before == 5, ch.chunks_fetched - before
            ok(f"bound: {err}")
        ch.put("held/first-get-done", True)
        ch.get("held/restored", timeout_s=120)
        assert same(ch.get("held", timeout_s=120), value())
        assert ch.chunks_fetched - before == manifest["chunks"], (ch.chunks_fetched - before, manifest["chunks"])
        ok("resumed: the second get fetched only the chunks the first had not")
        # an unset key: the bound, then the ended hook (asked between polls), then a key set before the end
        t0 = time.monotonic()
        try:
            ch.get("never", timeout_s=0.3)
        except channel.Late as err:
            assert "key g2rl/never" in str(err) and "nothing arrived" in str(err), err
            assert time.monotonic() - t0 >= 0.3
            ok("late: an unset key's get ends at its bound")
        asked = []
        try:
            ch.get("never", timeout_s=60, ended=lambda: asked.append(1) or ("gone" if len(asked) >= 5 else None))
        except channel.Ended as err:
            assert err.reason == "gone" and len(asked) == 5, asked
            ok("ended: the hook asked between polls")
        ch.put("set-before", [1, 2])
        assert ch.get("set-before", timeout_s=60, ended=lambda: "gone") == [1, 2]
        ok("ended: a key set before the end is taken")
        assert ch.look("never") is None and ch.look("set-before") == [1, 2]
        ch.delete("big")
        assert ch.look("big") is None and not kv.key_value_dir_get_bytes(ch.full("big"))
        ok("delete: the value and its chunks")
        # the trainer's finish ends a get that waits on it (stop.ended), with the trainer's code and step
        ch.put("done", True)
        try:
            ch.get("version/9", timeout_s=120, ended=stop.ended)
        except channel.Ended as err:
            assert err.reason.code == 2 and err.reason.step == 3 and not err.reason.now, err.reason
            ok("finish: the waiting get ends with the trainer's code")
        ch.put("finish/seen", True)


def refuse_checks() -> None:
    if me == WRITER:
        kv.key_value_set_bytes(ch.full("planted/whole"), pickle.dumps(Planted()))
        manifest = {"g2rl": 1, "bytes": 10, "chunk": CHUNK, "chunks": 1, "nonce": "abc", "crc32": 0}
        kv.key_value_set_bytes(ch.full("planted/chunk") + "/.chunk/abc/0", b"r" + pickle.dumps(Planted()))
        kv.key_value_set_bytes(ch.full("planted/chunk"), json.dumps(manifest).encode())
        kv.key_value_set_bytes(ch.full("sides/start"), pickle.dumps(Planted()))
        ch.put("planted", True)
        with stop.Watch():  # the reader's stop ends this process too, with its line and code
            time.sleep(120)
        raise AssertionError("the writer was not stopped")
    ch.get("planted", timeout_s=120)
    for key in ("planted/whole", "planted/chunk"):
        try:
            ch.get(key, timeout_s=60)
            raise AssertionError(f"{key} was not refused")
        except wire.Refused as err:
            assert str(err).startswith(f"key g2rl/{key} of jax.distributed's key-value store: ") and \
                "refused, nothing in it was run" in str(err) and "\n" not in str(err), err
            ok(f"refused {key}")
    from g2rl_jax.train import sides_store

    with stop.Watch():
        sides_store.get_start()  # as the rollout process reads it: stops every process, exit 2
    raise AssertionError("the planted start did not stop the run")


def sigterm_checks() -> None:
    from jax.experimental import multihost_utils

    from g2rl_jax.train.lifecycle import StopSignal

    with StopSignal(grace=5.0) as signal_stop:
        multihost_utils.sync_global_devices("started")
        print("running", flush=True)
        signal_stop.begin_step()  # a step in progress, none timed yet: SIGTERM abandons it at once
        while True:  # the step's collectives need both processes
            multihost_utils.sync_global_devices("step")
            time.sleep(0.05)


{"channel": channel_checks, "refuse": refuse_checks, "sigterm": sigterm_checks}[mode]()
