"""G2RL (arXiv 2512.15687): novelty ν of each response's gradient feature Φ within its group shapes the reward, and
two variants that follow the study's diagnosis (docs/study.md): the paper's shaping gives single-class groups
unit-scale advantages from novelty alone, pushing all-wrong groups toward what their wrong answers share.

  g2rl                the paper's equations: ν (eqs. cosine, weights, novelty), r̃ = clip(r (1 + λν̄), ±c), A;
                      algorithm.novelty_placement=advantage adds the novelty term after the standardisation
                      instead (the placement of ExTra, arXiv 2606.24994): A = GRPO's A of r, plus r̃ − r, so a
                      single-class group's novelty is not divided out; either reading of eq. scale (shaping_mode)
  g2rl_mixed_correct  the paper's r̃ only for the correct responses of mixed groups, the base reward elsewhere: the
                      paper's stated rationale (reward correct answers that differ from their peers) and nothing else
  g2rl_correct_peers  ν measured against the correct peers only (weights 1 on correct j ≠ i, 0 on wrong ones,
                      instead of exp(r_j)): "how unlike the right answers is this response"; a response without a
                      correct peer gets ν = 1, so an all-wrong group has no spread and no novelty signal
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from g2rl_jax import g2rl
from g2rl_jax.methods.grpo import standardise
from g2rl_jax.methods.registry import Group, Method, Signal, register


def _shape(group: Group, nu_Pxm, algo):
    return g2rl.shape_rewards(group.rewards, nu_Pxm, lam=algo.lam, clip=algo.reward_clip, mode=algo.shaping_mode)


def novelty_after_standardisation(grpo_adv_Pxm, rewards_Pxm, shaped_Pxm):
    """A = A_GRPO(r) + (r̃ − r): the paper's novelty term r̃ − r (λ r ν̄ in the text reading, λ r² ν̄ in the literal
    one, before the clip) added to GRPO's standardised advantage instead of standardised with it."""
    return grpo_adv_Pxm + (shaped_Pxm - rewards_Pxm.astype(jnp.float32))


def paper(group: Group, algo) -> Signal:
    nu_Pxm = g2rl.novelty(group.phi, group.rewards)
    shaped_Pxm = _shape(group, nu_Pxm, algo)
    if algo.novelty_placement == "reward":
        return Signal(shaped_Pxm, standardise(shaped_Pxm, group, algo), nu_Pxm)
    adv_Pxm = novelty_after_standardisation(g2rl.group_advantages(group.rewards), group.rewards, shaped_Pxm)
    if algo.single_class_groups == "zero":  # zero: single-class groups get no advantage at all, as in GRPO
        adv_Pxm = jnp.where(g2rl.single_class_groups(group.correct)[:, None], 0.0, adv_Pxm)
    return Signal(shaped_Pxm, adv_Pxm, nu_Pxm)


def paper_placement_only(cfg) -> tuple[str, str] | None:
    if cfg.algorithm.novelty_placement != "reward":
        return "algorithm.novelty_placement", (f"is read by exploration=g2rl only; {cfg.algorithm.exploration} "
                                               "shapes the reward before the standardisation, so leave it at reward")
    return None


def mixed_correct(group: Group, algo) -> Signal:
    nu_Pxm = g2rl.novelty(group.phi, group.rewards)
    mixed_P = ~g2rl.single_class_groups(group.correct)
    shaped_Pxm = jnp.where(group.correct & mixed_P[:, None], _shape(group, nu_Pxm, algo),
                           group.rewards.astype(jnp.float32))  # the paper's r̃ on correct answers of mixed groups only
    return Signal(shaped_Pxm, standardise(shaped_Pxm, group, algo), nu_Pxm)


def _correct_peer_novelty_group(phi_mxD, correct_m):
    phi_mxD = phi_mxD.astype(jnp.float32)
    phihat_mxD = phi_mxD / (jnp.linalg.norm(phi_mxD, axis=-1, keepdims=True) + g2rl.EPS)  # eq. cosine
    s_mxm = jnp.matmul(phihat_mxD, phihat_mxD.T, precision=jax.lax.Precision.HIGHEST)
    peers_mxm = (1.0 - jnp.eye(correct_m.shape[0], dtype=jnp.float32)) * correct_m.astype(jnp.float32)[None, :]
    count_m = jnp.sum(peers_mxm, axis=-1)
    w_mxm = peers_mxm / jnp.maximum(count_m, 1.0)[:, None]  # eq. weights with 1 on correct peers, 0 on wrong ones
    nu_m = jnp.sqrt(jnp.maximum(1.0 - jnp.sum(w_mxm * s_mxm**2, axis=-1), 0.0))  # eq. novelty
    return jnp.where(count_m > 0, nu_m, 1.0)  # no correct peer: nothing to be like, ν = 1


def correct_peer_novelty(phi_PxmxD, correct_Pxm):
    """ν [P, m] of each response against the correct responses of its group other than itself (1 where none)."""
    return jax.vmap(_correct_peer_novelty_group)(phi_PxmxD, correct_Pxm.astype(bool))


def correct_peers(group: Group, algo) -> Signal:
    nu_Pxm = correct_peer_novelty(group.phi, group.correct)
    shaped_Pxm = _shape(group, nu_Pxm, algo)
    return Signal(shaped_Pxm, standardise(shaped_Pxm, group, algo), nu_Pxm)


register(Method("g2rl", "G2RL: rewards shaped by gradient-feature novelty (arXiv 2512.15687), the paper's equations",
                paper, novelty=True))
register(Method("g2rl_mixed_correct", "G2RL's shaping on the correct responses of mixed groups only (the stated "
                "rationale of arXiv 2512.15687; study variant)", mixed_correct, check=paper_placement_only,
                novelty=True))
register(Method("g2rl_correct_peers", "G2RL (arXiv 2512.15687) with novelty measured against the correct peers only "
                "(study variant)",
                correct_peers, check=paper_placement_only, novelty=True))
