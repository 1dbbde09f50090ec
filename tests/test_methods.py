"""The exploration methods of g2rl_jax/methods/ against float64 NumPy transcriptions of their papers' equations:
pass@k's analytic advantage against brute force over k-subsets, the unlikeliness reward, NSR / W-REINFORCE, the
G2RL study variants, Clip-Cov / KL-Cov / forking tokens' choice of tokens, and the loss terms they set; plus the
registry, its config key, one short training run per family of token rules and one with Miner's token weights
(Miner's equations: tests/test_methods_single_class.py)."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_g2rl import np_advantages, np_novelty, np_shape
from test_train import assets, config  # noqa: F401 - the module-scoped tiny-model fixture and its config

from g2rl_jax import losses, methods
from g2rl_jax.config import AlgorithmConfig, ConfigError, load_config
from g2rl_jax.methods import covariance, forking, gradient_novelty, negative, passk, unlikeliness
from g2rl_jax.train import step as train_step

P, M, D = 5, 8, 12


@pytest.fixture(scope="module")
def groups():
    """Rewards ±1 with an all-right, an all-wrong, a one-right and two random groups; Φ; mean token log-probs."""
    rng = np.random.default_rng(0)
    correct = rng.uniform(size=(P, M)) < 0.5
    correct[0], correct[1] = True, False
    correct[2] = np.arange(M) == 3
    rewards = np.where(correct, 1.0, -1.0)
    phi = rng.normal(size=(P, M, D))
    seq_logp = rng.normal(-2.0, 1.0, size=(P, M))
    seq_logp[3, 2] = seq_logp[3, 5]  # a tie: ranked by position
    return {"correct": correct, "rewards": rewards, "phi": phi, "seq_logp": seq_logp}


def group_of(g) -> methods.Group:
    return methods.Group(rewards=jnp.asarray(g["rewards"], jnp.float32), correct=jnp.asarray(g["correct"]),
                         phi=jnp.asarray(g["phi"], jnp.float32), seq_logp=jnp.asarray(g["seq_logp"], jnp.float32))


def np_standardise(x, correct=None, zero_single=False):
    out = np_advantages(np.float64(x))
    if zero_single:
        single = correct.all(1) | ~correct.any(1)
        out[single] = 0.0
    return out


# ------------------------------------------------------------------------------------------------ pass@k
def np_passk_advantages(correct_m, k):
    """Chen et al.'s advantage from its definition: every k-subset is one attempt with the reward of its best
    response; standardise the subset rewards over the group's subsets (σ + 1e-6); a response's advantage is the
    mean over the subsets that hold it."""
    m = len(correct_m)
    subsets = list(itertools.combinations(range(m), k))
    reward = np.array([float(any(correct_m[i] for i in s)) for s in subsets])
    mean, sigma = reward.mean(), reward.std()  # population std: σ = sqrt(R̄(1 − R̄)) for 0/1 rewards
    z = (reward - mean) / (sigma + 1e-6)
    return np.array([np.mean([z[j] for j, s in enumerate(subsets) if i in s]) for i in range(m)])


@pytest.mark.parametrize("m, k", [(8, 4), (8, 1), (6, 3), (5, 5)])
def test_passk_table_is_the_mean_over_k_subsets(m, k):
    table = passk.advantage_table(m, k)
    for c in range(m + 1):
        correct = np.arange(m) < c
        want = np_passk_advantages(correct, k)
        got = np.where(correct, table[c, 0], table[c, 1])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"m={m} k={k} c={c}")


def test_passk_advantages_in_the_trainer(groups):
    algo = AlgorithmConfig(exploration="passk", passk_k=4)
    signal = passk.rewards(group_of(groups), algo)
    want = np.stack([np_passk_advantages(c, 4) for c in groups["correct"]])
    np.testing.assert_allclose(np.asarray(signal.advantages), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(signal.advantages)[:2] == 0.0)  # single-class groups: no signal
    k1 = passk.rewards(group_of(groups), AlgorithmConfig(exploration="passk", passk_k=1)).advantages
    np.testing.assert_allclose(np.asarray(k1), np_standardise(groups["rewards"]), atol=2e-3)  # k = 1 is GRPO


# ------------------------------------------------------------------------------------------------ unlikeliness
def np_unlikeliness(correct, seq_logp, beta):
    """The paper's 0/1 reward R(1 − β·rank/G), rank 0 the least likely of the G responses, mapped to ±1."""
    out = np.zeros(correct.shape)
    for g in range(correct.shape[0]):
        order = sorted(range(correct.shape[1]), key=lambda i: (seq_logp[g, i], i))  # ascending, ties by position
        rank = {i: r for r, i in enumerate(order)}
        for i in range(correct.shape[1]):
            big_r = float(correct[g, i]) * (1.0 - beta * rank[i] / correct.shape[1])
            out[g, i] = 2.0 * big_r - 1.0
    return out


