"""The key-value channel (control/channel.py) between two processes, measured: a large value put by one process and
got by the other through jax.distributed's key-value store.

    python -m g2rl_jax.bench channel [--mb 200] [--content samples] [--chunk-mb 4] [--repeats 3] [--writer 1]
        [--no-pack] [--pin]

launches two processes on localhost joined by jax.distributed (CPU, gloo). The writer (`--writer`, default process
1: the rollout process, whose samples the trainer's process 0 reads; process 0 holds the store) puts a value of
about `--mb` MB (`_value`: a step's samples' kind of content, or random floats) under a new key `--repeats` times;
the other process gets each, checks it equals the value sent, and deletes it. It prints one JSON line: the value's
encoded MB (control/wire.py), the put's and the get's seconds (the get timed from the moment the put ended, the
value complete in the store) and MB/s (median of the repeats), the get's seconds from the put's start (the
reader waiting, as a trainer does), and the CPU seconds of each process for one value (the writer's put; the
reader's wait and get, which include the store's own work: process 0 holds it), the figures to compare on a
machine shared with other jobs.

Each process runs `python -m g2rl_jax.bench.channel --worker I PORT ...`.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench channel", description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200.0, help="the value's size in MB")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="the channel's chunk size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--content", default="samples", choices=("samples", "random"),
                   help="a step's samples' kind of content, or random floats (what compresses least)")
    p.add_argument("--writer", type=int, default=1, choices=(0, 1), help="the process that puts")
    p.add_argument("--no-pack", action="store_true", help="send every chunk as it is (no zlib first)")
    p.add_argument("--pin", action="store_true", help="pin process i to CPU core i (os.sched_setaffinity)")
    p.add_argument("--worker", type=int, nargs=2, metavar=("PROCESS_ID", "PORT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _value(mb: float, content: str):
    """About `mb` MB: a step's samples' kind of content (`samples`: token ids of long-tailed lengths padded into
    [B, T] int32 ids, float32 log-probs and a bool mask, with each row's ids and text as lists), or random float32
    arrays of 8 MB (`random`: what compresses least)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if content == "random":
        floats = int(mb * 1e6) // 4
        step = 2 * 1024 * 1024
        return {"arrays": [rng.standard_normal(min(step, floats - i), dtype=np.float32)
                           for i in range(0, floats, step)]}
    T = 8192
    B = max(int(mb * 1e6 / (T * 9 + 2500 * 9)), 1)  # ids, log-probs, mask per position; a row's ids and text as lists
    lengths = np.minimum(rng.geometric(1 / 2500, B) + 50, T)
    ids_BxT = np.zeros((B, T), np.int32)
    logp_BxT = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        ids_BxT[b, :n] = rng.integers(0, 151_000, n)
        logp_BxT[b, :n] = -np.abs(rng.standard_normal(n, dtype=np.float32))
    return {"ids_BxT": ids_BxT, "logp_BxT": logp_BxT, "mask_BxT": np.arange(T) < lengths[:, None],
            "ids": [ids_BxT[b, :n].tolist() for b, n in enumerate(lengths)],
            "texts": ["x" * int(n) * 4 for n in lengths]}


def _equal(x, y) -> bool:
    import numpy as np

    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y, strict=True))
    return np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y


def worker(a) -> None:
    process_id, port = a.worker
    if a.pin:
        import os

        os.sched_setaffinity(0, {process_id % os.cpu_count()})
    from g2rl_jax import parallel
    from g2rl_jax.config import DistributedConfig
    from g2rl_jax.control import channel, wire

    parallel.initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                                      process_id=process_id))
    ch = channel.Channel(chunk_bytes=int(a.chunk_mb * 1e6), pack=not a.no_pack)
    value = _value(a.mb, a.content)
    size = len(wire.encode(value))
    puts, gets, waits, put_cpu, get_cpu = [], [], [], [], []
    for r in range(a.repeats):
        if process_id == a.writer:
            ch.get(f"bench/ready/{r}", timeout_s=600)  # the reader waits for the value already
            t0, c0 = time.time(), time.process_time()
            ch.put(f"bench/value/{r}", value)
            ch.put(f"bench/times/{r}", [t0, time.time(), time.process_time() - c0])
            continue
        ch.put(f"bench/ready/{r}", True)
        c0 = time.process_time()
        got = ch.get(f"bench/value/{r}", timeout_s=600)
        arrived, cpu = time.time(), time.process_time() - c0
        started, put_end, cpu_put = ch.get(f"bench/times/{r}", timeout_s=60)
        put_cpu.append(cpu_put)
        get_cpu.append(cpu)
        assert _equal(got, value)
        ch.delete(f"bench/value/{r}")
        puts.append(put_end - started)
        gets.append(max(arrived - put_end, 1e-9))
        waits.append(arrived - started)
    if process_id != a.writer:
        mb = size / 1e6
        print(json.dumps({"mb": round(mb, 1), "content": a.content, "pack": not a.no_pack, "chunk_mb": a.chunk_mb,
                          "chunks": math.ceil(size / (a.chunk_mb * 1e6)),
                          "writer": a.writer, "put_seconds": [round(x, 3) for x in puts],
                          "get_seconds": [round(x, 3) for x in gets], "from_put_start": [round(x, 3) for x in waits],
                          "put_mb_per_s": round(mb / statistics.median(puts), 1),
                          "get_mb_per_s": round(mb / statistics.median(gets), 1),
                          "end_to_end_mb_per_s": round(mb / statistics.median(waits), 1),
                          "writer_cpu_seconds": round(statistics.median(put_cpu), 2),
                          "reader_cpu_seconds": round(statistics.median(get_cpu), 2)}), flush=True)
    ch.put(f"bench/done/{process_id}", True)
    ch.get(f"bench/done/{1 - process_id}", timeout_s=600)


def main(argv) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    from g2rl_jax import localhost

    flags = [f"--mb={a.mb}", f"--content={a.content}", f"--chunk-mb={a.chunk_mb}", f"--repeats={a.repeats}",
             f"--writer={a.writer}", *(["--pin"] if a.pin else []), *(["--no-pack"] if a.no_pack else [])]
    ran = localhost.run(lambda i, port: [sys.executable, "-m", "g2rl_jax.bench.channel", "--worker", str(i),
                                         str(port), *flags], timeout=3600, processes=2, devices=1)
    for code, log in ran:
        if code != 0:
            print(log[-3000:], file=sys.stderr)
            return 1
    lines = [line for _, log in ran for line in log.splitlines() if line.startswith("{")]
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
