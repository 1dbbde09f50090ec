"""Segmented decode: the KV cache is written in place (XLA's memory analysis of the compiled segment), the same
seed samples the same completions whatever the budget, the read rungs, the batch buckets, the compaction and the
sharding, and a run compiles a bounded set of shapes. One tiny random Qwen3 per module."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax.model import load_pretrained
from g2rl_jax.parallel import MeshConfig, make_mesh
from g2rl_jax.rollout import batching, engine, generate, prewarm
from g2rl_jax.rollout.sampling import spec_for

from _helpers import tiny_qwen3_fixtures

PROMPTS = [[5, 17, 99, 3], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [42], [100, 3, 64, 2, 9, 88, 31]]
STOPS = tuple(range(0, 128, 16))  # with this model: lengths mean ~20, max ~70 over 32 samples at T = 1
KW = dict(temperature=1.0, num_samples=8, stop_token_ids=STOPS, seed=1)


model_dir, model = tiny_qwen3_fixtures(initializer_range=0.2)


@pytest.fixture
def first_capacity_16(monkeypatch):
    """Read 16 slots first so that the short test budgets walk through several read rungs, and move 16 slots at a
    time at a compaction so that they move in several chunks."""
    monkeypatch.setattr(engine, "FIRST_READ", 16)
    monkeypatch.setattr(engine, "REGROUP_CHUNK", 16)


@pytest.fixture(scope="module")
def long_budget(model):
    """A budget of 192 (256 slots, read rungs 16..256): the reference every other run is compared with."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "FIRST_READ", 16)
        mp.setattr(engine, "REGROUP_CHUNK", 16)
        before = engine.TRACE_COUNTS.copy()
        r = generate(model, PROMPTS, max_new_tokens=192, **KW)
    return r, engine.TRACE_COUNTS - before


def test_long_budget_compacts(long_budget, first_capacity_16):
    r, traced = long_budget
    lengths = np.array(list(map(len, r.completion_ids)))
    assert r.finish_reasons == ["stop"] * 32 and 1 < np.median(lengths) < 40 and lengths.max() > 32, lengths
    assert traced["live_rows"] >= 2, traced  # the batch shrank
    # the segments' rows, as the compile report predicts them from the lengths alone
    assert len(set(r.segments)) > 3 and list(r.segments) == engine.decode_schedule(lengths, 32, 192, 1), r.segments
    assert r.decode_steps == lengths.max() and r.completion_ids_BxT.shape[1] == batching.new_tokens_bucket(
        int(lengths.max()))


def test_same_completions_whatever_budget(model, long_budget, first_capacity_16):
    """Budget 24 (32 slots, read rungs 16 and 32, 8x smaller): the same tokens, cut at 24."""
    big, _ = long_budget
    small = generate(model, PROMPTS, max_new_tokens=24, **KW)
    for b, (short, full) in enumerate(zip(small.completion_ids, big.completion_ids)):
        assert short == full[:24], b
        assert small.finish_reasons[b] == ("stop" if len(full) <= 24 else "length")
        np.testing.assert_allclose(small.logprobs[b], big.logprobs[b][:24], atol=1e-5)


def test_same_completions_whatever_batch(model, long_budget, first_capacity_16):
    """Prompt 0 alone: its 8 samples in batch buckets of 8, 4, ... instead of 32, 16, ..., budget 24."""
    big, _ = long_budget
    alone = generate(model, PROMPTS[:1], max_new_tokens=24, **KW)
    assert alone.completion_ids == [ids[:24] for ids in big.completion_ids[:8]]


def test_sharded_compaction_samples_the_same(model_dir, long_budget, first_capacity_16):
    """data 2 x fsdp 2 x tensor 2: batch buckets are multiples of 4 rows, compaction gathers across devices."""
    big, _ = long_budget
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = load_pretrained(model_dir, mesh=mesh)
    before = engine.TRACE_COUNTS.copy()
    with jax.set_mesh(mesh):
        r = generate(sharded, PROMPTS, max_new_tokens=48, **KW)
    assert (engine.TRACE_COUNTS - before)["live_rows"] >= 1, "no compaction happened"
    assert list(r.segments) == engine.decode_schedule(list(map(len, r.completion_ids)), 32, 48, 4), r.segments
    assert r.completion_ids == [ids[:48] for ids in big.completion_ids]
    for b, lp in enumerate(r.logprobs):
        np.testing.assert_allclose(lp, big.logprobs[b][:48], atol=1e-5)


