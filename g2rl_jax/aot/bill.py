"""The whole run's compile bill: the programs of the run's bounded set, their compile seconds, and their share of the
estimated run time (the last lines of `python -m g2rl_jax.plan --target SLICE --compile`).

    b = bill(cfg, model, shapes, results, target)   # Bill: the set, its seconds, the run estimate
    print("\n".join(b.lines()))

A run compiles its whole set at its first step, on run.compile_threads threads (train/warmup.py,
rollout/prewarm.py), and nothing after. `program_counts` counts it without compiling (tests/test_program_count.py
checks it against a jax.monitoring listener on a real run, for every method and with packed passes): the
rollouts' programs (`rollout_keys`: per prompt bucket the prefill and first token, a decode segment at each batch
bucket (the read rungs from rollout.first_capacity inside it), and the moves between them: at each compaction a
layer's prefix and suffix rows, and the live rows with their prompts' masks and lengths; with run.eval_every
validation's rollout too, each key once); the passes' (the score, reference and
gradient programs at each micro-batch shape of each prompt bucket, each moving its micro-batch's rows in and its
results out itself, or when the run packs a program per packed shape once, `packed_counts`); once per run the
optimizer's init and step, the advantages and the method's own (`method_counts`); and the small ones by rule
(`small_counts`). The layout (grouped or packed, and its shapes) and the prompt buckets (at most
data.prompt_buckets) are those the trainer chooses on the target's chips (shapes.choice.run_choice: its price
model, not the compile seconds measured here), from the training prompts' lengths when the tokenizer at model.path
can encode them, else the worst case (every prompt in the bucket of data.max_prompt_tokens). Every program is
priced at the seconds its kind's compiled program took here (the largest of each kind: an ESTIMATE for the smaller
ones, which compile faster), a kind not compiled here by the price model (shapes.prices.model_seconds), the small
programs at a move's. The run: run.total_steps steps
of long-tailed responses (shapes.choice.long_tailed_lengths), each the score, reference and update passes at
ESTIMATE_MFU (the chosen layout's estimate), and the decode loop's segments (engine.decode_segments) at the HBM
bandwidth, every decode step reading the decode weights and the K/V of each row's read rung and of the prompts' prefix
(`decode_step_s`). `python -m g2rl_jax.bench ladder` prices the rollout's options with the same functions.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from g2rl_jax import methods
from g2rl_jax.compile_pool import MAX_AUTO_THREADS
from g2rl_jax.config import Config
from g2rl_jax.rollout import batching, engine
from g2rl_jax.shapes import choice as choice_lib
from g2rl_jax.shapes.layouts import Layout, PackShape, ShapeSet
from g2rl_jax.shapes.prices import ESTIMATE_MFU, Device, model_seconds
from g2rl_jax.shapes.step import StepShapes

HOST_THREADS = MAX_AUTO_THREADS  # run.compile_threads=0 on a TPU VM: one per core, at most this many


def micro_counts(shapes: ShapeSet, kl: bool) -> dict[str, int]:
    """Programs of one prompt bucket's micro-batch shapes by kind: the score, reference and gradient programs at
    each shape, each taking its micro-batch's rows from the whole batch and (score, reference) putting its results
    into the step's arrays itself, so no program moves rows in or out."""
    n = len(shapes.shapes)
    return {"score": n, "reference": n * kl, "gradient": n}


def packed_counts(cfg: Config, layout: PackShape, step_rows: int) -> dict[str, int]:
    """Programs of the packed passes (train/packing.py), once per run whatever the prompt buckets: the score,
    reference and gradient programs at each packed (rows, width) of the run's layout (rows of the largest prompt
    bucket + the budget at micro, micro/2, ... down to the batch shards, and the shards' rows at each narrower
    width, as many as the choice took); for a token rule, when a step has more than one update, the score program
    over a mini-batch's rows too (the current policy's pass). No program moves rows in or out."""
    algo = cfg.algorithm
    n = len(layout.micros)
    rule = methods.get(algo.exploration).tokens is not None and algo.mini_batch_size != step_rows
    return {"score": n * (1 + rule), "reference": n * (algo.kl_coef > 0), "gradient": n}


