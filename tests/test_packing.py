"""Packed micro-batches (train.packing) and segment masks in the model change no result and bound the shapes.

The model with 0/1 masks against a transcription of the code before segment ids (bitwise, every position); a packed
row against each of its segments run alone; the packing plan (every response once, capacity, contiguous segments,
padding counts, bounded shapes); and packed_gradients / packed_update against one unpacked pass over the whole
padded mini-batch and against the length-grouped step.gradients, for every algorithm.loss_agg mode.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax import g2rl
from g2rl_jax.config import AlgorithmConfig, OptimConfig
from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig, qwen3
from g2rl_jax.model import attention as attn
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import packing
from g2rl_jax.train import step as train_step

CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
RT = RuntimeConfig(param_dtype="float32", compute_dtype="float32", remat="none", attention="xla")
B, S, T = 8, 6, 40
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _long_tailed_batch(seed: int, b: int = B) -> train_step.Batch:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.geometric(1 / 6, b), T)  # long-tailed, one row at the full width, one empty
    first, empty = rng.choice(b, 2, replace=False)
    lengths[first], lengths[empty] = T, 0
    prompt_mask = (np.arange(S)[None] >= rng.integers(0, 3, (b, 1))).astype(np.int32)  # left padding
    completion_mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    return train_step.build_batch(rng.integers(1, CFG.vocab_size, (b, S)) * prompt_mask, prompt_mask,
                                  rng.integers(1, CFG.vocab_size, (b, T)) * completion_mask, completion_mask,
                                  rng.choice([-1.0, 1.0], b), rng.random(b) < 0.5, group_size=4)


def _settings(agg: str) -> train_step.LossSettings:
    algo = dataclasses.replace(AlgorithmConfig(), loss_agg=agg, kl_coef=0.05, exploration="entropy_bonus",
                               entropy_coef=0.01, dual_clip=1.5)
    return train_step.LossSettings.from_config(algo, 0.9)


def _rel(a_tree, b_tree) -> float:
    """‖a − b‖ / ‖b‖ over all leaves."""
    a, b = jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(a, b))
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in b)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def model():
    return nnx.split(Qwen3(CFG, RT, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def unpacked(model):
    """Today's computation: one pass over the whole padded mini-batch, autodiff of its whole loss."""
    graphdef, params = model
    batch = _long_tailed_batch(0)
    m = nnx.merge(graphdef, params)
    h, y = train_step._response_hidden(m, batch)
    logp = g2rl.token_logprobs(h, train_step._head(m, h), y, temperature=0.9)
    rng = np.random.default_rng(1)
    noise = jnp.asarray(0.05 * rng.standard_normal((B, T)), jnp.float32)
    mini = train_step.MiniBatch(batch, old_logp_BxT=logp + noise, ref_logp_BxT=logp - noise,
                                advantages_B=jnp.asarray(rng.standard_normal(B), jnp.float32))
    fn = jax.jit(jax.value_and_grad(train_step.policy_loss, has_aux=True), static_argnums=(1, 3))
    return {"mini": mini, "grads": {agg: fn(params, graphdef, mini, _settings(agg)) for agg in AGGS}}


# ------------------------------------------------------------------------------------------ the model, 0/1 masks
def _old_positions(mask_BxL):  # positions_from_mask before segment ids
    return jnp.maximum(jnp.cumsum(mask_BxL.astype(jnp.int32), axis=-1) - 1, 0)


def _old_xla(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_BxS):  # attention.xla before segment ids
    B_, L, H, K = q_BxLxHxK.shape
    G = k_BxSxGxK.shape[2]
    s = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxHxK.reshape(B_, L, G, H // G, K), k_BxSxGxK,
                   preferred_element_type=jnp.float32) * K ** -0.5
    causal = jnp.arange(L)[:, None] >= jnp.arange(k_BxSxGxK.shape[1])[None, :]
    s = jnp.where((causal[None] & mask_BxS[:, None, :].astype(bool))[:, None, None], s, attn._NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v_BxSxGxK.dtype)
    return jnp.einsum("bgrls,bsgk->blgrk", p, v_BxSxGxK).reshape(B_, L, H, K)


def test_positions_of_0_1_masks_unchanged():
    rng = np.random.default_rng(0)
    masks = (rng.random((64, 24)) < 0.7).astype(np.int32)  # holes anywhere, not only padding at the ends
    masks[:8] = (np.arange(24)[None] >= rng.integers(0, 24, (8, 1)))  # left padding
    for m in (masks, masks.astype(bool), masks.astype(np.float32)):
        np.testing.assert_array_equal(qwen3.positions_from_mask(jnp.asarray(m)), _old_positions(jnp.asarray(m)))
    seg = np.array([[0, 0, 1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 0, 1, 2, 0, 2, 2, 0]])
    np.testing.assert_array_equal(qwen3.positions_from_mask(jnp.asarray(seg)),
                                  [[0, 0, 0, 1, 0, 1, 2, 0, 0, 0], [0, 1, 2, 2, 3, 0, 0, 1, 2, 2]])


