"""Blocked attention over packed rows (the xla path): skips the (query block, key block) pairs of different sequences.

    out_BxLxHxK = blocked(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segments_BxL, block=64)

A packed row (train/packing.py) holds several sequences one after the other, each a contiguous run of one segment
id (0 = padding, the row's tail). The dense path (attention.xla) scores every (query, key) pair of the row and masks
the pairs of different segments: at long-tailed lengths most of that work is thrown away. Here a query at column c
of a run starting at column start(c) sees the keys [start(c), c] (its own sequence, causally), so the key blocks a
query block of `block` columns needs form one band, from the block of its earliest query's run start up to itself:
`need` blocks. Each query block attends over exactly that band, cut into the parts of need's binary digits (a part
of 2^j blocks per set bit j, `lax.cond` skipping the others: one compiled part per power of two up to the row's
block count), masked inside each part, the parts' softmaxes merged by rescaling (online softmax, float32). Windows
never span rows: an outer `lax.scan` walks the rows, an inner one the query blocks of a row; both and the conds are
reverse-mode differentiable, and each query block is `jax.checkpoint`ed (its backward recomputes its scores
instead of storing every part's residuals, like flash attention).

Work: a query block scores its band's blocks only (pair_counts), against the row's whole width for the dense path;
what it scores beyond its queries' own keys is the causal half of its diagonal block and the keys before a
sequence's start in its band's first block. Padding queries see only themselves (their outputs feed nothing; no
empty softmax). Results at real queries equal attention.xla's within float rounding
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


def band_blocks(start_NxB, block: int):
    """Per query block i of a row [N]: the key blocks its band needs, from the block of its earliest query's run
    start up to i (each query c of it sees the keys [start(c), c])."""
    return jnp.arange(start_NxB.shape[0]) - jnp.min(start_NxB, axis=1) // block + 1


def parts(n: int) -> tuple[int, ...]:
    """The part widths (in blocks) a row of n blocks compiles, widest first: 2^j <= n; a band of `need` blocks is
    the parts of need's set bits."""
    return tuple(2 ** j for j in reversed(range(max(n, 1).bit_length())))


def _part(w: int, block: int):
    """Unnormalised attention of one query block [b, G, R, K] over the w key blocks from block `first` (the keys a
    query may see masked in): (running max m, sum of exponentials l [G, R, b], weighted values o [b, G, R, K])."""
    def attend(first, q_bxGxRxK, start_b, i, k_LxGxK, v_LxGxK):
        k_SxGxK = jax.lax.dynamic_slice_in_dim(k_LxGxK, first * block, w * block, 0)
        v_SxGxK = jax.lax.dynamic_slice_in_dim(v_LxGxK, first * block, w * block, 0)
        keys_S, queries_b = first * block + jnp.arange(w * block), i * block + jnp.arange(block)
        allowed_bxS = (keys_S[None] >= start_b[:, None]) & (keys_S[None] <= queries_b[:, None])  # own run, causal
        s_GxRxbxS = jnp.einsum("qgrk,sgk->grqs", q_bxGxRxK, k_SxGxK, preferred_element_type=jnp.float32)
        s_GxRxbxS = jnp.where(allowed_bxS, s_GxRxbxS * q_bxGxRxK.shape[-1] ** -0.5, _NEG)
        m_GxRxb = jax.lax.stop_gradient(jnp.max(s_GxRxbxS, axis=-1))  # the result does not depend on it
        e_GxRxbxS = jnp.where(allowed_bxS, jnp.exp(s_GxRxbxS - m_GxRxb[..., None]), 0.0)
        o_bxGxRxK = jnp.einsum("grqs,sgk->qgrk", e_GxRxbxS.astype(v_SxGxK.dtype), v_SxGxK,
                               preferred_element_type=jnp.float32)
        return m_GxRxb, jnp.sum(e_GxRxbxS, axis=-1), o_bxGxRxK
    return attend


def _merge(acc, new):
    """Two partial softmaxes (m, l, o) over disjoint keys as one (the online softmax's rescaling)."""
    (m0, l0, o0), (m1, l1, o1) = acc, new
    m = jnp.maximum(m0, m1)
    a0, a1 = jnp.exp(m0 - m), jnp.exp(m1 - m)
    return m, a0 * l0 + a1 * l1, _per_query(a0) * o0 + _per_query(a1) * o1


def _per_query(x_GxRxb):
    """[G, R, b] -> [b, G, R, 1], to scale the values of each query."""
    return jnp.transpose(x_GxRxb, (2, 0, 1))[..., None]


def _row(q_LxGxRxK, k_LxGxK, v_LxGxK, start_L, *, block: int):
    """One padded row (L a multiple of block): scan its query blocks; each attends over exactly the key blocks of
    its band, as the parts of its block count's binary digits (lax.cond skips the others), merged by rescaling."""
    L, G, R, K = q_LxGxRxK.shape
    n = L // block
    start_NxB = start_L.reshape(n, block)
    widths = parts(n)
    fns = [_part(w, block) for w in widths]

    @jax.checkpoint
    def one(i, need, q_bxGxRxK, start_b):
        acc = (jnp.full((G, R, block), _NEG, jnp.float32), jnp.zeros((G, R, block), jnp.float32),
               jnp.zeros((block, G, R, K), jnp.float32))
        first = i + 1 - need
        for w, fn in zip(widths, fns):
            take = (need & w) > 0

            def add(state, fn=fn, w=w):
                acc, first = state
                return _merge(acc, fn(first, q_bxGxRxK, start_b, i, k_LxGxK, v_LxGxK)), first + w
            acc, first = jax.lax.cond(take, add, lambda state: state, (acc, first))
        _, l_GxRxb, o_bxGxRxK = acc
        return (o_bxGxRxK / _per_query(l_GxRxb)).astype(q_LxGxRxK.dtype)

    def body(carry, xs):
        return carry, one(*xs)

    xs = (jnp.arange(n), band_blocks(start_NxB, block), q_LxGxRxK.reshape(n, block, G, R, K), start_NxB)
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
    computed = 0
    for b in range(B):
        computed += int((np.arange(n) - start[b].reshape(n, block).min(axis=1) // block + 1).sum()) * block * block
    cols = np.arange(n * block)
    needed = int(((cols - start + 1) * (seg > 0)).sum())
    return computed, needed
