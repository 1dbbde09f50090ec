"""The exploration methods inside the update (train/step.py `update`), on a tiny random Qwen3, against float64 NumPy
transcriptions of their papers' rules and losses: NSR drops its correct rows (the loss is the token mean over the
wrong responses' tokens; a mini-batch with none takes no optimizer step, no AdamW momentum or weight decay either),
W-REINFORCE keeps every row with A = λ on the correct ones; Clip-Cov, KL-Cov and forking tokens choose their tokens
on each mini-batch's current policy: the second mini-batch of a step on the params the first one updated."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_methods import np_cov, np_top
from test_micro import CFG, RT

from g2rl_jax import methods
from g2rl_jax.config import AlgorithmConfig
from g2rl_jax.model import Qwen3, lora
from g2rl_jax.shapes.layouts import ShapeSet
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update

X, S, T, MICRO = 8, 5, 24, 4  # rows of a mini-batch, prompt and response positions, rows of a micro-batch
OPT = optax.adamw(1e-2, weight_decay=0.1)
SHAPES = ShapeSet.of([(MICRO, T)], "one")  # two micro-batches of a mini-batch, one program shape


@pytest.fixture(scope="module")
def model():
    return nnx.split(Qwen3(CFG, RT, rngs=nnx.Rngs(0)))


def batch_of(seed: int, correct) -> train_step.Batch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T + 1, X)
    prompt_mask = (np.arange(S)[None] >= rng.integers(0, 2, (X, 1))).astype(np.int32)
    completion_mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    correct = np.asarray(correct, bool)
    return train_step.build_batch(rng.integers(1, CFG.vocab_size, (X, S)) * prompt_mask, prompt_mask,
                                  rng.integers(1, CFG.vocab_size, (X, T)) * completion_mask, completion_mask,
                                  np.where(correct, 1.0, -1.0), correct, group_size=4)


def scores64(graphdef, params, batch):
    """log-probs and entropies of the batch's response tokens under params, as float64 NumPy."""
    s = train_step.score(graphdef, params, batch, temperature=1.0, micro=MICRO, shapes=SHAPES)
    return np.float64(s.logp_BxT), np.float64(s.entropy_BxT)


def np_ppo_loss(logp, old, adv, mask, *, clip=0.2, clipped=True, weight=None, coef=None):
    """Token mean over the mask of ℓ = max(−Aρ, −A clip(ρ, 1 ± ε)) (or −Aρ unclipped), + coef·|log ρ|, × weight."""
    log_rho = np.clip(logp - old, -20, 20)
    rho, a = np.exp(log_rho), adv[:, None]
    ell = np.maximum(-a * rho, -a * np.clip(rho, 1 - clip, 1 + clip)) if clipped else -a * rho
    ell = ell + (0.0 if coef is None else coef * np.abs(log_rho))
    ell = ell * (1.0 if weight is None else weight)
    return (ell * mask).sum() / mask.sum()


def copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def trees_equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def start(params):
    return jax.tree.map(jnp.array, params), OPT.init(lora.split_trainable(params)[0])


# ------------------------------------------------------------------------------------------------ NSR, W-REINFORCE
def rows_mini(graphdef, params, name, correct, seed):
    """A mini-batch as the trainer builds it for `name`: its advantages, the rows its keep_rows drops masked out,
    behaviour log-probs a little off the params' (so that the ratio is not 1)."""
    algo = AlgorithmConfig(exploration=name, kl_coef=0.0)
    batch = batch_of(seed, correct)
    scores = train_step.score(graphdef, params, batch, temperature=1.0, micro=MICRO, shapes=SHAPES)
    adv = train_step.advantages(batch, scores.phi_BxD, algo)["advantages"]
    keep = methods.get(name).keep_rows
    keep_X = np.ones(X, bool) if keep is None else np.asarray(keep(batch.correct))
    batch = train_step.Batch(batch.input_ids, batch.attention_mask, batch.response_mask * keep_X[:, None],
                             batch.rewards, batch.correct, batch.group_size)
    noise = 0.05 * np.random.default_rng(seed).standard_normal((X, T))
    mini = train_step.MiniBatch(batch, scores.logp_BxT + noise, scores.logp_BxT, adv)
    return mini, train_update.LossSettings.from_config(algo, 1.0)