def test_hidden_states_with_0_1_masks_bitwise_unchanged(model, monkeypatch):
    """Every position (padding included) of a left- and right-padded batch, xla and fused (XLA) backends."""
    graphdef, params = model
    batch = _long_tailed_batch(5)
    m = nnx.merge(graphdef, params)
    new = np.asarray(m.hidden_states(batch.input_ids, batch.attention_mask))
    monkeypatch.setattr(qwen3, "positions_from_mask", _old_positions)
    monkeypatch.setattr(attn, "xla", _old_xla)
    old = np.asarray(m.hidden_states(batch.input_ids, batch.attention_mask))
    assert np.isfinite(new).all()
    np.testing.assert_array_equal(new, old)
    monkeypatch.undo()
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((B, S + T, h, 16)), jnp.float32) for h in (4, 2, 2))
    mask = batch.attention_mask
    np.testing.assert_array_equal(attn.xla(q, k, v, mask), _old_xla(q, k, v, mask))
    real = mask.astype(bool)  # the fused mask before segment ids
    old_fused = jax.nn.dot_product_attention(q, k, v, mask=(real[:, None, :] == real[:, :, None])[:, None],
                                             is_causal=True, implementation="xla")
    np.testing.assert_array_equal(attn.fused(q, k, v, mask, "xla"), old_fused)


# ------------------------------------------------------------------------------------------ segments
def _segment_row(rng, lengths, width):
    ids, seg = np.zeros(width, np.int32), np.zeros(width, np.int32)
    o = 1  # one padding token first, then the segments, then padding
    for k, n in enumerate(lengths):
        ids[o:o + n], seg[o:o + n] = rng.integers(1, CFG.vocab_size, n), k + 1
        o += n
    return ids, seg


def test_segmented_forward_equals_each_segment_alone(model):
    graphdef, params = model
    m = nnx.merge(graphdef, params)
    rng = np.random.default_rng(3)
    rows = [_segment_row(rng, (5, 9, 3), 24), _segment_row(rng, (17, 1), 24)]
    ids, seg = (jnp.asarray(np.stack(x)) for x in zip(*rows))
    h = np.asarray(m.hidden_states(ids, seg))
    assert np.isfinite(h).all()
    for r in range(2):
        for k in range(1, int(seg[r].max()) + 1):
            cols = np.flatnonzero(np.asarray(seg[r]) == k)
            alone = m.hidden_states(ids[r:r + 1, cols], jnp.ones((1, len(cols)), jnp.int32))
            np.testing.assert_allclose(h[r, cols], np.asarray(alone)[0], rtol=1e-5, atol=1e-5)
    # the fused backend's mask (checked through XLA's implementation) sees the same segments
    q, k_, v = (jnp.asarray(rng.standard_normal((2, 24, h_, 16)), jnp.float32) for h_ in (4, 2, 2))
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(attn.fused(q, k_, v, seg, "xla"))[real],
                               np.asarray(attn.xla(q, k_, v, seg))[real], rtol=1e-5, atol=1e-5)


