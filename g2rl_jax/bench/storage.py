"""`python -m g2rl_jax.bench storage`: what keeping a run in a bucket costs, against local disk, side by side in one
run.

The bucket is a fake-gcs-server on loopback (g2rl_jax/bench/gcs_emulator.py, the test extra), or a real one with
`--url gs://BUCKET/DIR` (credentials needed). Demo size by default (the demo policy's architecture, random weights):
  checkpoint  Checkpointer.save (to the end of the asynchronous write) and restore_newest of the training state
              (trainable params, AdamW moments, step, RNG key), median of --repeats, each to a fresh directory;
  metrics     MetricsWriter.write of one step's record (--scalars numbers, jsonl + TensorBoard) over --steps steps:
              per-step mean, and the last --tail steps' mean (a growing file must not cost more per step);
  first step  `python -m g2rl_jax.train` for one step (no validation) with model.path a local directory and the same
              directory in the bucket, fresh processes, alternating --first-repeats times: seconds from the launch to
              the first step's metrics record, and the copy to the local cache alone (storage.local_copy).
The emulator is on this machine, so its figures are the storage layer's own cost (requests, copies, composes)
without a network's latency; docs/performance.md says what a real bucket adds.
"""
from __future__ import annotations

import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from g2rl_jax import cli, storage

ROOT = str(Path(__file__).resolve().parents[2])


def parse_args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a real bucket directory to measure (default: a fake-gcs-server on loopback)")
    p.add_argument("--hidden", type=int, help="model width (default: the demo policy's)")
    p.add_argument("--layers", type=int, help="model layers (default: the demo policy's)")
    p.add_argument("--repeats", type=int, default=5, help="checkpoint saves and restores per target")
    p.add_argument("--steps", type=int, default=200, help="metrics records per target")
    p.add_argument("--tail", type=int, default=20, help="the last steps whose mean is shown separately")
    p.add_argument("--scalars", type=int, default=40, help="numbers per metrics record (a demo step writes ~40)")
    p.add_argument("--first-repeats", type=int, default=1, help="trainer launches per model location (0: skip)")
    return p.parse_args(argv)


def _model_dir(out: str, hidden: int | None, layers: int | None) -> str:
    """A random Qwen3 of the demo policy's architecture (or the given width and depth) with the demo tokenizer."""
    import dataclasses

    from flax import nnx

    from g2rl_jax.demo.tokenizer import make_tokenizer
    from g2rl_jax.model import Qwen3, RuntimeConfig, save_pretrained
    from g2rl_jax.plan import demo_architecture

    cfg = demo_architecture()
    if hidden or layers:
        cfg = dataclasses.replace(cfg, hidden_size=hidden or cfg.hidden_size,
                                  num_hidden_layers=layers or cfg.num_hidden_layers)
    save_pretrained(Qwen3(cfg, RuntimeConfig(), rngs=nnx.Rngs(0)), out)
    make_tokenizer().save_pretrained(out)
    return out


def _state(model_dir: str):
    """The training state a checkpoint holds (trainer.state()): params, AdamW moments, step, RNG key data."""
    import jax
    import optax
    from flax import nnx

    from g2rl_jax.model import load_pretrained

    params = nnx.state(load_pretrained(model_dir))
    return {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jax.numpy.int32(1),
            "rng": jax.random.key_data(jax.random.key(0))}


class _Iterator:
    def get_state(self):
        return {"position": 1}

    def set_state(self, state):
        pass


def _checkpoint(root: str, state, repeats: int) -> tuple[float, float, int]:
    """(median save s, median restore s, bytes per checkpoint)."""
    import jax

    from g2rl_jax.train.checkpoint import Checkpointer

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    saves, restores = [], []
    for i in range(repeats):
        ckpt = Checkpointer(f"{root}/ckpt{i}", every=1, keep=1)
        t0 = time.perf_counter()
        ckpt.save(1, state, _Iterator(), force=True)
        ckpt.wait()
        saves.append(time.perf_counter() - t0)
        ckpt.close()
        reader = Checkpointer(f"{root}/ckpt{i}", every=1, keep=1)
        t0 = time.perf_counter()
        step, restored = reader.restore_newest(abstract, _Iterator())
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - t0)
        assert step == 1
        reader.close()
    size = sum(int(leaf.size * leaf.dtype.itemsize) for leaf in jax.tree.leaves(state))
    return statistics.median(saves), statistics.median(restores), size


