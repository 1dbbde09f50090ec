"""Packed micro-batches: several (prompt + response) sequences per row, a few fixed row shapes for every pass of a run.

    shape = PackShape.of(micro, min_rows, prompt_len=S_max, resp_len=T)   # rows of W = S_max + T and narrower ones
    plan = plan_packed(ids_BxL, attn_BxL, resp_BxT, shape)               # host: which sequence goes where
    for m in plan.micros: ...  m.ids_RxW, m.segments_RxW, m.positions_RxW, m.targets_RxC, m.source_BxT, m.in_B

Length-grouped micro-batches (train/micro.py) need one program per (rows, response width) shape and prompt bucket,
and pad each row to its shape's width. Packing puts whole sequences, unpadded (prompt tokens then response
tokens), one after the other into rows (first fit, longest first, at most `slots` sequences a row). The shapes
(`PackShape.micros`, g2rl_jax/shapes/layouts.py) do not depend on the step's lengths or prompt bucket: rows of W =
(largest prompt bucket) + (response budget) at micro, micro/2, ... rows down to the row shards, and the row shards'
count of rows at narrower widths (by default 9: 3 per octave down to W/8), so a pass compiles once per shape and a
pass's last micro-batches hold about the tokens left (`plan_micros`: the cover of least cost): padding is a row's
tail and the rounding of the last micro-batch to the nearest narrower width. A token attends to the causal tokens
of its own sequence only (segment ids, model.attention; on the xla backend block-sparse, PackShape.block:
model/packed_attention.py) and sits at its position in its own sequence, so each sequence computes what it
computes alone (tests/test_packing.py: equal to the unpacked pass within float tolerance).

Per-token results are gathered back to the [B, T] layout of a Batch on device (`unpack`), inside each pass's
program: the losses, the advantages and every per-row sum then run on the usual layout, over the same tokens.
Φ, a per-response sum over its tokens (eq. seq-feature), is accumulated per sequence slot inside the vocabulary
scan (`packed_stats`). Shape letters: R packed rows, W their width, K sequence slots of a row.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from g2rl_jax import g2rl
from g2rl_jax.shapes.layouts import SLOTS, PackShape, micro_cost


def first_fit(n_B, r_B, width: int, rows: int = 0, slots: int = 0, head: int = 0):
    """First fit of sequences of n_B tokens (r_B of them response tokens), in the order given, into rows of `width`:
    each into the first row with room (and fewer than `slots` sequences, slots > 0, and at most `head` response
    tokens, head > 0); a new row when none has, up to `rows` (0: no limit). (row_B, offset_B, slot_B, rows used);
    row -1: not placed."""
    row_B, offset_B, slot_B = np.full(len(n_B), -1), np.zeros(len(n_B), int), np.zeros(len(n_B), int)
    used, count, answers = [], [], []
    for b, (n, r_) in enumerate(zip(n_B, r_B)):
        r = next((i for i, u in enumerate(used) if u + n <= width and (not slots or count[i] < slots)
                  and (not head or answers[i] + r_ <= head)), len(used))
        if r == len(used):
            if (rows and r == rows) or n > width or (head and r_ > head):
                continue
            used.append(0)
            count.append(0)
            answers.append(0)
        row_B[b], offset_B[b], slot_B[b] = r, used[r], count[r]
        used[r] += n
        count[r] += 1
        answers[r] += r_
    return row_B, offset_B, slot_B, len(used)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each sequence lies: row_B and offset_B (its first token's column) and slot_B (its index among its
    row's sequences); width W of every row; R rows."""

    row_B: np.ndarray
    offset_B: np.ndarray
    width: int
    rows: int
    slot_B: np.ndarray | None = None


