"""The packed passes' programs of a step (algorithm.packing), lowered over abstract inputs for `plan --compile`.

    score, update, acc = packed_programs(cfg, a, s, graphdef, params, ref_graphdef, resident, scope)

With packing on, a run's score, reference and gradient passes run one program per packed (rows, width) of its
layouts.PackShape (train/passes.py), whatever the prompt bucket, and the warm-up compiles exactly those at the first
step (train/warmup.py). This module takes the warm-up's own lowerings (warmup.packed_score_lowers,
packed_update_lowers) over the abstract step batch and mini-batch of programs.py, so the memory verdict covers the
programs the run compiles and nothing else. The layout is the worst case's: rows of the largest prompt bucket of
data.max_prompt_tokens + the response budget, the finest packed candidate (shapes.step.pack_shape; the run's may be
narrower when its prompts are shorter, and hold fewer row shapes when its choice takes a coarser one). With a token
rule (Clip-Cov, KL-Cov, forking) and more than one update a step, the score programs over a mini-batch's rows too
(the current policy's pass). scope="largest" keeps, of each kind, the first of PackShape.micros: the most rows at
the full width, which holds the most bytes.
"""
from __future__ import annotations

import jax
from flax import nnx

from g2rl_jax import methods
from g2rl_jax.aot.programs import Abstract, Program, per_chip_bytes
from g2rl_jax.config import Config
from g2rl_jax.shapes.step import StepShapes, pack_shape
from g2rl_jax.train import update as train_update
from g2rl_jax.train import warmup


def _hidden(graphdef, params) -> int:
    """The model's hidden size D (Φ's width), from the abstract params."""
    return jax.eval_shape(lambda p: nnx.merge(graphdef, p).lm_head_weight(), params).shape[1]


def _programs(lowers: warmup.Lowers, phase: str, resident: int, keep: set | None, label: str = "") -> list[Program]:
    out = []
    for kind, (rows, width), lower in lowers:
        if keep is None or (rows, width) in keep:
            out.append(Program(f"packed {kind}{label} {rows} rows x {width} positions", kind, phase, lower, resident,
                               (rows, width)))
    return out


def packed_programs(cfg: Config, a: Abstract, s: StepShapes, graphdef, params, ref_graphdef, resident: int,
                    scope: str) -> tuple[list[Program], list[Program], tuple]:
    """(the score-phase programs: score and reference at every packed shape, the update-phase ones: the gradient at
    every packed shape and a token rule's mini-batch score, the gradient accumulator's abstract (grads, loss,
    diagnostics)). resident: per-chip bytes of the run state and the step's arrays alive beside the passes, less
    the params (arguments of each)."""
    algo, m, S, T = cfg.algorithm, s.samples, s.prompt_len, s.new_tokens
    settings = train_update.LossSettings.from_config(algo, cfg.rollout.temperature)
    shape = pack_shape(cfg, s)
    keep = None if scope == "all" else {shape.micros[0]}
    hidden = _hidden(graphdef, params)
    step_batch = a.batch(s.step_rows, S, T, m)
    reference = (ref_graphdef, params) if algo.kl_coef > 0 else None
    static = dict(temperature=settings.temperature, chunk=settings.chunk)
    score = _programs(warmup.packed_score_lowers(shape, graphdef, params, reference, warmup.packed_accumulators(
        step_batch, hidden), step_batch, **static), "score", resident, keep)
    terms = methods.token_fields(algo)
    mini = a.mini(algo.mini_batch_size, S, T, m, algo.rollout_is_cap is not None, terms)
    beside = resident + per_chip_bytes((mini.batch.input_ids, mini.batch.attention_mask))
    acc, lowers = warmup.packed_update_lowers(shape, graphdef, params, mini, settings=settings)
    update = _programs(lowers, "update", beside, keep)
    if methods.get(algo.exploration).tokens is not None and algo.mini_batch_size != s.step_rows and scope == "all":
        # the current policy's pass over a mini-batch's rows (the warm-up's _packed_update); the step's are larger
        update += _programs(warmup.packed_score_lowers(shape, graphdef, params, None, warmup.packed_accumulators(
            mini.batch, hidden), mini.batch, **static), "update", beside, keep,
            label=f" (a mini-batch of {algo.mini_batch_size})")
    return score, update, acc


__all__ = ["packed_programs"]
