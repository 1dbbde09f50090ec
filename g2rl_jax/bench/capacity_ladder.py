"""The decode before its read rungs, for side-by-side measurement: a KV cache that GROWS through the capacity ladder.

    tokens_BxT, lengths_B, segments = ladder_generate(model, prompts, max_new_tokens=1024, num_samples=16, seed=0)

Until 2026-11-28 the sampler's cache held `capacity` slots per row (128, doubling to the budget), every decode step
read all of them, and when a step needed more the cache grew to the next capacity (a move of each layer's buffers);
each (batch bucket, capacity) was a program of its own. The sampler now holds the budget from the start and reads
rungs of it (rollout/engine.py). This module keeps the old way reachable with the engine's own programs: the
segment at a single read rung equal to the cache's slots (no slicing, as the old segment), the compaction, and a
growth program here. Same samples as `generate` (same keys per sample and step), so `bench rollout` and `bench gpu`
can time both on one workload: what a step costs when it reads a whole small buffer instead of a prefix of the
budget's, and on a GPU what the old code's figures were measured on. Single device only (no mesh), as the benches
run it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax.model.qwen3 import PrefixCache, SuffixCache
from g2rl_jax.rollout import batching, engine, sampling
from g2rl_jax.rollout.generate import per_layer
from g2rl_jax.rollout.sampling import spec_for


@functools.partial(jax.jit, static_argnames=("rows", "capacity"))
def _grow(k_BxGxTxK, v_BxGxTxK, *, rows: int, capacity: int):
    """One layer's K and V of the batch's first `rows` rows (where a compaction left them, one shard), their slots
    padded with zeros to `capacity`: the old growth, which moved the live rows only."""
    pad = ((0, 0), (0, 0), (0, capacity - k_BxGxTxK.shape[2]), (0, 0))
    return jnp.pad(k_BxGxTxK[:rows], pad), jnp.pad(v_BxGxTxK[:rows], pad)


def ladder_generate(model, prompts: list[list[int]], *, max_new_tokens: int, num_samples: int, temperature=1.0,
                    top_p=1.0, top_k=0, stop_token_ids=(), seed: int = 0, first_capacity: int = 0):
    """Sample as `generate` does, with the cache grown through the capacity ladder; returns (tokens [B, T] and
    lengths [B] as NumPy, of the real samples, and the segments' (rows, capacity))."""
    cfg = model.config
    G, L = cfg.num_key_value_heads, cfg.num_hidden_layers
    sizes = batching.buckets_for(prompts, max_new_tokens, 1)
    ids_PxS, mask_PxS = batching.left_pad(prompts, sizes.num_prompts, sizes.prompt_len)
    ladder = engine.read_ladder(sizes.new_tokens, first_capacity)
    spec = spec_for(temperature, top_p, top_k, cfg.vocab_size)
    graphdef, state = nnx.split(model)
    logits_PxV, prefix, suffix = engine.prefill_fn(None, G, L)(graphdef, state, ids_PxS, mask_PxS,
                                                               num_samples=num_samples, capacity=ladder[0])
    key, temp, top_p, stops = (sampling.key(seed), np.float32(temperature), np.float32(top_p),
                               batching.stop_array(stop_token_ids))
    ds = engine.start_fn(None)(logits_PxV, key, temp, top_p, stops, np.int32(len(prompts) * num_samples),
                               num_samples=num_samples, new_tokens=sizes.new_tokens, spec=spec)
    layers = engine.decode_layers_fn(None)(graphdef, state)
    segment, t, level, per_prefix, segments = engine.segment_fn(None, G, L), 1, 0, num_samples, []
    while True:
        rows, capacity = ds.last_X.shape[0], ladder[level]
        min_live = engine.min_live_rows(rows, t, max_new_tokens, 1)
        segments.append((rows, capacity))
        ds, suffix, t_dev, live_dev = segment(
            graphdef, state, layers, prefix, suffix, ds, np.int32(t), np.int32(min(capacity + 1, max_new_tokens)),
            np.int32(min_live), key, temp, top_p, stops, spec=spec, reads=(capacity,))
        t, live = int(t_dev), int(live_dev)
        new_rows = engine.next_rows(rows, t, live, min_live, max_new_tokens, 1)
        if new_rows is None:
            break
        if new_rows < rows:
            ds, src_Y, prefix_Y, mask, lengths = engine.compact(None, ds, prefix.mask, prefix.lengths, new_rows,
                                                                per_prefix)
            pk, pv, sk, sv = per_layer(engine.regroup_fn(None, G),
                                                     (prefix.k, prefix.v, suffix.k, suffix.v), prefix_Y, src_Y,
                                                     np.int32(t - 1))
            prefix, suffix, per_prefix = PrefixCache(k=pk, v=pv, mask=mask, lengths=lengths), SuffixCache(sk, sv), 1
        if t > capacity:  # the cache is full: grow it to the next capacity
            level += 1
            grow = functools.partial(_grow, rows=ds.last_X.shape[0], capacity=ladder[level])
            suffix = SuffixCache(*per_layer(grow, (suffix.k, suffix.v)))
    B = len(prompts) * num_samples
    return np.asarray(ds.tokens_BxT)[:B], np.asarray(ds.lengths_B)[:B], segments
