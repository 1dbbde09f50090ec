"""The jitted pieces of `generate`: prefill once per prompt, then decode in SEGMENTS that compact the batch
between them, each decode step reading only the cache slots its position needs, so a step costs the slots filled and
the samples still running, and a compaction the slots filled, not the budget.

    logits, prefix, suffix = prefill(...)            # suffix: the budget's slots per sample, empty
    state = start(logits, ...)                       # token 0 of every sample (from its prompt's logits)
    loop:  state, suffix, t, live = segment(..., t, t_end, min_live)   # a lax.while_loop of decode steps
           rows = live_rows(state, new_batch); per layer: regroup(...) # compact the cache

A segment ends when the budget is spent, when every sample has stopped, or as soon as at most `min_live` samples
still run (a BATCH_SHRINK-th of the rows: then the next smaller batch bucket holds them; only while more than
COMPACT_MIN_STEPS steps remain). Between segments the host (`generate.py`) picks the next batch bucket (a
BATCH_SHRINK-th of the rows when it compacts; a segment that starts with fewer still running ends at once, and the
batch shrinks again). Compaction gathers the live rows first (stable order); the first compaction also gives each
row its own copy of its prompt's prefix (P = rows, m = 1, a new buffer per layer: prompt-sized), so rows of
different prompts can share a batch.

The suffix cache holds a row per decode row and the whole budget from the prefill on (memory.py prices every row at
the budget: the worst case, a batch none of whose samples stops). A compaction gives each layer a new suffix buffer
of the new batch's rows and copies into it the slots filled so far only, REGROUP_CHUNK at a time (`_take_filled`):
it moves what the rows hold, not the budget's slots; the rest of the new buffer is zeros, as in the old rows. Each
layer moves in turn and its old buffers are freed at once (generate.per_layer), so a move never holds a second copy
of the whole cache. The segment programs see the same buffers as before the move was cut to the filled slots, so
they and their numbers are unchanged (a cache kept at the full batch's rows and compacted in place changed XLA's
fusions and the log-probs' last bits: docs/performance.md).

A decode step reads a prefix of the cache: the READ RUNGS (`read_ladder`: from rollout.first_capacity,
READ_GROWTH-fold up to the budget; a step at position t reads the smallest rung >= t, so at most
max(first, READ_GROWTH t) slots). On CPU and TPU a step picks its rung by a lax.switch in each layer's attention
(one branch per rung: the step compiles once). On a GPU, where a conditional makes the host wait for the device to
say which branch, a segment is a while loop per rung instead (PHASED_READS), one after the other, each running the
steps whose position its rung holds: no conditional in a step, the step compiled once per rung (a compile that
grows with the rungs, which is why CPU and TPU keep the switch). Either way the rungs are inside the segment: a
rollout's bounded set is a segment per batch bucket and a compaction per step between neighbours (were the rungs
cache capacities, each would be a copy of the segments and moves, with a growth between them: 71 rollout programs
instead of 25 at the demo-size long-tailed run, docs/performance.md). Batch rungs are a trade: a step carries up to
BATCH_SHRINK x the live rows, and each bucket is a segment and a move to compile (`python -m g2rl_jax.bench
ladder`).

Per-sample determinism: token t of sample b (b = p*m + j in the global batch) is drawn with the key
fold_in(fold_in(key(seed), b), t); each row carries its sample index, so the draws do not depend on the batch
bucket, the compaction, the read rung, the budget or the sharding. Stopped rows keep being fed (static batch)
but record nothing; dummy rows (bucket padding) start stopped.

Compiles: one executable per shape (prompt bucket, batch bucket) and static sampler spec, and one per compaction
(its live rows with their prompts' masks and lengths, and a layer's prefix rows and suffix move, once per bucket);
the ladder is short, so a rollout has a bounded set, which rollout/prewarm.py compiles before the decode loop needs
any of it. `TRACE_COUNTS` counts traces per function (tests read it).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from g2rl_jax import parallel
from g2rl_jax.model import attention as attn
from g2rl_jax.model.qwen3 import PrefixCache, SuffixCache
from g2rl_jax.parallel import DEFAULT_RULES
from g2rl_jax.rollout.sampling import SamplerSpec, sample_tokens

TRACE_COUNTS: collections.Counter = collections.Counter()
FIRST_READ = 128  # suffix slots the first decode steps read (the budget's bucket when smaller); rollout.first_capacity
# A segment may end early to compact only while more than this many decode steps remain: a compaction (a gather per
# layer, and one more segment executable per new batch bucket) cannot pay for itself over a few steps; short
# budgets (the demo's 8 tokens) then decode in one segment, one batch bucket, one compiled shape.
COMPACT_MIN_STEPS = 8
READ_GROWTH = 2  # each read rung is this many times the one before (module docstring)
# platforms whose decode segments run a while loop per read rung (no conditional in a step: on a GPU each waits for
# the device); elsewhere a step picks its rung by a lax.switch in each layer (the step compiled once, not per rung).
# The benches set it for comparisons (then segment_fn.cache_clear()).
PHASED_READS: tuple[str, ...] = ("gpu",)
BATCH_SHRINK = 2  # a compaction cuts the batch bucket to this fraction of its rows
REGROUP_CHUNK = 128  # suffix slots a compaction moves at a time (_take_filled), and the filled slots' rounding


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["last_X", "sample_X", "stopped_X", "tokens_BxT", "logprobs_BxT", "lengths_B"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Rows of the current batch bucket (X, which compaction shrinks) and the outputs of all B = P*m samples
    (indexed by sample):
    last_X: the token each row feeds next; sample_X: its sample index; stopped_X: finished (or padding);
    tokens_BxT / logprobs_BxT: drawn tokens and their log-probs (0 after the end); lengths_B: tokens drawn."""

    last_X: jax.Array
    sample_X: jax.Array
    stopped_X: jax.Array
    tokens_BxT: jax.Array
    logprobs_BxT: jax.Array
    lengths_B: jax.Array


