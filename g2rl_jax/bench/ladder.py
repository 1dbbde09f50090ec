"""`python -m g2rl_jax.bench ladder`: what the rollout's prompt buckets and decode ladders trade, compile against
decode time, side by side; with --measure, one small real case on this machine to check the model's direction.

    python -m g2rl_jax.bench ladder --config configs/qwen3_1p7b_g2rl.yaml --preset qwen3-1.7b --target v5p-8 \\
        model.path=tests/assets/qwen3_tokenizer
    python -m g2rl_jax.bench ladder --measure          # the demo-size model on this CPU, long-tailed lengths

Each row is one option: at most --buckets prompt buckets (data.prompt_buckets), read rungs that grow --growth-fold
from --first slots (rollout.first_capacity) and batch buckets a --shrink-th of the rows before
(engine.READ_GROWTH and BATCH_SHRINK, set here for the what-if only; the engine's are 2). A rollout's bounded set
is a segment per batch bucket and a compaction between neighbours (the read rungs are branches inside each
segment, no program of their own), and every prompt bucket is a copy of it, so fewer batch rungs and prompt
buckets cut programs; each option also costs decode time: a step reads every slot of its read rung, carries up to
a shrink-fold of the live rows, and pads its prompts to the next bucket. For each option this prints
the whole run's programs (aot/bill.program_counts, the count tests/test_program_count.py checks: training and
validation rollouts, the passes, the small ones), their compile seconds on the run's threads by the price model
(shapes.prices.model_seconds: no compiling), the decode's HBM roofline per long-tailed step (aot/bill.decode_step_s,
--draws steps averaged, the prompts' shares from the training prompts' lengths), the score, reference and update
passes' seconds per step (the chosen layout's estimate, shapes/choice.py) and the run's total (run.total_steps
steps). A model, not a measurement: it prices bytes, FLOPs and the measured compile seconds per kind.

--measure runs the real thing at the demo size on this machine: the same rollout (random demo-size Qwen3, --rows
rows, prompts of 16-100 tokens, long-tailed lengths: stop ids that a near-uniform policy draws about once in
budget / 4 tokens) at each --option, first each from cold (jax's caches cleared): the programs it compiled (a
jax.monitoring listener) and their seconds; then all options side by side, interleaved, --repeats rounds: the
fastest wall seconds of each, with the byte model's decode bytes (decode weights and K/V, as aot/bill prices a
step) beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench ladder", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/qwen3_1p7b_g2rl.yaml", help="training config YAML")
    p.add_argument("--preset", default="qwen3-1.7b", help="architecture preset instead of model.path/config.json")
    p.add_argument("--target", default="v5p-8", help="a TPU slice as gcloud names it (v5p-8, ...)")
    p.add_argument("--buckets", action="append", type=int, default=[],
                   help="data.prompt_buckets (repeatable; default 0 (no limit), 2, 1)")
    p.add_argument("--growth", action="append", type=int, default=[], help="read rung factor (default 2, 4)")
    p.add_argument("--shrink", action="append", type=int, default=[], help="batch rung factor (default 2, 4)")
    p.add_argument("--first", action="append", type=int, default=[],
                   help="rollout.first_capacity (default 128, 512)")
    p.add_argument("--draws", type=int, default=4, help="long-tailed steps the decode estimate averages")
    p.add_argument("--measure", action="store_true", help="the demo-size real case on this machine instead")
    p.add_argument("--option", action="append", default=[], metavar="GROWTH,SHRINK,FIRST",
                   help="--measure: a ladder option (repeatable; default 2,2,128 2,2,512 4,4,128)")
    p.add_argument("--repeats", type=int, default=3, help="--measure: timed rounds (the fastest counts)")
    p.add_argument("--rows", type=int, default=64, help="--measure: decode rows (prompts x 8 samples)")
    p.add_argument("--budget", type=int, default=512, help="--measure: response budget")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    return p.parse_args(argv)


def _set_ladder(growth: int, shrink: int) -> None:
    from g2rl_jax.rollout import engine

    engine.READ_GROWTH, engine.BATCH_SHRINK = growth, shrink


def model_table(a) -> int:
    from g2rl_jax import parallel
    from g2rl_jax.aot import bill as bill_lib
    from g2rl_jax.aot import parse_target
    from g2rl_jax.config import load_config
    from g2rl_jax.plan import model_config
    from g2rl_jax.shapes import choice as choice_lib
    from g2rl_jax.shapes.prices import model_seconds
    from g2rl_jax.shapes.step import step_shapes

    base = load_config(a.config, a.overrides)
    model, source = model_config(base, a.preset)
    target = parse_target(a.target)
    mesh = parallel.make_mesh(base.mesh, target.devices())
    lengths = choice_lib.training_prompt_lengths(base)
    said = "the training prompts' lengths" if lengths is not None else "every prompt at data.max_prompt_tokens"
    lengths = [base.data.max_prompt_tokens] if lengths is None else lengths
    shares = choice_lib.prompt_shares(lengths, base.data.prompts_per_step)
    device = bill_lib.target_device(target)
    seconds = model_seconds(target.platform)
    threads = base.run.compile_threads or bill_lib.HOST_THREADS
    shapes_n = bill_lib.param_shapes(base, model)
    steps = base.run.total_steps
    print(f"{a.config} ({source}) on {target.name}, packing {base.algorithm.packing}, eval_every "
          f"{base.run.eval_every}; prompt shares from {said}: "
          f"{', '.join(f'{b}: {p:.2f}' for b, p in shares.items())}; compile by the price model on {threads} "
          f"threads; {steps} steps\n"
          f"| prompt buckets | read rungs | batch rungs | first read | rollout programs | programs | "
          f"compile s | passes s per step | decode s per step | compile + {steps} steps s |\n|{'---|' * 10}")
    for most, growth, shrink, first in itertools.product(a.buckets or [0, 2, 1], a.growth or [2, 4],
                                                         a.shrink or [2, 4], a.first or [128, 512]):
        _set_ladder(growth, shrink)
        cfg = load_config(a.config, [*a.overrides, f"data.prompt_buckets={most}", f"rollout.first_capacity={first}"])
        s = step_shapes(cfg, mesh)
        choice = choice_lib.run_choice(cfg, model, s, device, lengths)
        counts = bill_lib.program_counts(cfg, model, s.shards, choice, max(choice.prompts), shapes_n)
        rollout = sum(bill_lib.rollout_programs(cfg, model, s.shards, choice.prompts, max(choice.prompts)).values())
        compile_s = sum(n * seconds.get(k, seconds["regroup"]) for k, n in counts.items()) / threads
        decode = bill_lib.decode_step_s(cfg, model, s, target, shares, choice.prompts, a.draws)
        passes = choice.chosen.step_s
        print(f"| {','.join(map(str, choice.prompts))} | {growth} | {shrink} | {first} | {rollout} | "
              f"{sum(counts.values())} | {compile_s:,.0f} | {passes:.2f} | {decode:.2f} | "
              f"{compile_s + steps * (passes + decode):,.0f} |",
              flush=True)
    _set_ladder(2, 2)
    return 0


def _stops(vocab: int, mean: float) -> list[int]:
    """Stop ids that a near-uniform random policy draws about once in `mean` tokens: long-tailed (geometric)
    response lengths."""
    return list(range(vocab - max(1, round(vocab / mean)), vocab))


def measure(a) -> int:
    """The demo-size real case (module docstring): each ladder option's rollout compiled from cold, then run again."""
    import time

    import jax
    import numpy as np
    from flax import nnx

    from g2rl_jax.aot.bill import rollout_keys
    from g2rl_jax.demo.build import demo_architecture
    from g2rl_jax.model.qwen3 import Qwen3
    from g2rl_jax.rollout import batching, engine, prewarm
    from g2rl_jax.train.compiles import CompileClock

    cfg = dataclasses.replace(demo_architecture(), max_position_embeddings=2 * a.budget)  # its context: 256
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    samples = 8
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size - 64, int(n)).tolist() for n in rng.integers(16, 100, a.rows // samples)]
    stops = _stops(cfg.vocab_size, a.budget / 4)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # f32 K and V, all layers
    print(f"demo-size Qwen3 ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) on "
          f"this CPU: {len(prompts)} prompts x {samples} samples, budget {a.budget}, {len(stops)} stop ids (mean "
          f"length ~{a.budget // 4}), 2 compile threads\n| read rungs | batch rungs | first read | "
          f"programs | compile s | decode s | model decode MB | decode / first row's | model / first row's |\n"
          f"|{'---|' * 9}")
    options = [tuple(map(int, o.split(","))) for o in a.option] or [(2, 2, 128), (2, 2, 512), (4, 4, 128)]
    rows, found = len(prompts) * samples, []
    for growth, shrink, first in options:  # each from cold: its programs and their compile seconds
        _set_ladder(growth, shrink)
        jax.clear_caches()
        prewarm.WARMED.clear()
        prewarm._ROWS.clear()
        clock = CompileClock()
        out = _rollout(model, prompts, samples, stops, a.budget, first)
        found.append(clock.take())
        clock.close()
    runs = {o: [] for o in options}
    for i in range(1 + a.repeats):  # then side by side, interleaved: the first round compiles again (not timed)
        for growth, shrink, first in options:
            _set_ladder(growth, shrink)
            start = time.perf_counter()
            out = _rollout(model, prompts, samples, stops, a.budget, first)
            if i:
                runs[(growth, shrink, first)].append(time.perf_counter() - start)
    base = None
    for (growth, shrink, first), seen in zip(options, found):
        _set_ladder(growth, shrink)
        segs = engine.decode_segments(out.completion_lengths, rows, a.budget, 1)
        reads = engine.read_ladder(batching.new_tokens_bucket(a.budget), first)
        bytes_ = sum(n * (weights + (len(prompts) if r == rows else r) * out.prompt_ids_BxS.shape[1] * slot)
                     + r * slot * float(engine.read_slots(np.arange(t, t + n), reads).sum()) for r, t, n in segs)
        keys = rollout_keys(len(prompts), out.prompt_ids_BxS.shape[1], samples, a.budget, 1, None, first)
        decode_s = min(runs[(growth, shrink, first)])
        base = base or (decode_s, bytes_)
        print(f"| {growth} | {shrink} | {first} | {seen.programs} ({len(keys) + 1} by the bill) | "
              f"{seen.seconds:.1f} | {decode_s:.2f} | {bytes_ / 1e6:,.0f} | {decode_s / base[0]:.2f} | "
              f"{bytes_ / base[1]:.2f} |", flush=True)
    _set_ladder(2, 2)
    return 0


def _rollout(model, prompts, samples: int, stops, budget: int, first: int):
    from g2rl_jax.rollout import generate

    return generate(model, prompts, max_new_tokens=budget, num_samples=samples, stop_token_ids=stops, seed=0,
                    compile_threads=2, first_capacity=first)


def main(argv: list[str]) -> int:
    a = _args(argv)
    return measure(a) if a.measure else model_table(a)