@pytest.mark.parametrize("single", ["shaped", "zero"])
def test_unlikeliness_matches_numpy(groups, single):
    algo = AlgorithmConfig(exploration="unlikeliness", single_class_groups=single)
    signal = unlikeliness.rewards(group_of(groups), algo)
    want = np_unlikeliness(groups["correct"], groups["seq_logp"], 0.25)
    np.testing.assert_allclose(np.asarray(signal.shaped), want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(signal.advantages),
                               np_standardise(want, groups["correct"], single == "zero"), atol=1e-4)
    adv = np.asarray(signal.advantages)
    if single == "shaped":  # the all-right group: the least likely response gets the largest advantage
        assert adv[0, np.argmin(groups["seq_logp"][0])] == adv[0].max() > 0


def test_sequence_logp_is_the_masked_mean():
    logp = jnp.asarray([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0], [0.0, 0.0, 0.0]])
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0]], jnp.float32)
    np.testing.assert_allclose(np.asarray(train_step._sequence_logp(logp, mask)), [-1.5, -3.0, 0.0])


# ------------------------------------------------------------------------------------------------ NSR, W-REINFORCE
def test_nsr_and_w_reinforce(groups):
    g = group_of(groups)
    w = negative.w_reinforce(g, AlgorithmConfig(exploration="w_reinforce", positive_weight=0.1))
    np.testing.assert_allclose(np.asarray(w.advantages), np.where(groups["correct"], 0.1, -1.0), atol=1e-7)
    n = negative.nsr(g, AlgorithmConfig(exploration="nsr"))
    np.testing.assert_allclose(np.asarray(n.advantages), np.where(groups["correct"], 0.0, -1.0))
    keep = methods.get("nsr").keep_rows(np.asarray(groups["correct"]).reshape(-1))
    np.testing.assert_array_equal(keep, ~groups["correct"].reshape(-1))


# ------------------------------------------------------------------------------------------------ G2RL variants
def np_correct_peer_novelty(phi, correct):
    out = np.ones(correct.shape)
    for g in range(correct.shape[0]):
        hat = phi[g] / (np.linalg.norm(phi[g], axis=-1, keepdims=True) + 1e-6)
        for i in range(correct.shape[1]):
            peers = [j for j in range(correct.shape[1]) if j != i and correct[g, j]]
            if peers:
                out[g, i] = np.sqrt(max(1.0 - np.mean([(hat[i] @ hat[j]) ** 2 for j in peers]), 0.0))
    return out


def test_g2rl_mixed_correct_shapes_only_correct_answers_of_mixed_groups(groups):
    algo = AlgorithmConfig(exploration="g2rl_mixed_correct")
    signal = gradient_novelty.mixed_correct(group_of(groups), algo)
    nu = np_novelty(groups["phi"], groups["rewards"])
    shaped = np_shape(groups["rewards"], nu, 0.5, 3.0, "text")
    mixed = groups["correct"].any(1) & ~groups["correct"].all(1)
    want = np.where(groups["correct"] & mixed[:, None], shaped, groups["rewards"])
    np.testing.assert_allclose(np.asarray(signal.shaped), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(signal.advantages), np_standardise(want), atol=1e-4)
    assert np.all(np.asarray(signal.advantages)[:2] == 0.0)  # single-class groups: GRPO's zero, whatever the mode


