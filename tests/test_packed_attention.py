"""The blocked attention of packed rows (model/packed_attention.py) against a float64 NumPy transcription of masked
segment attention: outputs at real tokens and the gradients of q, k and v, with rows of several sequences, tail
padding, an empty row, a sequence spanning many blocks and a width that is not a multiple of the block."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rl_jax.model import attention, packed_attention
from g2rl_jax.shapes.layouts import PackShape


def _segments(rng, B: int, L: int):
    """Packed rows [B, L]: contiguous runs of distinct ids >= 1 (one run of L/2 or more in row 0), a padded tail,
    the last row empty."""
    seg = np.zeros((B, L), np.int32)
    next_id = 1
    for b in range(B - 1):
        col = 0
        while True:
            n = int(L * 0.6) if (b == 0 and col == 0) else int(rng.integers(1, L // 3))
            if col + n > L - 2:
                break
            seg[b, col:col + n] = next_id
            next_id, col = next_id + 1, col + n
    return seg


def _np_attention(q, k, v, seg, d_out):
    """Float64 masked segment attention (query i sees key j iff j <= i and seg_j == seg_i != 0; rows of padding
    queries give 0) and its gradients for the cotangent d_out: (out, dq, dk, dv)."""
    q, k, v, d_out = (x.astype(np.float64) for x in (q, k, v, d_out))
    B, L, H, K = q.shape
    G = k.shape[2]
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    causal = np.tril(np.ones((L, L), bool))
    for b in range(B):
        allowed = causal & (seg[b][:, None] == seg[b][None, :]) & (seg[b][:, None] > 0)
        for h in range(H):
            g = h // (H // G)
            s = q[b, :, h] @ k[b, :, g].T / np.sqrt(K)
            s = np.where(allowed, s, -np.inf)
            m = np.max(s, axis=1, keepdims=True)
            e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
            p = e / np.maximum(e.sum(axis=1, keepdims=True), 1e-300)
            out[b, :, h] = p @ v[b, :, g]
            dp = d_out[b, :, h] @ v[b, :, g].T
            ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True))
            dq[b, :, h] = ds @ k[b, :, g] / np.sqrt(K)
            dk[b, :, g] += ds.T @ q[b, :, h] / np.sqrt(K)
            dv[b, :, g] += p.T @ d_out[b, :, h]
    return out, dq, dk, dv


@pytest.mark.parametrize("L,block", [(45, 8), (64, 16)])
def test_blocked_attention_equals_a_float64_transcription(L, block):
    rng = np.random.default_rng(L)
    B, H, G, K = 4, 4, 2, 8
    seg = _segments(rng, B, L)
    q, k, v = (rng.standard_normal((B, L, n, K)).astype(np.float32) for n in (H, G, G))
    d_out = rng.standard_normal((B, L, H, K)).astype(np.float32) * (seg > 0)[:, :, None, None]  # real queries only
    want, dq, dk, dv = _np_attention(q, k, v, seg, d_out)

    def loss(q, k, v):
        out = attention.attention(q, k, v, jnp.asarray(seg), "xla", block=block)
        return jnp.sum(out * d_out), out

    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    real = seg > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=2e-5, rtol=2e-5)
    assert np.all(np.isfinite(np.asarray(got)))
    for name, g, w in zip("qkv", grads, (dq, dk, dv)):
        np.testing.assert_allclose(np.asarray(g), w, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
    dense = attention.xla(q, k, v, jnp.asarray(seg))  # the dense path agrees at real tokens
    np.testing.assert_allclose(np.asarray(dense)[real], np.asarray(got)[real], atol=2e-5, rtol=2e-5)


def test_parts_cover_each_query_blocks_band_exactly():
    assert packed_attention.parts(1) == (1,)
    assert packed_attention.parts(9) == (8, 4, 2, 1)
    assert packed_attention.parts(8) == (8, 4, 2, 1)
    seg = np.array([[1] * 20 + [2] * 3 + [3] * 9 + [0] * 8])  # 40 columns, blocks of 8: 5 blocks
    start = np.asarray(packed_attention.run_starts(jnp.asarray(seg)))[0]
    assert start[19] == 0 and start[20] == 20 and start[23] == 23 and start[35] == 35  # padding starts its own
    need = np.asarray(packed_attention.band_blocks(jnp.asarray(start.reshape(5, 8)), 8))
    # block 2 (cols 16-23) reaches back to column 0: 3 blocks (parts 2 + 1); block 3 (24-31) to column 23 (run 3):
    # 2 blocks; block 4 (32-39) is padding: itself
    assert list(need) == [1, 2, 3, 2, 1]
    computed, needed = packed_attention.pair_counts(seg, 8)
    assert computed == (1 + 2 + 3 + 2 + 1) * 64
    assert needed == 20 * 21 // 2 + 3 * 4 // 2 + 9 * 10 // 2


def test_padding_report_counts_the_packed_plan():
    """bench update --padding-only: padding = positions - tokens, needed pairs = sum n(n+1)/2, the dense path
    scores R x W^2 pairs, the blocked one fewer (long-tailed lengths)."""
    from g2rl_jax.bench import update_padding
    from g2rl_jax.model import Qwen3Config

    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    prompt_B, resp_B = update_padding.draw(24, 16, 256, seed=0)
    n_B = prompt_B + resp_B
    dense, blocked = (update_padding.packed_figures(cfg, prompt_B, resp_B, PackShape.of(
        8, 2, prompt_len=16, resp_len=256, block=block)) for block in (0, 32))
    for f in (dense, blocked):
        assert f["positions"] - f["padding"] == n_B.sum() and f["needed"] == (n_B * (n_B + 1) // 2).sum()
        assert f["positions"] % 272 == 0 and f["useful"] < f["total"]
    assert dense["computed"] == dense["positions"] * 272
    assert f["needed"] < blocked["computed"] < dense["computed"] / 2


def test_blocked_attention_on_a_mesh_runs_per_shard():
    """On a (data, fsdp, tensor) = (2, 2, 2) mesh of CPU devices the blocked path runs per shard (rows over data x
    fsdp, heads over tensor) and gives the single-device result."""
    from g2rl_jax.config import MeshConfig
    from g2rl_jax.parallel import make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(7)
    seg = _segments(rng, 4, 40)
    q, k, v = (rng.standard_normal((4, 40, n, 8)).astype(np.float32) for n in (4, 2, 2))
    want = attention.attention(q, k, v, jnp.asarray(seg), "xla", block=8)
    got = jax.jit(lambda *a: attention.attention(*a, "xla", mesh, 8))(q, k, v, jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
