"""The score, reference and gradient passes of a step over packed micro-batches (train/packing.py), with the
signatures of train/step.py's: each takes `shapes`, the run's layout, and runs the packed passes for a
shapes.layouts.PackShape or step.py's length-grouped ones for a shapes.layouts.ShapeSet.

    scores = score(graphdef, params, batch, temperature=T, micro=16, shapes=shape)        # Scores, [B, T] / [B, D]
    ref    = ref_logprobs(graphdef, ref_params, batch, temperature=T, micro=16, shapes=shape)
    params, opt_state, info = update(graphdef, params, opt_state, mini, optimizer=opt, settings=s, micro=16,
                                     shapes=shape, rule=rule)

A packed pass packs the rows on the host (plan_packed), places each micro-batch's [R, W] arrays with the batch's row
sharding and runs one program per micro-batch; each program gathers its per-token results back to the [B, T]
layout itself (packing.unpack) and adds them to the pass's accumulators (donated), so no program moves rows in or
out and a pass compiles one program per (rows, width) of the shape, whatever the prompt bucket. The gradient program
computes the policy loss of update.loss_from_logprobs on that [X, T] layout (X the mini-batch's rows, those of other
micro-batches masked out), so every aggregation mode, the sequence-level ratio and the token rules see the tokens
the unpacked loss sees; each micro-batch's share of the mini-batch mean is update.add_micro's.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import g2rl, methods, parallel
from g2rl_jax.shapes.layouts import PackShape
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import packing
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["ids_RxW", "segments_RxW", "positions_RxW", "targets_RxC", "slots_RxC",
                                "source_BxT", "valid_BxT", "in_B", "slot_B", "predict_RxC"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedMicro:
    """One packed micro-batch on device (packing.Packed's arrays)."""

    ids_RxW: jax.Array
    segments_RxW: jax.Array
    positions_RxW: jax.Array
    targets_RxC: jax.Array
    slots_RxC: jax.Array
    source_BxT: jax.Array
    valid_BxT: jax.Array
    in_B: jax.Array
    slot_B: jax.Array
    predict_RxC: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["micro", "response_mask_BxT", "old_logp_BxT", "ref_logp_BxT", "advantages_B",
                                "sampler_logp_BxT", "token_weight_BxT", "abs_log_ratio_coef_BxT"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedMini:
    """A packed micro-batch of a mini-batch and the mini-batch's per-row arrays [X, T] / [X] (MiniBatch's, less
    the token ids, which are in the packed rows): what the gradient program takes."""

    micro: PackedMicro
    response_mask_BxT: jax.Array
    old_logp_BxT: jax.Array
    ref_logp_BxT: jax.Array
    advantages_B: jax.Array
    sampler_logp_BxT: jax.Array | None = None
    token_weight_BxT: jax.Array | None = None
    abs_log_ratio_coef_BxT: jax.Array | None = None

    @classmethod
    def of(cls, micro: PackedMicro, mini: train_step.MiniBatch) -> "PackedMini":
        return cls(micro, mini.batch.response_mask, mini.old_logp_BxT, mini.ref_logp_BxT, mini.advantages_B,
                   mini.sampler_logp_BxT, mini.token_weight_BxT, mini.abs_log_ratio_coef_BxT)


def _sharding(rows: int, like_B):
    """Where an array of `rows` rows goes: rows split like like_B's where they divide evenly, else replicated."""
    sharding = getattr(like_B, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    split = sharding.spec[0] if len(sharding.spec) and rows % micro_lib.row_shards(like_B) == 0 else None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(split))


def _place(x: np.ndarray, like_B):
    """Host array x on like_B's devices (_sharding)."""
    target = _sharding(x.shape[0], like_B)
    if not isinstance(target, jax.sharding.NamedSharding):
        return jax.device_put(x, target)
    return jax.make_array_from_callback(x.shape, target, lambda index: x[index])


def on_device(p: packing.Packed, like_B) -> PackedMicro:
    """A host packed micro-batch placed on like_B's devices."""
    return PackedMicro(*(_place(np.asarray(getattr(p, f.name)), like_B)
                         for f in dataclasses.fields(PackedMicro)))


def template(shape: PackShape, micro: tuple[int, int], batch_rows: int, resp_len: int, like_B) -> PackedMicro:
    """The abstract packed micro-batch (shapes, dtypes, placements of on_device's) of one of shape.micros, (rows,
    row width), for batches of batch_rows x resp_len: what the warm-up lowers the programs over."""
    def spec(*dims, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=_sharding(dims[0], like_B))

    rows, w = micro
    c = shape.outputs(w)
    return PackedMicro(spec(rows, w), spec(rows, w), spec(rows, w), spec(rows, c), spec(rows, c),
                       spec(batch_rows, resp_len), spec(batch_rows, resp_len, dtype=jnp.bool_),
                       spec(batch_rows, dtype=jnp.bool_), spec(batch_rows), spec(rows, c))


def plan(batch: train_step.Batch, shape: PackShape, in_loss: bool = False) -> packing.PackedPlan:
    """The packed micro-batches of a (global) Batch's rows: all of them, or with in_loss only those with a response
    token in the loss (the gradient's)."""
    resp = parallel.gather(batch.response_mask)
    keep = resp.any(axis=1) if in_loss else None
    return packing.plan_packed(parallel.gather(batch.input_ids), parallel.gather(batch.attention_mask), resp, shape,
                               keep)


def plan_for(batch: train_step.Batch, micro: int, *, shapes, in_loss: bool = False):
    """The plan a pass runs over (positions and padding, for the step's metrics): packed or length-grouped."""
    if isinstance(shapes, PackShape):
        return plan(batch, shapes, in_loss)
    return micro_lib.plan_for(batch, micro, shapes=shapes)


def _hidden(model, m: PackedMicro, block: int):
    """The final hidden states at the output columns [R, C, D] (those that predict response tokens), and the head;
    block: the packed attention's (PackShape.block)."""
    h_RxWxD = model.hidden_states(m.ids_RxW, m.segments_RxW, positions=m.positions_RxW, block=block)
    h_RxCxD = jnp.take_along_axis(h_RxWxD, m.predict_RxC[..., None], axis=1)
    return h_RxCxD, model.lm_head_weight().astype(h_RxWxD.dtype)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk", "slots", "block"),
                   donate_argnames=("acc",))
def score_micro(graphdef, params, acc, m: PackedMicro, response_mask_BxT, *, temperature: float, chunk: int,
                slots: int, block: int = 0):
    """acc + one packed micro-batch's (log-probs [B, T], entropies [B, T], Φ [B, D]) of its sequences (eq.
    seq-feature: α̃ over each response's own tokens, response_mask_BxT)."""
    h_RxCxD, head = _hidden(nnx.merge(graphdef, params), m, block)
    mask_BxT = response_mask_BxT.astype(jnp.float32)
    alpha_BxT = mask_BxT / (jnp.sum(mask_BxT, axis=-1, keepdims=True) + g2rl.EPS)  # eq. seq-feature
    alpha_RxC = packing.to_packed(alpha_BxT, m.source_BxT, m.valid_BxT, m.targets_RxC.shape)
    logp, ent, phi_RxKxD = packing.packed_stats(h_RxCxD, head, m.targets_RxC, alpha_RxC, m.slots_RxC, slots=slots,
                                                temperature=temperature, chunk=chunk)
    phi_BxD = jnp.where(m.in_B[:, None], phi_RxKxD.reshape(-1, phi_RxKxD.shape[-1])[m.slot_B], 0.0)
    logp_acc, ent_acc, phi_acc = acc
    return (logp_acc + packing.unpack(logp, m.source_BxT, m.valid_BxT),
            ent_acc + packing.unpack(ent, m.source_BxT, m.valid_BxT), phi_acc + phi_BxD)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk", "block"), donate_argnames=("acc",))
def ref_micro(graphdef, params, acc, m: PackedMicro, *, temperature: float, chunk: int, block: int = 0):
    """acc + one packed micro-batch's log-probs [B, T] of its sequences' response tokens."""
    h_RxCxD, head = _hidden(nnx.merge(graphdef, params), m, block)
    logp = g2rl.token_logprobs(h_RxCxD, head, m.targets_RxC, temperature=temperature, chunk_size=chunk)
    return acc + packing.unpack(logp, m.source_BxT, m.valid_BxT)


def _scores(graphdef, params, batch: train_step.Batch, shape: PackShape, *, temperature: float, chunk: int,
            in_loss: bool = False):
    b, t = batch.response_mask.shape
    acc = (train_step.zeros_rows(batch.rewards, (b, t)), train_step.zeros_rows(batch.rewards, (b, t)),
           train_step.zeros_rows(batch.rewards, (b, graphdef_hidden(graphdef, params))))
    for p in plan(batch, shape, in_loss).micros:
        acc = score_micro(graphdef, params, acc, on_device(p, batch.rewards), batch.response_mask,
                          temperature=temperature, chunk=chunk, slots=shape.slots, block=shape.block)
        train_step.serialize_across_processes(acc)
    return acc


graphdef_hidden = train_step.hidden_size  # the model's hidden size D (Φ's width), found once per model


def score(graphdef, params, batch: train_step.Batch, *, temperature: float, micro: int, shapes,
          chunk: int = g2rl.DEFAULT_CHUNK) -> train_step.Scores:
    """Behaviour-policy pass (log-probs, entropies, Φ; eq. seq-feature) over packed micro-batches (PackShape) or
    step.score's length-grouped ones."""
    if not isinstance(shapes, PackShape):
        return train_step.score(graphdef, params, batch, temperature=temperature, micro=micro, chunk=chunk,
                                shapes=shapes)
    return train_step.Scores(*_scores(graphdef, params, batch, shapes, temperature=temperature, chunk=chunk))


def ref_logprobs(graphdef, params, batch: train_step.Batch, *, temperature: float, micro: int, shapes,
                 chunk: int = g2rl.DEFAULT_CHUNK):
    """Reference-model log-probs [B, T] over packed micro-batches (PackShape) or step.ref_logprobs's."""
    if not isinstance(shapes, PackShape):
        return train_step.ref_logprobs(graphdef, params, batch, temperature=temperature, micro=micro, chunk=chunk,
                                       shapes=shapes)
    acc = train_step.zeros_rows(batch.rewards, batch.response_mask.shape)
    for p in plan(batch, shapes).micros:
        acc = ref_micro(graphdef, params, acc, on_device(p, batch.rewards), temperature=temperature, chunk=chunk,
                        block=shapes.block)
        train_step.serialize_across_processes(acc)
    return acc


def policy_loss(params, graphdef, pm: PackedMini, s: train_update.LossSettings, block: int = 0):
    """update.policy_loss on a packed micro-batch: the forward over the packed rows, its per-token log-probs (and
    entropies, for the bonus) gathered to the mini-batch's [X, T] layout, the loss over this micro-batch's tokens."""
    m = pm.micro
    h_RxCxD, head = _hidden(nnx.merge(graphdef, params), m, block)
    ent = None
    if s.entropy_coef:
        logp, ent, _ = g2rl.token_stats(h_RxCxD, head, m.targets_RxC, jnp.ones_like(m.targets_RxC),
                                        temperature=s.temperature, chunk_size=s.chunk)
        ent = packing.unpack(ent, m.source_BxT, m.valid_BxT)
    else:
        logp = g2rl.token_logprobs(h_RxCxD, head, m.targets_RxC, temperature=s.temperature, chunk_size=s.chunk)
    mask_XxT = pm.response_mask_BxT * m.in_B[:, None]
    loss, diag = train_update.loss_from_logprobs(
        packing.unpack(logp, m.source_BxT, m.valid_BxT), ent, pm.old_logp_BxT, pm.ref_logp_BxT, pm.sampler_logp_BxT,
        pm.advantages_B, mask_XxT, s, token_weight_BxT=pm.token_weight_BxT,
        abs_log_ratio_coef_BxT=pm.abs_log_ratio_coef_BxT)
    return loss, dict(diag, **{train_update.TOKENS: jnp.sum(mask_XxT)})


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "total_rows", "block"), donate_argnames=("acc",))
def accumulate(graphdef, params, acc, pm: PackedMini, *, settings: train_update.LossSettings, total_rows: int,
               block: int = 0):
    """acc + this packed micro-batch's share of the mini-batch's (loss, gradients, diagnostics): update.accumulate's
    weights (update.add_micro) over its tokens of the [X, T] layout. One program per packed (rows, width): it
    counts the mini-batch's response tokens itself."""
    (loss, diag), grads = train_update.trainable_grad(policy_loss, params, graphdef, pm, settings, block)
    mask_XxT = pm.response_mask_BxT * pm.micro.in_B[:, None]
    return train_update.add_micro(acc, grads, loss, diag, mask_XxT, settings.agg, jnp.sum(pm.response_mask_BxT),
                                  total_rows)