def method_counts(cfg: Config, layout: Layout, step_rows: int) -> dict[str, int]:
    """Programs of the method's own (once per run): the EVOL embedder (Method.needs "embeddings"); for a token rule
    (Clip-Cov, KL-Cov, forking: methods.token_terms), the rule over a mini-batch and, when a step has more than one
    update, the current policy's score programs over a mini-batch's rows, one per micro-batch shape (none when a
    mini-batch is the whole step: the score pass's programs are the same)."""
    algo = cfg.algorithm
    method = methods.get(algo.exploration)
    counts = {"embed": int("embeddings" in method.needs), "token_terms": int(method.tokens is not None)}
    if method.tokens is not None and algo.mini_batch_size != step_rows and isinstance(layout, ShapeSet):
        counts["score"] = len(layout.shapes)
    return counts


@dataclasses.dataclass(frozen=True)
class Bill:
    choice: choice_lib.Choice
    counts: dict[str, int]  # programs of the whole set by kind
    seconds: dict[str, float]  # compile seconds of one program of each kind (measured for the largest)
    lower_s: float  # of all of them, the lowering (one at a time: it holds the GIL)
    compile_s: float  # of all of them, one at a time
    wall_s: float  # the first step's compile with `threads` threads
    threads: int
    steps: int
    step_s: float  # estimated seconds of one long-tailed step: passes + decode
    passes_s: float
    decode_s: float
    prompts_from: str

    @property
    def programs(self) -> int:
        return sum(self.counts.values())

    @property
    def share(self) -> float:
        return self.wall_s / (self.wall_s + self.steps * self.step_s)

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items(), key=lambda kv: -kv[1]) if n)
        return [
            f"whole-run compile bill ({self.steps} steps, the first compiles the set on {self.threads} threads; "
            f"prompt buckets from {self.prompts_from}):",
            f"  the bounded set: {self.programs} programs ({kinds}; 'regroup': the cache moves and micro-batch row "
            "moves, 'small': the run's small programs, both priced as a cache growth)",
            f"  compile seconds: {self.lower_s + self.compile_s:,.0f} s one at a time (each priced at its kind's "
            f"largest program compiled above: an ESTIMATE for the rest), ~{self.wall_s:,.0f} s at the first step",
            f"  the run: {self.steps} x {self.step_s:,.1f} s (an ESTIMATE: score, reference and update "
            f"{self.passes_s:,.1f} s at {ESTIMATE_MFU:.0%} MFU, decode {self.decode_s:,.1f} s at the HBM bandwidth, "
            f"long-tailed responses) = {self.steps * self.step_s:,.0f} s; compile share {self.share:.1%}",
            "  layouts and prompt buckets (g2rl_jax/shapes/choice.py; compile s on the threads, step s of the "
            "passes):",
            *("    " + line for line in self.choice.lines(self.steps)),
        ]


def _by_kind(results) -> dict:
    """The compiled program of most seconds of each kind."""
    out = {}
    for r in results:
        if r.error is None and (r.program.kind not in out or r.seconds > out[r.program.kind].seconds):
            out[r.program.kind] = r
    return out


def decode_seconds(cfg: Config, model, s: StepShapes, target, lengths_B, prompt_len: int) -> float:
    """Seconds of one rollout's decode loop at the HBM bandwidth: per decode step the decode weights (gathered over
    fsdp) and the K/V of each row's read rung and of the prompts' prefix (one per prompt until the first compaction
    gives each row its own), per chip."""
    from g2rl_jax.memory import decode_weight_bytes, gathered_decode_weight_bytes, kv_token_bytes, resolve_mesh
    from g2rl_jax.memory import shards as mesh_shards

    mesh = resolve_mesh(cfg, target.chips)
    weights = max(decode_weight_bytes(cfg, model, mesh), gathered_decode_weight_bytes(cfg, model, mesh))
    slot = model.num_hidden_layers * kv_token_bytes(cfg, model) / mesh_shards("kv_heads", mesh)
    total = 0.0
    for rows, start, steps in engine.decode_segments(lengths_B, s.rows, cfg.rollout.max_new_tokens, s.shards):
        prefixes = s.prompts if rows == s.rows else rows
        read = float(engine.read_slots(np.arange(start, start + steps), s.reads).sum())  # step t reads t slots' rung
        total += steps * (weights + prefixes * prompt_len / s.shards * slot) + rows * read / s.shards * slot
    return total / (target.hbm_gbps * 1e9)


