"""`python -m g2rl_jax.bench ladder`: what the decode ladders' first capacity and rungs trade, compile against run
time.

    python -m g2rl_jax.bench ladder --config configs/qwen3_1p7b_g2rl.yaml --preset qwen3-1.7b --target v5p-8 \\
        --first 128 --first 512 --rungs 2 --rungs 4

--rungs R: capacities grow R-fold and a compaction cuts the batch bucket to an R-th (engine.CAPACITY_GROWTH and
engine.BATCH_SHRINK, set here for the what-if only); each row also prints the rollout's programs per prompt bucket
(aot.bill.rollout_counts).

A decode segment is one compiled program per (rows, capacity), and compiling one 1.7B segment for TPU takes about
25 s whatever its shape (docs/tpu.md), so a ladder that starts higher compiles fewer segments. Each decode step
reads every slot of its capacity (masked), so it also reads more. For each --first this walks the decode loop's
segment rules (engine.decode_segments) over the response lengths of `--steps` steps of `bench update --long-tail`
(exponential, mean budget / 4, the longest at the budget) and prints the segments of the first step, the distinct
segment programs of all steps, and the decode's HBM roofline per step: each decode step reads the decode weights
(gathered over fsdp, as the compiled segment holds them) and the prefix and suffix cache at its capacity, per
chip, at the chip's HBM bandwidth. A model, not a measurement: it prices bytes only.
"""
from __future__ import annotations

import argparse

import numpy as np


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench ladder", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--preset", help="architecture preset instead of model.path/config.json")
    p.add_argument("--target", required=True, help="a TPU slice as gcloud names it (v5p-8, ...)")
    p.add_argument("--first", action="append", type=int, default=[], help="first capacity (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="steps of long-tailed lengths (default 10)")
    p.add_argument("--rungs", action="append", type=int, default=[],
                   help="ladder rung factor (repeatable; default the engine's)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from g2rl_jax import memory as mem
    from g2rl_jax.aot import parse_target
    from g2rl_jax.aot.bill import rollout_counts
    from g2rl_jax.bench.update import long_tailed_lengths
    from g2rl_jax.config import load_config
    from g2rl_jax.plan import model_config
    from g2rl_jax.rollout import batching, engine

    a = _args(argv)
    cfg = load_config(a.config, a.overrides)
    model, source = model_config(cfg, a.preset)
    target = parse_target(a.target)
    mesh = mem.resolve_mesh(cfg, target.chips)
    weights = max(mem.decode_weight_bytes(cfg, model, mesh), mem.gathered_decode_weight_bytes(cfg, model, mesh))
    _, prompts, prompt_len, _ = mem.kv_cache_bytes(cfg, model, mesh)
    per_chip = mem.shards("batch", mesh) * mem.shards("kv_heads", mesh)
    slot = model.num_hidden_layers * mem.kv_token_bytes(cfg, model) / per_chip  # one sequence position, all layers
    rows, budget = prompts * cfg.rollout.num_samples, cfg.rollout.max_new_tokens
    lengths = [long_tailed_lengths(cfg.data.prompts_per_step * cfg.rollout.num_samples, budget, i)
               for i in range(a.steps)]
    print(f"{a.config} ({source}) on {target.name}, mesh {mesh}: {rows} rows, budget {budget}; decode weights "
          f"{weights / 2**30:.2f} GiB per chip, {target.hbm_gbps:.0f} GB/s\n"
          f"| first capacity | rungs | segments, first step | distinct segments, {a.steps} steps | rollout programs "
          f"per prompt bucket | decode roofline s per step |\n|{'---|' * 6}")
    shards = mem.shards("batch", mesh)
    for rungs in a.rungs or [engine.CAPACITY_GROWTH]:
        engine.CAPACITY_GROWTH = engine.BATCH_SHRINK = rungs
        for first in a.first or [engine.FIRST_CAPACITY]:
            schedules = [engine.decode_segments(n, rows, budget, shards, first) for n in lengths]
            seconds = [sum(steps * (weights + (prompts * prompt_len + r * c) * slot) for r, c, steps in sched)
                       / (target.hbm_gbps * 1e9) for sched in schedules]
            distinct = {(r, c) for sched in schedules for r, c, _ in sched}
            t = batching.new_tokens_bucket(budget)
            programs = sum(rollout_counts(engine.batch_buckets(rows, shards, budget),
                                          engine.capacity_ladder(t, first)).values())
            print(f"| {first} | {rungs} | {len(schedules[0])} | {len(distinct)} | {programs} | "
                  f"{np.mean(seconds):.2f} |", flush=True)
    return 0
