"""Blocked attention over packed rows (the xla path): skips the (query block, key block) pairs of different sequences.

    out_BxLxHxK = blocked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segments_BxL, block=64)

A packed row (train/packing.py) holds several sequences one after the other, each a contiguous run of one segment
id (0 = padding, the row's tail). The dense path (attention.xla) scores every (query, key) pair of the row and masks
the pairs of different segments: at long-tailed lengths most of that work is thrown away. Here a query at column c
of a run starting at column start(c) sees the keys [start(c), c] (its own sequence, causally), so the key blocks a
query block of `block` columns needs form one band, from the block of its earliest query's run start up to itself.
Each query block computes one softmax over a key window of w whole blocks ending at itself, w the smallest of
1, 2, 4, ... (capped at the row's block count) that covers its band (`lax.switch` over those window widths), and
masks inside the window. Windows never span rows: an outer `lax.scan` walks the rows, an inner one the query blocks
of a row; both and the switch are reverse-mode differentiable, and each query block is `jax.checkpoint`ed (its
backward recomputes its scores instead of storing every window width's residuals, like flash attention).

Work: a query block's window holds at most twice the key blocks its band needs (one block when its sequences
start inside it), against the row's whole width for the dense path. Padding queries see only themselves (their
outputs feed nothing; no empty softmax). Results at real queries equal attention.xla's within float rounding
(tests/test_packed_attention.py: against a float64 NumPy transcription of masked segment attention, values and
gradients). Requires each segment to be one contiguous run per row, as packing places them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64  # query / key block of the packed path (columns)
_NEG = -1e30  # finite "minus infinity", as attention.xla's


def run_starts(segments_BxL):
    """Column where each token's run of equal segment ids begins [B, L] (a padding token, id 0, starts its own)."""
    seg = segments_BxL.astype(jnp.int32)
    L = seg.shape[1]
    new = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1) | (seg == 0)
    return jax.lax.cummax(jnp.where(new, jnp.arange(L), 0), axis=1)


def windows(n: int) -> tuple[int, ...]:
    """The key-window widths (in blocks) a row of n blocks compiles: 1, 2, 4, ... and n."""
    return tuple(sorted({min(2 ** i, n) for i in range(max(n - 1, 0).bit_length() + 1)}))


def window_class(start_NxB, block: int, n: int):
    """Per query block i of a row [N]: the index into windows(n) of the narrowest window ending at block i that
    holds the keys [start, c] of all its queries (the band from its earliest run start)."""
    need_N = jnp.arange(start_NxB.shape[0]) - jnp.min(start_NxB, axis=1) // block + 1
    return jnp.searchsorted(jnp.asarray(windows(n)), need_N)


def _window(w: int, block: int):
    """Attention of one query block [b, G, R, K] over the w key blocks ending at block i (columns clamped at 0)."""
    def attend(i, q_bxGxRxK, start_b, k_LxGxK, v_LxGxK):
        first = jnp.maximum(i + 1 - w, 0) * block
        k_SxGxK = jax.lax.dynamic_slice_in_dim(k_LxGxK, first, w * block, 0)
        v_SxGxK = jax.lax.dynamic_slice_in_dim(v_LxGxK, first, w * block, 0)
        keys_S, queries_b = first + jnp.arange(w * block), i * block + jnp.arange(block)
        allowed_bxS = (keys_S[None] >= start_b[:, None]) & (keys_S[None] <= queries_b[:, None])  # own run, causal
        s_GxRxbxS = jnp.einsum("qgrk,sgk->grqs", q_bxGxRxK, k_SxGxK, preferred_element_type=jnp.float32)
        s_GxRxbxS = jnp.where(allowed_bxS, s_GxRxbxS * q_bxGxRxK.shape[-1] ** -0.5, _NEG)
        p_GxRxbxS = jax.nn.softmax(s_GxRxbxS, axis=-1).astype(v_SxGxK.dtype)
        return jnp.einsum("grqs,sgk->qgrk", p_GxRxbxS, v_SxGxK)
    return attend


def _row(q_LxGxRxK, k_LxGxK, v_LxGxK, start_L, *, block: int):
    """One padded row (L a multiple of block): scan its query blocks, each over its window (lax.switch)."""
    L, G, R, K = q_LxGxRxK.shape
    n = L // block
    start_NxB = start_L.reshape(n, block)
    branches = [_window(w, block) for w in windows(n)]

    @jax.checkpoint
    def one(i, cls, q_bxGxRxK, start_b):
        return jax.lax.switch(cls, branches, i, q_bxGxRxK, start_b, k_LxGxK, v_LxGxK)

    def body(carry, xs):
        return carry, one(*xs)

    xs = (jnp.arange(n), window_class(start_NxB, block, n), q_LxGxRxK.reshape(n, block, G, R, K), start_NxB)
    _, out_NxbxGxRxK = jax.lax.scan(body, None, xs)
    return out_NxbxGxRxK.reshape(L, G, R, K)


def blocked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segments_BxL, *, block: int = BLOCK):
    """Causal GQA attention of packed rows (segment ids, 0 padding), skipping the key blocks outside each query
    block's band (see the module docstring); [B, L, H, K] in q's dtype."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxLxGxK.shape[2]
    Lp = -(-L // block) * block
    pad = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
    q_BxLxGxRxK = jnp.pad(q_BxLxHxK, pad).reshape(B, Lp, G, H // G, K)
    start_BxL = run_starts(jnp.pad(segments_BxL.astype(jnp.int32), ((0, 0), (0, Lp - L))))

    def body(carry, xs):
        return carry, _row(*xs, block=block)

    _, out = jax.lax.scan(body, None, (q_BxLxGxRxK, jnp.pad(k_BxLxGxK, pad), jnp.pad(v_BxLxGxK, pad), start_BxL))
    return out.reshape(B, Lp, H, K)[:, :L].astype(q_BxLxHxK.dtype)


def pair_counts(segments_BxL, block: int) -> tuple[int, int]:
    """(query-key pairs the blocked path scores, pairs a query of a real token needs: its own sequence's causal
    keys) of packed rows (host NumPy-compatible ints): how much of its attention work is spent off the sequences."""
    seg = np.asarray(segments_BxL, np.int64)
    B, L = seg.shape
    n = -(-L // block)
    seg = np.pad(seg, ((0, 0), (0, n * block - L)))
    start = np.asarray(run_starts(jnp.asarray(seg)))
    widths = np.asarray(windows(n))
    computed = 0
    for b in range(B):
        s_NxB = start[b].reshape(n, block)
        need = np.arange(n) - s_NxB.min(axis=1) // block + 1
        computed += int(widths[np.searchsorted(widths, need)].sum()) * block * block
    cols = np.arange(n * block)
    needed = int(((cols - start + 1) * (seg > 0)).sum())
    return computed, needed
