"""g2rl_jax.g2rl against float64 NumPy transcriptions of the equations of the G2RL paper ("Can LLMs Guide Their
Own Exploration? Gradient-Guided Reinforcement Learning for LLM Reasoning", arXiv 2512.15687)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from g2rl_jax import g2rl

EPS = 1e-6  # the paper's ε as the module documents it
B, L, D, V = 3, 13, 16, 52  # L = 13 is not a multiple of the chunk sizes below: exercises the padding


# ------------------------------------------------------------------------------------- NumPy transcriptions
def np_softmax_parts(h, w, y, temperature):
    z = np.einsum("bld,vd->blv", h, w) / temperature  # eq. head-softmax
    logp_all = z - z.max(-1, keepdims=True)
    logp_all = logp_all - np.log(np.exp(logp_all).sum(-1, keepdims=True))
    return logp_all, np.exp(logp_all)


def np_token_stats(h, w, y, mask, temperature):
    h, w, mask = np.float64(h), np.float64(w), np.float64(mask)
    y = np.asarray(y)
    logp_all, p = np_softmax_parts(h, w, y, temperature)
    logp = np.take_along_axis(logp_all, y[..., None], -1)[..., 0]
    entropy = -(p * logp_all).sum(-1)
    phi_t = w[y] - p @ w  # eq. token-feature: W(e(y_t) − p_t)
    alpha = mask / (mask.sum(-1, keepdims=True) + EPS)  # eq. seq-feature
    return logp, entropy, (alpha[..., None] * phi_t).sum(1)


def np_novelty(phi, r):
    phi, r = np.float64(phi), np.float64(r)
    out = np.zeros(r.shape)
    for g in range(r.shape[0]):
        hat = phi[g] / (np.linalg.norm(phi[g], axis=-1, keepdims=True) + EPS)  # eq. cosine
        s = hat @ hat.T
        m = r.shape[1]
        for i in range(m):
            others = [j for j in range(m) if j != i]
            denom = sum(np.exp(r[g, k]) for k in others) + EPS  # eq. weights
            explained = sum(np.exp(r[g, j]) / denom * s[i, j] ** 2 for j in others)
            out[g, i] = np.sqrt(max(1.0 - explained, 0.0))  # eq. novelty
    return out


def np_shape(r, nu, lam, clip, mode):
    r, nu = np.float64(r), np.float64(nu)
    lo, hi = nu.min(1, keepdims=True), nu.max(1, keepdims=True)
    nubar = np.where(hi - lo > g2rl.NU_SPREAD_MIN, (nu - lo) / np.where(hi - lo > 0, hi - lo, 1), 0.0)
    f = 1 + lam * nubar if mode == "text" else 1 + lam * r * nubar  # eq. scale
    return np.clip(r * f, -clip, clip)  # eq. shaped-reward, clip to ±c


def np_advantages(r):
    r = np.float64(r)
    return (r - r.mean(1, keepdims=True)) / np.sqrt(r.var(1, keepdims=True) + 1e-6)  # eq. grpo-adv


def np_evol_group(emb, correct, valid):
    """EVOL-RL's reward rule for one group, transcribed with plain Python loops."""
    m = len(correct)
    vidx = [i for i in range(m) if valid[i]]
    out = [-1.0] * m
    if len(vidx) < 2:
        for i in vidx:
            out[i] = 1.0 if correct[i] else -1.0
        return out
    e = np.float64(emb)[vidx]
    e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-8)
    s = np.clip(e @ e.T, 0.0, 1.0)
    c = [bool(correct[i]) for i in vidx]
    n = len(vidx)
    u = []
    for a in range(n):
        same = [b for b in range(n) if b != a and c[b] == c[a]]
        rest = [b for b in range(n) if b != a]
        mean = np.mean([s[a, b] for b in same]) if same else np.mean([s[a, b] for b in rest])
        u.append(1.0 - (0.5 * mean + 0.5 * max(s[a, b] for b in rest)))
    for flag, base in ((True, 0.5), (False, -1.0)):
        members = [a for a in range(n) if c[a] == flag]
        if not members:
            continue
        us = [u[a] for a in members]
        for a in members:
            if len(members) == 1:
                ut = 1.0
            elif max(us) > min(us):
                ut = (u[a] - min(us)) / (max(us) - min(us))
            else:
                ut = 0.5
            out[vidx[a]] = base + 0.5 * ut
    return out


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(B, L, D)).astype(np.float32)
    w = (0.7 * rng.normal(size=(V, D))).astype(np.float32)
    y = rng.integers(0, V, size=(B, L)).astype(np.int32)
    mask = (rng.uniform(size=(B, L)) < 0.7).astype(np.float32)
    mask[2, :] = 0.0  # a sequence without response tokens: Φ = 0, no NaN
    return h, w, y, mask