def test_compiles_bounded_and_reused(model, long_budget, first_capacity_16):
    """Several seeds (different stop times, so different compaction paths) compile at most one segment per batch
    bucket; running the same seeds again compiles nothing."""
    def run():
        for seed in (2, 3):
            generate(model, PROMPTS, max_new_tokens=192, **{**KW, "seed": seed})

    before = engine.TRACE_COUNTS.copy()
    run()
    first = engine.TRACE_COUNTS - before
    buckets = len(engine.batch_buckets(32, 1, 192))
    assert first["segment"] <= buckets and first["prefill"] == 0, first  # prefill: same bucket
    again = engine.TRACE_COUNTS.copy()
    run()
    assert engine.TRACE_COUNTS == again, engine.TRACE_COUNTS - again


def _segment_memory(model, capacity: int, rows_per_prompt: int = 8, prompts: int = 4):
    """(XLA temporary bytes of the compiled segment, suffix cache bytes) at this capacity, read whole (one rung: XLA
    on CPU copies the slice a smaller rung reads, rollout/engine.py; test_aot checks that the TPU compiler does
    not)."""
    graphdef, state = nnx.split(model)
    cfg = model.config
    G, L = cfg.num_key_value_heads, cfg.num_hidden_layers
    ids, mask = np.ones((prompts, 16), np.int32), np.ones((prompts, 16), bool)
    spec, stops = spec_for(1.0, 1.0, 0, cfg.vocab_size), batching.stop_array(())
    logits, prefix, suffix = engine.prefill_fn(None, G, L)(graphdef, state, ids, mask, num_samples=rows_per_prompt,
                                                           capacity=capacity)
    ds = engine.start_fn(None)(logits, jax.random.key(0), jnp.float32(1), jnp.float32(1), stops,
                               jnp.int32(prompts * rows_per_prompt), num_samples=rows_per_prompt, new_tokens=256,
                               spec=spec)
    layers = engine.decode_layers_fn(None)(graphdef, state)
    compiled = engine.segment_fn(None, G, L).lower(
        graphdef, state, layers, prefix, suffix, ds, jnp.int32(1), jnp.int32(capacity), jnp.int32(-1),
        jax.random.key(0), jnp.float32(1), jnp.float32(1), stops, spec=spec, reads=(capacity,)).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes >= sum(x.nbytes for x in suffix.k + suffix.v), "the suffix is not donated"
    return stats.temp_size_in_bytes, sum(x.nbytes for x in suffix.k + suffix.v)


def test_decode_temporaries_do_not_grow_with_the_cache(model):
    """8x the slots: the cache grows 8x, the step's temporaries only by its attention scores (a few [B, H, W]
    float32 rows), never by a copy of a layer's cache."""
    (temp_small, cache_small), (temp_big, cache_big) = _segment_memory(model, 32), _segment_memory(model, 256)
    cfg = model.config
    assert cache_big == 8 * cache_small
    scores_growth = 32 * cfg.num_attention_heads * (256 - 32) * 4  # one layer's [B, H, dW] float32 scores
    layer_kv = cache_big // cfg.num_hidden_layers
    assert temp_big - temp_small <= 4 * scores_growth < layer_kv / 2, (temp_small, temp_big, scores_growth)


