"""Pass@k training with the analytic group advantage (Chen et al., "Pass@k Training for Adaptively Balancing
Exploration and Exploitation of Large Reasoning Models", arXiv 2508.10751, section "analytical derivation").

A group of N = m responses, N_neg of them wrong, is scored as if every k-subset were one attempt whose reward is
its best response's: the mean subset reward R̄ = 1 − C(N_neg, k)/C(N, k), its standard deviation
σ = sqrt(R̄ (1 − R̄)), and each response's advantage is the mean standardised reward of the subsets that hold it:
    Â_pos = (1 − R̄) / (σ + 1e-6),   Â_neg = (1 − R̄ − C(N_neg − 1, k − 1)/C(N − 1, k − 1)) / (σ + 1e-6)
(1e-6 as the authors' code). Single-class groups get 0 either way (σ = 0 and both numerators 0). Correctness is
the response's base correctness; the advantages depend on the group's count of correct responses only, so they
are tabulated in float64 for every count 0 … m (m and k are static) and gathered.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from g2rl_jax.methods.grpo import no_novelty
from g2rl_jax.methods.registry import Group, Method, Signal, register

SIGMA_EPS = 1e-6


def _comb(n: int, k: int) -> int:
    return math.comb(n, k) if n >= 0 and k >= 0 else 0


def advantage_table(m: int, k: int) -> np.ndarray:
    """[m + 1, 2] float64: (Â_pos, Â_neg) of a group of m responses with c = 0 … m correct (the equations above)."""
    table = np.zeros((m + 1, 2), np.float64)
    for c in range(m + 1):
        n_neg = m - c
        rbar = 1.0 - _comb(n_neg, k) / _comb(m, k)  # mean pass@k reward of the group's k-subsets
        sigma = math.sqrt(rbar * (1.0 - rbar))
        all_wrong_with_me = _comb(n_neg - 1, k - 1) / _comb(m - 1, k - 1)  # a wrong response's subsets, all wrong
        table[c] = ((1.0 - rbar) / (sigma + SIGMA_EPS),
                    (1.0 - rbar - all_wrong_with_me) / (sigma + SIGMA_EPS) if n_neg else 0.0)
    return table


def rewards(group: Group, algo) -> Signal:
    m = group.rewards.shape[-1]
    table = jnp.asarray(advantage_table(m, algo.passk_k), jnp.float32)
    correct_Pxm = group.correct.astype(bool)
    count_P = jnp.sum(correct_Pxm, axis=-1)
    adv_Pxm = jnp.where(correct_Pxm, table[count_P, 0][:, None], table[count_P, 1][:, None])
    return Signal(group.rewards.astype(jnp.float32), adv_Pxm, no_novelty(group))


def check(cfg) -> tuple[str, str] | None:
    if cfg.algorithm.passk_k > cfg.rollout.num_samples:
        return "algorithm.passk_k", (f"must be <= rollout.num_samples={cfg.rollout.num_samples} (a k-subset of a "
                                     f"group holds k of its responses), got {cfg.algorithm.passk_k}")
    return None


register(Method("passk", "Pass@k training, analytic group advantage (Chen et al., arXiv 2508.10751)", rewards,
                check=check))