def stats_fn(temperature, chunk):
    return jax.jit(lambda h, w, y, m: g2rl.token_stats(h, w, y, m, temperature=temperature, chunk_size=chunk))


# ------------------------------------------------------------------------------------------------ token pass
@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 5), (1.3, 64)])
def test_token_stats_matches_numpy(tokens, temperature, chunk):
    logp, ent, phi = stats_fn(temperature, chunk)(*tokens)
    ref_logp, ref_ent, ref_phi = np_token_stats(*tokens, temperature)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(phi, ref_phi, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(phi[2]) == 0.0)
    logp_only = jax.jit(lambda h, w, y: g2rl.token_logprobs(h, w, y, temperature=temperature, chunk_size=chunk))
    np.testing.assert_allclose(logp_only(*tokens[:3]), ref_logp, atol=1e-5, rtol=1e-5)


def test_token_stats_bfloat16(tokens):
    """bf16 hidden / lm_head: the logits come from bf16 products accumulated in f32, so log-probs and entropy
    keep the f32 tolerance against float64 on the same rounded inputs. Φ's vocab-space residual r is rounded to
    bf16 before r·W (unit roundoff 2^-8), so |ΔΦ_d| ≤ 2^-8 Σ_v |r_v| |W_vd| plus the f32 tolerance."""
    h, w, y, mask = tokens
    h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    logp, ent, phi = stats_fn(1.0, 4)(h16, w16, y, mask)
    hr, wr = np.float64(np.asarray(h16, np.float32)), np.float64(np.asarray(w16, np.float32))
    ref_logp, ref_ent, ref_phi = np_token_stats(hr, wr, y, mask, 1.0)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)
    _, p = np_softmax_parts(hr, wr, y, 1.0)
    alpha = mask / (mask.sum(-1, keepdims=True) + EPS)
    r = np.einsum("bl,blv->bv", alpha, np.eye(V)[y] - p)
    bound = 2.0**-8 * np.abs(r) @ np.abs(wr) + 1e-5
    err = np.abs(np.asarray(phi, np.float64) - ref_phi)
    assert np.all(err <= bound), f"bf16 Φ error {err.max()} exceeds the rounding bound"


def naive_logp(h, w, y, temperature):
    logits = jnp.einsum("bld,vd->blv", h, w) / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), y[..., None], -1)[..., 0]


