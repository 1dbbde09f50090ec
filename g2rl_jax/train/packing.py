"""Packed micro-batches for the PPO update (verl's remove-padding, MaxText's packing): a prototype to time against
the length grouping of train.micro.

Each response's segment (its real prompt tokens, then its response tokens up to the last response_mask 1) is
placed in a row of capacity C = S + T, several segments per row (first-fit decreasing by length). A packed row's
attention mask holds segment ids (0 padding, 1, 2, ...): positions restart at each segment and tokens attend within
their segment (model.qwen3.positions_from_mask, model.attention), so every segment computes what its own row did.

    plan = plan_packing(attention_mask_BxL, response_mask_BxT, micro)   # host: placements, index arrays
    grads, loss, diag = packed_gradients(graphdef, params, mini, settings=s, micro=micro)   # == step.gradients

Micro-batch u holds `micro` packed rows (the last one padded with empty rows) cut to the width W_u =
width_bucket(its fullest row), capped at C. After its model pass, the hidden states of the positions that predict a
response token are gathered into [O, M_u] (M_u = width_bucket(their count / O), so the LM head runs on the response
tokens only, as in the grouped pass, not on prompts or padding); log-probs (and entropy) there are gathered into the
[X, T] response layout of its X responses (X: a power of two, padded responses have mask 0; these are per-token
scalars, so the full T costs little) and step.loss_from_logprobs runs as in step.policy_loss. Compiled shapes: one per
(W_u, M_u, X_u), W_u and M_u on micro.width_bucket's ladder, X_u on powers of two. Responses with an empty
response_mask cost nothing (they add 0 to every sum; the seq-mean modes still divide by all B rows, as
step.gradients does). Single-process prototype (the plan reads the whole mini-batch's masks on the host). Shape
letters: O packed rows of a micro-batch, W their width, M the predicting positions per packed row, X responses
of a micro-batch.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import g2rl, parallel
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import step as train_step


def count_bucket(n: int) -> int:
    """Rows of a micro-batch's response layout for n responses: the next power of two (at least 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["src_OxW", "seg_OxW", "pred_OxM", "resp_X", "hidx_XxT"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedMicro:
    """Index arrays of one packed micro-batch (int32): src_OxW flat index into the mini-batch's input_ids [B·L]
    (0 at padding); seg_OxW segment ids (0 padding); pred_OxM flat index into the packed [O·W] layout of the
    positions that predict a response token (-1 padding); resp_X the mini-batch row of each response (-1 padding);
    hidx_XxT flat index into pred's [O·M] of the position predicting response token t (0 past the response)."""

    src_OxW: np.ndarray
    seg_OxW: np.ndarray
    pred_OxM: np.ndarray
    resp_X: np.ndarray
    hidx_XxT: np.ndarray


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """row_B / offset_B: packed row and start of each response's segment (-1: empty response, not placed);
    length_B: segment lengths (prompt + response); micros: one PackedMicro per micro-batch; capacity C; positions /
    padding: sequence positions the micro-batches process ([micro, W_u] each) and how many of them are padding."""

    row_B: np.ndarray
    offset_B: np.ndarray
    length_B: np.ndarray
    micros: tuple[PackedMicro, ...]
    capacity: int
    positions: int
    padding: int

    @property
    def shapes(self) -> set[tuple[int, int, int]]:
        """Distinct compiled shapes (W_u, M_u, X_u)."""
        return {(m.src_OxW.shape[1], m.pred_OxM.shape[1], m.hidx_XxT.shape[0]) for m in self.micros}


def _segments(attention_mask_BxL, response_mask_BxT):
    """Host: real prompt tokens p_B and response lengths n_B, checking that segments are contiguous."""
    attn = np.asarray(attention_mask_BxL) != 0
    t = np.shape(response_mask_BxT)[1]
    s = attn.shape[1] - t
    resp_B = micro_lib.response_lengths(response_mask_BxT)
    prompt_B = attn[:, :s].sum(axis=1)
    for b in np.flatnonzero(resp_B):
        if prompt_B[b] < 1 or not attn[b, s - prompt_B[b]:s + resp_B[b]].all():
            raise ValueError(f"packing: row {b} is not a left-padded prompt (>= 1 token) followed by its response "
                             "without holes in the attention mask; packing needs contiguous segments")
    return prompt_B, resp_B