def pack(prompt_lengths_B, response_lengths_B, width: int, rows: int = 0, slots: int = 0, head: int = 0) -> PackPlan:
    """First-fit decreasing: sequences of prompt + response tokens, longest first, each into the first row with room
    (first_fit's limits). `rows`: at least this many rows (a fixed shape); raises ValueError when a sequence is
    longer than `width` or the sequences need more than `rows` rows (rows > 0)."""
    r_B = np.asarray(response_lengths_B, int)
    n_B = np.asarray(prompt_lengths_B, int) + r_B
    if n_B.size and n_B.max() > width:
        raise ValueError(f"a sequence of {n_B.max()} tokens does not fit a packed row of {width}; raise the width")
    order = np.argsort(-n_B, kind="stable")
    row_B, offset_B, slot_B = (np.zeros(len(n_B), int) for _ in range(3))
    row_B[order], offset_B[order], slot_B[order], used = first_fit(n_B[order], r_B[order], width, 0, slots, head)
    if rows and used > rows:
        raise ValueError(f"{len(n_B)} sequences need {used} packed rows of {width} tokens, more than {rows}")
    return PackPlan(row_B, offset_B, width, max(rows, used), slot_B)


BEAM, BEAM_DEPTH = 2, 6  # plan_micros: shapes tried per filled micro-batch, and over how many micro-batches


def plan_micros(n_B, r_B, shape: PackShape) -> list[tuple[int, int, np.ndarray, PackPlan]]:
    """Micro-batches of sequences of n_B tokens (r_B response tokens) at shape.micros, of least total
    micro.micro_cost: (rows, width, the sequences' indices, their PackPlan) each. A search over chains: each link
    either holds all the sequences left (the cheapest shape that does, first fit decreasing) or fills one of the
    BEAM largest shapes of at most the tokens left (first fit decreasing, longest first: they need the widest rows)
    and leaves the rest to the next link; every micro-batch's rows as wide as its longest sequence."""
    n_B, r_B = np.asarray(n_B, int), np.asarray(r_B, int)

    def fill(left, rows, width):
        row, off, slot, _ = first_fit(n_B[left], r_B[left], width, rows, shape.slots, shape.outputs(width))
        placed = row >= 0
        return placed, (rows, width, left[placed], PackPlan(row[placed], off[placed], width, rows, slot[placed]))

    def best(left, depth):
        need, top = int(n_B[left].sum()), left[0]  # the longest sequence left
        fits = [m for m in shape.micros if m[1] >= n_B[top] and shape.outputs(m[1]) >= r_B[top]]
        if not fits:
            raise ValueError(f"a sequence of {n_B[top]} tokens does not fit a packed row of {shape.width}; raise the "
                             "width")
        out = None
        for rows, width in sorted((m for m in fits if m[0] * m[1] >= need), key=lambda m: micro_cost(*m)):
            placed, micro = fill(left, rows, width)
            if placed.all():
                out = (micro_cost(rows, width), [micro])
                break
        below = sorted((m for m in fits if m[0] * m[1] < need), key=lambda m: (-m[0] * m[1], -m[1]))
        for rows, width in below[:BEAM if depth < BEAM_DEPTH else int(out is None)]:
            placed, micro = fill(left, rows, width)
            sub = best(left[~placed], depth + 1) if not placed.all() else (0, [])
            cost = micro_cost(rows, width) + sub[0]
            if out is None or cost < out[0]:
                out = (cost, [micro] + sub[1])
        if out is None:  # nothing below the tokens left and no cover: the largest shape, again
            rows, width = max(fits, key=lambda m: m[0] * m[1])
            placed, micro = fill(left, rows, width)
            sub = best(left[~placed], depth + 1) if not placed.all() else (0, [])
            out = (micro_cost(rows, width) + sub[0], [micro] + sub[1])
        return out

    return best(np.argsort(-n_B, kind="stable"), 0)[1] if len(n_B) else []


@dataclasses.dataclass(frozen=True)
class Packed:
    """Host arrays of a packed micro-batch: ids, segment ids (sequence b of the batch is segment b + 1; 0 padding)
    and positions in the own sequence [R, W]; predict_RxC: the columns whose next-token outputs the passes compute
    (the positions that predict response tokens, in order; all W columns with head 0), and at those their targets
    and sequence slots (0..K-1; K on padding) [R, C]; source_BxT: the flat index (row * C + output column) of the
    output that is response token t of sequence b,
    valid_BxT: whether that token exists in this micro-batch; in_B: sequence b is in it; slot_B: its flat slot
    (row * K + slot; 0 when not in it)."""

    ids_RxW: np.ndarray
    segments_RxW: np.ndarray
    positions_RxW: np.ndarray
    targets_RxC: np.ndarray
    source_BxT: np.ndarray
    valid_BxT: np.ndarray
    slots_RxC: np.ndarray | None = None
    in_B: np.ndarray | None = None
    slot_B: np.ndarray | None = None
    predict_RxC: np.ndarray | None = None