def _metrics(root: str, steps: int, tail: int, scalars: int) -> tuple[float, float]:
    """(mean s per write over all steps, mean over the last `tail`)."""
    from g2rl_jax.train.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(root, start_step=0, loggers=("jsonl", "tensorboard"))
    rng = np.random.default_rng(0)
    times = []
    for step in range(1, steps + 1):
        record = {f"metric_{k}": float(v) for k, v in enumerate(rng.standard_normal(scalars))}
        t0 = time.perf_counter()
        writer.write(step, record)
        times.append(time.perf_counter() - t0)
    writer.close()
    assert len(read_metrics(root)) == steps
    return float(np.mean(times)), float(np.mean(times[-tail:]))


def _first_step(model_path: str, out: str, env: dict) -> float:
    """Seconds from launching a one-step trainer to its step-1 metrics record."""
    from g2rl_jax.train.metrics import read_metrics

    cmd = [sys.executable, "-m", "g2rl_jax.train", "--config", f"{ROOT}/configs/demo.yaml",
           f"model.path={model_path}", f"run.output_dir={out}", "run.total_steps=2", "run.eval_every=0",
           "run.checkpoint_every=1000", "run.compilation_cache_dir="]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not read_metrics(out):
            if proc.poll() is not None:
                raise RuntimeError(f"the trainer ended before its first step: {proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from g2rl_jax.bench.gcs_emulator import GcsEmulator

            url = stack.enter_context(GcsEmulator(bucket="g2rl-bench")).url(f"bench-{os.getpid()}")
        local = stack.enter_context(tempfile.TemporaryDirectory(prefix="g2rl_bench_storage_"))
        where = {"local disk": f"{local}/run", "bucket": f"{url.rstrip('/')}/run"}
        model_dir = _model_dir(f"{local}/model", args.hidden, args.layers)
        state = _state(model_dir)
        rows = {}
        for name, root in where.items():
            save, restore, size = _checkpoint(f"{root}/checkpoints", state, args.repeats)
            per_step, tail = _metrics(f"{root}/metrics", args.steps, args.tail, args.scalars)
            rows[name] = (save, restore, per_step, tail)
        print(f"checkpoint: {size / 1e6:.2f} MB of state; metrics: {args.scalars} numbers a step, jsonl + tensorboard")
        print("| where | checkpoint save s | checkpoint restore s | metrics ms/step (all) | metrics ms/step "
              f"(last {args.tail}) |")
        print("|---|---|---|---|---|")
        for name, (save, restore, per_step, tail) in rows.items():
            print(f"| {name} | {save:.3f} | {restore:.3f} | {1e3 * per_step:.2f} | {1e3 * tail:.2f} |")
        if args.first_repeats:
            bucket_model = f"{url.rstrip('/')}/model"
            storage.upload_tree(model_dir, bucket_model)
            env = dict(os.environ, **{storage.CACHE_ENV: f"{local}/cache"})
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):  # the copy's one-line notice
                storage.local_copy(bucket_model, "model.path")
            copy = time.perf_counter() - t0
            storage.rmtree(f"{local}/cache")
            firsts = {"local disk": [], "bucket": []}
            for i in range(args.first_repeats):
                for name, path in (("local disk", model_dir), ("bucket", bucket_model)):
                    storage.rmtree(f"{local}/cache")  # every launch copies the model again
                    firsts[name].append(_first_step(path, f"{local}/first{i}_{name.split()[0]}", env))
            print(f"\ntime to the first step (launch -> step-1 record, compile included; {args.first_repeats} "
                  "launches each, alternating):")
            print("| model.path | seconds (median) | of which the copy to the local cache |")
            print("|---|---|---|")
            print(f"| local directory | {statistics.median(firsts['local disk']):.1f} | - |")
            print(f"| {bucket_model} | {statistics.median(firsts['bucket']):.1f} | {copy:.3f} (measured alone) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
