"""Measured shape tuning: price a run's layouts on this machine and write a shape file to pin.

    python -m g2rl_jax.bench tune-shapes --config configs/demo.yaml --out shapes.json [key=value ...]
    python -m g2rl_jax.train --config configs/demo.yaml run.shapes_file=shapes.json

A run takes its layout from a price model (g2rl_jax/shapes/choice.py), the same on every machine of a device kind.
This
command is the one place wall-clock enters the choice, and only when asked: it builds the run's trainer (model, data,
mesh), compiles the largest grouped score program (and the reference's, under the KL term) at the step's real
shapes, times its compile and its median of --repeats runs, prices the candidates, grouped and packed, from those
figures (shapes.prices.Prices.from_score: per micro_cost unit, the same for both) and writes the chosen layout and
prompt buckets as a shape file (the format of the run directory's micro_shapes.json, with "source": "tuned"). A run
with run.shapes_file set uses that file's layout (and says so in one line); its resumes keep it. The measurement
moves with the machine's load: tune on the machine you train on, idle.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench tune-shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--out", required=True, help="the shape file to write (set run.shapes_file to it)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of the measured program (the median is used)")
    p.add_argument("overrides", nargs="*", help="config key=value overrides, as the run will have them")
    return p.parse_args(argv)


def measure(trainer, repeats: int):
    """(compile seconds, run seconds) by kind of the largest score (and reference) program of the trainer's first
    step, and the batch it ran on (zeros of the step's shape)."""
    import functools

    import jax
    import numpy as np

    from g2rl_jax.compile_pool import compile_all
    from g2rl_jax.rollout.batching import new_tokens_bucket
    from g2rl_jax.train import step as train_step
    from g2rl_jax.train.setup import shard_rows

    cfg = trainer.cfg
    rows, m = cfg.data.prompts_per_step * cfg.rollout.num_samples, cfg.rollout.num_samples
    prompt_len, resp_len = max(trainer.warmup.shares), new_tokens_bucket(cfg.rollout.max_new_tokens)
    zeros = lambda width: np.zeros((rows, width), np.int32)  # noqa: E731
    batch = shard_rows(train_step.build_batch(zeros(prompt_len), zeros(prompt_len) + 1, zeros(resp_len) + 1,
                                              zeros(resp_len) + 1, np.zeros(rows, np.float32), np.zeros(rows, bool),
                                              m), trainer.mesh)
    micro = cfg.algorithm.micro_batch_size
    rows_X = np.arange(micro, dtype=np.int32)
    outs = train_step.score_outs(batch, train_step.hidden_size(trainer.graphdef, trainer.params))
    kinds = {"score": (train_step.score_micro, trainer.graphdef, trainer.params, outs)}
    if cfg.algorithm.kl_coef > 0:
        kinds["reference"] = (train_step.ref_micro, *trainer._reference(),
                              train_step.zeros_rows(batch.rewards, batch.response_mask.shape))
    static = dict(temperature=trainer.settings.temperature, chunk=train_step.g2rl.DEFAULT_CHUNK, width=resp_len)
    timings = compile_all([functools.partial(fn.lower, gd, p, batch, rows_X, o, **static)
                           for fn, gd, p, o in kinds.values()], 1)
    compile_s, run_s = {}, {}
    for (kind, (fn, gd, p, o)), t in zip(kinds.items(), timings):
        if t.error is not None:
            raise t.error
        compile_s[kind] = t.lower_s + t.compile_s
        o = jax.block_until_ready(fn(gd, p, batch, rows_X, o, **static))  # the first call loads the executable
        times = []
        for _ in range(max(repeats, 1)):
            start = time.perf_counter()
            o = jax.block_until_ready(fn(gd, p, batch, rows_X, o, **static))  # its outputs donated: fed back
            times.append(time.perf_counter() - start)
        run_s[kind] = statistics.median(times)
    return compile_s, run_s, batch


def main(argv) -> int:
    from g2rl_jax import storage
    from g2rl_jax.config import ConfigError, load_config
    from g2rl_jax.shapes import choice as choice_lib
    from g2rl_jax.shapes import record
    from g2rl_jax.shapes.layouts import micro_cost
    from g2rl_jax.shapes.prices import Prices
    from g2rl_jax.train import micro as micro_lib
    from g2rl_jax.train.loop import Trainer

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cfg = load_config(args.config, [*args.overrides, f"run.output_dir={tmp}/run", "run.shapes_file="])
        except ConfigError as err:
            print(f"tune-shapes: {err}", file=sys.stderr)
            return 2
        trainer = Trainer(cfg)
        try:
            compile_s, run_s, batch = measure(trainer, args.repeats)
        finally:
            trainer.close()
    micro = cfg.algorithm.micro_batch_size
    seq_len, resp_len = batch.input_ids.shape[1], batch.response_mask.shape[1]
    prices = Prices.from_score(compile_s, run_s, micro_cost(micro, seq_len), cfg.model.remat != "none")
    min_rows = micro_lib.row_shards(batch.rewards)
    warm = trainer.warmup
    choice = choice_lib.choose_for(cfg, trainer.model.config, warm.device, warm.lengths, step=warm.step, prices=prices)
    key = record.choice_key(micro, min_rows, resp_len, warm.shares)
    storage.write_text(args.out, record.choice_record(key, choice.layout, choice.prompts, "tuned"))
    print(f"measured: the score program of {micro} x {seq_len} compiles in {compile_s['score']:.1f} s and runs in "
          f"{run_s['score']:.3f} s (median of {args.repeats})")
    print("\n".join(choice.lines(cfg.run.total_steps)))
    print(f"wrote {args.out}: {choice.layout.name} ({len(choice.layout.shapes)} shapes), prompt buckets "
          f"{list(choice.prompts)}; pin it with run.shapes_file={args.out}")
    return 0