def gradients(graphdef, params, mini: train_step.MiniBatch, *, settings: train_update.LossSettings, shape: PackShape):
    """(grads f32, loss, diagnostics) of a mini-batch over packed micro-batches of its rows with a token in the loss
    (the others add nothing): equal to update.gradients's within float rounding."""
    rows, t = mini.batch.response_mask.shape
    like = PackedMini.of(template(shape, shape.micros[-1], rows, t, mini.batch.rewards), mini)
    acc = train_update.zero_accumulator(policy_loss, graphdef, params, (like,), settings, mini.batch.rewards)
    for p in plan(mini.batch, shape, in_loss=True).micros:
        pm = PackedMini.of(on_device(p, mini.batch.rewards), mini)
        acc = accumulate(graphdef, params, acc, pm, settings=settings, total_rows=rows, block=shape.block)
        train_step.serialize_across_processes(acc)
    return acc


def current_scores(graphdef, params, mini: train_step.MiniBatch, *, temperature: float, shape: PackShape,
                   chunk: int = g2rl.DEFAULT_CHUNK):
    """update.current_scores over packed micro-batches of the mini-batch's rows in the loss (0 on the others)."""
    logp, ent, _ = _scores(graphdef, params, mini.batch, shape, temperature=temperature, chunk=chunk, in_loss=True)
    return logp, ent


def update(graphdef, params, opt_state, mini: train_step.MiniBatch, *, optimizer, settings: train_update.LossSettings,
           micro: int, shapes, rule: train_update.TokenRule | None = None, padded: bool = False):
    """update.update over packed micro-batches (PackShape; the token rule decided on the current policy's packed
    scores) or update.update's length-grouped ones."""
    if not isinstance(shapes, PackShape):
        return train_update.update(graphdef, params, opt_state, mini, optimizer=optimizer, settings=settings,
                                 micro=micro, padded=padded, shapes=shapes, rule=rule)
    if rule is not None and methods.get(rule.algo.exploration).tokens is not None:
        if rule.current is None:
            rule = dataclasses.replace(rule, current=current_scores(graphdef, params, mini,
                                                                    temperature=settings.temperature, shape=shapes,
                                                                    chunk=settings.chunk))
        mini = train_update.decide_tokens(graphdef, params, mini, rule, settings=settings, micro=micro)
    grads, loss, diag = gradients(graphdef, params, mini, settings=settings, shape=shapes)
    return train_update.apply_gradients(params, opt_state, grads, loss, diag, optimizer=optimizer)
