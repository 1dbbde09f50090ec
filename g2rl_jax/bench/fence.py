"""What the fence costs tensorstore: `python -m g2rl_jax.bench fence`.

tensorstore (Orbax's array writer) reaches the store through a loopback forwarder once a run directory on an object
store is armed (control/fence_proxy.py), so that a process frozen past its lease sends nothing after its thaw. This
measures that hop side by side, alternating, in one run: MB/s of tensorstore's writes and reads of large values, and
an Orbax checkpoint save, straight to the endpoint against through a Forwarder whose fence holds a real lease (the
check each MiB makes is the one a run makes). Default target: a fake-gcs-server on loopback, which is itself the
slower end; --url measures a real bucket directory (the forwarder then speaks TLS to it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench fence", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a real bucket directory (default: a fake-gcs-server on loopback)")
    p.add_argument("--mb", type=int, default=256, help="MB written (and read) per repeat")
    p.add_argument("--value-mb", type=int, default=16, help="MB per tensorstore value")
    p.add_argument("--repeats", type=int, default=3, help="repeats per path, alternating")
    return p.parse_args(argv)


@contextlib.contextmanager
def _endpoint(url: str):
    """tensorstore's endpoint while inside: `url`."""
    from g2rl_jax.control.fence_proxy import TS_URL_ENV

    before = os.environ.get(TS_URL_ENV)
    os.environ[TS_URL_ENV] = url
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TS_URL_ENV, None)
        else:
            os.environ[TS_URL_ENV] = before


def _kvstore(root: str):
    import tensorstore as ts

    bucket, path = root.split("://", 1)[1].split("/", 1)
    return ts.KvStore.open({"driver": "gcs", "bucket": bucket, "path": path.rstrip("/") + "/"}).result()


def _values(root: str, mb: int, value_mb: int) -> tuple[float, float]:
    """(write MB/s, read MB/s) of mb MB in values of value_mb MB, all in flight at once as Orbax's writes are."""
    kv, value, n = _kvstore(root), os.urandom(value_mb << 20), max(mb // value_mb, 1)
    t0 = time.perf_counter()
    for future in [kv.write(f"v{i}", value) for i in range(n)]:
        future.result()
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for future in [kv.read(f"v{i}") for i in range(n)]:
        assert len(future.result().value) == len(value)
    read = time.perf_counter() - t0
    return n * value_mb / write, n * value_mb / read


def _save(root: str, state) -> float:
    from g2rl_jax.bench.storage import _Iterator
    from g2rl_jax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(root, every=1, keep=1)
    t0 = time.perf_counter()
    ckpt.save(1, state, _Iterator(), force=True)
    ckpt.wait()
    ckpt.close()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    import jax
    import numpy as np

    from g2rl_jax.control import fence_proxy
    from g2rl_jax.control.runlock import RunLock

    args = parse_args(sys.argv[1:] if argv is None else argv)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from g2rl_jax.bench.gcs_emulator import GcsEmulator

            # no proxy of the emulator's own in the way (the strict one is Python: it would be the slower end)
            url = stack.enter_context(GcsEmulator(bucket="g2rl-bench", proxy=None)).url(f"fence-{os.getpid()}")
        url = url.rstrip("/")
        lock = RunLock(f"{url}/held", 60.0)
        lock.acquire()  # arms the fence, which starts the forwarder: each forwarded MiB checks a held lease
        stack.callback(lock.release)
        state = {"w": jax.numpy.asarray(np.random.default_rng(0).standard_normal((args.mb << 18,), np.float32))}
        paths = {"straight to the endpoint": os.environ[fence_proxy.UPSTREAM_ENV] or fence_proxy.GCS,
                 "through the fence's forwarder": fence_proxy.start()}
        got: dict[str, list] = {name: [] for name in paths}
        for i in range(args.repeats):
            for name, endpoint in paths.items():
                with _endpoint(endpoint):
                    root = f"{url}/held/{name.split()[0]}{i}"
                    got[name].append((*_values(f"{root}/values", args.mb, args.value_mb),
                                      _save(f"{root}/checkpoints", state)))
        print(f"tensorstore through the fence: {args.mb} MB per repeat in {args.value_mb} MB values, and an Orbax "
              f"save of a {args.mb} MB state; median of {args.repeats}, alternating; against {url}")
        print("| path | write MB/s | read MB/s | checkpoint save s |")
        print("|---|---|---|---|")
        for name, rows in got.items():
            write, read, save = (statistics.median(col) for col in zip(*rows))
            print(f"| {name} | {write:.0f} | {read:.0f} | {save:.2f} |")
        print(f"requests the fence refused: {fence_proxy.refused()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
