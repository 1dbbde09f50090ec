"""Packed rows (several sequences per row, segment ids, positions per sequence) compute what each sequence computes
alone: the packed score (log-probs, entropies, per-sequence Φ), reference and gradient passes (train/passes.py)
equal the unpacked (length-grouped, left/right-padded) passes of train/step.py within float32 rounding, Φ's
per-slot scan equals a float64 NumPy transcription of eq. seq-feature, the packing plan puts every sequence in one
row without overlap, and a packed training run equals an unpacked one and compiles nothing after its first step.
One tiny random Qwen3 per module."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train import assets  # noqa: F401 - a fixture

from g2rl_jax.config import AlgorithmConfig
from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.shapes.choice import long_tailed_lengths
from g2rl_jax.shapes.layouts import PackShape
from g2rl_jax.train import packing, passes
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update


@pytest.fixture(scope="module")
def model():
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return Qwen3(cfg, RuntimeConfig(), rngs=nnx.Rngs(3))


def _batch(seed: int = 0, b: int = 8, s: int = 8, t: int = 16):
    """Host arrays of a Batch: prompts of 2..s tokens left-padded, responses of 1..t tokens right-padded."""
    rng = np.random.default_rng(seed)
    p_B, r_B = rng.integers(2, s + 1, b), rng.integers(1, t + 1, b)
    ids = rng.integers(1, 97, (b, s + t)).astype(np.int32)
    attn = np.zeros((b, s + t), np.int32)
    resp = np.zeros((b, t), np.float32)
    for i in range(b):
        attn[i, s - p_B[i]:s + r_B[i]] = 1
        resp[i, :r_B[i]] = 1
    ids = np.where(attn > 0, ids, 0)
    return ids, attn, resp, p_B, r_B


def test_plan_places_every_sequence_once_without_overlap():
    rng = np.random.default_rng(1)
    p_B, r_B = rng.integers(1, 30, 40), rng.integers(1, 90, 40)
    plan = packing.pack(p_B, r_B, 128)
    n_B = p_B + r_B
    cells = np.zeros((plan.rows, 128), int)
    for b in range(40):
        cells[plan.row_B[b], plan.offset_B[b]:plan.offset_B[b] + n_B[b]] += 1
    assert cells.max() == 1 and cells.sum() == n_B.sum()
    assert plan.rows <= -(-n_B.sum() // 128) + 2  # first fit decreasing wastes little here
    with pytest.raises(ValueError, match="raise the width"):
        packing.pack([100], [40], 128)
    with pytest.raises(ValueError, match="more than 1"):
        packing.pack([60, 60], [10, 10], 128, rows=1)
    capped = packing.pack(p_B, r_B, 128, slots=2)  # at most two sequences a row
    assert np.bincount(capped.row_B).max() <= 2 and capped.slot_B.max() == 1
    for r in range(capped.rows):  # slots of a row are 0, 1, ... in placement order
        assert sorted(capped.slot_B[capped.row_B == r]) == list(range(np.sum(capped.row_B == r)))


def test_plan_micros_cover_the_sequences_with_little_padding():
    """Every sequence in exactly one micro-batch, at a shape of the layout, in a row as wide as it; the narrower rows
    take the last tokens: long-tailed lengths (Qwen3-1.7B's bill model, two draws) pad under 5% of the positions,
    against over 10% with the full-width rows alone."""
    shape = PackShape.of(16, 4, prompt_len=1024, resp_len=8192)
    assert shape.micros[:3] == ((16, 9216), (8, 9216), (4, 9216)) and len(shape.micros) == 12
    assert all(r == 4 and w % 8 == 0 for r, w in shape.micros[3:]) and shape.micros[-1] == (4, 1152)
    full = dataclasses.replace(shape, micros=shape.micros[:3])
    pads = {}
    for layout in (shape, full):
        positions = tokens = 0
        for seed in range(2):
            rng = np.random.default_rng(seed)
            r_B = long_tailed_lengths(32, 8192, seed)
            n_B = rng.integers(128, 257, 32) + r_B
            micros = packing.plan_micros(n_B, r_B, layout)
            seen = np.concatenate([idx for _, _, idx, _ in micros])
            assert sorted(seen) == list(range(32))
            for rows, width, idx, plan in micros:
                assert (rows, width) in layout.micros and plan.rows == rows and plan.width == width
                cells = np.zeros((rows, width), int)
                for b, r, o in zip(idx, plan.row_B, plan.offset_B):
                    cells[r, o:o + n_B[b]] += 1
                assert cells.max() == 1 and cells.sum() == n_B[idx].sum()
                positions += rows * width
            tokens += n_B.sum()
        pads[layout is shape] = 1 - tokens / positions
    assert pads[True] < 0.05 < 0.10 < pads[False], pads


@pytest.mark.parametrize("width,block", [(24, 0), (40, 8), (96, 16), (96, 0)])
def test_packed_reference_logprobs_equal_the_unpacked_pass(model, width, block):
    """The reference pass over packed rows as the trainer lays them out (passes.ref_logprobs: PackShape.of's output
    columns, as many as a row's width and gathered to its front, head > 0) against the unpacked reference pass
    (train.step's, one padded row per sequence): equal within float32 rounding on every response token, for rows of
    three widths (so sequences share rows differently), dense attention (0) or blocked."""
    graphdef, params = nnx.split(model)
    ids, attn, resp, _, _ = _batch()
    batch = train_step.Batch(jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(resp), jnp.zeros(8), jnp.zeros(8, bool),
                             group_size=4)
    want_BxT = np.asarray(train_step.ref_stats(graphdef, params, batch, temperature=0.7, chunk=8)) * resp
    shape = PackShape(width, ((8, width),), head=width, block=block)
    micros = passes.plan(batch, shape).micros
    sharing = max(len(set(row[row > 0])) for m in micros for row in m.segments_RxW)
    assert sharing > 1 or width == 24, sharing  # several sequences a row
    assert any((m.predict_RxC[:, 0] > 0).any() for m in micros)  # the output columns are not the row's positions
    got_BxT = np.asarray(passes.ref_logprobs(graphdef, params, batch, temperature=0.7, micro=4, shapes=shape, chunk=8))
    np.testing.assert_allclose(got_BxT, want_BxT, atol=2e-5, rtol=2e-5, err_msg=f"width {width} block {block}")
    assert np.all(got_BxT[resp == 0] == 0) and np.all(got_BxT[resp > 0] < 0)


def _np_phi(h_RxWxD, w_VxD, targets_RxW, alpha_RxW, slots_RxW, slots, temperature):
    """Φ [R, K, D] in float64 NumPy, straight from eqs. head-softmax, token-feature and seq-feature: per slot k of
    row r, Σ_t α̃_t (W[y_t] − p_tᵀ W) over the positions t of that slot, p_t = softmax(W h_t / T)."""
    h, w = h_RxWxD.astype(np.float64), w_VxD.astype(np.float64)
    u = h @ w.T / temperature
    p = np.exp(u - u.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    phi_t = w[targets_RxW] - p @ w  # [R, W, D]
    out = np.zeros((h.shape[0], slots, w.shape[1]))
    for r in range(h.shape[0]):
        for t in range(h.shape[1]):
            if slots_RxW[r, t] < slots:
                out[r, slots_RxW[r, t]] += alpha_RxW[r, t] * phi_t[r, t]
    return out


def test_packed_phi_equals_a_float64_transcription():
    rng = np.random.default_rng(4)
    R, W, D, V, K = 3, 20, 8, 23, 4
    h = rng.standard_normal((R, W, D)).astype(np.float32)
    w = rng.standard_normal((V, D)).astype(np.float32)
    y = rng.integers(0, V, (R, W)).astype(np.int32)
    slots_RxW = rng.integers(0, K + 1, (R, W)).astype(np.int32)  # K: padding
    alpha = np.where(slots_RxW < K, rng.random((R, W)), 0).astype(np.float32)
    _, _, phi = packing.packed_stats(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), jnp.asarray(alpha),
                                     jnp.asarray(slots_RxW), slots=K, temperature=0.7, chunk=6)
    np.testing.assert_allclose(np.asarray(phi), _np_phi(h, w, y, alpha, slots_RxW, K, 0.7), atol=1e-4, rtol=1e-4)


SHAPES = (PackShape(40, ((4, 40), (1, 40), (1, 24), (1, 16)), 3, head=16, block=8),
          PackShape(24, ((2, 24),), 16, block=0))  # outputs at the response positions only (head: at most
# 16 of them a row), or at all W; rows of three widths (the narrower ones for the last tokens) or one; several
# sequences a row, or one or two; the blocked attention (blocks of 8: five a row) or the dense mask


@pytest.fixture(scope="module")
def split(model):
    return nnx.split(model)


def _device_batch(b=8, seed=0):
    ids, attn, resp, _, _ = _batch(seed, b=b)
    return train_step.Batch(jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(resp), jnp.zeros(b), jnp.zeros(b, bool),
                            group_size=4)


@pytest.mark.parametrize("shape", SHAPES, ids=["rows40-blocked", "rows24-dense"])
def test_packed_score_and_reference_equal_the_unpacked_passes(split, shape):
    """Log-probs, entropies and Φ of every response (Φ a per-response sum, accumulated per packed sequence) equal
    the unpacked scoring pass over the whole padded batch, and the reference log-probs its reference pass."""
    graphdef, params = split
    batch = _device_batch()
    resp = np.asarray(batch.response_mask)
    logp, ent, phi = train_step.score_stats(graphdef, params, batch, temperature=0.7, chunk=8)
    got = passes.score(graphdef, params, batch, temperature=0.7, micro=4, shapes=shape, chunk=8)
    assert len(passes.plan(batch, shape).micros) > 1 or shape.width == 40
    for name, want, have in (("logp", logp, got.logp_BxT), ("entropy", ent, got.entropy_BxT)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want) * resp, atol=3e-5, rtol=3e-5, err_msg=name)
        assert np.all(np.asarray(have)[resp == 0] == 0)
    np.testing.assert_allclose(np.asarray(got.phi_BxD), np.asarray(phi), atol=1e-6, rtol=1e-4)
    assert np.abs(np.asarray(phi)).max() > 1e-3
    ref = passes.ref_logprobs(graphdef, params, batch, temperature=0.7, micro=4, shapes=shape, chunk=8)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(logp) * resp, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("agg,ratio_level", [("token-mean", "token"), ("seq-mean-token-mean", "sequence"),
                                             ("seq-mean-token-sum", "token")])
def test_packed_gradients_equal_the_unpacked_ones(split, agg, ratio_level):
    """Loss, gradients and diagnostics of a mini-batch with two rows out of the loss (response mask zeroed), the
    entropy bonus and the KL term on: the packed micro-batches equal the unpacked pass over the whole mini-batch."""
    graphdef, params = split
    batch = _device_batch(seed=1)
    rng = np.random.default_rng(2)
    keep = jnp.asarray([1, 1, 0, 1, 1, 1, 1, 0], jnp.float32)[:, None]
    batch = dataclasses.replace(batch, response_mask=batch.response_mask * keep)
    old = jnp.asarray(-rng.random((8, 16)) * 3, jnp.float32)
    mini = train_step.MiniBatch(batch, old, old + 0.1, jnp.asarray(rng.standard_normal(8), jnp.float32))
    algo = dataclasses.replace(AlgorithmConfig(), kl_coef=0.01, entropy_coef=0.01, loss_agg=agg,
                               ratio_level=ratio_level, exploration="entropy_bonus")
    settings = dataclasses.replace(train_update.LossSettings.from_config(algo, 0.7), chunk=8)
    want_g, want_loss, want_diag = train_update.gradients(graphdef, params, mini, settings=settings, micro=8,
                                                        padded=True)
    for shape in SHAPES:
        got_g, got_loss, got_diag = passes.gradients(graphdef, params, mini, settings=settings, shape=shape)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)
        assert set(got_diag) == set(want_diag)
        for k in want_diag:
            np.testing.assert_allclose(float(got_diag[k]), float(want_diag[k]), rtol=2e-5, atol=1e-6, err_msg=k)
        for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):  # on the host: no program per leaf shape
            scale = float(np.abs(np.asarray(b)).max())
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale + 1e-9)
        assert any(float(np.abs(np.asarray(b)).max()) > 1e-4 for b in jax.tree.leaves(want_g))


def test_a_packed_training_step_equals_an_unpacked_one(assets, tmp_path):  # noqa: F811
    """One g2rl step of test_train's tiny policy with algorithm.packing on and off: the same rollout, then scores,
    advantages and the update agree (float32), the packed run's passes ran at the packed layout, and its warm-up
    compiled every program its second step runs (run.strict_compiles)."""
    from test_train import config

    from g2rl_jax.train.loop import Trainer
    from g2rl_jax.train.metrics import read_metrics

    runs = {}
    for packed in (True, False):  # the packed run: two steps, strict (a compile after the first step raises)
        out = tmp_path / f"packed_{packed}"
        trainer = Trainer(config(assets, out, steps=1 + packed, **{"algorithm.packing": packed,
                                                                    "algorithm.kl_coef": 0.01,
                                                                    "run.strict_compiles": packed}))
        trainer.resume()
        trainer.run()
        assert isinstance(trainer.warmup.layout, PackShape) == packed
        records = read_metrics(out)
        if packed:
            assert records[0]["programs_compiled"] > 0 and records[1]["programs_compiled"] == 0
        runs[packed] = records[0]
    for key in ("accuracy", "response_length"):
        assert runs[True][key] == runs[False][key], key  # the same rollout
    for key in ("reward", "loss", "kl", "novelty", "grad_norm", "entropy", "clip_fraction", "approx_kl"):
        np.testing.assert_allclose(runs[True][key], runs[False][key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert runs[True]["padding_fraction"] < runs[False]["padding_fraction"]
