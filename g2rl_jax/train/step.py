"""One RL step, stage by stage. Each stage is a pure function a user can call on its own (Colab, IPython):

    batch   = build_batch(rollout, rewards, correct)             # padded arrays for scoring and the update
    scores  = score(graphdef, params, batch, temperature=T)      # Scores: logp_BxT, entropy_BxT, phi_BxD
    ref     = ref_logprobs(graphdef, ref_params, batch, ...)     # reference-model log-probs (KL term)
    signal  = advantages(batch, scores.phi_BxD, algorithm, ...)  # ν, shaped rewards r̃, group advantages A
    mini    = MiniBatch(batch, scores.logp_BxT, ref, signal["advantages"])   # rows of one optimizer update
    params, opt_state, info = update.update(graphdef, params, opt_state, mini, ..., rule=update.TokenRule(algo, key))

The update stage (the policy loss, micro-batch gradients, the optimizer step) lives in train/update.py. A method's
token rule (Clip-Cov, KL-Cov, forking tokens: `methods.token_terms`) is decided inside `update`, on the
mini-batch's current policy (the params it updates), as the papers do; a mini-batch with no row in the loss (NSR's
all-correct one, or all filtered) takes no optimizer step.

Arrays follow the layout of `Batch` and the shape letters of `g2rl_jax` (its docstring): B = P·m responses,
group-major (the m samples of prompt p are rows p·m … p·m+m−1); S prompt positions (left-padded), T response
positions (right-padded). hidden[:, S−1+t]
predicts response token t. A failing stage raises `StageError` naming the stage, the array and its shape.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import g2rl, methods
from g2rl_jax.config import AlgorithmConfig
from g2rl_jax.shapes.layouts import ShapeSet
from g2rl_jax.train import micro as micro_lib


class StageError(RuntimeError):
    """A stage of the RL step failed; the message names the stage and the offending array and shape."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["input_ids", "attention_mask", "response_mask", "rewards", "correct"],
                   meta_fields=["group_size"])