def packed_inputs(input_ids_BxL, attention_mask_BxL, response_mask_BxT, plan: PackPlan, keep_B=None,
                  slots: int = SLOTS, head: int = 0) -> Packed:
    """Pack the real tokens of a Batch's host arrays ([B, S+T], prompts left- and responses right-padded) by
    `plan` (pack's, from the lengths of the rows keep_B, default all; the others are left out). A sequence's
    response is its attention mask's tokens after S; valid_BxT marks its tokens that response_mask keeps."""
    ids_BxL, attn_BxL = np.asarray(input_ids_BxL), np.asarray(attention_mask_BxL) != 0
    resp_BxT = np.asarray(response_mask_BxT) != 0
    b, t = resp_BxT.shape
    s = ids_BxL.shape[1] - t
    R, W = plan.rows, plan.width
    C = head or W
    ids, seg, pos = (np.zeros((R, W), np.int32) for _ in range(3))
    tgt, slot_RxC = np.zeros((R, C), np.int32), np.full((R, C), slots, np.int32)
    predict = np.tile(np.arange(W, dtype=np.int32), (R, 1)) if not head else np.zeros((R, C), np.int32)
    outputs = np.zeros(R, int)  # head > 0: output columns used in each row
    source, valid = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
    in_B, slot_B = np.zeros(b, bool) if keep_B is None else np.asarray(keep_B, bool).copy(), np.zeros(b, np.int32)
    rows_B = np.arange(b) if keep_B is None else np.flatnonzero(keep_B)
    for j, i in enumerate(rows_B):
        tokens = ids_BxL[i][attn_BxL[i]]
        n, r, o = len(tokens), plan.row_B[j], plan.offset_B[j]
        prompt = int(attn_BxL[i, :s].sum())
        ids[r, o:o + n], seg[r, o:o + n], pos[r, o:o + n] = tokens, i + 1, np.arange(n)
        resp = n - prompt
        predicting = o + prompt - 1 + np.arange(resp)  # position p-1+j predicts response token j
        if head:
            cols = outputs[r] + np.arange(resp)
            outputs[r] += resp
            predict[r, cols], tgt[r, cols] = predicting, tokens[prompt:]
        else:
            cols = predicting
            tgt[r, o:o + n - 1] = tokens[1:]
        if plan.slot_B is not None:
            slot_RxC[r, cols] = plan.slot_B[j]
            slot_B[i] = r * slots + plan.slot_B[j]
        source[i, :resp] = r * C + cols
        valid[i, :resp] = resp_BxT[i, :resp]
        in_B[i] = True
    return Packed(ids, seg, pos, tgt, source, valid, slot_RxC, in_B, slot_B, predict)


def sequence_lengths(attention_mask_BxL, resp_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens [B], response tokens [B]) of a Batch's host attention mask."""
    attn = np.asarray(attention_mask_BxL) != 0
    s = attn.shape[1] - resp_len
    return attn[:, :s].sum(axis=1), attn[:, s:].sum(axis=1)


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """The packed micro-batches of some rows (host arrays), and the positions they compute and how many of those are
    padding (no sequence's token)."""

    micros: tuple[Packed, ...]
    positions: int
    padding: int


