"""The update stage of one RL step: the policy loss (PPO-clip with the KL term and the methods' token terms),
gradients accumulated over micro-batches, the optimizer step, and a method's token rule decided on the current
policy. `update` is the whole stage; train/step.py has the stages before it (batch, scores, advantages) and the
`MiniBatch` it takes; train/passes.py the same over packed rows.

    params, opt_state, info = update(graphdef, params, opt_state, mini, ..., rule=TokenRule(algo, key))
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from g2rl_jax import g2rl, losses, methods
from g2rl_jax.config import AlgorithmConfig
from g2rl_jax.model import lora
from g2rl_jax.shapes.layouts import ShapeSet
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import step as train_step
from g2rl_jax.train.step import MiniBatch, StageError, head, plan, response_hidden


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The static knobs of the policy loss (from AlgorithmConfig and the rollout temperature)."""

    temperature: float
    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg: str
    entropy_coef: float
    kl_coef: float
    kl_kind: str
    ratio_level: str = "token"
    rollout_is_cap: float | None = None
    chunk: int = g2rl.DEFAULT_CHUNK
    clip: bool = True  # the exploration method's (Method.ppo_clip): KL-Cov's loss does not clip the ratio

    @classmethod
    def from_config(cls, algo: AlgorithmConfig, temperature: float) -> "LossSettings":
        return cls(temperature=temperature if temperature > 0 else 1.0, clip_low=algo.clip_low,
                   clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.loss_agg,
                   entropy_coef=algo.entropy_coef, kl_coef=algo.kl_coef, kl_kind=algo.kl_kind,
                   ratio_level=algo.ratio_level, rollout_is_cap=algo.rollout_is_cap,
                   clip=methods.get(algo.exploration).ppo_clip)


def policy_loss(params, graphdef, mb: MiniBatch, s: LossSettings):
    """PPO-clip + β·KL − entropy bonus on one micro-batch (eq. grpo-obj), f32 loss; returns (loss, diagnostics)."""
    model = nnx.merge(graphdef, params)
    batch = mb.batch
    h, targets = response_hidden(model, batch)
    head_VxD = head(model, h)
    if s.entropy_coef:
        logp, ent, _ = g2rl.token_stats(h, head_VxD, targets, batch.response_mask, temperature=s.temperature,
                                        chunk_size=s.chunk)
    else:
        logp, ent = g2rl.token_logprobs(h, head_VxD, targets, temperature=s.temperature, chunk_size=s.chunk), None
    loss, diag = loss_from_logprobs(logp, ent, mb.old_logp_BxT, mb.ref_logp_BxT, mb.sampler_logp_BxT,
                                    mb.advantages_B, batch.response_mask, s, token_weight_BxT=mb.token_weight_BxT,
                                    abs_log_ratio_coef_BxT=mb.abs_log_ratio_coef_BxT)
    return loss, dict(diag, **{TOKENS: jnp.sum(batch.response_mask)})


TOKENS = "response_tokens"  # the diagnostic that counts the tokens in the loss (summed, not averaged, over micros)


def loss_from_logprobs(logp_BxT, entropy_BxT, old_logp_BxT, ref_logp_BxT, sampler_logp_BxT, advantages_B, mask_BxT,
                       s: LossSettings, *, token_weight_BxT=None, abs_log_ratio_coef_BxT=None):
    """losses.ppo_loss with the settings s (eq. grpo-obj) on per-token log-probs (entropy: None without the bonus)
    of some responses and their old / reference / sampler log-probs, advantages and response mask, and the
    exploration method's per-token terms (methods.token_terms; None without a token rule)."""
    if s.rollout_is_cap is not None and sampler_logp_BxT is None:
        raise StageError("update: algorithm.rollout_is_cap needs the sampler's log-probs in the mini-batch "
                         "(MiniBatch.sampler_logp_BxT = Rollout.logprobs_BxT)")
    return losses.ppo_loss(
        logp_BxT, old_logp_BxT, advantages_B, mask_BxT, clip_low=s.clip_low, clip_high=s.clip_high,
        dual_clip=s.dual_clip, agg=s.agg, entropy=entropy_BxT, entropy_coef=s.entropy_coef,
        ref_logp=ref_logp_BxT if s.kl_coef else None, kl_coef=s.kl_coef, kl_kind=s.kl_kind,
        ratio_level=s.ratio_level, sampler_logp=sampler_logp_BxT if s.rollout_is_cap is not None else None,
        is_cap=s.rollout_is_cap, clip=s.clip, token_weight=token_weight_BxT, abs_log_ratio_coef=abs_log_ratio_coef_BxT)