def test_g2rl_correct_peers_matches_numpy(groups):
    algo = AlgorithmConfig(exploration="g2rl_correct_peers", single_class_groups="zero")
    signal = gradient_novelty.correct_peers(group_of(groups), algo)
    nu = np_correct_peer_novelty(groups["phi"], groups["correct"])
    np.testing.assert_allclose(np.asarray(signal.nu), nu, atol=1e-5)
    assert np.all(np.asarray(signal.nu)[1] == 1.0)  # all wrong: no correct peer
    assert np.asarray(signal.nu)[2, 3] == 1.0  # the only correct response of its group
    want = np_shape(groups["rewards"], nu, 0.5, 3.0, "text")
    np.testing.assert_allclose(np.asarray(signal.shaped), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(signal.advantages), np_standardise(want, groups["correct"], True), atol=1e-4)


# ------------------------------------------------------------------------------------------------ token rules
X, T = 16, 7


@pytest.fixture(scope="module")
def mini():
    rng = np.random.default_rng(1)
    mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, size=(X, 1))).astype(np.float64)
    adv = rng.normal(size=X) * 2.0
    logp = rng.uniform(-6.0, -0.01, size=(X, T))
    entropy = rng.uniform(0.0, 3.0, size=(X, T))
    return {"mask": mask, "adv": adv, "logp": logp, "entropy": entropy}


def tokens_of(d, key=0) -> methods.Tokens:
    """The token rule's inputs; the behaviour log-probs are the current ones unless d has "old" (ρ = 1)."""
    return methods.Tokens(jnp.asarray(d["adv"], jnp.float32), jnp.asarray(d["logp"], jnp.float32),
                          jnp.asarray(d["entropy"], jnp.float32), jnp.asarray(d.get("old", d["logp"]), jnp.float32),
                          jnp.asarray(d["mask"], jnp.float32), jax.random.key(key))


def np_cov(d):
    """Cov_t = (log π_t − mean) (A_t − mean) over the N response tokens (Cui et al.'s centred cross-product)."""
    on = d["mask"] > 0
    adv = np.broadcast_to(d["adv"][:, None], d["mask"].shape)
    return np.where(on, (d["logp"] - d["logp"][on].mean()) * (adv - adv[on].mean()), 0.0)


def np_top(score, on, count):
    """The `count` entries of `score` among `on` with the largest values (ties by row-major position)."""
    flat = [(-score.reshape(-1)[i], i) for i in np.flatnonzero(on.reshape(-1))]
    chosen = np.zeros(score.size, bool)
    for _, i in sorted(flat)[:count]:
        chosen[i] = True
    return chosen.reshape(score.shape)


def test_token_covariance_matches_numpy(mini):
    np.testing.assert_allclose(np.asarray(covariance.token_covariance(tokens_of(mini))), np_cov(mini), atol=1e-4)


@pytest.mark.parametrize("ratio", [2e-4, 0.1])
def test_clip_cov_draws_its_share_of_the_band(mini, ratio):
    algo = AlgorithmConfig(exploration="clip_cov", clip_cov_ratio=ratio, clip_cov_low=0.2, clip_cov_high=4.0)
    cov, on = np_cov(mini), mini["mask"] > 0
    eligible = on & (cov > 0.2) & (cov < 4.0)
    count = min(max(math.floor(ratio * on.sum()), 1), eligible.sum())
    assert 0 < count < eligible.sum() or ratio < 1e-3, "a weak test: the band must hold more than the draw"
    hits = np.zeros(cov.shape)
    for key in range(200):
        weight = np.asarray(covariance.clip_cov_tokens(tokens_of(mini, key), algo).weight)
        chosen = weight == 0.0
        u = np.float64(jax.random.uniform(jax.random.key(key), cov.shape))
        np.testing.assert_array_equal(chosen, np_top(np.where(eligible, u, -1.0), eligible, count))
        assert set(np.unique(weight)) <= {0.0, 1.0}
        hits += chosen
    freq = hits[eligible] / 200  # a uniform draw: every band token about count / |band| of the time
    assert abs(freq.mean() - count / eligible.sum()) < 1e-9 and freq.max() - freq.min() < 0.25


