"""The methods that target single-class groups against float64 NumPy transcriptions: Miner (arXiv 2601.04731),
transcribed row by row as the authors' `compute_ent_inc_advantage` loops, its focal token credit as a loss weight
against per-token advantages in the PPO loss, and G2RL's novelty term added after the group standardisation
(`algorithm.novelty_placement=advantage`, both readings of eq. scale). Miner's token weights in a real Trainer step:
tests/test_methods.py, whose module has the tiny model."""
import jax.numpy as jnp
import numpy as np
import pytest
from test_g2rl import np_advantages, np_novelty, np_shape

from g2rl_jax import losses, methods
from g2rl_jax.config import AlgorithmConfig, ConfigError, load_config
from g2rl_jax.methods import gradient_novelty, miner
from g2rl_jax.train import step as train_step

P, M, T, D = 6, 8, 9, 12


def make_groups(seed=0, mixed=True):
    """±1 rewards: groups 0 and 3 all right, 1 all wrong, the rest mixed (or all wrong with mixed=False); token
    log-probs under the behaviour policy with ragged response masks; Φ."""
    rng = np.random.default_rng(seed)
    correct = rng.uniform(size=(P, M)) < 0.5
    correct[0] = correct[3] = True
    correct[1] = False
    correct[2] = np.arange(M) == 5
    if not mixed:
        correct[2:] = False
        correct[3] = True
    lengths = rng.integers(1, T + 1, size=(P, M))
    mask = (np.arange(T)[None, None, :] < lengths[..., None]).astype(np.float64)
    logp = np.log(rng.uniform(0.02, 1.0, size=(P, M, T)))
    logp[0, 4, :] = logp[0, 6, :]  # equal likelihoods within an all-right group
    lengths[0, 4] = lengths[0, 6]
    mask[0, 4] = mask[0, 6]
    return {"correct": correct, "rewards": np.where(correct, 1.0, -1.0), "logp": logp, "mask": mask,
            "phi": rng.normal(size=(P, M, D))}