def _micro_weight(mask_BxT, agg: str, total_tokens, total_rows):
    """Share of one micro-batch in the mini-batch mean, so accumulated micro losses equal the mini-batch loss:
    its tokens over the mini-batch's (token-mean), else its rows over the mini-batch's (the seq-mean modes)."""
    if agg == "token-mean":
        return jnp.sum(mask_BxT) / jnp.maximum(total_tokens, 1.0)
    return mask_BxT.shape[0] / total_rows


def all_finite(tree) -> jax.Array:
    """bool scalar: every element of every leaf is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def trainable_grad(loss_fn, params, *args):
    """((loss, aux), gradients) of loss_fn(params, *args) with respect to the trainable part of params only
    (lora.split_trainable: the LoRA adapters, or every parameter without them); the frozen base enters as a
    constant, so no gradient of it is ever formed."""
    trainable, frozen = lora.split_trainable(params)
    return jax.value_and_grad(lambda t: loss_fn(nnx.merge_state(t, frozen), *args), has_aux=True)(trainable)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "total_rows", "width"), donate_argnames=("acc",))
def accumulate(graphdef, params, acc, mini: MiniBatch, rows_X, *, settings: LossSettings, total_rows: int,
               width: int):
    """acc + w·(loss, gradients, pg_loss) + w_tokens·(token-mean diagnostics) of micro-batch rows_X of the
    mini-batch (its responses cut to `width`): w its share of the mini-batch's loss (_micro_weight), w_tokens its
    share of the tokens. acc = (grads f32 like the trainable params, loss, diagnostics). One program per micro-batch
    shape [X, S + T_u] (and loss settings): it takes the rows from the whole mini-batch itself."""
    mb = train_step.take_rows(mini, rows_X, width)
    (loss, diag), grads = trainable_grad(policy_loss, params, graphdef, mb, settings)
    return add_micro(acc, grads, loss, diag, mb.batch.response_mask, settings.agg, jnp.sum(mini.batch.response_mask),
                     total_rows)


def add_micro(acc, grads, loss, diag, mask_XxT, agg: str, total_tokens, total_rows: int):
    """acc + one micro-batch's (gradients, loss, diagnostics), weighted by its share of the mini-batch (its
    response mask mask_XxT; padded responses, all-zero rows, count as rows in the seq-mean modes)."""
    grads_acc, loss_acc, diag_acc = acc
    w = _micro_weight(mask_XxT, agg, total_tokens, total_rows)
    grads_acc = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), grads_acc, grads)
    w_tokens = _micro_weight(mask_XxT, "token-mean", total_tokens, total_rows)
    # pg_loss is aggregated like the loss; the token count is a sum; every other diagnostic is a token mean
    scale = {"pg_loss": w, TOKENS: 1.0}
    diag_acc = {k: diag_acc[k] + scale.get(k, w_tokens) * d for k, d in diag.items()}
    return grads_acc, loss_acc + w * loss, diag_acc


_DIAG_SHAPES: dict = {}


def _diag_shapes(loss_fn, graphdef, params, data: tuple, settings: LossSettings) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of the diagnostics of loss_fn(params, graphdef, *data, settings), traced once per (loss, model,
    settings, shapes): a trace per mini-batch cost more host time than the tiny demo's whole update."""
    leaves, tree = jax.tree.flatten((params, data))
    key = (loss_fn, graphdef, settings, tree, tuple((x.shape, x.dtype) for x in leaves))
    if key not in _DIAG_SHAPES:
        _DIAG_SHAPES[key] = jax.eval_shape(lambda p, d: loss_fn(p, graphdef, *d, settings)[1], params, data)
    return _DIAG_SHAPES[key]


def accumulator_spec(loss_fn, graphdef, params, data: tuple, settings: LossSettings, rows_B):
    """Shapes, dtypes and placements of the (grads f32 like the trainable params, loss, diagnostics) that add_micro
    accumulates into, for the loss loss_fn(params, graphdef, *data, settings); scalars on rows_B's mesh, replicated."""
    sharding = rows_B.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    diag = _diag_shapes(loss_fn, graphdef, params, data, settings)
    return (jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding),
                         lora.trainable(params)),
            jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding),
            {k: jax.ShapeDtypeStruct(d.shape, d.dtype, sharding=sharding) for k, d in diag.items()})


