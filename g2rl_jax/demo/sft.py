"""Supervised warm start for the demo policy: imitate a noisy teacher, cross-entropy, AdamW, one jitted step.

The teacher answers each problem correctly with probability `teacher_accuracy` and otherwise makes one of the
carry slips `task.TEACHER_ERRORS` (uniformly), drawn afresh every time a row is used. A model that fits the teacher
is right about `teacher_accuracy` of the time when sampling at temperature 1 while the correct answer stays its
most likely one: the regime RL with a verifiable reward improves on (the paper's base models are unreliable, not
ignorant). Why not simply stop a clean warm start early: small models learn addition in a sudden jump, so the
accuracy of an early stop depends on the exact step count and floating-point details of the machine.

Each row is the prompt exactly as RL shows it (`plain` template), then the response and `<|endoftext|>`; only
the response tokens (eos included) carry loss.

    ids_BxJxL, mask_BxJxL = encode_sft(examples, tokenizer)     # J = 1 + len(TEACHER_ERRORS) variants per row
    losses = train_sft(model, ids_BxJxL, mask_BxJxL, SFTConfig(steps=1000))   # updates `model` in place
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from g2rl_jax.data.datasets import Example
from g2rl_jax.data.prompts import plain_prompt
from g2rl_jax.demo.task import TEACHER_ERRORS, solution
from g2rl_jax.model import Qwen3

ERRORS = (0, *TEACHER_ERRORS)  # variant k of a row answers with sum + ERRORS[k]; variant 0 is correct


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_fraction: float = 0.05  # of the steps, linear from 0 to learning_rate; then cosine to 10%
    weight_decay: float = 0.01
    teacher_accuracy: float = 0.4
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SFTConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"SFTConfig.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.learning_rate <= 0:
            raise ValueError(f"SFTConfig.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 < self.teacher_accuracy <= 1:
            raise ValueError(f"SFTConfig.teacher_accuracy must be in (0, 1], got {self.teacher_accuracy}")

    def variant_probs(self) -> np.ndarray:
        """Probability of each response variant (ERRORS order): correct, then the slips uniformly."""
        slip = (1.0 - self.teacher_accuracy) / len(TEACHER_ERRORS)
        return np.array([self.teacher_accuracy] + [slip] * len(TEACHER_ERRORS))


def encode_sft(examples: Sequence[Example], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids [N, K, L] of prompt + response variant k + eos, and the mask [N, K, L] of loss tokens."""
    return encode_variants(examples, [[solution(ex, e) for e in ERRORS] for ex in examples], tokenizer)


def encode_variants(examples: Sequence[Example], responses: Sequence[Sequence[str]], tokenizer):
    """encode_sft for any task: `responses[i]` are the K response variants of example i (K the same for all)."""
    prompts = tokenizer([plain_prompt(ex) for ex in examples], add_special_tokens=False)["input_ids"]
    rows = []
    for prompt, variants in zip(prompts, responses):
        replies = tokenizer(list(variants), add_special_tokens=False)["input_ids"]
        rows.append([(prompt, reply + [tokenizer.eos_token_id]) for reply in replies])
    width = max(len(p) + len(r) for variants in rows for p, r in variants)
    ids_BxJxL = np.full((len(rows), len(rows[0]), width), tokenizer.pad_token_id, np.int32)
    mask_BxJxL = np.zeros((len(rows), len(rows[0]), width), np.float32)
    for i, variants in enumerate(rows):
        for k, (p, r) in enumerate(variants):
            ids_BxJxL[i, k, : len(p) + len(r)] = p + r
            mask_BxJxL[i, k, len(p): len(p) + len(r)] = 1.0
    return ids_BxJxL, mask_BxJxL


def sft_loss(model: Qwen3, ids_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of the masked tokens, each predicted from the tokens before it."""
    logits_BxLxV = model(ids_BxL[:, :-1])
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    nll_BxL = -jnp.take_along_axis(logp_BxLxV, ids_BxL[:, 1:, None], axis=-1)[..., 0]
    weights_BxL = mask_BxL[:, 1:]
    return jnp.sum(nll_BxL * weights_BxL) / jnp.maximum(jnp.sum(weights_BxL), 1.0)


def make_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
    warmup = int(cfg.warmup_fraction * cfg.steps)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, warmup, cfg.steps,
                                                  end_value=0.1 * cfg.learning_rate)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=cfg.weight_decay))


def train_sft(model: Qwen3, ids_BxJxL: np.ndarray, mask_BxJxL: np.ndarray, cfg: SFTConfig,
              probs_J: np.ndarray | None = None, progress: str | None = None) -> list[float]:
    """Run `cfg.steps` AdamW steps on random rows with teacher-drawn variants (variant j with probability
    probs_J[j]; default: cfg.variant_probs() for the addition task); `model` ends trained. With `progress`, a
    progress bar of that title (steps, rate, time left, the loss) on stderr."""
    probs = cfg.variant_probs() if probs_J is None else np.asarray(probs_J, np.float64)
    if ids_BxJxL.shape != mask_BxJxL.shape or ids_BxJxL.shape[1:2] != probs.shape:
        raise ValueError(f"ids {ids_BxJxL.shape} and mask {mask_BxJxL.shape} must both be [N, {len(probs)}, L]")
    if len(ids_BxJxL) < cfg.batch_size:
        raise ValueError(f"{len(ids_BxJxL)} training rows are fewer than SFTConfig.batch_size={cfg.batch_size}")
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(cfg)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, ids_BxL, mask_BxL):
        loss, grads = jax.value_and_grad(lambda p: sft_loss(nnx.merge(graphdef, p), ids_BxL, mask_BxL))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(cfg.seed)
    losses = []
    bar = tqdm(total=cfg.steps, desc=progress, unit="step", disable=progress is None, dynamic_ncols=True,
               mininterval=1.0)
    for i in range(cfg.steps):
        rows = rng.choice(len(ids_BxJxL), size=cfg.batch_size, replace=False)
        variants = rng.choice(len(probs), size=cfg.batch_size, p=probs)
        params, opt_state, loss = step(params, opt_state, ids_BxJxL[rows, variants], mask_BxJxL[rows, variants])
        losses.append(loss)
        bar.update(1)
        if progress is not None and i % 100 == 99:  # reading the loss waits for the step: only now and then
            bar.set_postfix(loss=f"{float(loss):.3f}")
    bar.close()
    nnx.update(model, params)
    return [float(x) for x in jax.device_get(losses)]
