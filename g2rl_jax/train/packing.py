"""Packed micro-batches: several (prompt + response) sequences per row, one fixed [rows, width] shape per pass.

    plan = pack(prompt_lengths_B, response_lengths_B, width)       # host: which sequence goes where
    p = packed_inputs(batch_host, plan)                            # ids / segment ids / positions [R, W], maps
    logp_RxW = packed_token_logprobs(graphdef, params, p.ids_RxW, p.segments_RxW, p.positions_RxW,
                                     p.targets_RxW, temperature=T)
    logp_BxT = unpack(logp_RxW, p.source_BxT, p.valid_BxT)         # back to the [B, T] layout of a Batch

Length-grouped micro-batches (train/micro.py) need one program per (rows, response width) shape, and pad each row
to its shape's width. Packing puts whole sequences, unpadded (prompt tokens then response tokens), one after the
other into rows of `width` tokens (first fit, longest first): every row has the same shape, so a pass compiles
once whatever the lengths, and only a row's tail is padding. A token attends to the causal tokens of its own
sequence only (segment ids, model.attention) and sits at its position in its own sequence, so each sequence
computes what it computes alone (tests/test_packing.py: equal to the unpacked pass within float tolerance).
Per-token results are gathered back to [B, T] on device (`unpack`): the losses, the advantages and Φ's per-row
sums then run on the usual layout.

Status: the packed token log-probs (the reference pass's computation) and their equality with the unpacked pass;
the trainer still runs train/micro.py's length-grouped micro-batches (see docs/performance.md).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import g2rl


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each sequence lies: row_B and offset_B (its first token's column); width W of every row; R rows."""

    row_B: np.ndarray
    offset_B: np.ndarray
    width: int
    rows: int


def pack(prompt_lengths_B, response_lengths_B, width: int, rows: int = 0) -> PackPlan:
    """First-fit decreasing: sequences of prompt + response tokens, longest first, each into the first row with room
    (a new row when none has). `rows`: at least this many rows (a fixed shape); raises ValueError when a sequence is
    longer than `width` or the sequences need more than `rows` rows (rows > 0)."""
    n_B = np.asarray(prompt_lengths_B, int) + np.asarray(response_lengths_B, int)
    if n_B.size and n_B.max() > width:
        raise ValueError(f"a sequence of {n_B.max()} tokens does not fit a packed row of {width}; raise the width")
    row_B, offset_B, used = np.zeros(len(n_B), int), np.zeros(len(n_B), int), []
    for b in np.argsort(-n_B, kind="stable"):
        r = next((i for i, u in enumerate(used) if u + n_B[b] <= width), len(used))
        if r == len(used):
            used.append(0)
        row_B[b], offset_B[b] = r, used[r]
        used[r] += n_B[b]
    if rows and len(used) > rows:
        raise ValueError(f"{len(n_B)} sequences need {len(used)} packed rows of {width} tokens, more than {rows}")
    return PackPlan(row_B, offset_B, width, max(rows, len(used)))


@dataclasses.dataclass(frozen=True)
class Packed:
    """Host arrays of a packed micro-batch: ids, segment ids (sequence b of the batch is segment b + 1; 0 padding),
    positions in the own sequence, and next-token targets [R, W]; source_BxT: the flat index (row * W + column)
    of the position that predicts response token t of sequence b, valid_BxT: whether that token exists."""

    ids_RxW: np.ndarray
    segments_RxW: np.ndarray
    positions_RxW: np.ndarray
    targets_RxW: np.ndarray
    source_BxT: np.ndarray
    valid_BxT: np.ndarray


def packed_inputs(input_ids_BxL, attention_mask_BxL, response_mask_BxT, plan: PackPlan) -> Packed:
    """Pack the real tokens of a Batch's host arrays ([B, S+T], prompts left- and responses right-padded) by
    `plan` (pack's, from these rows' prompt and response lengths)."""
    ids_BxL, attn_BxL = np.asarray(input_ids_BxL), np.asarray(attention_mask_BxL) != 0
    resp_BxT = np.asarray(response_mask_BxT) != 0
    b, t = resp_BxT.shape
    s = ids_BxL.shape[1] - t
    R, W = plan.rows, plan.width
    ids, seg, pos, tgt = (np.zeros((R, W), np.int32) for _ in range(4))
    source, valid = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
    for i in range(b):
        tokens = ids_BxL[i][attn_BxL[i]]
        n, r, o = len(tokens), plan.row_B[i], plan.offset_B[i]
        prompt = int(attn_BxL[i, :s].sum())
        ids[r, o:o + n], seg[r, o:o + n], pos[r, o:o + n] = tokens, i + 1, np.arange(n)
        tgt[r, o:o + n - 1] = tokens[1:]
        resp = int(resp_BxT[i].sum())
        source[i, :resp] = r * W + o + prompt - 1 + np.arange(resp)  # position p-1+j predicts response token j
        valid[i, :resp] = True
    return Packed(ids, seg, pos, tgt, source, valid)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk"))
def packed_token_logprobs(graphdef, params, ids_RxW, segments_RxW, positions_RxW, targets_RxW, *,
                          temperature: float, chunk: int = g2rl.DEFAULT_CHUNK):
    """log p(next token) [R, W] at every packed position (eq. token log-prob of the reference / behaviour pass);
    positions whose target is not a response token hold values `unpack` drops."""
    model = nnx.merge(graphdef, params)
    h_RxWxD = model.hidden_states(ids_RxW, segments_RxW, positions=positions_RxW)
    head = model.lm_head_weight().astype(h_RxWxD.dtype)
    return g2rl.token_logprobs(h_RxWxD, head, targets_RxW, temperature=temperature, chunk_size=chunk)


@jax.jit
def unpack(x_RxW, source_BxT, valid_BxT):
    """Per-token packed results back to [B, T]: x at each response token's predicting position, 0 elsewhere."""
    return jnp.where(valid_BxT, x_RxW.reshape(-1)[source_BxT], 0.0)