def group_of(g) -> methods.Group:
    seq = (g["logp"] * g["mask"]).sum(-1) / g["mask"].sum(-1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return methods.Group(rewards=f32(g["rewards"]), correct=jnp.asarray(g["correct"]), phi=f32(g["phi"]),
                         seq_logp=f32(seq), token_logp=f32(g["logp"]), token_mask=f32(g["mask"]))


# ------------------------------------------------------------------------------------------------ Miner
def np_miner(correct, rewards, logp, mask, gamma, kappa):
    """Token advantages [P, m, T] as the authors' code computes them (credit_method focal, incorrect_scale 0,
    clip_high 0, correct_scale 1, norm_level group, scale_by_normal kappa), row by row; mixed groups standardised
    with the population variance, as this project's GRPO (the authors': Bessel's)."""
    p, m, t = logp.shape
    adv = np.zeros((p, m, t))
    additional, normal_rows = [], []
    for g in range(p):
        seq = [(logp[g, i] * mask[g, i]).sum() / mask[g, i].sum() for i in range(m)]
        if correct[g].all():  # positive homogeneous: reward the responses less likely than the group's mean
            mean = np.mean(seq)
            for i in range(m):
                temp = max(0.0, -(seq[i] - mean))
                credit = temp * (1.0 - np.exp(logp[g, i])) ** gamma * mask[g, i]
                adv[g, i] = credit
                if temp > 0:
                    additional.append((g, i))
        elif correct[g].any():
            r = rewards[g]
            for i in range(m):
                adv[g, i] = (r[i] - r.mean()) / np.sqrt(r.var() + 1e-6) * mask[g, i]
                normal_rows.append((g, i))
    if kappa is not None and additional:
        normal_sum = sum(np.abs(adv[g, i]).sum() for g, i in normal_rows)
        additional_sum = sum(np.abs(adv[g, i]).sum() for g, i in additional)
        if additional_sum > 0:
            scale = min(1.0, kappa * normal_sum / additional_sum) if normal_sum > 0 else 0.0
            for g, i in additional:
                adv[g, i] *= scale
    return adv


def token_advantages(signal, mask):
    """A_{i,t} the trainer trains on: the row advantage times the token weight (0 off the mask)."""
    return np.asarray(signal.advantages)[..., None] * np.asarray(signal.token_weight) * mask


@pytest.mark.parametrize("kappa", [0.0015, 0.5, 1e6, None])
def test_miner_matches_the_authors_loop(kappa):
    g = make_groups()
    algo = AlgorithmConfig(exploration="miner", miner_calibration=kappa)
    signal = miner.rewards(group_of(g), algo)
    want = np_miner(g["correct"], g["rewards"], g["logp"], g["mask"], 2.0, kappa)
    got = token_advantages(signal, g["mask"])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert np.all(got[1] == 0.0) and np.all(got[[0, 3]] >= 0.0)  # all wrong: nothing; all right: never negative
    intrinsic, normal = np.abs(got[[0, 3]]).sum(), np.abs(got[2:]).sum() - np.abs(got[3]).sum()
    if kappa == 0.0015:  # the calibration binds: the intrinsic total is κ times the verifiable one
        np.testing.assert_allclose(intrinsic, kappa * normal, rtol=1e-4)
    if kappa in (1e6, None):  # it does not: the uncertainty reward times the focal weight, unscaled
        u = miner.uncertainty_rewards(group_of(g).seq_logp)
        np.testing.assert_allclose(got[0], np.asarray(u)[0][:, None] * (1 - np.exp(g["logp"][0])) ** 2 * g["mask"][0],
                                   rtol=1e-4, atol=1e-7)
    assert got[0, 4].sum() == got[0, 6].sum()  # equal likelihoods, equal credit


def test_miner_without_a_mixed_group_gives_the_intrinsic_reward_nothing():
    g = make_groups(mixed=False)
    signal = miner.rewards(group_of(g), AlgorithmConfig(exploration="miner"))
    want = np_miner(g["correct"], g["rewards"], g["logp"], g["mask"], 2.0, 0.0015)
    assert np.all(want == 0.0)
    np.testing.assert_array_equal(token_advantages(signal, g["mask"]), want)


def test_miner_focal_gamma_and_mixed_groups_are_grpo():
    g = make_groups(seed=3)
    signal = miner.rewards(group_of(g), AlgorithmConfig(exploration="miner", miner_gamma=0.5,
                                                        miner_calibration=None))
    np.testing.assert_allclose(token_advantages(signal, g["mask"]),
                               np_miner(g["correct"], g["rewards"], g["logp"], g["mask"], 0.5, None), rtol=2e-5,
                               atol=1e-7)
    grpo = methods.get("grpo").rewards(group_of(g), AlgorithmConfig(exploration="grpo"))
    mixed = g["correct"].any(1) & ~g["correct"].all(1)
    np.testing.assert_array_equal(np.asarray(signal.advantages)[mixed], np.asarray(grpo.advantages)[mixed])
    assert np.all(np.asarray(signal.token_weight)[mixed] == 1.0)


def np_ppo_token_advantages(logp, old, adv_BxT, mask, eps=0.2):
    """verl's PPO loss with a per-token advantage, token-mean."""
    rho = np.exp(logp - old)
    ell = np.maximum(-adv_BxT * rho, -adv_BxT * np.clip(rho, 1 - eps, 1 + eps))
    return (ell * mask).sum() / mask.sum()


def test_focal_weight_in_the_loss_is_a_per_token_advantage():
    """Advantage s·u_i with weight (1 − p_t)^γ on the loss equals the authors' per-token advantage, clipping
    included (the weight is ≥ 0)."""
    g = make_groups(seed=1)
    signal = miner.rewards(group_of(g), AlgorithmConfig(exploration="miner", miner_calibration=None))
    rng = np.random.default_rng(2)
    old = g["logp"].reshape(P * M, T)
    logp = old + rng.normal(scale=0.4, size=old.shape)
    mask = g["mask"].reshape(P * M, T)
    got, _ = losses.ppo_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old)),
                             jnp.asarray(signal.advantages).reshape(-1), jnp.asarray(mask, jnp.float32),
                             token_weight=jnp.asarray(signal.token_weight).reshape(P * M, T))
    want = np_ppo_token_advantages(logp, old, token_advantages(signal, g["mask"]).reshape(P * M, T), mask)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_the_advantage_stage_hands_miner_its_log_probs_and_returns_token_weights():
    g = make_groups(seed=4)
    b = P * M
    batch = train_step.Batch(input_ids=jnp.zeros((b, 4 + T), jnp.int32), attention_mask=jnp.ones((b, 4 + T), jnp.int32),
                             response_mask=jnp.asarray(g["mask"].reshape(b, T), jnp.float32),
                             rewards=jnp.asarray(g["rewards"].reshape(b), jnp.float32),
                             correct=jnp.asarray(g["correct"].reshape(b)), group_size=M)
    algo = AlgorithmConfig(exploration="miner")
    out = train_step.advantages(batch, jnp.asarray(g["phi"].reshape(b, D), jnp.float32), algo,
                                logp_BxT=jnp.asarray(g["logp"].reshape(b, T), jnp.float32))
    want = np_miner(g["correct"], g["rewards"], g["logp"], g["mask"], 2.0, 0.0015).reshape(b, T)
    np.testing.assert_allclose(np.asarray(out["advantages"])[:, None] * np.asarray(out["token_weight"])
                               * g["mask"].reshape(b, T), want, rtol=2e-5, atol=1e-7)
    assert "token_weight" not in train_step.advantages(batch, jnp.asarray(g["phi"].reshape(b, D), jnp.float32),
                                                       AlgorithmConfig(exploration="grpo"))
    assert methods.token_fields(algo) == (True, False) and methods.token_fields(AlgorithmConfig()) == (False, False)


