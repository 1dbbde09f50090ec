"""One process per side: the weight sync from a training mesh to a rollout mesh held by other processes, measured.

    python -m g2rl_jax.bench async_sides [--processes 2] [--rollout-processes 1] [--devices 1] [--model demo]
        [--dtype float32] [--pushes 5] [--pin]

launches that many processes on localhost, joined by jax.distributed (CPU, gloo collectives, JAX's socket
transfers across hosts), each with `--devices` fake CPU devices. The last `--rollout-processes` processes hold
the rollout mesh (parallel.side_meshes), the others the training mesh; `--pin` pins process i to core i. The
training side builds a random Qwen3 (`--model`: the demo's architecture, `tiny`, or a preset such as
qwen3-0.6b), then `--pushes` times changes its params (one jitted step on the training mesh) and pushes them
(train/weight_sync.SideSync); after each push every rollout process computes the logits of a fixed batch on its
mesh with the params it received, and checks them against the training side's, sent through the run's key-value
channel (control/channel.py). It prints one JSON line: bytes per push, seconds per push (on the rollout side, from
both sides meeting to the arrival), and the largest logit difference.

Each process runs `python -m g2rl_jax.bench.async_sides --worker I PORT ...` (tests/test_async_sides.py uses it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

BATCH = (4, 16)  # rows, tokens of the checked forward pass
WAIT_MS = 3_600_000  # a hang guard only


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench async_sides", description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--rollout-processes", type=int, default=1)
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices per process")
    p.add_argument("--rollout-tensor", type=int, default=1, help="mesh.rollout_tensor of the rollout mesh")
    p.add_argument("--model", default="demo", help="demo (the demo's architecture), tiny, or a preset name")
    p.add_argument("--dtype", default="float32", help="the params' dtype (model.param_dtype)")
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--pin", action="store_true", help="pin process i to CPU core i (os.sched_setaffinity)")
    p.add_argument("--worker", type=int, nargs=2, metavar=("PROCESS_ID", "PORT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _qwen3_config(name: str):
    from g2rl_jax.model.config import PRESETS

    if name == "demo":
        from g2rl_jax.demo.build import PolicySpec

        return PolicySpec().qwen3_config(tokenizer_size=1000)
    return PRESETS[name]


def worker(a) -> None:
    process_id, port = a.worker
    if a.pin:
        os.sched_setaffinity(0, {process_id % os.cpu_count()})
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax._src import distributed

    from g2rl_jax import parallel
    from g2rl_jax.config import DistributedConfig, MeshConfig
    from g2rl_jax.control import channel
    from g2rl_jax.model import Qwen3
    from g2rl_jax.model.config import RuntimeConfig
    from g2rl_jax.train.weight_sync import SideSync, enable_cross_host_transfers, shardings_on

    enable_cross_host_transfers(f"127.0.0.1:{port + 1 + process_id}")  # before the backend starts
    parallel.initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}",
                                                      num_processes=a.processes, process_id=process_id))
    client = distributed.global_state.client
    config = MeshConfig(data=1, fsdp=-1, tensor=1, rollout_tensor=a.rollout_tensor)
    train_mesh, rollout_mesh = parallel.side_meshes(config, a.rollout_processes)
    training = process_id in {d.process_index for d in train_mesh.devices.flat}
    cfg = _qwen3_config(a.model)
    rt = RuntimeConfig(param_dtype=a.dtype, compute_dtype="float32", remat="none", attention="xla")
    mesh = train_mesh if training else rollout_mesh
    make = lambda: Qwen3(cfg, rt, rngs=nnx.Rngs(0), mesh=mesh)  # noqa: E731
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    rollout_shardings = shardings_on(abstract, rollout_mesh)
    sync = SideSync(train_mesh, rollout_shardings)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, BATCH).astype(np.int32)
    forward = nnx.jit(lambda model, x: model(x))

    if training:
        shardings = parallel.state_shardings(abstract, train_mesh)
        params = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
        step = jax.jit(lambda p, v: jax.tree.map(lambda x: x * 0.9 + 0.01 * v, p), donate_argnums=0)
    figures = []
    for v in range(a.pushes):
        if training:
            params = step(params, jnp.float32(v))
            logits = parallel.gather(forward(nnx.merge(graphdef, params), parallel.global_rows(train_mesh, ids[
                parallel.process_rows(train_mesh, BATCH[0])], BATCH[0])))
            if process_id == 0:
                channel.default().put(f"bench/logits/{v}", np.asarray(logits))
        client.wait_at_barrier(f"sides/push/{v}", WAIT_MS)  # both sides meet: the push's seconds start here
        received = sync.push(params if training else abstract)
        if not training:
            x = jax.device_put(ids, parallel.batch_sharding(rollout_mesh))
            got = forward(nnx.merge(graphdef, received), x)
            want = channel.default().get(f"bench/logits/{v}", schema=np.ndarray, timeout_s=WAIT_MS / 1000)
            diff = max(float(np.max(np.abs(np.asarray(s.data) - want[s.index]))) for s in got.addressable_shards)
            figures.append((sync.seconds, diff))
    client.wait_at_barrier("sides/done", WAIT_MS)
    if not training:
        seconds = [s for s, _ in figures[1:]] or [figures[0][0]]  # the first push compiles the rollout side's copy
        print(json.dumps({"process": process_id, "bytes_per_push": sync.bytes, "pushes": a.pushes,
                          "seconds_per_push": float(np.mean(seconds)), "seconds_first_push": figures[0][0],
                          "max_logit_diff": max(d for _, d in figures)}), flush=True)


def launch(a, timeout: float = 600.0) -> list[dict]:
    """Run the processes; the rollout processes' JSON lines."""
    from g2rl_jax import localhost

    args = ["--processes", str(a.processes), "--rollout-processes", str(a.rollout_processes), "--devices",
            str(a.devices), "--rollout-tensor", str(a.rollout_tensor), "--model", a.model, "--pushes", str(a.pushes),
            "--dtype", a.dtype]
    args += ["--pin"] if a.pin else []
    ran = localhost.run(lambda i, port: [sys.executable, "-m", "g2rl_jax.bench.async_sides", *args, "--worker", str(i),
                                         str(port)], timeout=timeout, processes=a.processes, devices=a.devices)
    failed = [f"process {i} {'hung' if code is None else f'exited {code}'}:\n{log[-3000:]}"
              for i, (code, log) in enumerate(ran) if code != 0]
    if failed:
        raise RuntimeError("\n".join(failed))
    return [json.loads(line) for _, log in ran for line in log.splitlines() if line.startswith('{"process"')]


def main(argv=None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.worker is not None:
        worker(a)
        return
    t0 = time.perf_counter()
    for row in launch(a):
        print(json.dumps(row | {"model": a.model, "wall_seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
