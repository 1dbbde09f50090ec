"""Negative-sample reinforcement and W-REINFORCE (Zhu et al., "The Surprising Effectiveness of Negative
Reinforcement in LLM Reasoning", arXiv 2506.01347): REINFORCE on the ±1 reward without a group baseline.

  nsr          only the wrong responses train: A = r (= −1) on them, and the correct responses leave the loss
               (the authors' code drops them from the batch; here their rows are masked out, the same token mean)
  w_reinforce  every response trains, the positive ones down-weighted: A = λ·r on correct responses, r on the
               others, λ = algorithm.positive_weight (0.1, the paper's)
Both keep the project's PPO-clipped loss, as the authors' verl code does; neither standardises within groups.
"""
from __future__ import annotations

import jax.numpy as jnp

from g2rl_jax.methods.grpo import no_novelty
from g2rl_jax.methods.registry import Group, Method, Signal, register


def weighted_advantages(rewards_Pxm, correct_Pxm, positive_weight: float):
    """A = λ·r on correct responses, r on the others (W-REINFORCE; λ = 0 is NSR's advantage)."""
    r = rewards_Pxm.astype(jnp.float32)
    return jnp.where(correct_Pxm.astype(bool), positive_weight * r, r)


def nsr(group: Group, algo) -> Signal:
    return Signal(group.rewards.astype(jnp.float32), weighted_advantages(group.rewards, group.correct, 0.0),
                  no_novelty(group))


def w_reinforce(group: Group, algo) -> Signal:
    return Signal(group.rewards.astype(jnp.float32),
                  weighted_advantages(group.rewards, group.correct, algo.positive_weight), no_novelty(group))


def negatives_only(correct_B):
    return ~correct_B.astype(bool)


register(Method("nsr", "negative-sample reinforcement: REINFORCE on the wrong responses only (Zhu et al., "
                "arXiv 2506.01347)", nsr, keep_rows=negatives_only))
register(Method("w_reinforce", "W-REINFORCE: REINFORCE with positive rewards down-weighted by λ (Zhu et al., "
                "arXiv 2506.01347)", w_reinforce))
