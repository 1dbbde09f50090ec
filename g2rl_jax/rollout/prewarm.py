"""Compile the decode segments a rollout can reach before its decode loop meets them, several at a time.

    prewarm.segments(fn, (graphdef, state, layers, prefix, suffix, ds, *scalars), spec, ladder, buckets, threads)

The decode loop compiles one segment program per (batch rows, cache capacity) the first time it meets it, one at a
time: at 1.7B on v5p-8 about 15-25 s each, 12 of them in the first step of a long-tailed run (docs/tpu.md, "Time to
first step"). Which ones a step meets depends on its response lengths, unknown until it has run, so this compiles
every reachable one (each capacity of the ladder x each batch bucket) on `threads` threads right after the prefill,
each lowered over abstract arguments with the shardings of the real ones: the sampler's later call with the same
shapes, dtypes and shardings finds it compiled (tests/test_rollout_segments.py counts the compiles per thread).
Lowering takes ~0.5 s a segment and holds the GIL; compiling releases it. Compiling all of them pays only with
enough threads: it runs when they fit in about four rounds (len(shapes) <= 4 * threads), and each shape once per
process. It changes when programs compile, nothing they compute.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from g2rl_jax.model.qwen3 import PrefixCache, SuffixCache

ROUNDS = 4  # compile every reachable segment only when they take at most this many rounds of `threads`
WARMED: set = set()  # signatures of the segment programs compiled here (in this process)


def _like(x, shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)


def segment_args(prefix: PrefixCache, suffix: SuffixCache, ds, rows: int, capacity: int):
    """(prefix, suffix, decode state) as the decode loop passes them to the segment of `rows` rows and `capacity`
    slots: before any compaction (rows = the full batch) the prompts' prefix, after one a prefix row per batch row."""
    full = ds.tokens_BxT.shape[0]
    if rows != full:
        prefix = PrefixCache(k=tuple(_like(x, (rows, *x.shape[1:])) for x in prefix.k),
                             v=tuple(_like(x, (rows, *x.shape[1:])) for x in prefix.v),
                             mask=_like(prefix.mask, (rows, *prefix.mask.shape[1:])),
                             lengths=_like(prefix.lengths, (rows,)))
    cache = lambda xs: tuple(_like(x, (rows, x.shape[1], capacity, x.shape[3])) for x in xs)  # noqa: E731
    row = lambda x: _like(x, (rows,))  # noqa: E731
    ds = dataclasses.replace(ds, last_X=row(ds.last_X), sample_X=row(ds.sample_X), stopped_X=row(ds.stopped_X))
    return prefix, SuffixCache(k=cache(suffix.k), v=cache(suffix.v)), ds


def segments(fn, args: tuple, spec, ladder: tuple[int, ...], buckets: tuple[int, ...], threads: int) -> list:
    """Compile `fn` (engine.segment_fn) at every (rows, capacity) of buckets x ladder not compiled yet, when there
    are at most ROUNDS * threads of them; `args` are the first segment's (graphdef, state, layers, prefix, suffix,
    ds, t, t_end, min_live, key, temperature, top_p, stops). Returns the train.warmup Timings."""
    from g2rl_jax.train.warmup import compile_all  # the trainer's compile pool

    if threads <= 1:
        return []
    graphdef, state, layers, prefix, suffix, ds, *scalars = args
    lowers = []
    for rows in buckets:
        for capacity in ladder:
            pre, suf, d = segment_args(prefix, suffix, ds, rows, capacity)
            leaves = jax.tree.leaves((state, layers, pre, suf, d, *scalars))
            key = (graphdef, spec, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves))
            if key not in WARMED:
                lowers.append((key, functools.partial(fn.lower, graphdef, state, layers, pre, suf, d, *scalars,
                                                      spec=spec)))
    if not lowers or len(lowers) > ROUNDS * threads:
        return []
    timings = compile_all([lower for _, lower in lowers], threads)
    WARMED.update(key for (key, _), t in zip(lowers, timings) if t.error is None)
    return timings