def test_clip_cov_leaves_ppo_clipped_tokens_out_of_the_draw(mini):
    """π_θ ≠ π_old: the tokens whose PPO loss takes the clipped term are not drawn (the authors' clip_by_origin)."""
    algo = AlgorithmConfig(exploration="clip_cov", clip_cov_ratio=0.5, clip_cov_low=0.0, clip_cov_high=10.0,
                           clip_low=0.1, clip_high=0.1)
    d = dict(mini, old=mini["logp"] + np.random.default_rng(4).normal(scale=0.2, size=mini["logp"].shape))
    cov, on = np_cov(d), d["mask"] > 0
    rho, a = np.exp(d["logp"] - d["old"]), d["adv"][:, None]
    clipped = -a * np.clip(rho, 0.9, 1.1) > -a * rho
    eligible = on & ~clipped & (cov > 0.0) & (cov < 10.0)
    assert (on & clipped & (cov > 0)).sum() > 0 and eligible.sum() > 0
    count = min(max(math.floor(0.5 * on.sum()), 1), eligible.sum())
    weight = np.asarray(covariance.clip_cov_tokens(tokens_of(d, 5), algo).weight)
    u = np.float64(jax.random.uniform(jax.random.key(5), cov.shape))
    np.testing.assert_array_equal(weight == 0.0, np_top(np.where(eligible, u, -1.0), eligible, count))


def test_kl_cov_penalises_the_largest_covariances(mini):
    algo = AlgorithmConfig(exploration="kl_cov", kl_cov_ratio=0.05, kl_cov_coef=1.5)
    on = mini["mask"] > 0
    count = max(math.floor(0.05 * on.sum()), 1)
    coef = np.asarray(covariance.kl_cov_tokens(tokens_of(mini), algo).abs_log_ratio)
    np.testing.assert_array_equal(coef, 1.5 * np_top(np_cov(mini), on, count))
    assert count > 1


def test_forking_keeps_the_top_entropy_tokens_and_the_authors_mean(mini):
    algo = AlgorithmConfig(exploration="forking", forking_ratio=0.2)
    on = mini["mask"] > 0
    keep = max(int(0.2 * on.sum() + 0.9999), 1)
    chosen = np_top(mini["entropy"], on, keep)
    weight = np.asarray(forking.forking_tokens(tokens_of(mini), algo).weight)
    np.testing.assert_allclose(weight, chosen * on.sum() / keep, rtol=1e-6)
    loss_t = np.random.default_rng(2).normal(size=(X, T))
    ours = (loss_t * weight * mini["mask"]).sum() / mini["mask"].sum()  # token-mean over all response tokens
    np.testing.assert_allclose(ours, loss_t[chosen].mean(), rtol=1e-6)  # the authors': mean over chosen tokens


def test_token_terms_decides_per_mini_batch(mini):
    """Two mini-batches stacked: each gets the rule applied to its own rows, with its own key."""
    algo = AlgorithmConfig(exploration="forking")
    both = {k: np.concatenate([v, v[::-1]]) for k, v in mini.items()}
    terms = methods.token_terms(*(jnp.asarray(both[k], jnp.float32) for k in ("adv", "logp", "entropy", "logp",
                                                                               "mask")),
                                jax.random.key(0), algo=algo, mini_batch_size=X)
    first = forking.forking_tokens(tokens_of(mini), algo).weight
    second = forking.forking_tokens(tokens_of({k: v[::-1] for k, v in mini.items()}), algo).weight
    np.testing.assert_allclose(np.asarray(terms.weight), np.concatenate([first, second]), rtol=1e-6)
    assert terms.abs_log_ratio is None
    assert methods.token_terms(*(jnp.zeros((X, T)),) * 5, jax.random.key(0), algo=AlgorithmConfig(),
                               mini_batch_size=X).weight is None  # g2rl has no token rule


def test_loss_terms_match_numpy(mini):
    """ppo_loss with clip off, a |log ρ| penalty and a token weight, against the per-token transcription."""
    rng = np.random.default_rng(3)
    old = mini["logp"]
    logp = old + rng.normal(scale=0.3, size=old.shape)
    coef, weight = rng.uniform(size=old.shape) < 0.2, rng.uniform(0, 2, size=old.shape)
    for clip in (True, False):
        got, _ = losses.ppo_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, mini["adv"], mini["mask"])),
                                 clip=clip, token_weight=jnp.asarray(weight, jnp.float32),
                                 abs_log_ratio_coef=jnp.asarray(1.5 * coef, jnp.float32))
        rho = np.exp(logp - old)
        a = mini["adv"][:, None]
        ell = np.maximum(-a * rho, -a * np.clip(rho, 0.8, 1.2)) if clip else -a * rho
        ell = (ell + 1.5 * coef * np.abs(logp - old)) * weight
        np.testing.assert_allclose(float(got), (ell * mini["mask"]).sum() / mini["mask"].sum(), rtol=1e-5)


