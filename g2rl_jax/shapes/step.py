"""The worst-case sizes of one training step of a config on a mesh, as the sampler and the passes bucket them.

    s = step_shapes(cfg, mesh)        # StepShapes: prompts, prompt bucket, budget slots, rows, read rungs, ...
    rollout_counts(s.buckets)         # one prompt bucket's rollout programs by kind
    pack_shape(cfg, s)                # the finest packed layout of such a step

`plan --compile` (aot/programs.py) lowers a step's programs at these sizes, the memory planner counts bytes at
them, and the run's choice (choice.py) prices its candidates with them.
"""
from __future__ import annotations

import dataclasses

from g2rl_jax.rollout import batching, engine
from g2rl_jax.shapes.layouts import PackShape, row_counts, width_ladder


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The worst-case sizes of one step on a mesh (as the sampler and the micro-batching bucket them)."""

    shards: int  # how many ways the batch rows are split over the mesh
    prompts: int  # P: prompt rows of the rollout, bucketed and a multiple of the batch shards
    prompt_len: int  # S: the largest prompt bucket
    new_tokens: int  # T: KV slots of the budget
    samples: int  # m
    rows: int  # B = P * m rows the sampler decodes
    step_rows: int  # responses a step scores: data.prompts_per_step * m
    reads: tuple[int, ...]  # the decode's read rungs (engine.read_ladder); the cache holds new_tokens slots
    buckets: tuple[int, ...]  # decode batch buckets: B, then each smaller one a compaction reaches
    micro_rows: tuple[int, ...]  # rows of a micro-batch (layouts.row_counts)
    widths: tuple[int, ...]  # response widths of a micro-batch


def step_shapes(cfg, mesh) -> StepShapes:
    """The step's sizes for config `cfg` on `mesh` (a jax Mesh: its batch axes split the rows)."""
    shards = engine.batch_shards(mesh)
    prompts = -(-batching.bucket(cfg.data.prompts_per_step, 1) // shards) * shards
    m = cfg.rollout.num_samples
    t = batching.new_tokens_bucket(cfg.rollout.max_new_tokens)
    return StepShapes(shards=shards, prompts=prompts, prompt_len=batching.bucket(cfg.data.max_prompt_tokens,
                                                                  batching.MIN_PROMPT_BUCKET),
                      new_tokens=t, samples=m, rows=prompts * m, step_rows=cfg.data.prompts_per_step * m,
                      reads=engine.read_ladder(t, cfg.rollout.first_capacity),
                      buckets=engine.batch_buckets(prompts * m, shards, cfg.rollout.max_new_tokens),  # as generate
                      micro_rows=row_counts(cfg.algorithm.micro_batch_size, shards),
                      widths=width_ladder(t))


def rollout_counts(buckets: tuple[int, ...]) -> dict[str, int]:
    """Programs of one rollout (one prompt bucket) by kind: a segment per batch bucket, and the moves between them
    ("regroup": per compaction a layer's prefix and suffix rows, and the live rows with their prompts' masks and
    lengths); prefill, first token and decode weights once."""
    return {"prefill": 1, "start": 1, "decode_layers": 1, "segment": len(buckets), "regroup": 2 * (len(buckets) - 1)}


def pack_shape(cfg, s: StepShapes) -> PackShape:
    """The finest packed layout of a step of these shapes: rows of the largest prompt bucket of
    data.max_prompt_tokens + the budget (a run whose prompts are shorter packs narrower rows)."""
    return PackShape.of(cfg.algorithm.micro_batch_size, s.shards, prompt_len=s.prompt_len, resp_len=s.new_tokens)
