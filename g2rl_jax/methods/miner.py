"""Miner (Jiang et al., "Miner: Mining Intrinsic Mastery for Data-Efficient RL in Large Reasoning Models", arXiv
2601.04731): the policy's own uncertainty rewards the all-correct groups GRPO leaves at zero advantage.

Transcribed from the authors' code (github.com/pixas/Miner, `baselines/core_algos.py`, the `miner` advantage
estimator, as of 2026-04-09), with the settings its README gives to train Miner (credit_method=focal, γ = 2,
incorrect_scale=0, clip_high=0, scale_by_normal=0.0015, correct_scale=1, group-level means); the paper's method
section could not be read here, so its equations are the code's. With ℓ_i the mean token log-prob of response i
under the behaviour policy, p_{i,t} = exp(log π_old(y_t)) and L_i its response length:
  mixed group   A_i = GRPO's standardised base reward (eq. grpo-adv), every token alike
  all-correct   the uncertainty reward u_i = max(0, mean_j ℓ_j − ℓ_i) (a correct response the policy finds less
                likely than its group's mean), spread over the tokens by focal credit:
                A_{i,t} = s · u_i · (1 − p_{i,t})^γ, γ = 2
  all-wrong     0
  calibration   s = min(1, κ · Σ_mixed |A_i| L_i / Σ_all-correct Σ_t u_i (1 − p_{i,t})^γ), κ = 0.0015, over the
                whole step's batch (the adaptive scale that keeps the intrinsic advantages' total at most κ times
                the verifiable ones'); s = 0 in a step without a mixed group; κ = null: s = 1
Here A_{i,t} is the row advantage s·u_i with a token weight (1 − p_{i,t})^γ on the policy-gradient loss (the same:
the weight is ≥ 0). Mixed groups use the project's GRPO standardisation (population variance, as the `grpo` row),
where the authors' code uses verl's (Bessel's variance, ε outside the square root): a factor sqrt(m/(m−1)) on
every mixed-group advantage, which the calibration's ratio follows. docs/peers.md has every choice.
"""
from __future__ import annotations

import jax.numpy as jnp

from g2rl_jax.methods.grpo import no_novelty, standardise
from g2rl_jax.methods.registry import Group, Method, Signal, register


def uncertainty_rewards(seq_logp_Pxm):
    """u [P, m] = max(0, mean_j ℓ_j − ℓ_i) within each group (Miner's intrinsic reward of an all-correct group)."""
    seq_logp_Pxm = seq_logp_Pxm.astype(jnp.float32)
    return jnp.maximum(jnp.mean(seq_logp_Pxm, axis=-1, keepdims=True) - seq_logp_Pxm, 0.0)


def focal_weights(token_logp_PxmxT, gamma: float):
    """(1 − p_t)^γ [P, m, T] with p_t = exp(log p_t) (Miner's token-level focal credit)."""
    return (-jnp.expm1(token_logp_PxmxT.astype(jnp.float32))) ** gamma


def calibration_scale(grpo_adv_Pxm, mixed_P, intrinsic_PxmxT, all_correct_P, lengths_Pxm, kappa):
    """s = min(1, κ · Σ_mixed |A_i| L_i / Σ_all-correct |A_{i,t}|) over the batch (Miner's calibration); 1 when
    there is nothing intrinsic to scale, 0 when there is but no mixed group; kappa None: 1."""
    if kappa is None:
        return jnp.float32(1.0)
    normal = jnp.sum(jnp.where(mixed_P[:, None], jnp.abs(grpo_adv_Pxm) * lengths_Pxm, 0.0))
    extra = jnp.sum(jnp.where(all_correct_P[:, None, None], jnp.abs(intrinsic_PxmxT), 0.0))
    return jnp.where(extra > 0, jnp.minimum(1.0, kappa * normal / jnp.where(extra > 0, extra, 1.0)), 1.0)


def rewards(group: Group, algo) -> Signal:
    correct_Pxm = group.correct.astype(bool)
    all_correct_P = jnp.all(correct_Pxm, axis=-1)
    mixed_P = jnp.any(correct_Pxm, axis=-1) & ~all_correct_P
    mask_PxmxT = group.token_mask.astype(jnp.float32)
    grpo_Pxm = standardise(group.rewards, group, algo)
    u_Pxm = uncertainty_rewards(group.seq_logp)
    focal_PxmxT = focal_weights(group.token_logp, algo.miner_gamma)
    s = calibration_scale(grpo_Pxm, mixed_P, u_Pxm[..., None] * focal_PxmxT * mask_PxmxT, all_correct_P,
                          jnp.sum(mask_PxmxT, axis=-1), algo.miner_calibration)
    adv_Pxm = jnp.where(all_correct_P[:, None], s * u_Pxm, jnp.where(mixed_P[:, None], grpo_Pxm, 0.0))
    weight_PxmxT = jnp.where(all_correct_P[:, None, None], focal_PxmxT, 1.0)
    return Signal(group.rewards.astype(jnp.float32), adv_Pxm, no_novelty(group), token_weight=weight_PxmxT)


register(Method("miner", "Miner: the policy's uncertainty rewards all-correct groups, focal token credit, calibrated "
                "against the verifiable advantages (Jiang et al., arXiv 2601.04731)", rewards,
                needs=frozenset({"seq_logp"}), token_weights=True))