def naive_entropy(h, w, temperature):
    logp_all = jax.nn.log_softmax(jnp.einsum("bld,vd->blv", h, w) / temperature, -1)
    return -jnp.sum(jnp.exp(logp_all) * logp_all, -1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_gradients_equal_naive_autodiff(tokens, temperature):
    h, w, y, mask = tokens
    rng = np.random.default_rng(1)
    g_lp, g_ent = rng.normal(size=(B, L)).astype(np.float32), rng.normal(size=(B, L)).astype(np.float32)
    grad_fused = jax.jit(jax.grad(lambda h, w: jnp.sum(
        g_lp * g2rl.token_logprobs(h, w, y, temperature=temperature, chunk_size=4)), (0, 1)))
    grad_naive = jax.jit(jax.grad(lambda h, w: jnp.sum(g_lp * naive_logp(h, w, y, temperature)), (0, 1)))
    for a, b in zip(grad_fused(h, w), grad_naive(h, w)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)

    def stats_objective(h, w):  # log-probs and entropy both carry gradient; Φ is a constant
        logp, ent, phi = g2rl.token_stats(h, w, y, mask, temperature=temperature, chunk_size=5)
        return jnp.sum(g_lp * logp + g_ent * ent) + jnp.sum(phi)

    def naive_objective(h, w):
        return jnp.sum(g_lp * naive_logp(h, w, y, temperature) + g_ent * naive_entropy(h, w, temperature))

    for a, b in zip(jax.jit(jax.grad(stats_objective, (0, 1)))(h, w), jax.jit(jax.grad(naive_objective, (0, 1)))(h, w)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_token_stats_batch_equals_loop_over_sequences(tokens):
    h, w, y, mask = tokens
    fn = stats_fn(1.0, 4)
    batched = fn(h, w, y, mask)
    for b in range(B):
        single = fn(h[b : b + 1], w, y[b : b + 1], mask[b : b + 1])
        for got, want in zip(single, batched):
            np.testing.assert_allclose(got[0], want[b], atol=1e-6, rtol=1e-6)


def test_token_stats_sharded_batch_and_vocab(tokens):
    """hidden sharded on batch, lm_head on vocab over a "tensor" axis: same numbers as one device."""
    h, w, y, mask = tokens
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    h4, y4, m4 = (np.concatenate([x, x[:1]]) for x in (h, y, mask))  # B = 4 divides the data axis
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(h4, P("data")), put(w, P("tensor")), put(y4, P("data")), put(m4, P("data")))
    got = stats_fn(1.0, 4)(*args)
    want = np_token_stats(h4, w, y4, m4, 1.0)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


def test_token_pass_shape_errors_at_trace_time(tokens):
    h, w, y, mask = tokens
    fn = stats_fn(1.0, 4)
    with pytest.raises(ValueError, match="lm_head must be"):
        fn(h, w[:, :-1], y, mask)
    with pytest.raises(ValueError, match="targets must be"):
        fn(h, w, y[:, :-1], mask)
    with pytest.raises(ValueError, match="integer token ids"):
        fn(h, w, y.astype(np.float32), mask)
    with pytest.raises(ValueError, match="mask must be"):
        fn(h, w, y, mask[:2])
    with pytest.raises(ValueError, match="hidden must be"):
        jax.jit(lambda h, w, y: g2rl.token_logprobs(h, w, y))(h[0], w, y)
    with pytest.raises(ValueError, match="temperature"):
        g2rl.token_logprobs(h, w, y, temperature=0.0)


# ------------------------------------------------------------------------------------------ group equations
@pytest.fixture(scope="module")
def group():
    rng = np.random.default_rng(2)
    phi = rng.normal(size=(4, 6, 8)).astype(np.float32)
    rewards = np.where(rng.uniform(size=(4, 6)) < 0.5, 1.0, -1.0).astype(np.float32)
    rewards[3] = rng.normal(size=6) * 2  # continuous rewards too
    return phi, rewards


def test_novelty_matches_numpy(group):
    phi, r = group
    np.testing.assert_allclose(jax.jit(g2rl.novelty)(phi, r), np_novelty(phi, r), atol=1e-5)
    phi16 = jnp.asarray(phi, jnp.bfloat16)  # bf16 Φ: computed in f32 from the rounded values, same tolerance
    np.testing.assert_allclose(g2rl.novelty(phi16, r), np_novelty(np.asarray(phi16, np.float32), r), atol=1e-5)


def test_novelty_scale_invariant(group):
    """ν changes only through ε in Φ̂ = Φ/(‖Φ‖+ε): |ΔS| ≤ 2ε/‖Φ‖, so |Δν| ≤ 2·max|ΔS| / (2ν) per pair bound."""
    phi, r = group
    nu = np.asarray(g2rl.novelty(phi, r))
    for scale in (0.1, 7.0, 1e3):
        delta_s = 4 * EPS / (scale * np.linalg.norm(phi, axis=-1).min())
        bound = 2 * delta_s / (2 * nu.min()) + 1e-6
        np.testing.assert_allclose(g2rl.novelty(phi * scale, r), nu, atol=bound)


def test_novelty_parallel_orthogonal_single_zero():
    rng = np.random.default_rng(3)
    direction = rng.normal(size=8)
    parallel = (rng.choice([-2.0, -0.5, 1.0, 3.0], size=(2, 5))[..., None] * direction).astype(np.float32)
    r = np.ones((2, 5), np.float32)
    # exactly 1 − Σ w S² = ε/(Σ e^r + ε) ≈ 7e-8 (ν ≈ 3e-4), but f32 cosines of parallel unit vectors are off by
    # up to ~D·2^-24 ≈ 5e-7, so 1 − S² ≈ 1e-6 and ν = sqrt(·) can reach ~1e-3: the float32 floor of ν
    assert np.all(np.asarray(g2rl.novelty(parallel, r)) < 2e-3)
    orthogonal = (np.eye(8)[None, :5] * np.array([1.0, 2.0, 0.5, 3.0, 1e-3])[:, None]).astype(np.float32)
    np.testing.assert_allclose(g2rl.novelty(orthogonal, r[:1]), 1.0, atol=1e-6)
    np.testing.assert_allclose(g2rl.novelty(parallel[:, :1], r[:, :1]), 1.0)  # group of one
    zeros = np.zeros((1, 4, 8), np.float32)
    zeros_nu = np.asarray(g2rl.novelty(zeros, r[:1, :4]))
    assert not np.any(np.isnan(zeros_nu)) and np.all(zeros_nu == 1.0)
    one_zero = np.concatenate([zeros[:, :1], parallel[:1, :3]], axis=1)
    nu = np.asarray(g2rl.novelty(one_zero, r[:1, :4]))
    assert not np.any(np.isnan(nu)) and nu[0, 0] == 1.0
    np.testing.assert_allclose(nu, np_novelty(one_zero, r[:1, :4]), atol=1e-5)


@pytest.mark.parametrize("mode", ["text", "literal"])
@pytest.mark.parametrize("lam", [0.5, 3.0])
def test_shape_rewards_matches_numpy_and_stays_in_clip(group, mode, lam):
    phi, r = group
    nu = np.asarray(g2rl.novelty(phi, r))
    shaped = np.asarray(jax.jit(lambda r, nu: g2rl.shape_rewards(r, nu, lam=lam, mode=mode))(r, nu))
    np.testing.assert_allclose(shaped, np_shape(r, nu, lam, 3.0, mode), atol=1e-5)
    assert np.all(np.abs(shaped) <= 3.0)
    big = np.random.default_rng(4).normal(size=(5, 7)).astype(np.float32) * 10
    assert np.all(np.abs(np.asarray(g2rl.shape_rewards(big, np.abs(big) % 1, lam=lam, clip=2.0, mode=mode))) <= 2.0)


def test_shape_rewards_reading_of_the_text():
    """Text: novel correct answers gain, novel wrong answers lose more. Literal: novel wrong answers lose less."""
    r = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
    nu = np.array([[0.2, 0.9, 0.2, 0.9]], np.float32)
    text = np.asarray(g2rl.shape_rewards(r, nu, lam=0.5))
    literal = np.asarray(g2rl.shape_rewards(r, nu, lam=0.5, mode="literal"))
    np.testing.assert_allclose(text, [[1.0, 1.5, -1.0, -1.5]], atol=1e-6)
    np.testing.assert_allclose(literal, [[1.0, 1.5, -1.0, -0.5]], atol=1e-6)
    flat = np.asarray(g2rl.shape_rewards(r, np.full_like(nu, 0.4)))  # no spread: ν̄ = 0, r̃ = r
    np.testing.assert_allclose(flat, r)


def test_advantages_and_credit_within_correctness_classes(group):
    phi, r = group
    np.testing.assert_allclose(jax.jit(g2rl.group_advantages)(r), np_advantages(r), atol=1e-5)
    all_correct = np.ones((1, 6), np.float32)
    np.testing.assert_allclose(g2rl.group_advantages(all_correct), 0.0)  # GRPO: no signal
    nu = g2rl.novelty(phi[:1], all_correct)
    adv = np.asarray(g2rl.group_advantages(g2rl.shape_rewards(all_correct, nu)))
    assert np.abs(adv).max() > 0.5  # G2RL: credit within the correctness class ...
    assert np.array_equal(np.argsort(adv[0]), np.argsort(np.asarray(nu)[0]))  # ... ordered by novelty


@pytest.mark.parametrize("lam", [0.1, 0.5, 2.0])
def test_single_class_groups_shaped_or_zero(group, lam):
    """shaped: an all-equal group's advantages are ∓(ν̄ − mean ν̄)/std ν̄ whatever λ is, so in an all-wrong group
    the least novel wrong answers get positive advantage; zero: those groups get A = 0, mixed groups unchanged."""
    phi, _ = group
    r = np.array([[1, 1, 1, 1, 1, 1], [-1, -1, -1, -1, -1, -1], [1, -1, 1, -1, -1, 1], [-1] * 6], np.float32)
    correct = r > 0
    nu = np.asarray(g2rl.novelty(phi, r))
    shaped = np.asarray(g2rl.shape_rewards(r, nu, lam=lam, clip=10.0))
    want = np_advantages(shaped)
    lo, hi = np.float64(nu).min(1, keepdims=True), np.float64(nu).max(1, keepdims=True)
    nubar = (nu - lo) / (hi - lo)  # every group of the fixture has spread
    unit = (nubar - nubar.mean(1, keepdims=True)) / nubar.std(1, keepdims=True)
    np.testing.assert_allclose(want[0], unit[0], atol=2e-3)  # λ is gone (up to ε in the std)
    np.testing.assert_allclose(want[1], -unit[1], atol=2e-3)
    assert want[1][np.argmin(nu[1])] > 0  # the least novel wrong answer is pushed up
    fn = jax.jit(lambda a, c: g2rl.group_advantages(a, c, single_class="zero"))
    np.testing.assert_allclose(g2rl.group_advantages(shaped, correct), want, atol=1e-5)
    zero = np.asarray(fn(shaped, correct))
    np.testing.assert_allclose(zero, np.where(np.array([1, 1, 0, 1], bool)[:, None], 0.0, want), atol=1e-5)
    np.testing.assert_array_equal(g2rl.single_class_groups(correct), [True, True, False, True])
    with pytest.raises(ValueError, match="needs the base correctness"):
        g2rl.group_advantages(shaped, single_class="zero")
    with pytest.raises(ValueError, match="single_class must be one of"):
        g2rl.group_advantages(shaped, correct, single_class="drop")


def np_extremes(adv, nu):
    """Per group: the advantage of the response with the largest ν and of the one with the smallest (first on ties)."""
    adv, nu = np.float64(adv), np.float64(nu)
    most = [adv[g][max(range(nu.shape[1]), key=lambda i: (nu[g, i], -i))] for g in range(nu.shape[0])]
    least = [adv[g][min(range(nu.shape[1]), key=lambda i: (nu[g, i], i))] for g in range(nu.shape[0])]
    return np.array(most), np.array(least)


def test_novelty_extremes_matches_numpy(group):
    """The diagnostic behind single_class_adv_*_novel: in an all-wrong group under `shaped` the least novel answer
    gets a positive advantage and the most novel a negative one; in an all-right group the other way round."""
    phi, _ = group
    r = np.array([[1, 1, 1, 1, 1, 1], [-1] * 6, [1, -1, 1, -1, -1, 1], [-1] * 6], np.float32)
    nu = np.asarray(g2rl.novelty(phi, r))
    adv = np.asarray(g2rl.group_advantages(g2rl.shape_rewards(r, nu, lam=0.5)))
    most, least = jax.jit(g2rl.novelty_extremes)(adv, nu)
    want_most, want_least = np_extremes(adv, nu)
    np.testing.assert_allclose(most, want_most, atol=1e-6)
    np.testing.assert_allclose(least, want_least, atol=1e-6)
    assert most[0] > 0 > least[0] and least[1] > 0 > most[1] and least[3] > 0 > most[3]
    tied = np.array([[0.3, 0.9, 0.9, 0.1, 0.1]], np.float32)  # ties: the first of the equal responses
    values = np.arange(5, dtype=np.float32)[None]
    np.testing.assert_array_equal(np.concatenate(g2rl.novelty_extremes(values, tied)), [1.0, 3.0])
    with pytest.raises(ValueError, match="nu must share"):
        g2rl.novelty_extremes(adv, nu[:, :3])


def test_embedding_novelty_matches_numpy():
    rng = np.random.default_rng(5)
    emb = rng.normal(size=(5, 6, 10)).astype(np.float32)
    emb[:, :, 0] += 2.0  # mostly positive cosines, some clipped at 0
    correct = rng.uniform(size=(5, 6)) < 0.5
    valid = np.ones((5, 6), bool)
    correct[1] = [True, False, False, False, False, False]  # a correctness set of one
    valid[2] = [True, True, False, True, False, True]  # invalid responses get −1
    emb[3] = emb[3, :1]  # identical embeddings: no spread
    valid[4] = [False, False, True, False, False, False]  # a lone valid response
    got = np.asarray(jax.jit(g2rl.embedding_novelty)(emb, correct, valid))
    want = np.array([np_evol_group(emb[g], correct[g], valid[g]) for g in range(5)])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_vmapped_groups_equal_python_loop(group):
    phi, r = group
    nu = g2rl.novelty(phi, r)
    emb, correct, valid = phi[..., :5], r > 0, np.ones(r.shape, bool)
    batched = [nu, g2rl.shape_rewards(r, nu), g2rl.group_advantages(r), g2rl.embedding_novelty(emb, correct, valid)]
    for g in range(r.shape[0]):
        s = slice(g, g + 1)
        looped = [g2rl.novelty(phi[s], r[s]), g2rl.shape_rewards(r[s], nu[s]), g2rl.group_advantages(r[s]),
                  g2rl.embedding_novelty(emb[s], correct[s], valid[s])]
        for got, want in zip(looped, batched):
            np.testing.assert_allclose(got[0], want[g], atol=1e-6)


def test_group_shape_errors_at_trace_time(group):
    phi, r = group
    with pytest.raises(ValueError, match="rewards must share"):
        jax.jit(g2rl.novelty)(phi, r[:, :-1])
    with pytest.raises(ValueError, match="phi must have 3 dims"):
        jax.jit(g2rl.novelty)(phi[0], r)
    with pytest.raises(ValueError, match="nu must share"):
        jax.jit(g2rl.shape_rewards)(r, r[:2])
    with pytest.raises(ValueError, match="mode must be one of"):
        g2rl.shape_rewards(r, r, mode="bonus")
    with pytest.raises(ValueError, match="lam must be"):
        g2rl.shape_rewards(r, r, lam=-1.0)
    with pytest.raises(ValueError, match="rewards must have 2 dims"):
        jax.jit(g2rl.group_advantages)(r[0])
    with pytest.raises(ValueError, match="valid must share"):
        g2rl.embedding_novelty(phi, r > 0, np.ones((4, 5), bool))