def test_splash_kernel_takes_segment_masks():
    """The TPU splash kernel (Pallas interpreter) with a segment mask, against the XLA path (real queries)."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention",
                        reason=f"jax {jax.__version__} has no Pallas TPU splash_attention module")
    rng = np.random.default_rng(4)
    seg = np.stack([_segment_row(rng, (40, 70, 9), 130)[1], _segment_row(rng, (128,), 130)[1]])
    q, k, v = (jnp.asarray(rng.standard_normal((2, 130, h, 128)), jnp.float32) for h in (4, 2, 2))
    with jax.default_matmul_precision("highest"):
        got = attn.splash(q, k, v, jnp.asarray(seg), interpret=True)
        ref = attn.xla(q, k, v, jnp.asarray(seg))
    real = seg > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("seed,micro", [(3, 1), (4, 2), (5, 3)])
def test_plan_places_every_response_once_within_capacity(seed, micro):
    batch = _long_tailed_batch(seed, b=16)
    attn_BxL, resp_BxT = np.asarray(batch.attention_mask), np.asarray(batch.response_mask)
    ids = np.asarray(batch.input_ids).reshape(-1)
    plan = packing.plan_packing(attn_BxL, resp_BxT, micro)
    lengths = micro_lib.response_lengths(resp_BxT)
    live = lengths > 0
    assert (plan.row_B[~live] == -1).all() and (plan.row_B[live] >= 0).all()
    seen = []
    for u, pm in enumerate(plan.micros):
        r_, w = pm.src_OxW.shape
        assert r_ == micro and w <= S + T
        for x, b in enumerate(pm.resp_X):
            if b < 0:
                assert (pm.hidx_XxT[x] == 0).all()
                continue
            seen.append(b)
            prompt = attn_BxL[b, :S].sum()
            assert plan.length_B[b] == prompt + lengths[b]
            flat_src = pm.src_OxW.reshape(-1)
            # the position predicting response token t holds token t - 1 of the response (the prompt's last for 0)
            want_prev = np.concatenate([[b * (S + T) + S - 1], b * (S + T) + S + np.arange(lengths[b] - 1)])
            pred = pm.pred_OxM.reshape(-1)[pm.hidx_XxT[x, :lengths[b]]]
            np.testing.assert_array_equal(flat_src[pred], want_prev)
            np.testing.assert_array_equal(flat_src[pred + 1], b * (S + T) + S + np.arange(lengths[b]))
            seg = pm.seg_OxW.reshape(-1)[pred]
            assert len(set(seg.tolist())) == 1 and seg[0] > 0
        for r in range(r_):  # segments of a row do not overlap and fit; padding is segment 0
            fill = sum(int(plan.length_B[b]) for b in np.flatnonzero(plan.row_B == u * micro + r))
            assert fill <= plan.capacity and (pm.seg_OxW[r] > 0).sum() == fill
            assert (ids[pm.src_OxW[r][pm.seg_OxW[r] > 0]] != 0).all()
        assert sorted(pm.pred_OxM[pm.pred_OxM >= 0].tolist()) == sorted(  # the LM head sees each response token once
            pm.pred_OxM.reshape(-1)[pm.hidx_XxT[pm.resp_X >= 0]][(np.arange(pm.hidx_XxT.shape[1])[None]
                                                                  < lengths[pm.resp_X[pm.resp_X >= 0]][:, None])])
    assert sorted(seen) == np.flatnonzero(live).tolist()  # every response exactly once
    assert plan.positions == sum(micro * pm.src_OxW.shape[1] for pm in plan.micros)
    assert plan.padding == plan.positions - int((attn_BxL[live, :S].sum() + lengths.sum()))
    grouped = micro_lib.plan_micro(resp_BxT, 2, attn_BxL)
    assert plan.positions - plan.padding == grouped.positions - grouped.padding - int(attn_BxL[~live, :S].sum())


def test_plan_shapes_are_bounded_and_first_fit_decreasing():
    shapes = set()
    for seed in range(40):
        batch = _long_tailed_batch(200 + seed, b=32)
        plan = packing.plan_for(batch, 2)
        shapes |= plan.shapes
        rows = plan.row_B.max() + 1
        assert rows >= -(-plan.length_B.sum() // plan.capacity)
        assert rows <= 2 * -(-plan.length_B.sum() // plan.capacity) + 1  # FFD's bound, loosely
    widths = {min(micro_lib.width_bucket(n), S + T) for n in range(1, S + T + 1)}
    counts = {1, 2, 4, 8, 16, 32}
    assert {w for w, _, _ in shapes} <= widths and {m for _, m, _ in shapes} <= widths
    assert {x for _, _, x in shapes} <= counts
    assert len(shapes) <= 16, shapes  # 12 seen: most micro-batches are full rows
    assert [packing.count_bucket(n) for n in (0, 1, 2, 3, 8, 9, 17, 100)] == [1, 1, 2, 4, 8, 16, 32, 128]
    with pytest.raises(ValueError, match="contiguous segments"):
        mask = np.asarray(_long_tailed_batch(0).attention_mask).copy()
        mask[:, S] = 0  # a hole after the prompt
        packing.plan_packing(mask, np.asarray(_long_tailed_batch(0).response_mask), 2)


# ------------------------------------------------------------------------------------------ results unchanged
@pytest.mark.parametrize("agg,micro", [("token-mean", 1), ("seq-mean-token-mean", 1), ("seq-mean-token-sum", 2)])
def test_packed_gradients_equal_one_unpacked_pass(model, unpacked, agg, micro):
    graphdef, params = model
    mini = unpacked["mini"]
    plan = packing.plan_for(mini.batch, micro)
    assert len(plan.micros) >= 2  # several micro-batches accumulated
    (loss0, diag0), grads0 = unpacked["grads"][agg]
    grads, loss, diag = packing.packed_gradients(graphdef, params, mini, settings=_settings(agg), micro=micro)
    assert abs(float(loss) / float(loss0) - 1) <= 1e-6, (float(loss), float(loss0))
    assert _rel(grads, grads0) <= 1e-6
    assert set(diag) == set(diag0)
    for key in diag0:
        np.testing.assert_allclose(float(diag[key]), float(diag0[key]), rtol=1e-6, atol=1e-7, err_msg=key)
    grouped = train_step.gradients(graphdef, params, mini, settings=_settings(agg), micro=2)
    assert abs(float(loss) / float(grouped[1]) - 1) <= 1e-6 and _rel(grads, grouped[0]) <= 1e-6


def test_sequence_ratio_is_cap_and_no_entropy_equal_one_unpacked_pass(model, unpacked):
    """The other loss paths: GSPO's sequence-level ratio, the truncated IS weight, token_logprobs (no entropy)."""
    graphdef, params = model
    mini = unpacked["mini"]
    mini = dataclasses.replace(mini, sampler_logp_BxT=mini.old_logp_BxT + 0.3 * (mini.ref_logp_BxT - mini.old_logp_BxT))
    settings = dataclasses.replace(_settings("seq-mean-token-mean"), ratio_level="sequence", rollout_is_cap=1.02,
                                   entropy_coef=0.0)
    fn = jax.jit(jax.value_and_grad(train_step.policy_loss, has_aux=True), static_argnums=(1, 3))
    (loss0, diag0), grads0 = fn(params, graphdef, mini, settings)
    grads, loss, diag = packing.packed_gradients(graphdef, params, mini, settings=settings, micro=1)
    assert "entropy" not in diag and float(diag["rollout_is_capped_frac"]) > 0
    assert abs(float(loss) / float(loss0) - 1) <= 1e-6 and _rel(grads, grads0) <= 1e-6
    for key in diag0:
        np.testing.assert_allclose(float(diag[key]), float(diag0[key]), rtol=1e-6, atol=1e-7, err_msg=key)