def decode_step_s(cfg: Config, model, s: StepShapes, target, shares: dict[int, float], prompts: tuple[int, ...],
                  draws: int = 1) -> float:
    """Decode seconds of a long-tailed step (shapes.long_tailed_lengths, `draws` steps averaged), its prompts padded
    to the smallest of the run's buckets `prompts` that holds the step's longest (`shares`: shapes.prompt_shares)."""
    total = 0.0
    for seed in range(draws):
        lengths_B = choice_lib.long_tailed_lengths(s.step_rows, cfg.rollout.max_new_tokens, seed)
        total += sum(share * decode_seconds(cfg, model, s, target, lengths_B, choice_lib.pad_prompt(b, prompts))
                     for b, share in shares.items())
    return total / draws


def param_shapes(cfg: Config, model) -> int:
    """Distinct (shape, dtype) of the trainable parameters (the adapters' with LoRA), from an abstract policy."""
    import jax
    from flax import nnx

    from g2rl_jax.aot.programs import lora_policy
    from g2rl_jax.model import lora
    from g2rl_jax.model.qwen3 import Qwen3
    from g2rl_jax.train import setup

    runtime = setup.runtime_config(cfg.model)
    build = (lora_policy(model, runtime, None, cfg.model) if cfg.model.lora.rank
             else lambda: Qwen3(model, runtime, rngs=nnx.Rngs(0), mesh=None))
    state = nnx.state(nnx.eval_shape(build))
    return len({(x.shape, str(x.dtype)) for x in jax.tree.leaves(lora.trainable(state))})


def target_device(target) -> Device:
    """What the price model knows of a Target's chips (its platform, bf16 peak and count)."""
    return Device(target.platform, target.peak_tflops, target.chips)


