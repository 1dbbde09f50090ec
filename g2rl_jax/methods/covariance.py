"""Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617, section 4): the policy entropy falls with the covariance between a token's log-prob and
its advantage, so both act on the few tokens where that covariance is highest.

Over the response tokens of one mini-batch (N of them), token t's centred cross-product is
    Cov_t = (log π_θ(y_t) − mean log π_θ) · (A_t − mean A)     (means over the N tokens; A_t its response's A)
  clip_cov  draws ⌊r·N⌋ tokens (at least 1) at random among those with ω_low < Cov_t < ω_high that PPO does not
            clip already, and detaches them: their policy-gradient loss is weighted 0 (r = 2e-4, ω = (1, 5), the
            paper's)
  kl_cov    takes the ⌊k·N⌋ tokens (at least 1) of largest Cov_t and adds β·|log ρ_t| to their loss (k = 2e-3,
            β = 1, the paper's values for its 7B model); as the authors' code (and verl's), KL-Cov's loss does not
            clip the ratio: ℓ_t = −A_t ρ_t (+ β|log ρ_t| on the chosen tokens)
π_θ is the current policy, as in the authors' code: the params the mini-batch's update starts from, whose
log-probs are detached (train/step.py decides the tokens inside each update, `decide_tokens`); so the choice is
the same however the mini-batch is cut into micro-batches. "PPO clips already" is the authors' test: the clipped
term of the PPO loss is the larger one, −A·clip(ρ, 1 − ε_low, 1 + ε_high) > −A·ρ (none at π_θ = π_old).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from g2rl_jax import losses
from g2rl_jax.methods.grpo import rewards
from g2rl_jax.methods.registry import Method, Tokens, TokenTerms, register


def token_covariance(tok: Tokens):
    """Cov_t [X, T] = (log π_θ(y_t) − mean) (A_t − mean), means over the mini-batch's response tokens (0 off the
    mask)."""
    mask = tok.mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    adv_XxT = jnp.broadcast_to(tok.advantages.astype(jnp.float32)[:, None], mask.shape)
    logp = tok.logp.astype(jnp.float32)
    mean_adv, mean_logp = jnp.sum(adv_XxT * mask) / n, jnp.sum(logp * mask) / n
    return (logp - mean_logp) * (adv_XxT - mean_adv) * mask


def ranks_descending(score_XxT):
    """Rank of every entry of score (0 the largest; ties by position, row-major)."""
    flat = score_XxT.reshape(-1)
    return jnp.argsort(jnp.argsort(-flat, stable=True), stable=True).reshape(score_XxT.shape)


def _count(fraction: float, n_tokens):
    return jnp.maximum(jnp.floor(fraction * n_tokens), 1.0)  # ⌊fraction·N⌋, at least one token


def ppo_clipped(tok: Tokens, algo):
    """[X, T] tokens whose PPO loss takes the clipped term: −A·clip(ρ, 1 − ε_low, 1 + ε_high) > −A·ρ."""
    ratio = jnp.exp(jnp.clip(tok.logp.astype(jnp.float32) - tok.old_logp.astype(jnp.float32),
                             -losses.LOG_RATIO_CLAMP, losses.LOG_RATIO_CLAMP))
    adv_Xx1 = tok.advantages.astype(jnp.float32)[:, None]
    return -adv_Xx1 * jnp.clip(ratio, 1.0 - algo.clip_low, 1.0 + algo.clip_high) > -adv_Xx1 * ratio


def clip_cov_tokens(tok: Tokens, algo) -> TokenTerms:
    cov = token_covariance(tok)
    on = tok.mask > 0
    eligible = on & ~ppo_clipped(tok, algo) & (cov > algo.clip_cov_low) & (cov < algo.clip_cov_high)
    draw = jnp.where(eligible, jax.random.uniform(tok.key, cov.shape), -1.0)  # a uniform subset of the eligible
    chosen = eligible & (ranks_descending(draw) < _count(algo.clip_cov_ratio, jnp.sum(on)))
    return TokenTerms(weight=1.0 - chosen.astype(jnp.float32))


def kl_cov_tokens(tok: Tokens, algo) -> TokenTerms:
    on = tok.mask > 0
    cov = jnp.where(on, token_covariance(tok), -jnp.inf)
    chosen = on & (ranks_descending(cov) < _count(algo.kl_cov_ratio, jnp.sum(on)))
    return TokenTerms(abs_log_ratio=algo.kl_cov_coef * chosen.astype(jnp.float32))


register(Method("clip_cov", "Clip-Cov: detach a few random high-covariance tokens (Cui et al., arXiv 2505.22617)",
                rewards, tokens=clip_cov_tokens))
register(Method("kl_cov", "KL-Cov: |log ρ| penalty on the highest-covariance tokens, unclipped ratio (Cui et al., "
                "arXiv 2505.22617)", rewards, tokens=kl_cov_tokens, ppo_clip=False))