def test_a_method_has_a_token_rule_or_step_token_weights_not_both():
    with pytest.raises(ValueError, match="both a token rule and per-step token weights"):
        methods.register(methods.Method("both", "x (arXiv 0)", miner.rewards,
                                        tokens=methods.get("forking").tokens, token_weights=True))


# ------------------------------------------------------------------------------------------------ G2RL placement
@pytest.mark.parametrize("mode", ["text", "literal"])
@pytest.mark.parametrize("single", ["shaped", "zero"])
def test_g2rl_novelty_after_the_standardisation(mode, single):
    g = make_groups(seed=5)
    algo = AlgorithmConfig(exploration="g2rl", novelty_placement="advantage", shaping_mode=mode,
                           single_class_groups=single)
    signal = gradient_novelty.paper(group_of(g), algo)
    nu = np_novelty(g["phi"], g["rewards"])
    shaped = np_shape(g["rewards"], nu, 0.5, 3.0, mode)
    want = np_advantages(g["rewards"]) + (shaped - g["rewards"])  # GRPO's A, then the novelty term
    single_P = g["correct"].all(1) | ~g["correct"].any(1)
    if single == "zero":
        want[single_P] = 0.0
    np.testing.assert_allclose(np.asarray(signal.advantages), want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(signal.shaped), shaped, atol=1e-5)
    adv = np.asarray(signal.advantages)
    lo, hi = nu.min(1), nu.max(1)
    nubar = (nu - lo[:, None]) / (hi - lo)[:, None]
    if single == "shaped":  # the novelty term survives in single-class groups, at λ's scale
        np.testing.assert_allclose(adv[0], 0.5 * nubar[0], atol=1e-4)  # all right: +λν̄ in both readings
        np.testing.assert_allclose(adv[1], (-0.5 if mode == "text" else 0.5) * nubar[1], atol=1e-4)  # all wrong
        paper = gradient_novelty.paper(group_of(g), AlgorithmConfig(exploration="g2rl", shaping_mode=mode))
        assert np.abs(np.asarray(paper.advantages)[1]).max() > 1.0 > np.abs(adv[1]).max()  # λ divided out or not


def test_novelty_placement_is_g2rl_s_only():
    with pytest.raises(ConfigError, match="algorithm.novelty_placement: is read by exploration=g2rl only"):
        load_config("configs/study_countdown.yaml", ["algorithm.exploration=g2rl_mixed_correct",
                                                     "algorithm.novelty_placement=advantage"])
    with pytest.raises(ConfigError, match="algorithm.miner_calibration: must be > 0 or null"):
        load_config("configs/study_countdown.yaml", ["algorithm.exploration=miner", "algorithm.miner_calibration=0"])
    load_config("configs/study_countdown.yaml", ["algorithm.novelty_placement=advantage"])