def test_packed_update_equals_update(model, unpacked):
    graphdef, params = model
    settings = _settings("seq-mean-token-mean")
    optimizer = train_step.make_optimizer(OptimConfig(), 10)
    copy = lambda t: jax.tree.map(jnp.array, t)  # noqa: E731 (both updates donate params and opt_state)
    want = train_step.update(graphdef, copy(params), optimizer.init(params), unpacked["mini"], optimizer=optimizer,
                             settings=settings, micro=2)
    got = packing.packed_update(graphdef, copy(params), optimizer.init(params), unpacked["mini"],
                                optimizer=optimizer, settings=settings, micro=1)
    assert int(got[2]["skipped"]) == 0
    # Adam's first step is ~lr·sign(g): elements whose gradient is ~0 may step differently, so compare the new
    # params elementwise to a small fraction of the largest step (an update not applied would miss by all of it)
    step = max(float(jnp.max(jnp.abs(a - p))) for a, p in zip(jax.tree.leaves(want[0]), jax.tree.leaves(params)))
    assert step > 0
    for a, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=0, atol=0.01 * step)
    for key in want[2]:
        np.testing.assert_allclose(float(got[2][key]), float(want[2][key]), rtol=1e-5, atol=1e-7, err_msg=key)


def test_lora_packed_and_grouped_gradients_equal_autodiff_of_the_adapters(model, unpacked):
    """With LoRA adapters, packed and length-grouped gradients cover the adapters only and equal jax.grad of the
    whole padded mini-batch's loss with respect to the adapters."""
    from g2rl_jax.model import lora

    graphdef, params = model
    adapted = lora.attach(nnx.merge(graphdef, params), lora.LoraSpec(2, 4.0, ("q_proj", "o_proj", "down_proj")),
                          dtype="float32", seed=0)
    for name in adapted.adapters.spec.targets:  # non-zero B: the adapters change the policy
        b = getattr(adapted.adapters, f"{name}_b")
        b[...] = 0.1 * jax.random.normal(jax.random.key(len(name)), b.shape)
    graphdef, params = nnx.split(adapted)
    adapters, base = lora.split_trainable(params)
    mini, settings = unpacked["mini"], _settings("token-mean")
    loss_of_adapters = lambda a: train_step.policy_loss(nnx.merge_state(a, base), graphdef, mini, settings)  # noqa: E731
    (loss0, _), grads0 = jax.jit(jax.value_and_grad(loss_of_adapters, has_aux=True))(adapters)
    for grads, loss, _ in (packing.packed_gradients(graphdef, params, mini, settings=settings, micro=1),
                           train_step.gradients(graphdef, params, mini, settings=settings, micro=2)):
        assert jax.tree.structure(grads) == jax.tree.structure(adapters)
        assert abs(float(loss) / float(loss0) - 1) <= 1e-6 and _rel(grads, grads0) <= 1e-6