def zero_accumulator(loss_fn, graphdef, params, data: tuple, settings: LossSettings, rows_B):
    """The zeros of accumulator_spec (what add_micro accumulates into), made by one program for the whole tree."""
    leaves, tree = jax.tree.flatten(accumulator_spec(loss_fn, graphdef, params, data, settings, rows_B))
    return jax.tree.unflatten(tree, _zeros_program(tuple(leaves))())


_ZEROS: dict = {}


def _zeros_program(specs: tuple[jax.ShapeDtypeStruct, ...]):
    """One jitted program that makes zeros of every spec (shape, dtype, placement): one program, not one a shape;
    the same program for placements that are equivalent however they are spelled (a mesh's P() and P(None, None))."""
    programs = _ZEROS.setdefault(tuple((x.shape, str(x.dtype)) for x in specs), [])
    for have, program in programs:
        if all(a.sharding.is_equivalent_to(b.sharding, len(a.shape)) for a, b in zip(have, specs)):
            return program
    program = jax.jit(lambda: tuple(jnp.zeros(x.shape, x.dtype) for x in specs),
                      out_shardings=tuple(x.sharding for x in specs))
    programs.append((specs, program))
    return program


def gradients(graphdef, params, mini: MiniBatch, *, settings: LossSettings, micro: int, padded: bool = False,
              shapes: ShapeSet | None = None):
    """(grads f32, loss, diagnostics) of a mini-batch, accumulated over its length-grouped `micro`-row micro-batches
    (train.micro; `shapes` as for `score`): equal to one pass over the whole padded mini-batch, at the cost of the
    response tokens. padded=True runs every micro-batch at the full width instead (the layout before grouping, for
    benchmarks)."""
    return accumulate_plan(graphdef, params, mini, plan(mini.batch, micro, "update", padded, shapes),
                           settings=settings)


def accumulate_plan(graphdef, params, mini: MiniBatch, micro_plan: micro_lib.MicroPlan, *, settings: LossSettings):
    """`gradients` over the micro-batches of a given plan of the mini-batch's rows."""
    batch = mini.batch
    rows = batch.response_mask.shape[0]
    acc = None
    for rows_X, width in zip(micro_plan.rows, micro_plan.widths):
        if acc is None:
            like = jax.eval_shape(lambda m, r, w=width: train_step.take_rows(m, r, w), mini, rows_X)  # shapes only
            acc = zero_accumulator(policy_loss, graphdef, params, (like,), settings, batch.rewards)
        acc = accumulate(graphdef, params, acc, mini, rows_X, settings=settings, total_rows=rows, width=width)
        train_step.serialize_across_processes(acc)
    return acc


@functools.partial(jax.jit, static_argnames=("optimizer",), donate_argnames=("params", "opt_state"))
def apply_gradients(params, opt_state, grads, loss, diag, *, optimizer: optax.GradientTransformation):
    """One optimizer step on the trainable params (grads and opt_state are theirs; the frozen part, if any, comes
    back untouched). A non-finite loss, gradient or updated parameter skips it: params and optimizer state come
    back unchanged and info["skipped"] is 1. So does a mini-batch with no token in the loss (diag[TOKENS] = 0: its
    rows were all dropped, e.g. NSR's correct responses): no step at all, not an AdamW step on a zero gradient
    (which would still move the params by momentum and weight decay); info["empty"] is 1. info[TOKENS]: the
    mini-batch's response tokens in the loss."""
    trainable, frozen = lora.split_trainable(params)
    diag = dict(diag)
    tokens = diag.pop(TOKENS)
    empty = tokens == 0
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    finite &= all_finite(new_trainable)  # finite gradients can still give non-finite params (e.g. lr=inf)
    step = finite & ~empty
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(step, n, o), new, old)  # noqa: E731
    info = dict(diag, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.int32),
                empty=empty.astype(jnp.int32), **{TOKENS: tokens})
    return nnx.merge_state(keep(new_trainable, trainable), frozen), keep(new_opt_state, opt_state), info


@dataclasses.dataclass(frozen=True)
class TokenRule:
    """What `update` needs to decide the configured method's token rule (methods.token_terms) on a mini-batch:
    the algorithm config, a PRNG key (for rules that draw) and the data folded into it, in order, for this update's
    key (jax.random.fold_in, inside the rule's program), and the current policy's log-probs and entropies [X, T] of
    the mini-batch's rows when they are known already (the scoring pass's, before a step's first update: its params
    are the behaviour policy's); None: computed here from the params."""

    algo: AlgorithmConfig
    key: jax.Array
    current: tuple[jax.Array, jax.Array] | None = None
    folds: tuple[int, ...] = ()


