"""Packed rows (several sequences per row, segment ids, positions per sequence) compute what each sequence computes
alone: the packed token log-probs equal the unpacked (length-grouped, left/right-padded) pass's, and the packing
plan puts every sequence in one row without overlap. One tiny random Qwen3 per module."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.train import packing
from g2rl_jax.train import step as train_step


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


def test_packed_logprobs_equal_the_unpacked_pass(model):
    """Three widths of packed rows (so sequences share rows differently) against the unpacked reference pass
    (train.step's, one padded row per sequence): equal within float32 rounding on every response token."""
    ids, attn, resp, p_B, r_B = _batch()
    graphdef, params = nnx.split(model)
    batch = train_step.Batch(jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(resp), jnp.zeros(8), jnp.zeros(8, bool),
                             group_size=4)
    (want_BxT,), () = train_step._ref_micro(graphdef, params, batch, temperature=0.7, chunk=8)
    want_BxT = np.asarray(want_BxT) * resp
    for width in (24, 40, 96):
        plan = packing.pack(p_B, r_B, width)
        p = packing.packed_inputs(ids, attn, resp, plan)
        assert plan.rows < 8 or width == 24, plan.rows  # several sequences per row
        logp_RxW = packing.packed_token_logprobs(graphdef, params, p.ids_RxW, p.segments_RxW, p.positions_RxW,
                                                 p.targets_RxW, temperature=0.7, chunk=8)
        got_BxT = np.asarray(packing.unpack(logp_RxW, p.source_BxT, p.valid_BxT))
        np.testing.assert_allclose(got_BxT, want_BxT, atol=2e-5, rtol=2e-5, err_msg=f"width {width}")
        assert np.all(got_BxT[resp == 0] == 0) and np.all(got_BxT[resp > 0] < 0)