@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's responses, padded. input_ids/attention_mask [B, S+T]; response_mask [B, T] (1 on the
    response tokens, the stop token included); rewards, correct [B] (base ±1 reward and its correctness)."""

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    rewards: jax.Array
    correct: jax.Array
    group_size: int

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["logp_BxT", "entropy_BxT", "phi_BxD"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Scores:
    """The behaviour-policy scoring pass: log-prob and entropy of every response token, and each response's
    gradient feature Φ (eq. seq-feature)."""

    logp_BxT: jax.Array
    entropy_BxT: jax.Array
    phi_BxD: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["batch", "old_logp_BxT", "ref_logp_BxT", "advantages_B", "sampler_logp_BxT",
                                "token_weight_BxT", "abs_log_ratio_coef_BxT"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MiniBatch:
    """The rows of one optimizer update: the responses, their behaviour and reference log-probs, advantages,
    (for algorithm.rollout_is_cap only) the sampler's own log-probs, Rollout.logprobs_BxT, and (for the methods
    with a token rule only, `methods.token_terms`) the per-token weight and |log ρ| coefficient of the policy loss."""

    batch: Batch
    old_logp_BxT: jax.Array
    ref_logp_BxT: jax.Array
    advantages_B: jax.Array
    sampler_logp_BxT: jax.Array | None = None
    token_weight_BxT: jax.Array | None = None
    abs_log_ratio_coef_BxT: jax.Array | None = None


def mini_batches(step_rows: MiniBatch, keep_B: np.ndarray, size: int, extra_B=None) -> list[tuple]:
    """The step's mini-batches of `size` consecutive rows, each with the response mask of the rows keep_B drops
    zeroed (they stay in the batch: static shapes), and the same rows of extra_B (a tree of [B, ...] arrays, or
    None): [(mini, extra_X)]. One program for every mini-batch (`_kept_rows`)."""
    keep_B = np.asarray(keep_B, np.float32)
    return [_kept_rows(step_rows, keep_B, extra_B, np.int32(start), size=size)
            for start in range(0, step_rows.advantages_B.shape[0], size)]


@functools.partial(jax.jit, static_argnames=("size",))
def _kept_rows(step_rows: MiniBatch, keep_B, extra_B, start, *, size: int):
    """Rows [start, start + size) of every array of step_rows (response mask × keep_B) and of extra_B (start
    traced: one program for every mini-batch)."""
    rows = lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)  # noqa: E731
    mini = jax.tree.map(rows, step_rows)
    batch = dataclasses.replace(mini.batch, response_mask=mini.batch.response_mask * rows(keep_B)[:, None])
    return dataclasses.replace(mini, batch=batch), jax.tree.map(rows, extra_B)


def build_batch(prompt_ids_BxS, prompt_mask_BxS, completion_ids_BxT, completion_mask_BxT, rewards_B, correct_B,
                group_size: int) -> Batch:
    """Join left-padded prompts and right-padded completions into one [B, S+T] batch (host numpy in, arrays out)."""
    arrays = {"prompt_ids": prompt_ids_BxS, "prompt_mask": prompt_mask_BxS, "completion_ids": completion_ids_BxT,
              "completion_mask": completion_mask_BxT, "rewards": rewards_B, "correct": correct_B}
    b = np.shape(prompt_ids_BxS)[0]
    for name, x in arrays.items():
        if np.shape(x)[0] != b:
            raise StageError(f"build_batch: {name} has shape {np.shape(x)}, expected {b} rows like prompt_ids")
    if b % group_size:
        raise StageError(f"build_batch: {b} responses is not a multiple of the group size {group_size}")
    host = lambda x, dtype: jax.device_put(np.asarray(x).astype(dtype))  # noqa: E731 - cast and placed: no program
    return Batch(
        input_ids=host(np.concatenate([prompt_ids_BxS, completion_ids_BxT], axis=1), np.int32),
        attention_mask=host(np.concatenate([prompt_mask_BxS, completion_mask_BxT], axis=1), np.int32),
        response_mask=host(completion_mask_BxT, np.float32),
        rewards=host(rewards_B, np.float32),
        correct=host(correct_B, bool),
        group_size=group_size,
    )


def with_rewards(batch: Batch, rewards_B, correct_B) -> Batch:
    """`batch` with these rewards and correctness (placed as its own were): a batch built while its rewards were
    still coming (train/sampling_rounds.PendingRewards) completed. Nothing before the advantages reads them."""
    return dataclasses.replace(batch, rewards=rewards_B, correct=correct_B)


def response_hidden(model, batch: Batch):
    """Hidden states that predict the response tokens: hidden[:, S−1 : S−1+T] of the joined sequence."""
    h_BxLxD = model.hidden_states(batch.input_ids, batch.attention_mask)
    s, t = batch.prompt_len, batch.response_mask.shape[1]
    return h_BxLxD[:, s - 1:s - 1 + t], batch.input_ids[:, s:]


def head(model, h_BxTxD):
    """The LM head [V, D] in the hidden states' dtype."""
    return model.lm_head_weight().astype(h_BxTxD.dtype)


def zeros_rows(like_B, shape, dtype=jnp.float32):
    """Zeros of `shape` [B, ...] with like_B's row sharding (a global array on every process of a multi-host run),
    made on the host: no program of their own."""
    sharding = like_B.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        rows = sharding.spec[0] if len(sharding.spec) else None
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(rows))
    return host_zeros(shape, dtype, sharding)


def host_zeros(shape, dtype, sharding) -> jax.Array:
    """Zeros of `shape` placed by `sharding`, each shard filled on the host (no compiled program)."""
    return jax.make_array_from_callback(tuple(shape), sharding,
                                        lambda index: np.zeros(np.empty(shape, np.bool_)[index].shape, dtype))


def serialize_across_processes(tree) -> None:
    """Multi-host only: wait for a micro-batch's programs before launching the next. With many small programs in
    flight, CPU (gloo) collectives of consecutive programs were seen to interleave differently on two processes and
    deadlock; one micro-batch at a time keeps every process on the same program."""
    if jax.process_count() > 1:
        jax.block_until_ready(tree)


def per_micro(micro_plan: micro_lib.MicroPlan, run, outs):
    """Run `run(rows_X, width, outs) -> outs` on each micro-batch of the plan, each call one program that takes the
    micro-batch's rows from the whole batch and puts its results into `outs` (donated): arrays [B, T] and [B, ...]
    whose positions no micro-batch kept stay as they came (zeros)."""
    for rows_X, width in zip(micro_plan.rows, micro_plan.widths):
        outs = run(rows_X, width, outs)
        serialize_across_processes(outs)
    return outs


