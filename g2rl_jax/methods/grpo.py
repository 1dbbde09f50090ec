"""GRPO: the group-standardised base reward (eq. grpo-adv of the G2RL paper, arXiv 2512.15687), and the entropy
bonus baseline, which keeps GRPO's advantages and adds −entropy_coef · entropy to the loss
(`losses.ppo_loss(entropy_coef=...)`, set from `algorithm.entropy_coef`)."""
from __future__ import annotations

import jax.numpy as jnp

from g2rl_jax import g2rl
from g2rl_jax.methods.registry import Group, Method, Signal, register


def standardise(shaped_Pxm, group: Group, algo):
    """A = (r̃ − mean) / sqrt(var + 1e-6) within each group (eq. grpo-adv); single-class groups as
    algorithm.single_class_groups says (g2rl.group_advantages)."""
    return g2rl.group_advantages(shaped_Pxm, group.correct, single_class=algo.single_class_groups)


def no_novelty(group: Group):
    return jnp.full_like(group.rewards, jnp.nan)


def rewards(group: Group, algo) -> Signal:
    return Signal(group.rewards, standardise(group.rewards, group, algo), no_novelty(group))


register(Method("grpo", "GRPO: the group-standardised base reward (DeepSeekMath, arXiv 2402.03300)", rewards))
def entropy_bonus_check(cfg) -> tuple[str, str] | None:
    if cfg.algorithm.entropy_coef <= 0:
        return "algorithm.entropy_coef", (f"must be > 0 with exploration=entropy_bonus (the bonus's coefficient), "
                                          f"got {cfg.algorithm.entropy_coef}; e.g. algorithm.entropy_coef=0.01")
    return None


register(Method("entropy_bonus", "GRPO plus an entropy bonus −entropy_coef · H in the loss (the G2RL paper's "
                "baseline, arXiv 2512.15687)", rewards, check=entropy_bonus_check, needs=frozenset({"entropy"})))
