"""Unlikeliness reward (He, Fried, Welleck, "Rewarding the Unlikely: Lifting GRPO Beyond Distribution Sharpening",
arXiv 2506.02355): a correct response is rewarded less the more likely the policy finds it within its group.

The paper's reward on its 0/1 scale is R̃_i = R_i (1 − β_rank · rank_i / G) with rank_i ∈ {0 … G − 1} the rank
of response i among the group's G responses by likelihood, 0 the least likely (the authors' code ranks every
response by its mean token log-prob under the behaviour policy; a wrong response's R = 0 makes its rank moot).
On this project's ±1 scale (r = 2R − 1) that is r̃_i = r_i − 2 β_rank · rank_i / G on correct responses, r_i on
the others; then GRPO's standardisation (single-class groups as algorithm.single_class_groups says: an all-right
group's advantages then come from its likelihood ranks alone, as in the paper). β_rank = 0.25, the paper's.
Ties in likelihood rank by position in the group (a stable sort).
"""
from __future__ import annotations

import jax.numpy as jnp

from g2rl_jax.methods.grpo import no_novelty, standardise
from g2rl_jax.methods.registry import Group, Method, Signal, register


def likelihood_ranks(seq_logp_Pxm):
    """[P, m] rank of each response's likelihood within its group, 0 the least likely (ties by position)."""
    return jnp.argsort(jnp.argsort(seq_logp_Pxm, axis=-1, stable=True), axis=-1, stable=True)


def unlikeliness_rewards(rewards_Pxm, correct_Pxm, seq_logp_Pxm, penalty: float):
    """r̃ = r − 2 β_rank · rank / G on correct responses, r elsewhere (the paper's R(1 − β_rank rank/G) on ±1)."""
    g = rewards_Pxm.shape[-1]
    rank_Pxm = likelihood_ranks(seq_logp_Pxm).astype(jnp.float32)
    return rewards_Pxm.astype(jnp.float32) - 2.0 * penalty * (rank_Pxm / g) * correct_Pxm.astype(jnp.float32)


def rewards(group: Group, algo) -> Signal:
    shaped_Pxm = unlikeliness_rewards(group.rewards, group.correct, group.seq_logp, algo.unlikeliness_penalty)
    return Signal(shaped_Pxm, standardise(shaped_Pxm, group, algo), no_novelty(group))


register(Method("unlikeliness", "unlikeliness reward: correct answers the policy finds likely are rewarded less "
                "(He et al., arXiv 2506.02355)", rewards, needs=frozenset({"seq_logp"})))
