"""Compile every program a rollout's decode loop can reach before the loop meets any of them, several at a time.

    prewarm.rollout(mesh, graphdef, state, layers, prefix, suffix, ds, scalars, spec, reads, buckets,
                    num_samples, threads)

Which decode segments and cache moves a rollout runs depends on its response lengths, unknown until it has run; a loop
that compiled each when it first met it would compile, one at a time, whatever a step's new lengths reach (at 1.7B on
v5p-8 a segment takes 15-25 s to compile, and a long-tailed run kept meeting new ones for many steps). The set is
bounded: a segment at each batch bucket (its read rungs inside it, engine.py), and the moves between them (the batch
shrinks to the next bucket: its live rows with their prompts' masks and lengths, and one layer's prefix and suffix
rows, once per bucket). So this compiles all of it right
after the first prefill, on `threads` threads, each program lowered over abstract arguments with the shardings of the
real ones (taken from the prefill's arrays, or from the compiled program whose output feeds it): the decode loop's
later call with the same shapes, dtypes and shardings finds it compiled (tests/test_rollout_segments.py counts the
compiles). Each program once per process (`WARMED`). Lowering takes ~0.5 s a segment at 1.7B and holds the GIL;
compiling releases it. It changes when programs compile, nothing they compute.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from g2rl_jax.model.qwen3 import PrefixCache, SuffixCache
from g2rl_jax.rollout import engine

WARMED: set = set()  # keys of the programs compiled here (in this process)
_ROWS: dict[tuple, tuple] = {}  # live rows program key -> its compiled outputs' (old row, prefix row) templates


def _like(x, shape) -> jax.ShapeDtypeStruct:
    """An argument of `shape` placed as x: with x's sharding when x is committed to it; an uncommitted array (a
    model built without a mesh) lowers without one, as jit then treats it."""
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding if getattr(x, "committed", True) else None)


def _template(x, committed: bool) -> jax.ShapeDtypeStruct:
    """A compiled output as an argument: shape, dtype and, when the program's inputs were committed (so are its
    outputs), sharding (no layout)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)


def segment_args(prefix: PrefixCache, suffix: SuffixCache, ds, rows: int):
    """(prefix, suffix, decode state) as the decode loop passes them to the segment of `rows` rows: before any
    compaction (rows = the full batch) the prompts' prefix, after one a prefix row per batch row."""
    full = ds.tokens_BxT.shape[0]
    if rows != full:
        prefix = PrefixCache(k=tuple(_like(x, (rows, *x.shape[1:])) for x in prefix.k),
                             v=tuple(_like(x, (rows, *x.shape[1:])) for x in prefix.v),
                             mask=_like(prefix.mask, (rows, *prefix.mask.shape[1:])),
                             lengths=_like(prefix.lengths, (rows,)))
    cache = lambda xs: tuple(_like(x, (rows, *x.shape[1:])) for x in xs)  # noqa: E731
    row = lambda x: _like(x, (rows,))  # noqa: E731
    ds = dataclasses.replace(ds, last_X=row(ds.last_X), sample_X=row(ds.sample_X), stopped_X=row(ds.stopped_X))
    return prefix, SuffixCache(k=cache(suffix.k), v=cache(suffix.v)), ds


def _key(name: str, *trees, static=()) -> tuple:
    leaves = jax.tree.leaves(trees)
    return (name, static, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves))


def rollout(mesh, graphdef, state, layers, prefix: PrefixCache, suffix: SuffixCache, ds, scalars: tuple, spec,
            reads: tuple[int, ...], buckets: tuple[int, ...], num_samples: int, threads: int) -> list:
    """Compile, on `threads` threads, every decode segment (one per batch bucket, with the read rungs `reads`) and
    every move between them that the decode loop of generate.py can reach and this process has not compiled yet;
    the arguments are the first segment's (graphdef, state, layers, prefix, suffix, ds) and its scalars (t, t_end,
    min_live, key, temperature, top_p, stops). Returns the compile_pool Timings."""
    from g2rl_jax.compile_pool import compile_all  # the pool the trainer compiles on too

    G, L = suffix.k[0].shape[1], len(suffix.k)
    segment, regroup, live_rows = engine.segment_fn(mesh, G, L), engine.regroup_fn(mesh, G), engine.live_rows_fn(mesh)
    full = ds.tokens_BxT.shape[0]
    shrinks = list(zip(buckets, buckets[1:]))
    jobs: dict[tuple, object] = {}

    def add(key: tuple, lower) -> None:
        if key not in WARMED and key not in jobs:
            jobs[key] = lower

    def rows_call(rows: int, half: int) -> tuple[tuple, dict]:
        """The live rows program's arguments and static arguments at the compaction of `rows` rows."""
        pre, _, d = segment_args(prefix, suffix, ds, rows)
        return (d.last_X, d.sample_X, d.stopped_X, pre.mask, pre.lengths), dict(
            rows=half, per_prefix=num_samples if rows == full else 1)

    # the live rows of each compaction first (their outputs are the K/V gathers' row indices)
    moves = {}
    for rows, half in shrinks:
        args, static = rows_call(rows, half)
        key = _key("live_rows", *args, static=tuple(static.items()))
        if key not in _ROWS:
            moves[key] = functools.partial(live_rows.lower, *args, **static)
    timings = compile_all(list(moves.values()), threads) if moves else []
    committed = getattr(ds.last_X, "committed", True)
    _ROWS.update({key: tuple(_template(x, committed) for x in t.compiled.out_info[3:5])
                  for key, t in zip(moves, timings) if t.error is None})
    for rows in buckets:
        pre, suf, d = segment_args(prefix, suffix, ds, rows)
        add(_key("segment", state, layers, pre, suf, d, *scalars, static=(graphdef, spec, reads)),
            functools.partial(segment.lower, graphdef, state, layers, pre, suf, d, *scalars, spec=spec, reads=reads))
    for rows, half in shrinks:  # the batch shrinks
        args, static = rows_call(rows, half)
        key = _key("live_rows", *args, static=tuple(static.items()))
        if key not in _ROWS:
            continue
        keep_X, prefix_X = _ROWS[key]
        pre, suf, _ = segment_args(prefix, suffix, ds, rows)
        move = (pre.k[0], pre.v[0], suf.k[0], suf.v[0], prefix_X, keep_X, scalars[0])
        add(_key("regroup", *move), functools.partial(regroup.lower, *move))
    done = compile_all(list(jobs.values()), threads) if jobs else []
    WARMED.update(key for key, t in zip(jobs, done) if t.error is None)
    return timings + done