def bill(cfg: Config, model, s: StepShapes, results, target, lengths=None) -> Bill:
    """The bill of a run of `cfg` on `target` (module docstring): the programs `program_counts` predicts (the same
    count tests/test_program_count.py checks against a run), each priced at its kind's compiled program of
    `results` (report.Result; `--programs largest` suffices; a kind not among them by `model_seconds`), and the
    training prompts' `lengths` (None: the worst case)."""
    by_kind = _by_kind(results)
    threads = cfg.run.compile_threads or HOST_THREADS
    prompts_from = "the training prompts' lengths" if lengths is not None else (
        f"the worst case, every prompt at data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if lengths is None:
        lengths = np.array([cfg.data.max_prompt_tokens])
    shares = choice_lib.prompt_shares(lengths, cfg.data.prompts_per_step)
    seconds = {**model_seconds(target.platform), **{k: r.seconds for k, r in by_kind.items()}}
    seconds["small"] = seconds["regroup"]  # the small programs: priced as a move
    lower = {k: r.lower_seconds for k, r in by_kind.items()}
    choice = choice_lib.run_choice(cfg, model, s, target_device(target), lengths)
    counts = program_counts(cfg, model, s.shards, choice, max(choice.prompts), param_shapes(cfg, model))
    compile_s = sum(n * (seconds.get(k, 0.0) - lower.get(k, 0.0)) for k, n in counts.items())
    lower_s = sum(n * lower.get(k, 0.0) for k, n in counts.items())
    longest = max((seconds.get(k, 0.0) - lower.get(k, 0.0) for k, n in counts.items() if n), default=0.0)
    wall = lower_s + max(longest, compile_s / threads)
    passes = choice.chosen.step_s
    decode = decode_step_s(cfg, model, s, target, shares, choice.prompts)
    return Bill(choice, counts, seconds, lower_s, compile_s, wall, threads, cfg.run.total_steps,
                passes + decode, passes, decode, prompts_from)


def rollout_keys(prompts: int, prompt_len: int, samples: int, budget: int, shards: int, spec,
                 first_capacity: int = 0) -> set[tuple]:
    """The programs one `generate` shape compiles (rollout/generate.py, rollout/prewarm.py), each as a key that
    another rollout with the same shapes shares: prefill and first token, a segment at each batch bucket (its
    buckets from the budget itself; the cache at the budget's bucket, the read rungs from it), and per compaction
    the live rows and a layer's prefix and suffix rows."""
    T = batching.new_tokens_bucket(budget)
    reads, rows = engine.read_ladder(T, first_capacity), prompts * samples
    buckets = engine.batch_buckets(rows, shards, budget)
    keys = {("prefill", prompts, prompt_len, samples, T), ("start", prompts, samples, T, spec)}
    keys |= {("segment", r, prompt_len, rows, T, spec, reads) for r in buckets}
    for r, half in zip(buckets, buckets[1:]):
        keys.add(("live_rows", r, half, samples if r == rows else 1, prompt_len))
        keys.add(("regroup", r, T, prompt_len, prompts if r == rows else r, half))
    return keys


def rollout_programs(cfg: Config, model, shards: int, prompt_buckets: tuple[int, ...],
                     eval_prompt_len: int) -> dict[str, int]:
    """The rollouts' programs by kind ("regroup": the moves): training's at each prompt bucket and validation's,
    shared where their keys are (rollout_keys), and the decode weights once."""
    from g2rl_jax.rollout.sampling import spec_for

    data, ro, vocab = cfg.data, cfg.rollout, model.vocab_size
    prompts = -(-batching.bucket(data.prompts_per_step, 1) // shards) * shards
    keys: set[tuple] = set()
    train_spec = spec_for(ro.temperature, ro.top_p, ro.top_k or 0, vocab)
    for prompt_len in prompt_buckets:
        keys |= rollout_keys(prompts, prompt_len, ro.num_samples, ro.max_new_tokens, shards, train_spec,
                             ro.first_capacity)
    if cfg.run.eval_every and data.eval_datasets:
        keys |= rollout_keys(prompts, eval_prompt_len, data.eval_samples, data.eval_max_new_tokens, shards,
                             spec_for(data.eval_temperature, 1.0, 0, vocab), ro.first_capacity)
    counts = {"decode_layers": 1}
    for key in keys:
        kind = "regroup" if key[0] in ("live_rows", "regroup") else key[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def small_counts(cfg: Config, step_rows: int, param_shapes: int) -> dict[str, int]:
    """The small programs a run compiles besides its set, by rule (the demo's, counted by a jax.monitoring listener,
    tests/test_program_count.py), four for every method: the round's seed, the mini-batch rows (one program for
    every field and every mini-batch, the response mask of the rows kept applied in it), the gradient
    accumulator's zeros (one program for the whole tree) and the step's record (every reduction of its metrics,
    the learning rate and the log-prob drift included: train/metrics.step_metrics). Made on the host or inside the
    program that uses them, no program of their own: the keys, the batch's arrays, the KL reference's copy, the
    rollout's scalars, the score passes' and token fields' zeros, the update key (folded in the token rule's
    program) and the token sums (in the gradient programs). cfg, step_rows and param_shapes (distinct trainable
    shapes) do not count: every one of these is one program whatever the method, the mini-batches and the
    parameters."""
    del cfg, step_rows, param_shapes
    return {"small": 4}


def program_counts(cfg: Config, model, shards: int, choice: choice_lib.Choice, eval_prompt_len: int,
                   param_shapes: int) -> dict[str, int]:
    """Every program a run of `cfg` compiles, by kind, without compiling any: the rollouts' (training, at each of
    the choice's prompt buckets, and validation's, shared where their shapes are), the passes' (the micro-batch
    set's at each prompt bucket, or the packed ones once), the run's own (init,
    advantages, the optimizer step, the method's) and the small ones (small_counts). shards: the batch shards of
    the mesh; param_shapes: distinct shapes of the trainable parameters."""
    step_rows = cfg.data.prompts_per_step * cfg.rollout.num_samples
    counts = rollout_programs(cfg, model, shards, choice.prompts, eval_prompt_len)
    passes = ([packed_counts(cfg, choice.layout, step_rows)] if choice.packed else
              [micro_counts(choice.layout, cfg.algorithm.kl_coef > 0)] * len(choice.prompts))
    for part in passes + [
            {"init": 1, "advantages": 1, "apply": 1}, method_counts(cfg, choice.layout, step_rows),
            small_counts(cfg, step_rows, param_shapes)]:
        for k, n in part.items():
            counts[k] = counts.get(k, 0) + n
    return counts