@pytest.mark.parametrize("name", ["nsr", "w_reinforce"])
def test_negative_reinforcement_loss_over_the_rows_it_keeps(model, name):
    """NSR: the token mean of −A_t ρ_t (clipped) over the wrong responses' tokens only, A = −1 (the authors drop the
    correct responses from the batch); W-REINFORCE: over every token, A = λ on correct responses, −1 on wrong."""
    graphdef, params0 = model
    correct = np.array([1, 0, 0, 1, 1, 0, 1, 0], bool)
    mini, settings = rows_mini(graphdef, params0, name, correct, seed=3)
    logp, _ = scores64(graphdef, params0, mini.batch)
    lam = 0.0 if name == "nsr" else AlgorithmConfig().positive_weight
    adv = np.where(correct, lam, -1.0)
    keep = ~correct if name == "nsr" else np.ones(X, bool)
    mask = np.asarray(batch_of(3, correct).response_mask, np.float64) * keep[:, None]
    np.testing.assert_allclose(np.asarray(mini.advantages_B)[keep], adv[keep], rtol=1e-7)  # λ in float32
    want = np_ppo_loss(logp, np.float64(mini.old_logp_BxT), adv, mask)
    params, opt_state = start(params0)
    _, _, info = train_update.update(graphdef, params, opt_state, mini, optimizer=OPT, settings=settings, micro=MICRO,
                                   shapes=SHAPES)
    assert int(info["empty"]) == 0 and int(info["skipped"]) == 0
    np.testing.assert_allclose(float(info["loss"]), want, rtol=2e-5)


def test_nsr_all_correct_mini_batch_takes_no_optimizer_step(model):
    """After a mixed mini-batch (AdamW momentum now non-zero), an all-correct one leaves NSR nothing to train on: the
    params and the whole optimizer state (moments, count) come back unchanged, where a zero-gradient AdamW step
    would still move the params by momentum and weight decay."""
    graphdef, params0 = model
    mixed, settings = rows_mini(graphdef, params0, "nsr", [1, 0, 0, 1, 1, 0, 1, 0], seed=4)
    right, _ = rows_mini(graphdef, params0, "nsr", [1] * X, seed=5)
    assert float(jnp.sum(right.batch.response_mask)) == 0
    params, opt_state = start(params0)
    params, opt_state, info = train_update.update(graphdef, params, opt_state, mixed, optimizer=OPT, settings=settings,
                                                micro=MICRO, shapes=SHAPES)
    assert int(info["empty"]) == 0 and not trees_equal(params, params0)
    before = copy((params, opt_state))
    params, opt_state, info = train_update.update(graphdef, params, opt_state, right, optimizer=OPT, settings=settings,
                                                micro=MICRO, shapes=SHAPES)
    assert int(info["empty"]) == 1 and int(info["skipped"]) == 0
    assert trees_equal((params, opt_state), before)
    # the same zero gradient as an AdamW step would have moved them: what "no step" rules out
    trainable = lora.split_trainable(params)[0]
    updates, _ = OPT.update(jax.tree.map(jnp.zeros_like, trainable), opt_state, trainable)
    assert max(float(jnp.max(jnp.abs(u))) for u in jax.tree.leaves(updates)) > 0


# ------------------------------------------------------------------------------------------------ token rules
ALGO = {"clip_cov": dict(clip_cov_ratio=0.1, clip_cov_low=0.0, clip_cov_high=10.0),
        "kl_cov": dict(kl_cov_ratio=0.05, kl_cov_coef=1.5),
        "forking": dict(forking_ratio=0.2)}