def take_rows(batch: Batch, rows_X, width: int) -> Batch:
    """Micro-batch rows_X of `batch` (or of a MiniBatch: its `.batch` gives the widths), responses cut to `width`."""
    like = batch.batch if isinstance(batch, MiniBatch) else batch
    return micro_lib.take_micro(batch, rows_X, width=width, seq_len=like.input_ids.shape[1],
                                resp_len=like.response_mask.shape[1])


def score_stats(graphdef, params, mb: Batch, *, temperature: float, chunk: int):
    """Log-probs and entropies [X, T_u] and Φ [X, D] of one micro-batch (eq. seq-feature); traced, not jitted."""
    model = nnx.merge(graphdef, params)
    h, targets = response_hidden(model, mb)
    return g2rl.token_stats(h, head(model, h), targets, mb.response_mask, temperature=temperature, chunk_size=chunk)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk", "width"), donate_argnames=("outs",))
def score_micro(graphdef, params, batch: Batch, rows_X, outs, *, temperature: float, chunk: int, width: int):
    """The scoring pass of micro-batch rows_X of `batch` at response width `width`, its log-probs, entropies and Φ
    put into outs = (logp [B, T], entropy [B, T], Φ [B, D]) (donated). One program per (rows, width) shape."""
    logp, ent, phi = score_stats(graphdef, params, take_rows(batch, rows_X, width), temperature=temperature,
                                 chunk=chunk)
    return tuple(micro_lib.put_micro(full, rows_X, part) for full, part in zip(outs, (logp, ent, phi)))


_HIDDEN: dict = {}


def hidden_size(graphdef, params) -> int:
    """The model's hidden size D (Φ's width), found once per model."""
    if graphdef not in _HIDDEN:
        _HIDDEN[graphdef] = nnx.merge(graphdef, params).lm_head_weight().shape[1]
    return _HIDDEN[graphdef]


def score_outs(batch: Batch, hidden: int):
    """The zeros `score_micro` puts into: log-probs [B, T], entropies [B, T], Φ [B, D]."""
    b, t = batch.response_mask.shape
    return tuple(zeros_rows(batch.rewards, shape) for shape in ((b, t), (b, t), (b, hidden)))


def score(graphdef, params, batch: Batch, *, temperature: float, micro: int, chunk: int = g2rl.DEFAULT_CHUNK,
          shapes: ShapeSet | None = None) -> Scores:
    """Behaviour-policy pass: log-probs, entropy and Φ via g2rl.token_stats (eq. seq-feature), over length-grouped
    micro-batches of `micro` rows (train.micro; `shapes`: the micro-batch shapes allowed, default all); positions
    past a micro-batch's width come back as 0."""
    def run(rows_X, width, outs):
        return score_micro(graphdef, params, batch, rows_X, outs, temperature=temperature, chunk=chunk, width=width)

    outs = score_outs(batch, hidden_size(graphdef, params))
    return Scores(*per_micro(plan(batch, micro, "scoring", shapes=shapes), run, outs))


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk", "width"), donate_argnames=("out",))
def ref_micro(graphdef, params, batch: Batch, rows_X, out, *, temperature: float, chunk: int, width: int):
    """The reference model's log-probs of micro-batch rows_X of `batch` at width `width`, put into out [B, T]
    (donated). One program per (rows, width) shape."""
    logp = ref_stats(graphdef, params, take_rows(batch, rows_X, width), temperature=temperature, chunk=chunk)
    return micro_lib.put_micro(out, rows_X, logp)


def ref_stats(graphdef, params, mb: Batch, *, temperature: float, chunk: int):
    """Log-probs [X, T_u] of one micro-batch's response tokens under the reference params; traced, not jitted."""
    model = nnx.merge(graphdef, params)
    h, targets = response_hidden(model, mb)
    return g2rl.token_logprobs(h, head(model, h), targets, temperature=temperature, chunk_size=chunk)


def ref_logprobs(graphdef, params, batch: Batch, *, temperature: float, micro: int, chunk: int = g2rl.DEFAULT_CHUNK,
                 shapes: ShapeSet | None = None):
    """Reference-model log-probs [B, T] of the response tokens (for the KL term), micro-batched as `score`."""
    def run(rows_X, width, out):
        return ref_micro(graphdef, params, batch, rows_X, out, temperature=temperature, chunk=chunk, width=width)

    out = zeros_rows(batch.rewards, batch.response_mask.shape)
    return per_micro(plan(batch, micro, "reference", shapes=shapes), run, out)