def _np_take_filled(x, keep, filled, chunk):
    """NumPy: x's rows `keep`, their filled slots rounded up to the chunk (all slots when the chunk does not divide
    them) copied, every other slot zero."""
    T = x.shape[2]
    moved = T if T % chunk else min(T, -(-filled // chunk) * chunk)
    out = np.zeros((len(keep), *x.shape[1:]), x.dtype)
    out[:, :, :moved] = x[keep, :, :moved]
    return out


@pytest.mark.parametrize("chunk,filled", [(16, 20), (16, 33), (24, 5), (64, 64), (16, 0)])
def test_a_compaction_moves_the_filled_slots_of_the_rows_it_keeps(monkeypatch, chunk, filled):
    """The suffix rows a compaction keeps, moved REGROUP_CHUNK slots at a time (one chunk when it does not divide
    the slots) over the filled slots only, the rest zeros: NumPy's; and with every slot past the filled ones zero
    (as the decode leaves them), bit for bit the whole rows' take."""
    monkeypatch.setattr(engine, "REGROUP_CHUNK", chunk)
    x = np.random.default_rng(0).normal(size=(8, 2, 64, 4)).astype(np.float32)
    keep = np.array([6, 1, 3, 0], np.int32)
    take = jax.jit(lambda x, keep, filled: engine._take_filled(x, keep, filled))  # a new function: this chunk
    np.testing.assert_array_equal(np.asarray(take(jnp.asarray(x), keep, jnp.int32(filled))),
                                  _np_take_filled(x, keep, filled, chunk))
    x[:, :, filled:] = 0
    np.testing.assert_array_equal(np.asarray(take(jnp.asarray(x), keep, jnp.int32(filled))), x[keep])


def test_compaction_only_with_steps_left(model, monkeypatch, first_capacity_16):
    """A budget of COMPACT_MIN_STEPS tokens decodes without compacting (one batch bucket, no new segment shape),
    even though most rows stop early; budget 24 compacts the same prompts. After a compaction each segment gets
    suffix buffers of exactly its batch's rows: the segment programs are those of a batch that size from the start
    (a cache kept at the full batch's rows made XLA fuse the step otherwise and moved the log-probs' last bits)."""
    calls, rows = [], []
    real, real_segment_fn = engine.compact, engine.segment_fn
    monkeypatch.setattr(engine, "compact", lambda *a, **k: calls.append(a[4]) or real(*a, **k))

    def segment_fn(*fn_args):
        segment = real_segment_fn(*fn_args)
        return lambda *a, **k: rows.append((a[4].k[0].shape[0], a[5].last_X.shape[0])) or segment(*a, **k)

    monkeypatch.setattr(engine, "segment_fn", segment_fn)
    kw = dict(KW, stop_token_ids=tuple(range(0, 128, 5)))  # most rows stop within a few tokens
    short = generate(model, PROMPTS, max_new_tokens=engine.COMPACT_MIN_STEPS, **kw)
    assert short.finish_reasons.count("stop") >= 20 and calls == [], (short.finish_reasons, calls)
    generate(model, PROMPTS, max_new_tokens=24, **kw)
    assert calls, "budget 24 should compact"
    assert len(set(rows)) > 1 and all(cache == batch for cache, batch in rows), rows


def test_prewarm_compiles_everything_the_decode_loop_can_reach(model_dir, long_budget, first_capacity_16):
    """compile_threads=2 on the sharded mesh (4 row shards, budget 48: 64 slots read in rungs of 16, 32, 64,
    buckets 32, 16, 8, 4): every decode segment (one per bucket) and every move between them (3 compactions, each
    a live-row cut with the prompts' masks and lengths, and a layer's prefix and suffix rows) compiles on the
    pool's threads, the decode loop compiles none, the samples are the same; a second rollout, whose lengths
    differ, compiles nothing at all."""
    from test_warmup import Compiles

    big, _ = long_budget
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = load_pretrained(model_dir, mesh=mesh)
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as mp, jax.set_mesh(mesh):
        mp.setattr(prewarm, "WARMED", set())
        mp.setattr(prewarm, "_ROWS", {})
        with Compiles() as compiles:
            r = generate(sharded, PROMPTS, max_new_tokens=48, compile_threads=2, **KW)
        assert engine.read_ladder(64) == (16, 32, 64) and engine.batch_buckets(32, 4, 48) == (32, 16, 8, 4)
        in_pool = {fn: compiles.by[fn, True] for fn in ("_segment", "_regroup", "_live_rows")}
        assert in_pool == {"_segment": 4, "_regroup": 3, "_live_rows": 3}, in_pool
        assert all(compiles.by[fn, False] == 0 for fn in in_pool), compiles.by  # the decode loop compiled none
        assert len(set(r.segments)) >= 3, r.segments  # the loop met several of them
        assert r.completion_ids == [ids[:48] for ids in big.completion_ids]
        with Compiles() as again:
            other = generate(sharded, PROMPTS, max_new_tokens=48, compile_threads=2, **{**KW, "seed": 5})
        assert list(other.completion_lengths) != list(r.completion_lengths)
        assert sum(again.by.values()) == 0, again.by


def test_prewarm_without_a_mesh_matches_uncommitted_arrays(model, first_capacity_16):
    """A model built without a mesh holds uncommitted arrays, which jit lowers without a sharding: the warm-up's
    programs are lowered so too, and a rollout with other lengths compiles nothing."""
    from test_warmup import Compiles

    graphdef, state = nnx.split(model)
    loose = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state))  # uncommitted arrays
    assert not any(x.committed for x in jax.tree.leaves(nnx.split(loose)[1]))
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prewarm, "WARMED", set())
        mp.setattr(prewarm, "_ROWS", {})
        with Compiles() as first:
            r = generate(loose, PROMPTS, max_new_tokens=48, compile_threads=2, **KW)
        with Compiles() as again:
            other = generate(loose, PROMPTS, max_new_tokens=48, compile_threads=2, **{**KW, "seed": 7})
    loop = ("_segment", "_regroup", "_live_rows")
    assert len(set(r.segments)) >= 3 and all(first.by[fn, False] == 0 for fn in loop), (r.segments, first.by)
    assert len(set(other.segments)) >= 3 and sum(again.by.values()) == 0, (other.segments, again.by)
