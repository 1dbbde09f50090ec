"""g2rl_jax.losses against float64 NumPy transcriptions (PPO clip, DAPO clip-higher, dual clip, KL estimators,
GSPO's sequence-level ratio, truncated importance weights against the sampler's log-probs)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rl_jax import losses

B, L = 5, 9


def np_kl(logp, ref, kind):
    logp, ref = np.float64(logp), np.float64(ref)
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    x = np.clip(ref - logp, -20, 20)  # verl's low_var_kl clamps
    return np.clip(np.exp(x) - x - 1, -10, 10)


def np_agg(x, mask, mode):
    if mode == "token-mean":
        return (x * mask).sum() / max(mask.sum(), 1)
    if mode == "seq-mean-token-sum":
        return (x * mask).sum(-1).mean()
    return ((x * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()


def np_ppo(logp, old, adv, mask, clip_low, clip_high, dual_clip, agg, entropy, entropy_coef, ref, kl_coef, kind,
           level="token", sampler=None, cap=None):
    logp, old, adv, mask = (np.float64(x) for x in (logp, old, adv, mask))
    loss_tok = np.zeros((B, L))
    low = np.zeros((B, L))
    high = np.zeros((B, L))
    dual = np.zeros((B, L))
    weight = np.ones((B, L))
    capped = np.zeros((B, L))
    for b in range(B):
        a = adv[b]
        # GSPO: ρ_b = (π_θ(y_b) / π_old(y_b)) ** (1 / |y_b|), over the response's own tokens only
        seq_rho = np.exp(sum(logp[b, t] - old[b, t] for t in range(L) if mask[b, t]) / max(mask[b].sum(), 1))
        for t in range(L):
            rho = np.exp(logp[b, t] - old[b, t]) if level == "token" else seq_rho
            ell = max(-a * rho, -a * min(max(rho, 1 - clip_low), 1 + clip_high))  # eq. grpo-obj, negated
            if dual_clip is not None and a < 0:
                ell = min(ell, -a * dual_clip)
                dual[b, t] = rho > dual_clip
            if cap is not None:
                raw = np.exp(old[b, t] - np.float64(sampler[b, t]))
                weight[b, t], capped[b, t] = min(raw, cap), raw > cap
            loss_tok[b, t] = ell * weight[b, t]
            low[b, t] = a < 0 and rho < 1 - clip_low
            high[b, t] = a > 0 and rho > 1 + clip_high
    kl = np_kl(logp, ref, kind)
    loss = np_agg(loss_tok, mask, agg) - entropy_coef * np_agg(entropy, mask, agg) + kl_coef * np_agg(kl, mask, agg)
    mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    log_r = logp - old
    diag = {"pg_loss": np_agg(loss_tok, mask, agg), "clip_frac_low": mean(low), "clip_frac_high": mean(high),
            "approx_kl": mean(np.exp(log_r) - 1 - log_r), "entropy": mean(entropy), "kl": mean(kl)}
    if dual_clip is not None:
        diag["dual_clip_frac"] = mean(dual)
    if cap is not None:
        diag["rollout_is_weight_mean"], diag["rollout_is_capped_frac"] = mean(weight), mean(capped)
    return loss, diag


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    old = rng.uniform(-4, -0.05, size=(B, L)).astype(np.float32)
    logp = (old + rng.normal(scale=0.3, size=(B, L))).astype(np.float32)  # ratios well outside [0.8, 1.28]
    ref = (old + rng.normal(scale=0.5, size=(B, L))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    mask = (rng.uniform(size=(B, L)) < 0.8).astype(np.float32)
    entropy = rng.uniform(0, 3, size=(B, L)).astype(np.float32)
    return logp, old, adv, mask, entropy, ref


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_penalty_matches_numpy(batch, kind):
    logp, _, _, _, _, ref = batch
    np.testing.assert_allclose(jax.jit(losses.kl_penalty, static_argnums=2)(logp, ref, kind), np_kl(logp, ref, kind),
                               atol=1e-5, rtol=1e-5)
    extreme_ref = np.array([[-30.0, 0.0, -1.0]], np.float32)  # ref − logp = 30: both clamps engage for k3
    extreme = np.array([[0.0, -30.0, -1.0]], np.float32)
    np.testing.assert_allclose(losses.kl_penalty(extreme, extreme_ref, kind), np_kl(extreme, extreme_ref, kind),
                               rtol=1e-5)


@pytest.mark.parametrize("agg", losses.AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 1.5])  # 1.5: some A < 0 tokens of the fixture have ρ > 1.5
def test_ppo_loss_matches_numpy(batch, agg, dual_clip):
    logp, old, adv, mask, entropy, ref = batch
    kwargs = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, agg=agg, entropy_coef=0.01, kl_coef=0.1)
    fn = jax.jit(lambda *a: losses.ppo_loss(*a[:4], entropy=a[4], ref_logp=a[5], kl_kind="k3", **kwargs))
    loss, diag = fn(logp, old, adv, mask, entropy, ref)
    want_loss, want_diag = np_ppo(logp, old, adv, mask, 0.2, 0.28, dual_clip, agg, entropy, 0.01, ref, 0.1, "k3")
    np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=1e-5)
    for key, value in want_diag.items():
        np.testing.assert_allclose(diag[key], value, atol=1e-5, rtol=1e-5, err_msg=key)
    assert 0 < float(diag["clip_frac_low"]) < 1 and 0 < float(diag["clip_frac_high"]) < 1
    assert ("dual_clip_frac" in diag) == (dual_clip is not None)
    if dual_clip is not None:
        assert 0 < float(diag["dual_clip_frac"]) < 1, "the dual clip never engaged: the test would not see a bug"


@pytest.mark.parametrize("agg", losses.AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_sequence_ratio_matches_numpy(batch, agg, dual_clip):
    """GSPO: one length-normalised ratio per response, clipped per response (ratio_level="sequence")."""
    logp, old, adv, mask, entropy, ref = batch
    seq_logp = (old + np.random.default_rng(1).normal(scale=0.2, size=(B, 1))).astype(np.float32)  # shift per row
    seq_logp = seq_logp + (logp - old)  # and per token, so token ratios clip where the mean does not
    kwargs = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": dual_clip, "agg": agg, "entropy_coef": 0.01,
              "kl_coef": 0.1}
    fn = jax.jit(lambda *a: losses.ppo_loss(*a[:4], entropy=a[4], ref_logp=a[5], ratio_level="sequence", **kwargs))
    loss, diag = fn(seq_logp, old, adv, mask, entropy, ref)
    want_loss, want_diag = np_ppo(seq_logp, old, adv, mask, 0.2, 0.28, dual_clip, agg, entropy, 0.01, ref, 0.1, "k3",
                                  level="sequence")
    np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=1e-5)
    for key, value in want_diag.items():
        np.testing.assert_allclose(diag[key], value, atol=1e-5, rtol=1e-5, err_msg=key)
    assert float(diag["clip_frac_low"]) + float(diag["clip_frac_high"]) > 0, "no response clipped: a weak test"
    token_loss, _ = losses.ppo_loss(seq_logp, old, adv, mask, **{k: v for k, v in kwargs.items() if "_coef" not in k})
    assert abs(float(token_loss) - float(diag["pg_loss"])) > 1e-4, "the sequence ratio must differ from the token one"


def test_sequence_ratio_gradient_is_the_mean_token_gradient(batch):
    """Unclipped, d/dlogp_t of −A ρ_b with ρ_b = exp(mean log-ratio) is −A ρ_b / |y_b| on every response token."""
    logp, old, adv, mask, _, _ = batch
    near = (old + 0.01 * (logp - old)).astype(np.float32)  # every ρ within the clip range
    grad = jax.grad(lambda lp: losses.ppo_loss(lp, old, adv, mask, ratio_level="sequence",
                                               agg="seq-mean-token-mean")[0])(near)
    n = mask.sum(-1)
    rho = np.exp(((np.float64(near) - old) * mask).sum(-1) / n)
    want = -adv[:, None] * rho[:, None] / n[:, None] * mask / B
    np.testing.assert_allclose(grad, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("level", losses.RATIO_LEVELS)
def test_truncated_is_weights_match_numpy(batch, level):
    """rollout_is_cap: each token's loss weighted by min(π_old / π_sampler, C); the weights' mean and capped share."""
    logp, old, adv, mask, entropy, ref = batch
    sampler = (old + np.random.default_rng(2).normal(scale=0.3, size=(B, L))).astype(np.float32)
    fn = jax.jit(lambda *a: losses.ppo_loss(*a[:4], sampler_logp=a[4], is_cap=1.5, ratio_level=level,
                                            agg="seq-mean-token-mean", ref_logp=a[5], kl_coef=0.1))
    loss, diag = fn(logp, old, adv, mask, sampler, ref)
    want_loss, want_diag = np_ppo(logp, old, adv, mask, 0.2, 0.2, None, "seq-mean-token-mean", entropy, 0.0, ref,
                                  0.1, "k3", level=level, sampler=sampler, cap=1.5)
    np.testing.assert_allclose(loss, want_loss, atol=1e-5, rtol=1e-5)
    for key in ("pg_loss", "rollout_is_weight_mean", "rollout_is_capped_frac", "kl"):
        np.testing.assert_allclose(diag[key], want_diag[key], atol=1e-5, rtol=1e-5, err_msg=key)
    assert 0 < float(diag["rollout_is_capped_frac"]) < 1, "the cap never (or always) engaged: a weak test"
    same, same_diag = losses.ppo_loss(logp, old, adv, mask, sampler_logp=old, is_cap=1.5, ratio_level=level)
    plain, _ = losses.ppo_loss(logp, old, adv, mask, ratio_level=level)
    np.testing.assert_allclose(same, plain, rtol=1e-6)  # sampler == trainer: every weight is 1
    assert float(same_diag["rollout_is_weight_mean"]) == 1.0 and float(same_diag["rollout_is_capped_frac"]) == 0.0


def test_ppo_loss_bfloat16_inputs(batch):
    """bf16 log-probs are upcast before any arithmetic: f32 tolerance against float64 on the rounded values."""
    logp, old, adv, mask, entropy, ref = batch
    r16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
    loss, _ = losses.ppo_loss(jnp.asarray(logp, jnp.bfloat16), jnp.asarray(old, jnp.bfloat16), adv, mask)
    want, _ = np_ppo(r16(logp), r16(old), adv, mask, 0.2, 0.2, None, "token-mean", entropy, 0.0, ref, 0.0, "k1")
    np.testing.assert_allclose(loss, want, atol=1e-5, rtol=1e-5)


def test_ppo_gradient_zero_on_clipped_tokens(batch):
    logp, old, adv, mask, _, _ = batch
    grad = np.asarray(jax.grad(lambda lp: losses.ppo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0])(logp))
    ratio = np.exp(np.float64(logp) - old)
    clipped = ((adv[:, None] > 0) & (ratio > 1.28)) | ((adv[:, None] < 0) & (ratio < 0.8))
    assert clipped.any() and np.all(grad[clipped] == 0.0)
    live = ~clipped & (mask > 0)
    assert np.all(grad[live] != 0.0)


def test_ppo_loss_errors(batch):
    logp, old, adv, mask, entropy, ref = batch
    with pytest.raises(ValueError, match="agg must be one of"):
        losses.ppo_loss(logp, old, adv, mask, agg="sum")
    with pytest.raises(ValueError, match="advantages must be one per sequence"):
        losses.ppo_loss(logp, old, np.ones((B, L)), mask)
    with pytest.raises(ValueError, match="old_logp must be"):
        jax.jit(losses.ppo_loss)(logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        losses.ppo_loss(logp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="entropy_coef"):
        losses.ppo_loss(logp, old, adv, mask, entropy_coef=0.01)
    with pytest.raises(ValueError, match="kl_coef"):
        losses.ppo_loss(logp, old, adv, mask, kl_coef=0.001)
    with pytest.raises(ValueError, match="kl_kind must be one of"):
        losses.ppo_loss(logp, old, adv, mask, ref_logp=ref, kl_kind="k4")
    with pytest.raises(ValueError, match="kind must be one of"):
        losses.kl_penalty(logp, ref, "full")
    with pytest.raises(ValueError, match="ratio_level must be one of"):
        losses.ppo_loss(logp, old, adv, mask, ratio_level="response")
    with pytest.raises(ValueError, match="is_cap and sampler_logp go together"):
        losses.ppo_loss(logp, old, adv, mask, is_cap=2.0)
    with pytest.raises(ValueError, match="is_cap must be > 0"):
        losses.ppo_loss(logp, old, adv, mask, sampler_logp=old, is_cap=0.0)