def plan(batch: Batch, micro: int, stage: str, padded: bool = False,
         shapes: ShapeSet | None = None) -> micro_lib.MicroPlan:
    """The micro-batch plan of `batch` (micro_lib.plan_for); a bad size raises StageError naming `stage`."""
    try:
        return micro_lib.plan_for(batch, micro, padded=padded, shapes=shapes)
    except ValueError as err:
        raise StageError(f"{stage}: {err}") from None


def _sequence_logp(logp_BxT, mask_BxT):
    """Each response's mean token log-prob [B] (0 for an empty response)."""
    mask = mask_BxT.astype(jnp.float32)
    return jnp.sum(logp_BxT * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


@functools.partial(jax.jit, static_argnames=("algo",))
def advantages(batch: Batch, phi_BxD, algo: AlgorithmConfig, embeddings_BxE=None, valid_B=None,
               logp_BxT=None) -> dict[str, jax.Array]:
    """ν, shaped rewards and group advantages [B] of the configured exploration method (g2rl_jax/methods/; for g2rl
    eqs. novelty, shaped-reward, grpo-adv); rewards are regrouped [P, m] and the method's group functions see
    every group at once. One program (jitted): run op by op, its dispatches cost the tiny demo more than the math.
    What a method needs (Method.needs): embeddings_BxE from the embedding model and valid_B (default all), the
    responses with an answer (evol); logp_BxT, the behaviour log-probs (unlikeliness, miner). A method with
    per-step token weights (Method.token_weights: miner) adds "token_weight" [B, T] to the result."""
    method = methods.get(algo.exploration)
    m = batch.group_size
    r_Pxm, correct_Pxm = batch.rewards.reshape(-1, m), batch.correct.reshape(-1, m)
    given = {"embeddings": embeddings_BxE, "seq_logp": logp_BxT}
    missing = [name for name in sorted(method.needs & given.keys()) if given[name] is None]  # "entropy": the loss's
    if missing:
        raise StageError(f"advantages: exploration={algo.exploration} needs {', '.join(missing)} "
                         "(embeddings_BxE from the embedding model; logp_BxT from the scoring pass)")
    group = methods.Group(
        rewards=r_Pxm, correct=correct_Pxm, phi=phi_BxD.reshape(-1, m, phi_BxD.shape[-1]),
        embeddings=None if embeddings_BxE is None else embeddings_BxE.reshape(-1, m, embeddings_BxE.shape[-1]),
        valid=jnp.ones_like(correct_Pxm) if valid_B is None else jnp.asarray(valid_B, bool).reshape(-1, m),
        seq_logp=None if logp_BxT is None else _sequence_logp(logp_BxT, batch.response_mask).reshape(-1, m),
        token_logp=None if logp_BxT is None else logp_BxT.reshape(-1, m, logp_BxT.shape[-1]),
        token_mask=None if logp_BxT is None else batch.response_mask.reshape(-1, m, logp_BxT.shape[-1]))
    signal = method.rewards(group, algo)
    nu_Pxm, shaped_Pxm, adv_Pxm = signal.nu, signal.shaped, signal.advantages
    if method.novelty:  # diagnostics: what each group gives its most and least novel response
        most_P, least_P = g2rl.novelty_extremes(adv_Pxm, nu_Pxm)
    else:
        most_P = least_P = jnp.full(r_Pxm.shape[:1], jnp.nan)
    per_group = {"single_class": g2rl.single_class_groups(correct_Pxm), "all_wrong": ~jnp.any(correct_Pxm, axis=-1),
                 "most_novel_advantage": most_P, "least_novel_advantage": least_P}
    t = batch.response_mask.shape[1]
    tokens = {} if signal.token_weight is None else {"token_weight": signal.token_weight.reshape(-1, t)}
    return {"nu": nu_Pxm.reshape(-1), "shaped_rewards": shaped_Pxm.reshape(-1), "advantages": adv_Pxm.reshape(-1),
            **{k: jnp.repeat(v, m) for k, v in per_group.items()}, **tokens}  # per-group values repeated over m rows


def group_keep_mask(correct_B, group_size: int) -> np.ndarray:
    """Optional filter (algorithm.filter_equal_groups): keep groups whose BASE correctness is mixed.
    Keyed on correctness, not on the shaped reward, so G2RL's within-class signal cannot rescue a group."""
    c_Pxm = np.asarray(correct_B, bool).reshape(-1, group_size)
    keep_P = c_Pxm.any(axis=1) & ~c_Pxm.all(axis=1)
    return np.repeat(keep_P, group_size)