def _first_fit_decreasing(length_B, capacity: int):
    """Host: (row_B, offset_B, fill_O) placing each segment of length > 0 in the first row with room (longest first)."""
    row_B, offset_B = np.full(len(length_B), -1), np.full(len(length_B), -1)
    fill_O: list[int] = []
    for b in np.argsort(-length_B, kind="stable"):
        n = int(length_B[b])
        if n == 0:
            continue
        r = next((r for r, f in enumerate(fill_O) if f + n <= capacity), len(fill_O))
        if r == len(fill_O):
            fill_O.append(0)
        row_B[b], offset_B[b] = r, fill_O[r]
        fill_O[r] += n
    return row_B, offset_B, np.asarray(fill_O, int)


def plan_packing(attention_mask_BxL, response_mask_BxT, micro: int, *, capacity: int | None = None) -> PackPlan:
    """Pack a mini-batch's segments into rows of `capacity` (default S + T) and cut them into micro-batches of
    `micro` packed rows (host numpy in, plan out); see the module docstring."""
    attn = np.asarray(attention_mask_BxL)
    seq_len = attn.shape[1]
    t = np.shape(response_mask_BxT)[1]
    s = seq_len - t
    capacity = seq_len if capacity is None else int(capacity)
    if micro < 1:
        raise ValueError(f"packing: micro must be >= 1; got {micro}")
    prompt_B, resp_B = _segments(attn, response_mask_BxT)
    length_B = np.where(resp_B > 0, prompt_B + resp_B, 0)
    if length_B.max(initial=0) > capacity:
        raise ValueError(f"packing: a segment of {length_B.max()} tokens does not fit a row of capacity {capacity}")
    row_B, offset_B, fill_O = _first_fit_decreasing(length_B, capacity)
    micros, positions = [], 0
    for u in range(max(-(-len(fill_O) // micro), 1)):
        rows = range(u * micro, min((u + 1) * micro, len(fill_O)))
        width = min(micro_lib.width_bucket(max((fill_O[r] for r in rows), default=1)), capacity)
        src_OxW, seg_OxW = np.zeros((micro, width), np.int32), np.zeros((micro, width), np.int32)
        resp = [b for b in np.flatnonzero(row_B >= u * micro) if row_B[b] < (u + 1) * micro]
        n_pred = sum(int(resp_B[b]) for b in resp)
        pred_OxM = np.full((micro, min(micro_lib.width_bucket(-(-n_pred // micro)), width)), -1, np.int32)
        resp_X = np.full(count_bucket(len(resp)), -1, np.int32)
        hidx_XxT = np.zeros((len(resp_X), t), np.int32)
        start = 0
        for r in rows:  # segment ids 1, 2, ... in order of offset within each row
            for k, b in enumerate(sorted(np.flatnonzero(row_B == r), key=lambda b: offset_B[b])):
                o, n, p = offset_B[b], length_B[b], prompt_B[b]
                src_OxW[r - u * micro, o:o + n] = b * seq_len + np.arange(s - p, s + resp_B[b])
                seg_OxW[r - u * micro, o:o + n] = k + 1
        for x, b in enumerate(resp):
            resp_X[x] = b
            base = (row_B[b] - u * micro) * width + offset_B[b] + prompt_B[b] - 1
            pred_OxM.reshape(-1)[start:start + resp_B[b]] = base + np.arange(resp_B[b])
            hidx_XxT[x, :resp_B[b]] = start + np.arange(resp_B[b])
            start += resp_B[b]
        micros.append(PackedMicro(src_OxW, seg_OxW, pred_OxM, resp_X, hidx_XxT))
        positions += micro * width
    return PackPlan(row_B, offset_B, length_B, tuple(micros), capacity, positions, positions - int(length_B.sum()))


def plan_for(batch: train_step.Batch, micro: int, *, capacity: int | None = None) -> PackPlan:
    """plan_packing for a Batch (its masks read on the host)."""
    return plan_packing(parallel.gather(batch.attention_mask), parallel.gather(batch.response_mask), micro,
                        capacity=capacity)


def packing_counts(batch: train_step.Batch, micro: int, *, capacity: int | None = None) -> tuple[int, int]:
    """(positions, padding) the packed micro-batches of `batch` process, as MicroPlan.positions / .padding."""
    plan = plan_for(batch, micro, capacity=capacity)
    return plan.positions, plan.padding


def _take_responses(x_BxT, pm: PackedMicro):
    """Rows resp_X of a [B, T] array, 0 on padded responses."""
    valid_X = pm.resp_X >= 0
    x_XxT = jnp.take(x_BxT, jnp.maximum(pm.resp_X, 0), axis=0)[:, :pm.hidx_XxT.shape[1]]
    return jnp.where(valid_X[:, None], x_XxT, 0).astype(x_BxT.dtype)


def _packed_loss(params, graphdef, mini: train_step.MiniBatch, pm: PackedMicro, s: train_step.LossSettings):
    """step.policy_loss on one packed micro-batch: model pass on [O, W] with segment masks, the LM head on the
    [O, M] predicting positions, per-token scalars gathered into [X, T], then step.loss_from_logprobs as there."""
    model = nnx.merge(graphdef, params)
    ids_OW = jnp.where(pm.seg_OxW > 0, jnp.take(mini.batch.input_ids.reshape(-1), pm.src_OxW), 0).reshape(-1)
    h_OxWxD = model.hidden_states(ids_OW.reshape(pm.src_OxW.shape), pm.seg_OxW)
    pred_OxM = jnp.maximum(pm.pred_OxM, 0)
    h_OxMxD = jnp.take(h_OxWxD.reshape(-1, h_OxWxD.shape[-1]), pred_OxM, axis=0)
    targets_OxM = jnp.take(ids_OW, pred_OxM + 1, mode="clip")  # the next token of the segment
    head = train_step._head(model, h_OxMxD)
    mask_XxT = _take_responses(mini.batch.response_mask, pm)
    if s.entropy_coef:
        logp_OxM, ent_OxM, _ = g2rl.token_stats(h_OxMxD, head, targets_OxM, (pm.pred_OxM >= 0).astype(jnp.float32),
                                                temperature=s.temperature, chunk_size=s.chunk)
        ent = ent_OxM.reshape(-1)[pm.hidx_XxT]
    else:
        logp_OxM = g2rl.token_logprobs(h_OxMxD, head, targets_OxM, temperature=s.temperature, chunk_size=s.chunk)
        ent = None
    logp = logp_OxM.reshape(-1)[pm.hidx_XxT]
    adv_X = jnp.where(pm.resp_X >= 0, jnp.take(mini.advantages_B, jnp.maximum(pm.resp_X, 0)), 0.0)
    sampler = None if mini.sampler_logp_BxT is None else _take_responses(mini.sampler_logp_BxT, pm)
    return train_step.loss_from_logprobs(logp, ent, _take_responses(mini.old_logp_BxT, pm),
                                         _take_responses(mini.ref_logp_BxT, pm), sampler, adv_X, mask_XxT, s)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "total_rows"), donate_argnames=("acc",))
def accumulate_packed(graphdef, params, acc, mini: train_step.MiniBatch, pm: PackedMicro, total_tokens, *,
                      settings: train_step.LossSettings, total_rows: int):
    """acc + this packed micro-batch's weighted (gradients, loss, diagnostics), as step.accumulate: w its share of
    the mini-batch loss (its tokens, or its X_u response rows, padded ones adding 0), w_tokens its share of tokens."""
    (loss, diag), grads = train_step.trainable_grad(_packed_loss, params, graphdef, mini, pm, settings)
    return train_step.add_micro(acc, grads, loss, diag, _take_responses(mini.batch.response_mask, pm), settings.agg,
                                total_tokens, total_rows)


def packed_gradients(graphdef, params, mini: train_step.MiniBatch, *, settings: train_step.LossSettings,
                     micro: int, capacity: int | None = None, plan: PackPlan | None = None):
    """(grads f32, loss, diagnostics) of a mini-batch over packed micro-batches of `micro` rows: equal to
    step.gradients (one pass over the whole padded mini-batch). `plan`: a precomputed plan_for(mini.batch, ...)."""
    plan = plan_for(mini.batch, micro, capacity=capacity) if plan is None else plan
    rows = mini.batch.response_mask.shape[0]
    total_tokens = jnp.sum(mini.batch.response_mask)
    acc = None
    for pm in plan.micros:
        pm = jax.tree.map(jnp.asarray, pm)
        if acc is None:
            acc = train_step.zero_accumulator(_packed_loss, graphdef, params, (mini, pm), settings, mini.batch.rewards)
        acc = accumulate_packed(graphdef, params, acc, mini, pm, total_tokens, settings=settings, total_rows=rows)
    return acc


def packed_update(graphdef, params, opt_state, mini: train_step.MiniBatch, *, optimizer, settings, micro: int,
                  capacity: int | None = None):
    """One optimizer update: packed_gradients, then step.apply_gradients (params and opt_state donated); the
    signature and returns of step.update."""
    grads, loss, diag = packed_gradients(graphdef, params, mini, settings=settings, micro=micro, capacity=capacity)
    return train_step.apply_gradients(params, opt_state, grads, loss, diag, optimizer=optimizer)