# ------------------------------------------------------------------------------------------------ registry, config
def test_registry_names_every_method_once_and_the_config_checks_them():
    assert set(methods.NAMES) == {"grpo", "entropy_bonus", "evol", "g2rl", "g2rl_mixed_correct", "g2rl_correct_peers",
                                  "clip_cov", "kl_cov", "passk", "unlikeliness", "nsr", "w_reinforce", "forking",
                                  "miner"}
    for name in methods.NAMES:
        method = methods.get(name)
        assert method.name == name and "arXiv" in method.summary, name
    assert not methods.get("kl_cov").ppo_clip and methods.get("clip_cov").ppo_clip
    with pytest.raises(ValueError, match="choose one of grpo"):
        methods.get("ppo")


@pytest.mark.parametrize("override, message", [
    ("algorithm.exploration=ppo", "choose one of grpo, entropy_bonus"),
    ("algorithm.passk_k=0", "must be >= 1"),
    ("algorithm.forking_ratio=0", "must be a share of tokens in (0, 1]"),
    ("algorithm.clip_cov_high=0.5", "must exceed algorithm.clip_cov_low=1.0"),
    ("algorithm.unlikeliness_penalty=2", "must be in [0, 1]"),
])
def test_bad_method_keys_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config("configs/study_countdown.yaml", [override])
    with pytest.raises(ConfigError, match="algorithm.passk_k: must be <= rollout.num_samples=8"):
        load_config("configs/study_countdown.yaml", ["algorithm.exploration=passk", "algorithm.passk_k=9"])


# ------------------------------------------------------------------------------------------------ in the trainer
@pytest.mark.parametrize("name", ["kl_cov", "unlikeliness", "nsr"])
def test_one_training_step_per_family(assets, tmp_path, name):  # noqa: F811
    """A token rule with the unclipped loss (kl_cov), a method that needs the log-probs (unlikeliness) and one
    that drops rows (nsr) run a real Trainer step; the loss is finite and the update applied."""
    from g2rl_jax.train.loop import Trainer

    trainer = Trainer(config(assets, tmp_path / name, mode=name, steps=1, **{"algorithm.kl_cov_ratio": 0.1}))
    trainer.resume()
    before = jax.tree.map(np.asarray, trainer.params)
    record = trainer.run()[-1]
    assert np.isfinite(record["loss"]) and record["skipped_updates"] == 0
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, trainer.params))
    assert any(changed) or name == "nsr" and record["accuracy"] == 1.0


def test_miner_token_weights_reach_the_trainers_loss(assets, tmp_path, monkeypatch):  # noqa: F811
    """A real Trainer step with Miner's rewards stage run and its output replaced by advantages of 1 (the tiny
    random policy is always wrong, so its own are 0) and token weights of 0, no KL term: the loss is exactly 0 and
    so is the gradient, which holds only if the weights reach every micro-batch's loss (without them it is −1)."""
    import dataclasses

    from g2rl_jax.methods import miner
    from g2rl_jax.train.loop import Trainer

    def zero_weights(group, algo):
        signal = miner.rewards(group, algo)
        assert signal.token_weight is not None
        return dataclasses.replace(signal, advantages=jnp.ones_like(signal.advantages),
                                   token_weight=jnp.zeros_like(signal.token_weight))

    monkeypatch.setitem(methods.REGISTRY, "miner", dataclasses.replace(methods.get("miner"), rewards=zero_weights))
    # a γ no other test uses: the jitted advantage stage traces the patched method, not a cached one
    trainer = Trainer(config(assets, tmp_path / "miner", mode="miner", steps=1,
                             **{"algorithm.kl_coef": 0.0, "algorithm.miner_gamma": 1.5}))
    trainer.resume()
    record = trainer.run()[-1]
    assert record["loss"] == 0.0 and record["grad_norm"] == 0.0 and record["skipped_updates"] == 0