def batch_shards(mesh) -> int:
    """How many ways the batch is split on `mesh` (1 without a mesh)."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in DEFAULT_RULES.mesh_axes("batch"))


def read_ladder(new_tokens: int, first: int = 0) -> tuple[int, ...]:
    """The read rungs: `first` (default FIRST_READ) growing READ_GROWTH-fold, the last one `new_tokens` (the
    bucketed budget, the cache's slots). A step at position t reads at most max(first, READ_GROWTH t) slots."""
    ladder = [min(first or FIRST_READ, new_tokens)]
    while ladder[-1] < new_tokens:
        ladder.append(min(READ_GROWTH * ladder[-1], new_tokens))
    return tuple(ladder)


def read_slots(num_valid, reads: tuple[int, ...]) -> np.ndarray:
    """The slots a step with `num_valid` filled suffix slots reads: the smallest rung >= it (decode_attention)."""
    rungs = np.asarray(reads)
    return rungs[np.minimum(np.searchsorted(rungs, num_valid), len(rungs) - 1)]


def batch_bucket(live: int, shards: int) -> int:
    """Rows that hold `live` samples: a power of two times the batch shard count, at least one row per shard."""
    per_shard = -(-max(live, 1) // shards)
    return shards * (1 << (per_shard - 1).bit_length())


def smaller_bucket(rows: int, shards: int) -> int:
    """The batch bucket a compaction of `rows` rows cuts to: a BATCH_SHRINK-th of them, at least one row per shard
    (`rows` itself when it cannot shrink)."""
    return min(rows, batch_bucket(rows // BATCH_SHRINK, shards))


def batch_buckets(rows: int, shards: int, new_tokens: int) -> tuple[int, ...]:
    """Row counts the decode batch can have: `rows`, then each smaller bucket a compaction reaches (none when the
    budget is too short for a compaction to pay)."""
    buckets = [rows]
    while smaller_bucket(buckets[-1], shards) < buckets[-1] and new_tokens > COMPACT_MIN_STEPS:
        buckets.append(smaller_bucket(buckets[-1], shards))
    return tuple(buckets)


def min_live_rows(rows: int, t: int, max_new_tokens: int, shards: int) -> int:
    """The segment that starts at step t with `rows` rows runs until the budget is spent or at most this many
    samples still run: the next smaller bucket's rows, while a compaction can pay for itself (more than
    COMPACT_MIN_STEPS steps left and a smaller bucket exists); else -1 (never)."""
    smaller = smaller_bucket(rows, shards)
    return smaller if smaller < rows and max_new_tokens - t > COMPACT_MIN_STEPS else -1


def next_rows(rows: int, t: int, live: int, min_live: int, max_new_tokens: int, shards: int) -> int | None:
    """After a segment stopped at step t with `live` samples running: None when the decode is done, else the rows
    of the next segment (the next smaller batch bucket when it compacts, whatever number still runs: it holds
    min_live rows)."""
    if live == 0 or t >= max_new_tokens:
        return None
    return smaller_bucket(rows, shards) if live <= min_live else rows


def decode_schedule(lengths_B, rows: int, max_new_tokens: int, shards: int) -> list[int]:
    """The rows of each segment `generate` runs when its samples draw lengths_B tokens each (the stop token
    included; a sample at max_new_tokens never stops), starting from `rows` rows (the bucketed prompts x samples,
    dummies stopped): the decode loop of generate.py, with each segment's stopping step worked out on the host."""
    return [r for r, _, _ in decode_segments(lengths_B, rows, max_new_tokens, shards)]


def decode_segments(lengths_B, rows: int, max_new_tokens: int, shards: int) -> list[tuple[int, int, int]]:
    """decode_schedule's segments with their steps: (rows, first step, steps); step t reads read_slots(t)."""
    lengths_B = np.sort(np.asarray(lengths_B))
    t, out = 1, []
    while True:
        start, min_live = t, min_live_rows(rows, t, max_new_tokens, shards)
        live = lambda t: int(len(lengths_B) - np.searchsorted(lengths_B, t, side="right"))  # noqa: E731 n_b > t
        while t < max_new_tokens and live(t) > 0 and live(t) > min_live:
            t += 1
        out.append((rows, start, t - start))
        rows = next_rows(rows, t, live(t), min_live, max_new_tokens, shards)
        if rows is None:
            return out


def _is_stop(tokens_X, stops_Z):
    return (tokens_X[:, None] == stops_Z[None, :]).any(-1)


def _draw(logits_XxV, sample_X, t, key, temperature, top_p, spec: SamplerSpec):
    """Token t of each row's sample with key fold_in(fold_in(key, sample), t), and its log-prob."""
    keys_X = jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(key, s), t))(sample_X)
    return sample_tokens(logits_XxV, keys_X, temperature, top_p, spec)


# ------------------------------------------------------------------------------------------------ the steps
def _prefill(graphdef, state, ids_PxS, mask_PxS, *, num_samples: int, capacity: int):
    """Last-token logits [P, V], the prompt K/V cache, and an empty suffix of `capacity` slots per sample (the
    budget's)."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    logits_PxV, prefix = model.prefill(ids_PxS, mask_PxS)
    return logits_PxV, prefix, model.init_suffix(prefix, num_samples=num_samples, max_new_tokens=capacity)


def _start(logits_PxV, key, temperature, top_p, stops_Z, num_real, *, num_samples: int, new_tokens: int,
           spec: SamplerSpec) -> DecodeState:
    """Token 0 of every sample, drawn from its prompt's prefill logits; samples b >= num_real start stopped."""
    TRACE_COUNTS["start"] += 1
    B = logits_PxV.shape[0] * num_samples
    sample_B = jnp.arange(B, dtype=jnp.int32)
    tok_B, lp_B = _draw(jnp.repeat(logits_PxV, num_samples, axis=0), sample_B, 0, key, temperature, top_p, spec)
    return DecodeState(last_X=tok_B, sample_X=sample_B, stopped_X=_is_stop(tok_B, stops_Z) | (sample_B >= num_real),
                       tokens_BxT=jnp.zeros((B, new_tokens), jnp.int32).at[:, 0].set(tok_B),
                       logprobs_BxT=jnp.zeros((B, new_tokens), jnp.float32).at[:, 0].set(lp_B),
                       lengths_B=jnp.ones((B,), jnp.int32))


def _decode_layers(graphdef, state):
    """Each layer's weights, sliced and cast to the compute dtype once per rollout (see Qwen3.decode_layers)."""
    TRACE_COUNTS["decode_layers"] += 1
    return nnx.merge(graphdef, state).decode_layers()


def _segment(graphdef, state, layers, prefix: PrefixCache, suffix: SuffixCache, ds: DecodeState, t, t_end,
             min_live, key, temperature, top_p, stops_Z, *, spec: SamplerSpec, reads: tuple[int, ...], phased: bool):
    """Decode steps t, t+1, ... (step t feeds token t-1 into slot t-1 and draws token t, reading the read rung
    that holds t slots) while t < t_end, some row is live and more than `min_live` rows are. Returns (state,
    suffix, t, live rows). One while loop whose steps choose their rung by a lax.switch in each layer's attention,
    or with `phased` a while loop per rung, one after the other, each running the steps whose position its rung
    holds (none when t is already past it): no conditional in a step, the step compiled once per rung."""
    TRACE_COUNTS["segment"] += 1
    model = nnx.merge(graphdef, state)
    B = ds.lengths_B.shape[0]

    def running(c):
        t, ds, _ = c
        live = jnp.sum(~ds.stopped_X)
        return (t < t_end) & (live > 0) & (live > min_live)

    def step(reads, c):
        t, ds, suffix = c
        logits_XxV, suffix = model.decode_step(ds.last_X, prefix, suffix, step=t - 1, layers=layers, reads=reads)
        tok_X, lp_X = _draw(logits_XxV, ds.sample_X, t, key, temperature, top_p, spec)
        live_X = ~ds.stopped_X
        dest_X = jnp.where(live_X, ds.sample_X, B)  # stopped rows write nowhere (index B is dropped)
        ds = DecodeState(
            last_X=tok_X, sample_X=ds.sample_X, stopped_X=ds.stopped_X | (live_X & _is_stop(tok_X, stops_Z)),
            tokens_BxT=ds.tokens_BxT.at[dest_X, t].set(tok_X, mode="drop"),
            logprobs_BxT=ds.logprobs_BxT.at[dest_X, t].set(lp_X, mode="drop"),
            lengths_B=ds.lengths_B.at[dest_X].add(1, mode="drop"))
        return t + 1, ds, suffix

    carry = (t, ds, suffix)
    if phased:
        for read in reads:  # step t reads the smallest rung >= t slots
            carry = jax.lax.while_loop(lambda c, read=read: running(c) & (c[0] <= read),
                                       functools.partial(step, (read,)), carry)
    else:
        carry = jax.lax.while_loop(running, functools.partial(step, reads), carry)
    t, ds, suffix = carry
    return ds, suffix, t, jnp.sum(~ds.stopped_X)


def _live_rows(last_X, sample_X, stopped_X, mask_QxS, lengths_Q, *, rows: int, per_prefix: int):
    """The per-row state cut to `rows` rows, live rows first (in their current order), the old row of each, the
    prefix row each reads (old row // per_prefix: the rows that share one prompt's prefix), and that prefix row's
    mask and length (the prefix's Q rows: the prompts, or one per batch row after a compaction)."""
    TRACE_COUNTS["live_rows"] += 1
    keep_Y = jnp.argsort(stopped_X, stable=True)[:rows].astype(jnp.int32)
    prefix_Y = keep_Y // per_prefix
    return (last_X[keep_Y], sample_X[keep_Y], stopped_X[keep_Y], keep_Y, prefix_Y, mask_QxS[prefix_Y],
            lengths_Q[prefix_Y])


def compact(mesh, ds: DecodeState, prefix_mask, prefix_lengths, rows: int,
            per_prefix: int) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """`ds` with its live rows first in a batch of `rows`, the old row of each new one, its prefix row, and the
    prefix mask and lengths of the new rows."""
    last_X, sample_X, stopped_X, keep_Y, prefix_Y, mask, lengths = live_rows_fn(mesh)(
        ds.last_X, ds.sample_X, ds.stopped_X, prefix_mask, prefix_lengths, rows=rows, per_prefix=per_prefix)
    ds = dataclasses.replace(ds, last_X=last_X, sample_X=sample_X, stopped_X=stopped_X)
    return ds, keep_Y, prefix_Y, mask, lengths


def _regroup(prefix_k_QxGxSxK, prefix_v_QxGxSxK, suffix_k_XxGxTxK, suffix_v_XxGxTxK, prefix_Y, keep_Y, filled):
    """One layer's K/V at a compaction: prefix rows `prefix_Y`, and suffix rows `keep_Y` over their filled slots
    (_take_filled); new buffers."""
    TRACE_COUNTS["regroup"] += 1
    return (prefix_k_QxGxSxK[prefix_Y], prefix_v_QxGxSxK[prefix_Y], _take_filled(suffix_k_XxGxTxK, keep_Y, filled),
            _take_filled(suffix_v_XxGxTxK, keep_Y, filled))


def _take_filled(x_XxGxTxK, keep_Y, filled):
    """x's rows keep_Y, in a new buffer of the same slots: its first `filled` slots (rounded up to REGROUP_CHUNK)
    copied, REGROUP_CHUNK slots at a time, the rest zeros. Every slot past the filled ones is zero in every row of
    x (the prefill's), so this is x[keep_Y], bit for bit, at the cost of the slots the rows hold, not the budget's.
    A chunk at a time: XLA gathers rows of a batch-sharded array by first gathering it whole onto every device, so
    a chunk is what each device holds extra."""
    _, G, T, K = x_XxGxTxK.shape
    chunk = REGROUP_CHUNK if T % REGROUP_CHUNK == 0 else T

    def body(i, out_YxGxTxK):
        part_YxGxCxK = jax.lax.dynamic_slice_in_dim(x_XxGxTxK, i * chunk, chunk, axis=2)[keep_Y]
        return jax.lax.dynamic_update_slice_in_dim(out_YxGxTxK, part_YxGxCxK, i * chunk, axis=2)

    out_YxGxTxK = jnp.zeros((keep_Y.shape[0], G, T, K), x_XxGxTxK.dtype)
    return jax.lax.fori_loop(0, (filled + chunk - 1) // chunk, body, out_YxGxTxK)


# ------------------------------------------------------------------------------------------------ shardings
def _kv_sharding(mesh, num_kv_heads: int) -> NamedSharding:
    """One layer's [batch, kv_heads, length, head_dim]: batch over data/fsdp, KV heads over tensor.

    Errors if the model's KV heads do not divide the tensor axis (the batch is bucketed to divide its axes)."""
    spec = DEFAULT_RULES.spec(("batch", "kv_heads", "seq", "head_dim"), (batch_shards(mesh), num_kv_heads, 1, 1),
                              mesh, "KV cache")
    return NamedSharding(mesh, spec)


def batch_sharding(mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis over data/fsdp, the rest replicated."""
    return parallel.batch_sharding(mesh, ndim=ndim)


def _state_sharding(mesh) -> DecodeState:
    b1, b2 = batch_sharding(mesh, 1), batch_sharding(mesh, 2)
    return DecodeState(last_X=b1, sample_X=b1, stopped_X=b1, tokens_BxT=b2, logprobs_BxT=b2, lengths_B=b1)


def _caches_sharding(mesh, num_kv_heads: int, num_layers: int):
    kv = (_kv_sharding(mesh, num_kv_heads),) * num_layers
    prefix = PrefixCache(k=kv, v=kv, mask=batch_sharding(mesh, 2), lengths=batch_sharding(mesh, 1))
    return prefix, SuffixCache(k=kv, v=kv)


# ------------------------------------------------------------------------------------------------ jitted, per mesh
@functools.lru_cache(maxsize=None)
def prefill_fn(mesh, num_kv_heads: int, num_layers: int):
    """jit(_prefill), with the caches' shardings pinned on `mesh` (None: single device, no constraints)."""
    static = ("graphdef", "num_samples", "capacity")
    if mesh is None:
        return jax.jit(_prefill, static_argnames=static)
    prefix, suffix = _caches_sharding(mesh, num_kv_heads, num_layers)
    return jax.jit(_prefill, static_argnames=static, out_shardings=(batch_sharding(mesh, 2), prefix, suffix))


@functools.lru_cache(maxsize=None)
def decode_layers_fn(mesh):
    """jit(_decode_layers); each slice keeps its parameter's sharding (GSPMD propagates it)."""
    return jax.jit(_decode_layers, static_argnames=("graphdef",))


@functools.lru_cache(maxsize=None)
def start_fn(mesh):
    static = ("num_samples", "new_tokens", "spec")
    if mesh is None:
        return jax.jit(_start, static_argnames=static)
    return jax.jit(_start, static_argnames=static, out_shardings=_state_sharding(mesh))


def run_platform(mesh) -> str:
    """The platform the programs for `mesh` run on ("cpu", "gpu", "tpu"; without a mesh, this host's backend)."""
    return attn.mesh_platform(mesh) or jax.default_backend()


# XLA:CPU's copy insertion with region analysis, for a phased segment on CPU: its step reads (a slice of) the cache it
# has just written in place, and without it XLA:CPU fuses the write into the read's slice, cannot order the two and
# keeps a copy of the whole buffer per layer and step (a step's read across a conditional, or on a GPU or TPU, keeps
# none)
CPU_PHASED_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.lru_cache(maxsize=None)
def segment_fn(mesh, num_kv_heads: int, num_layers: int):
    """jit(_segment) with the suffix cache and the decode state donated (updated in place)."""
    static, donate = ("graphdef", "spec", "reads"), ("suffix", "ds")
    phased = run_platform(mesh) in PHASED_READS
    segment = functools.partial(_segment, phased=phased)
    options = CPU_PHASED_OPTIONS if phased and run_platform(mesh) == "cpu" else None
    if mesh is None:
        return jax.jit(segment, static_argnames=static, donate_argnames=donate, compiler_options=options)
    _, suffix = _caches_sharding(mesh, num_kv_heads, num_layers)
    scalar = NamedSharding(mesh, PartitionSpec())
    return jax.jit(segment, static_argnames=static, donate_argnames=donate, compiler_options=options,
                   out_shardings=(_state_sharding(mesh), suffix, scalar, scalar))


@functools.lru_cache(maxsize=None)
def live_rows_fn(mesh):
    static = ("rows", "per_prefix")
    if mesh is None:
        return jax.jit(_live_rows, static_argnames=static)
    b1, b2, replicated = batch_sharding(mesh, 1), batch_sharding(mesh, 2), NamedSharding(mesh, PartitionSpec())
    return jax.jit(_live_rows, static_argnames=static, out_shardings=(b1, b1, b1, replicated, replicated, b2, b1))


@functools.lru_cache(maxsize=None)
def regroup_fn(mesh, num_kv_heads: int):
    """jit(_regroup), one layer at a time (the caller frees each old layer as soon as it has moved; donation would
    not help: the outputs have other shapes)."""
    if mesh is None:
        return jax.jit(_regroup)
    kv = _kv_sharding(mesh, num_kv_heads)
    return jax.jit(_regroup, out_shardings=(kv,) * 4)