def current_scores(graphdef, params, mini: MiniBatch, *, temperature: float, micro: int,
                   shapes: ShapeSet | None = None, chunk: int = g2rl.DEFAULT_CHUNK):
    """Log-probs and entropies [X, T] of a mini-batch's response tokens under `params` (the current policy π_θ),
    by the scoring program over its micro-batches (the gradient's plan of its rows); no gradient flows through them
    (the papers detach what decides their tokens)."""
    scores = train_step.score(graphdef, params, mini.batch, temperature=temperature, micro=micro, chunk=chunk,
                              shapes=shapes)
    return scores.logp_BxT, scores.entropy_BxT


def decide_tokens(graphdef, params, mini: MiniBatch, rule: TokenRule, *, settings: LossSettings, micro: int,
                  shapes: ShapeSet | None = None) -> MiniBatch:
    """The mini-batch with the method's per-token terms (token weight, |log ρ| coefficient) decided over its rows on
    the current policy: its log-probs and entropies (rule.current, or `current_scores`), the behaviour log-probs
    (for the ratio, which Clip-Cov reads), advantages and response mask."""
    logp, ent = rule.current if rule.current is not None else current_scores(
        graphdef, params, mini, temperature=settings.temperature, micro=micro, shapes=shapes, chunk=settings.chunk)
    terms = rule_terms(mini.advantages_B, logp, ent, mini.old_logp_BxT, mini.batch.response_mask, rule.key,
                       np.asarray(rule.folds, np.uint32), algo=rule.algo, mini_batch_size=mini.advantages_B.shape[0])
    return dataclasses.replace(mini, token_weight_BxT=terms.weight, abs_log_ratio_coef_BxT=terms.abs_log_ratio)


@functools.partial(jax.jit, static_argnames=("algo", "mini_batch_size"))
def rule_terms(advantages_B, logp_BxT, entropy_BxT, old_logp_BxT, mask_BxT, key, folds_K, *, algo: AlgorithmConfig,
               mini_batch_size: int):
    """methods.token_terms with the key `key` folded with each of folds_K [K] uint32 in turn: one program, the
    update's key made in it."""
    for k in range(folds_K.shape[0]):
        key = jax.random.fold_in(key, folds_K[k])
    return methods.token_terms(advantages_B, logp_BxT, entropy_BxT, old_logp_BxT, mask_BxT, key, algo=algo,
                               mini_batch_size=mini_batch_size)


def with_token_fields(mini: MiniBatch, algo: AlgorithmConfig) -> MiniBatch:
    """The mini-batch with zeros [B, T] in the token-term fields the configured method sets (methods.token_fields),
    None in the others: the layout `decide_tokens` gives, for compiling the gradient program ahead of time."""
    weight, abs_log_ratio = methods.token_fields(algo)
    zeros = train_step.zeros_rows(mini.advantages_B, mini.old_logp_BxT.shape)  # made on the host: no program
    return dataclasses.replace(mini, token_weight_BxT=zeros if weight else None,
                               abs_log_ratio_coef_BxT=zeros if abs_log_ratio else None)


def update(graphdef, params, opt_state, mini: MiniBatch, *, optimizer: optax.GradientTransformation,
           settings: LossSettings, micro: int, padded: bool = False, shapes: ShapeSet | None = None,
           rule: TokenRule | None = None):
    """One optimizer update on a mini-batch: with a token rule, its tokens decided on the current params
    (`decide_tokens`), then `gradients` over length-grouped micro-batches and `apply_gradients` (params and
    opt_state are donated; a non-finite loss or gradient skips the update, info["skipped"] = 1; a mini-batch with no
    token in the loss takes no step, info["empty"] = 1)."""
    if rule is not None and methods.get(rule.algo.exploration).tokens is not None:
        mini = decide_tokens(graphdef, params, mini, rule, settings=settings, micro=micro, shapes=shapes)
    grads, loss, diag = gradients(graphdef, params, mini, settings=settings, micro=micro, padded=padded,
                                  shapes=shapes)
    return apply_gradients(params, opt_state, grads, loss, diag, optimizer=optimizer)