def plan_packed(input_ids_BxL, attention_mask_BxL, response_mask_BxT, shape: PackShape, keep_B=None) -> PackedPlan:
    """Pack the rows keep_B (default all) of a Batch's host arrays into micro-batches of `shape` (plan_micros), each
    micro-batch's arrays on its own."""
    t = np.shape(response_mask_BxT)[1]
    prompt_B, resp_B = sequence_lengths(attention_mask_BxL, t)
    keep_B = np.ones(len(prompt_B), bool) if keep_B is None else np.asarray(keep_B, bool)
    rows_B = np.flatnonzero(keep_B)
    micros, positions = [], 0
    for rows, width, idx, sub in plan_micros((prompt_B + resp_B)[rows_B], resp_B[rows_B], shape):
        order = np.argsort(rows_B[idx])  # packed_inputs takes the plan in the batch's row order
        sub = PackPlan(sub.row_B[order], sub.offset_B[order], width, rows, sub.slot_B[order])
        keep = np.zeros(len(keep_B), bool)
        keep[rows_B[idx]] = True
        micros.append(packed_inputs(input_ids_BxL, attention_mask_BxL, response_mask_BxT, sub, keep, shape.slots,
                                    shape.outputs(width) if shape.head else 0))
        positions += rows * width
    return PackedPlan(tuple(micros), positions, positions - int((prompt_B + resp_B)[rows_B].sum()))


# ------------------------------------------------------------------------------------------- device side
def packed_stats(h_RxWxD, w_VxD, targets_RxC, alpha_RxW, slots_RxC, *, slots: int, temperature: float, chunk: int):
    """(log-probs [R, W], entropies [R, W], Φ [R, K, D]) of packed rows in one chunked vocabulary scan: g2rl's
    token_stats (eqs. head-softmax, token-feature, seq-feature, efficient), with Φ's vocabulary-space sum
    Σ_t α̃_t (e(y_t) − p_t) kept per sequence slot (slots_RxC: each position's slot, K on padding)."""
    temperature, chunk = g2rl._static_chunking(temperature, chunk, h_RxWxD.shape[1])

    def body(q_RxKxV, xs):
        h_RxCxD, y_RxC, a_RxC, k_RxC = xs
        u_RxCxV = g2rl._chunk_logits(h_RxCxD, w_VxD, temperature)
        m_RxC, e_RxCxV, s_RxC, _, logp_RxC = g2rl._chunk_normaliser(u_RxCxV, y_RxC)
        ent_RxC = jnp.log(s_RxC) - jnp.sum(e_RxCxV * (u_RxCxV + (-m_RxC)[..., None]), axis=-1) / s_RxC
        onehot_RxCxK = jax.nn.one_hot(k_RxC, slots, dtype=jnp.float32) * (a_RxC / s_RxC)[..., None]
        q_RxKxV = q_RxKxV + jnp.einsum("rck,rcv->rkv", onehot_RxCxK, e_RxCxV, preferred_element_type=jnp.float32)
        return q_RxKxV, (logp_RxC, ent_RxC)

    r, vocab = h_RxWxD.shape[0], w_VxD.shape[0]
    q_RxKxV, (logp, ent) = g2rl._scan_positions(body, jnp.zeros((r, slots, vocab), jnp.float32),
                                                (h_RxWxD, targets_RxC, alpha_RxW, slots_RxC), chunk)
    rows_RxW = jnp.broadcast_to(jnp.arange(r)[:, None], targets_RxC.shape)
    onehots_RxKxV = jnp.zeros((r, slots, vocab), jnp.float32).at[rows_RxW, slots_RxC, targets_RxC].add(
        alpha_RxW, mode="drop")
    r_RxKxV = onehots_RxKxV - q_RxKxV  # eq. token-feature summed with α̃ per sequence: Φ = Wᵀ r
    phi_RxKxD = jnp.einsum("rkv,vd->rkd", r_RxKxV.astype(w_VxD.dtype), w_VxD, preferred_element_type=jnp.float32)
    return logp, ent, phi_RxKxD


def to_packed(x_BxT, source_BxT, valid_BxT, shape_RxW):
    """[B, T] per-token values placed at their outputs of the packed rows [R, C] (0 elsewhere)."""
    flat = jnp.zeros(shape_RxW[0] * shape_RxW[1], x_BxT.dtype)
    return flat.at[source_BxT].add(jnp.where(valid_BxT, x_BxT, 0)).reshape(shape_RxW)


def unpack(x_RxW, source_BxT, valid_BxT):
    """Per-token packed results back to [B, T]: x at each response token's predicting position, 0 elsewhere."""
    return jnp.where(valid_BxT, x_RxW.reshape(-1)[source_BxT], 0.0)