def np_rule(name, algo, logp, ent, old, adv, mask, key):
    """The paper's choice of tokens on (logp, ent) of the current policy: (token weight, |log ρ| coefficient)."""
    on = mask > 0
    n = on.sum()
    if name == "forking":
        keep = max(int(algo.forking_ratio * n + 0.9999), 1)
        return np_top(ent, on, keep) * n / keep, None
    cov = np_cov({"mask": mask, "adv": adv, "logp": logp})
    if name == "kl_cov":
        return None, algo.kl_cov_coef * np_top(cov, on, max(math.floor(algo.kl_cov_ratio * n), 1))
    rho, a = np.exp(np.clip(logp - old, -20, 20)), adv[:, None]
    clipped = -a * np.clip(rho, 1 - algo.clip_low, 1 + algo.clip_high) > -a * rho  # PPO's clip is active
    eligible = on & ~clipped & (cov > algo.clip_cov_low) & (cov < algo.clip_cov_high)
    count = min(max(math.floor(algo.clip_cov_ratio * n), 1), eligible.sum())
    u = np.float64(jax.random.uniform(jax.random.split(key, 1)[0], mask.shape))
    return 1.0 - np_top(np.where(eligible, u, -1.0), eligible, count), None


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "forking"])
def test_token_rules_choose_on_each_mini_batchs_current_policy(model, name):
    """Two mini-batches: the first updates the params; the second's tokens are the NumPy rule on the updated
    params' log-probs and entropies (not on the behaviour pass's, which choose other tokens), and its loss is the
    NumPy loss with them."""
    graphdef, params0 = model
    algo = AlgorithmConfig(exploration=name, kl_coef=0.0, clip_low=0.05, clip_high=0.05, **ALGO[name])
    settings = train_update.LossSettings.from_config(algo, 1.0)
    rng = np.random.default_rng(7)
    minis = []
    for seed in (8, 9):
        batch = batch_of(seed, rng.random(X) < 0.5)
        logp0, _ = scores64(graphdef, params0, batch)
        old = logp0 + 0.05 * rng.standard_normal((X, T))  # the behaviour policy, a little off π_θ
        minis.append(train_update.with_token_fields(train_step.MiniBatch(
            batch, jnp.asarray(old, jnp.float32), jnp.asarray(old, jnp.float32),
            jnp.asarray(rng.normal(size=X) * 2, jnp.float32)), algo))
    keys = [jax.random.key(11), jax.random.key(12)]
    params, opt_state = start(params0)
    params, opt_state, _ = train_update.update(graphdef, params, opt_state, minis[0], optimizer=OPT, settings=settings,
                                             micro=MICRO, shapes=SHAPES, rule=train_update.TokenRule(algo, keys[0]))
    mini = minis[1]
    mask, adv, old = (np.float64(x) for x in (mini.batch.response_mask, mini.advantages_B, mini.old_logp_BxT))
    logp1, ent1 = scores64(graphdef, params, mini.batch)  # the current policy of the second update
    logp0, ent0 = scores64(graphdef, params0, mini.batch)  # the behaviour pass's, stale by one update
    weight, coef = np_rule(name, algo, logp1, ent1, old, adv, mask, keys[1])
    stale = np_rule(name, algo, logp0, ent0, old, adv, mask, keys[1])
    chosen, stale_chosen = (w if w is not None else c for w, c in ((weight, coef), stale))
    assert not np.array_equal(chosen, stale_chosen), "a weak test: the first update must change the choice"
    decided = train_update.decide_tokens(graphdef, params, mini, train_update.TokenRule(algo, keys[1]),
                                       settings=settings, micro=MICRO, shapes=SHAPES)
    got = decided.token_weight_BxT if weight is not None else decided.abs_log_ratio_coef_BxT
    np.testing.assert_allclose(np.asarray(got) * mask, chosen * mask, rtol=1e-6)
    want = np_ppo_loss(logp1, old, adv, mask, clip=0.05, clipped=methods.get(name).ppo_clip, weight=weight, coef=coef)
    _, _, info = train_update.update(graphdef, params, opt_state, mini, optimizer=OPT, settings=settings, micro=MICRO,
                                   shapes=SHAPES, rule=train_update.TokenRule(algo, keys[1]))
    np.testing.assert_allclose(float(info["loss"]), want, rtol=2e-5)


def test_rule_terms_fold_the_update_key_as_fold_in_does():
    """update.rule_terms folds the update's key in its own program: the same terms, bit for bit, as
    methods.token_terms on the key folded outside it (the run's key before the folds moved in). Clip-Cov draws its
    detached tokens with the key, a quarter of the tokens among almost all eligible: other folds draw others."""
    rng = np.random.default_rng(0)
    logp, ent, old = (jnp.asarray(rng.normal(size=(X, T)), jnp.float32) for _ in range(3))
    adv, mask = jnp.asarray(rng.normal(size=X), jnp.float32), jnp.asarray(rng.random((X, T)) < 0.7, jnp.float32)
    algo = AlgorithmConfig(exploration="clip_cov", mini_batch_size=X, micro_batch_size=MICRO, clip_cov_ratio=0.25,
                           clip_cov_low=-100.0, clip_cov_high=100.0)
    key = jax.random.key(3)

    def rule(folds):
        return np.asarray(train_update.rule_terms(adv, logp, ent, old, mask, key, np.asarray(folds, np.uint32),
                                                  algo=algo, mini_batch_size=X).weight)

    want = methods.token_terms(adv, logp, ent, old, mask, jax.random.fold_in(jax.random.fold_in(key, 5), 2),
                               algo=algo, mini_batch_size=X).weight
    np.testing.assert_array_equal(rule((5, 2)), np.asarray(want))
    assert not np.array_equal(rule((2, 5)), rule((5, 2)))  # the key decides: the folds' order counts
