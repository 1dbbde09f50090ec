"""The equations of "Can LLMs Guide Their Own Exploration? Gradient-Guided Reinforcement Learning for LLM
Reasoning" (G2RL, arXiv 2512.15687, section Method) as pure JAX functions.

Token pass (batched over B sequences; one chunked scan, never the full [B, L, V] logits):
  token_logprobs  log p_t(y_t), differentiable with a memory-lean custom VJP (recomputes each chunk).
  token_stats     log-probs, entropies and the sequence gradient feature Φ in the same pass (eqs.
                  head-softmax, token-grad, token-feature, seq-feature, efficient). Φ is built in vocab space:
                  Φ = (Σ_t α̃_t (e(y_t) − p_t)) · W, one [V]·[V, D] product per sequence, not one per token.
Group equations (each a `jax.vmap` over the P groups, one per prompt, of a per-group function on m responses):
  novelty            eqs. cosine, weights, novelty: ν ∈ [0, 1].
  shape_rewards      eqs. scale, shaped-reward and the clip to ±c ("text" or "literal" reading, see below).
  group_advantages   eq. grpo-adv, population variance; groups whose base correctness is all equal keep their
                     shaped advantages (the paper) or get zero (GRPO's outcome), see single_class_groups.
  novelty_extremes   diagnostic: the advantage each group gives its most and its least novel response.
  embedding_novelty  the EVOL-RL baseline: shaped rewards from an external embedding model's vectors.
The entropy-bonus baseline lives in `g2rl_jax.losses.ppo_loss(entropy=..., entropy_coef=...)`.
Shape letters (B, P, m, L, C, Q, V, D, ...) are those of the legend in `g2rl_jax`'s docstring.
"""
import functools

import jax
import jax.numpy as jnp

EPS = 1e-6  # the paper's ε in eqs. seq-feature, cosine and weights (the paper gives no value)
ADV_EPS = 1e-6  # ε inside the square root of eq. grpo-adv
DEFAULT_CHUNK = 64  # sequence positions per chunk: the live logits are [B, chunk, V] in float32
# Below this spread, min–max of ν would only amplify float32 noise: ν = sqrt(1 − Σ w S²) turns a rounding
# error of ~1e-7 in 1 − Σ w S² into ~3e-4 in ν, so a group whose ν differ by less counts as "no spread".
NU_SPREAD_MIN = 1e-3
SHAPING_MODES = ("text", "literal")
SINGLE_CLASS_MODES = ("shaped", "zero")
EMBED_NORM_MIN = 1e-8  # EVOL-RL's floor on embedding norms before the cosine


# ---------------------------------------------------------------------------------------------- token pass
def _check_token_inputs(hidden, lm_head, targets, mask=None):
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, L, D] (final hidden states after the final norm); "
                         f"got shape {hidden.shape}")
    if lm_head.ndim != 2 or lm_head.shape[1] != hidden.shape[2]:
        raise ValueError(f"lm_head must be [V, D] with D = hidden.shape[2] = {hidden.shape[2]}; "
                         f"got shape {lm_head.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [B, L] = {hidden.shape[:2]} like hidden's first two dims; "
                         f"got {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must hold integer token ids; got dtype {targets.dtype}")
    if mask is not None and mask.shape != hidden.shape[:2]:
        raise ValueError(f"mask must be [B, L] = {hidden.shape[:2]} like hidden's first two dims; got {mask.shape}")


def _static_chunking(temperature, chunk_size, length):
    if not isinstance(temperature, (int, float)) or temperature <= 0:
        raise ValueError(f"temperature must be a Python number > 0 (it is static under jit); got {temperature!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive Python int; got {chunk_size!r}")
    return float(temperature), min(chunk_size, length)


def _scan_positions(body, carry, per_position, chunk):
    """carry, ys = body(carry, xs) over consecutive chunks of the position axis (axis 1) of per_position.

    Each chunk is a dynamic slice of the [B, L, ...] inputs and each chunk's outputs ys ([B, C, ...]) are written
    in place into [B, L, ...] buffers, so neither side is copied into a chunk-major layout; a trailing partial chunk
    runs once at its own size, so nothing is padded. None entries of per_position stay None.
    """
    length = next(x for x in per_position if x is not None).shape[1]
    n, tail = divmod(length, chunk)

    def slices(start, size):
        return tuple(None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in per_position)

    def write(ys, ys_chunk, start):
        return jax.tree.map(lambda y, c: jax.lax.dynamic_update_slice_in_dim(y, c, start, axis=1), ys, ys_chunk)

    _, specs = jax.eval_shape(body, carry, slices(0, chunk))
    ys = jax.tree.map(lambda s: jnp.zeros((s.shape[0], length, *s.shape[2:]), s.dtype), specs)

    def step(state, i):
        carry, ys = state
        carry, ys_chunk = body(carry, slices(i * chunk, chunk))
        return (carry, write(ys, ys_chunk, i * chunk)), None

    (carry, ys), _ = jax.lax.scan(step, (carry, ys), jnp.arange(n))
    if tail:
        carry, ys_chunk = body(carry, slices(n * chunk, tail))
        ys = write(ys, ys_chunk, n * chunk)
    return carry, ys


def _chunk_logits(h_BxCxD, w_VxD, temperature):
    # eq. head-softmax: u = z / T with z = W h (no bias in Qwen3), float32 accumulation for any input dtype
    z_BxCxV = jnp.einsum("bcd,vd->bcv", h_BxCxD, w_VxD, preferred_element_type=jnp.float32)
    return z_BxCxV / temperature


def _chunk_normaliser(u_BxCxV, y_BxC):
    """m = max u, e = exp(u − m), s = Σ e, lse = m + log s, log p(y) = u_y − lse. Only u and e are [B, C, V]."""
    m_BxC = jnp.max(u_BxCxV, axis=-1)
    e_BxCxV = jnp.exp(u_BxCxV - m_BxC[..., None])
    s_BxC = jnp.sum(e_BxCxV, axis=-1)
    lse_BxC = m_BxC + jnp.log(s_BxC)
    u_y_BxC = jnp.take_along_axis(u_BxCxV, y_BxC[..., None], axis=-1)[..., 0]
    return m_BxC, e_BxCxV, s_BxC, lse_BxC, u_y_BxC - lse_BxC


def _logprobs_scan(hidden_BxLxD, w_VxD, targets_BxL, temperature, chunk):
    def body(carry, xs):
        h_BxCxD, y_BxC = xs
        *_, lse_BxC, logp_BxC = _chunk_normaliser(_chunk_logits(h_BxCxD, w_VxD, temperature), y_BxC)
        return carry, (logp_BxC, lse_BxC)

    _, (logp, lse) = _scan_positions(body, (), (hidden_BxLxD, targets_BxL), chunk)
    return logp, lse


def _stats_scan(hidden_BxLxD, w_VxD, targets_BxL, alpha_BxL, temperature, chunk):
    def body(q_BxV, xs):  # q accumulates Σ_t α̃_t p_t in vocab space (eqs. seq-feature, efficient)
        h_BxCxD, y_BxC, a_BxC = xs
        u_BxCxV = _chunk_logits(h_BxCxD, w_VxD, temperature)
        m_BxC, e_BxCxV, s_BxC, lse_BxC, logp_BxC = _chunk_normaliser(u_BxCxV, y_BxC)
        # H = log s − Σ p (u − m). The shift is written u + (−m), not reused from e's u − m: a shared u − m would be
        # a third [B, C, V] buffer, this form fuses into the reduction (bench score, temporary memory)
        ent_BxC = jnp.log(s_BxC) - jnp.sum(e_BxCxV * (u_BxCxV + (-m_BxC)[..., None]), axis=-1) / s_BxC
        q_BxV = q_BxV + jnp.einsum("bc,bcv->bv", a_BxC / s_BxC, e_BxCxV, preferred_element_type=jnp.float32)
        return q_BxV, (logp_BxC, ent_BxC, lse_BxC)

    b, vocab = hidden_BxLxD.shape[0], w_VxD.shape[0]
    q_BxV, (logp, ent, lse) = _scan_positions(body, jnp.zeros((b, vocab), jnp.float32),
                                              (hidden_BxLxD, targets_BxL, alpha_BxL), chunk)
    # Σ_t α̃_t e(y_t): one scatter of the weights into vocab space
    onehots_BxV = jnp.zeros((b, vocab), jnp.float32).at[jnp.arange(b)[:, None], targets_BxL].add(alpha_BxL)
    # eq. token-feature summed with α̃: Φ = Wᵀ r, r = Σ_t α̃_t (e(y_t) − p_t), rounded to W's dtype, f32 accumulation
    r_BxV = onehots_BxV - q_BxV
    phi_BxD = jnp.einsum("bv,vd->bd", r_BxV.astype(w_VxD.dtype), w_VxD, preferred_element_type=jnp.float32)
    return logp, ent, lse, phi_BxD


def _chunk_grads(h_BxCxD, w_VxD, y_BxC, lse_BxC, g_logp_BxC, ent_BxC, g_ent_BxC, temperature):
    """Cotangent of one chunk: d log p(y)/du = e(y) − p, dH/du = −p (log p + H); then through z = W h."""
    u_BxCxV = _chunk_logits(h_BxCxD, w_VxD, temperature)
    logp_BxCxV = u_BxCxV - lse_BxC[..., None]
    onehot_BxCxV = y_BxC[..., None] == jnp.arange(w_VxD.shape[0])  # e(y_t), fused into du; no gather over V
    # du = g_logp e(y) − p (g_logp + g_ent (log p + H)): one fused expression of u, so du is the only other [B, C, V]
    weight_BxCxV = g_logp_BxC[..., None]
    if g_ent_BxC is not None:
        weight_BxCxV = weight_BxCxV + g_ent_BxC[..., None] * (logp_BxCxV + ent_BxC[..., None])
    du_BxCxV = jnp.where(onehot_BxCxV, g_logp_BxC[..., None], 0.0) - jnp.exp(logp_BxCxV) * weight_BxCxV
    dz_BxCxV = du_BxCxV / temperature
    dh_BxCxD = jnp.einsum("bcv,vd->bcd", dz_BxCxV.astype(w_VxD.dtype), w_VxD, preferred_element_type=jnp.float32)
    dw_VxD = jnp.einsum("bcv,bcd->vd", dz_BxCxV.astype(h_BxCxD.dtype), h_BxCxD, preferred_element_type=jnp.float32)
    return dh_BxCxD.astype(h_BxCxD.dtype), dw_VxD


def _grads_scan(hidden_BxLxD, w_VxD, targets_BxL, lse_BxL, g_logp_BxL, ent_BxL, g_ent_BxL, temperature, chunk):
    def body(dw_VxD, xs):
        dh_BxCxD, dw_chunk = _chunk_grads(xs[0], w_VxD, *xs[1:], temperature)
        return dw_VxD + dw_chunk, (dh_BxCxD,)

    per_position = (hidden_BxLxD, targets_BxL, lse_BxL, g_logp_BxL, ent_BxL, g_ent_BxL)
    dw_VxD, (dh,) = _scan_positions(body, jnp.zeros(w_VxD.shape, jnp.float32), per_position, chunk)
    return dh, dw_VxD.astype(w_VxD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_logprobs(hidden, w, targets, temperature, chunk):
    return _logprobs_scan(hidden, w, targets, temperature, chunk)[0]


def _fused_logprobs_fwd(hidden, w, targets, temperature, chunk):
    logp, lse = _logprobs_scan(hidden, w, targets, temperature, chunk)
    return logp, (hidden, w, targets, lse)  # residuals: inputs plus one float per position


def _fused_logprobs_bwd(temperature, chunk, res, g_logp):
    hidden, w, targets, lse = res
    dh, dw = _grads_scan(hidden, w, targets, lse, g_logp, None, None, temperature, chunk)
    return dh, dw, None


_fused_logprobs.defvjp(_fused_logprobs_fwd, _fused_logprobs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_stats(hidden, w, targets, alpha, temperature, chunk):
    logp, ent, _, phi = _stats_scan(hidden, w, targets, alpha, temperature, chunk)
    return logp, ent, phi


def _fused_stats_fwd(hidden, w, targets, alpha, temperature, chunk):
    logp, ent, lse, phi = _stats_scan(hidden, w, targets, alpha, temperature, chunk)
    return (logp, ent, phi), (hidden, w, targets, lse, ent)


def _fused_stats_bwd(temperature, chunk, res, cotangents):
    hidden, w, targets, lse, ent = res
    g_logp, g_ent, _ = cotangents  # Φ leaves token_stats through stop_gradient: its cotangent is always zero
    dh, dw = _grads_scan(hidden, w, targets, lse, g_logp, ent, g_ent, temperature, chunk)
    return dh, dw, None, None


_fused_stats.defvjp(_fused_stats_fwd, _fused_stats_bwd)


def token_logprobs(hidden, lm_head, targets, *, temperature=1.0, chunk_size=DEFAULT_CHUNK):
    """log p_t(y_t) [B, L] for hidden [B, L, D], lm_head [V, D], integer targets [B, L].

    hidden[:, t] gives the distribution of targets[:, t]; p_t = softmax(hidden_t · lm_headᵀ / T). Chunked over
    the sequence (live logits [B, chunk_size, V], float32); differentiable in hidden and lm_head through a custom
    VJP that recomputes each chunk's logits instead of storing them.
    """
    _check_token_inputs(hidden, lm_head, targets)
    length = hidden.shape[1]
    temperature, chunk = _static_chunking(temperature, chunk_size, length)
    return _fused_logprobs(hidden, lm_head, targets, temperature, chunk)


def token_stats(hidden, lm_head, targets, mask, *, temperature=1.0, chunk_size=DEFAULT_CHUNK):
    """(logprobs [B, L], entropy [B, L], phi [B, D]) in one chunked pass; see token_logprobs for the layout.

    phi = Σ_t α̃_t φ_t with φ_t = lm_head[y_t] − p_t · lm_head (eq. token-feature, without 1/T) and
    α̃_t = mask_t / (Σ_s mask_s + ε) (eq. seq-feature). logprobs and entropy are differentiable (custom VJP, so
    the entropy bonus can use them); phi is returned under stop_gradient.
    """
    _check_token_inputs(hidden, lm_head, targets, mask)
    length = hidden.shape[1]
    temperature, chunk = _static_chunking(temperature, chunk_size, length)
    mask_BxL = mask.astype(jnp.float32)
    alpha_BxL = mask_BxL / (jnp.sum(mask_BxL, axis=-1, keepdims=True) + EPS)  # eq. seq-feature, α ≡ 1 on the mask
    logp, ent, phi = _fused_stats(hidden, lm_head, targets, alpha_BxL, temperature, chunk)
    return logp, ent, jax.lax.stop_gradient(phi)


# ------------------------------------------------------------------------------------------ group equations
def _check_group(name, x, ndim, like=None):
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims ([P, m{', D' if ndim == 3 else ''}]); got shape {x.shape}")
    if like is not None and x.shape[:2] != like.shape[:2]:
        raise ValueError(f"{name} must share [P, m] = {like.shape[:2]} with its partner array; got shape {x.shape}")


def _novelty_group(phi_mxD, r_m):
    phi_mxD = phi_mxD.astype(jnp.float32)
    r_m = r_m.astype(jnp.float32)
    phihat_mxD = phi_mxD / (jnp.linalg.norm(phi_mxD, axis=-1, keepdims=True) + EPS)  # eq. cosine
    s_mxm = jnp.matmul(phihat_mxD, phihat_mxD.T, precision=jax.lax.Precision.HIGHEST)
    others_mxm = 1.0 - jnp.eye(r_m.shape[0], dtype=jnp.float32)
    # eq. weights, with numerator and denominator both scaled by exp(−max r) so exp cannot overflow
    shift = jnp.max(r_m)
    x_m = jnp.exp(r_m - shift)
    w_mxm = others_mxm * x_m[None, :] / (others_mxm @ x_m + EPS * jnp.exp(-shift))[:, None]
    return jnp.sqrt(jnp.maximum(1.0 - jnp.sum(w_mxm * s_mxm**2, axis=-1), 0.0))  # eq. novelty


def novelty(phi, rewards):
    """ν [P, m] from sequence features phi [P, m, D] and base rewards [P, m] (eqs. cosine, weights, novelty).

    A group of one has no peers and gets ν = 1; a zero feature has Φ̂ = 0, so ν = 1 and no NaN.
    """
    _check_group("phi", phi, 3)
    _check_group("rewards", rewards, 2, like=phi)
    return jax.vmap(_novelty_group)(phi, rewards)


def _minmax_group(nu_m):
    lo, span = jnp.min(nu_m), jnp.max(nu_m) - jnp.min(nu_m)
    spread = span > NU_SPREAD_MIN
    return jnp.where(spread, (nu_m - lo) / jnp.where(spread, span, 1.0), 0.0)


def _shape_group(r_m, nu_m, lam, clip, mode):
    nubar_m = _minmax_group(nu_m.astype(jnp.float32))
    r_m = r_m.astype(jnp.float32)
    gain_m = lam * nubar_m if mode == "text" else lam * r_m * nubar_m  # eq. scale: f = 1 + λ(·) ν̄
    return jnp.clip(r_m * (1.0 + gain_m), -clip, clip)  # eq. shaped-reward, then clip to ±c


def shape_rewards(rewards, nu, *, lam=0.5, clip=3.0, mode="text"):
    """Shaped rewards r̃ [P, m] (eqs. scale, shaped-reward, clip to ±c); ν̄ = min–max of ν within the group.

    mode="text" (default): r̃ = clip(r (1 + λ ν̄), ±c), the paper's prose: novelty boosts a correct answer and
    amplifies the penalty of a wrong one. mode="literal": f = 1 + λ r ν̄ read as written, r̃ = clip(r + λ r² ν̄),
    which for r = −1 softens the penalty of novel wrong answers, contradicting the prose (docs/paper.md, "How the paper
    is read").
    """
    _check_group("rewards", rewards, 2)
    _check_group("nu", nu, 2, like=rewards)
    if mode not in SHAPING_MODES:
        raise ValueError(f"mode must be one of {SHAPING_MODES}; got {mode!r}")
    if not isinstance(lam, (int, float)) or lam < 0:
        raise ValueError(f"lam must be a Python number >= 0 (the paper's λ ∈ [0, λ_max]); got {lam!r}")
    if not isinstance(clip, (int, float)) or clip <= 0:
        raise ValueError(f"clip must be a Python number > 0 (the paper's c = 3); got {clip!r}")
    shape = functools.partial(_shape_group, lam=float(lam), clip=float(clip), mode=mode)
    return jax.vmap(shape)(rewards, nu)


def _advantages_group(r_m):
    r_m = r_m.astype(jnp.float32)
    centred_m = r_m - jnp.mean(r_m)
    return centred_m / jnp.sqrt(jnp.mean(centred_m**2) + ADV_EPS)  # eq. grpo-adv, population variance


def single_class_groups(correct):
    """[P] bool: the groups of correct [P, m] whose base correctness is all equal (all right or all wrong)."""
    _check_group("correct", correct, 2)
    correct = correct.astype(bool)
    return jnp.all(correct, axis=-1) | ~jnp.any(correct, axis=-1)


def group_advantages(rewards, correct=None, *, single_class="shaped"):
    """A [P, m] = (r − mean) / sqrt(var + 1e-6) within each group (eq. grpo-adv).

    single_class="shaped" (the paper's equations): a group whose base correctness is all equal is standardised
    like any other, so its shaped rewards r̃ = ±(1 + λν̄) come out as ∓(ν̄ − mean ν̄) / std ν̄ at full unit scale
    whatever λ > 0 is. single_class="zero" gives such groups zero advantage, as plain GRPO's ±1 rewards do;
    it needs `correct` [P, m].
    """
    _check_group("rewards", rewards, 2)
    if single_class not in SINGLE_CLASS_MODES:
        raise ValueError(f"single_class must be one of {SINGLE_CLASS_MODES}; got {single_class!r}")
    adv_Pxm = jax.vmap(_advantages_group)(rewards)
    if single_class == "shaped":
        return adv_Pxm
    if correct is None:
        raise ValueError("single_class='zero' needs the base correctness correct [P, m] to find single-class groups")
    _check_group("correct", correct, 2, like=rewards)
    return jnp.where(single_class_groups(correct)[:, None], 0.0, adv_Pxm)


def _extremes_group(adv_m, nu_m):
    return adv_m[jnp.argmax(nu_m)], adv_m[jnp.argmin(nu_m)]


def novelty_extremes(advantages, nu):
    """(A of each group's most novel response, A of its least novel response), [P] each, from advantages and ν
    [P, m]: the responses at argmax ν and argmin ν (the first one on ties). A diagnostic: in a single-class group
    under single_class="shaped" these are the ±(ν̄ − mean ν̄)/std ν̄ extremes (see group_advantages)."""
    _check_group("advantages", advantages, 2)
    _check_group("nu", nu, 2, like=advantages)
    return jax.vmap(_extremes_group)(advantages.astype(jnp.float32), nu.astype(jnp.float32))


def _embedding_novelty_group(emb_mxE, correct_m, valid_m):
    emb_mxE = emb_mxE.astype(jnp.float32)
    unit_mxE = emb_mxE / jnp.maximum(jnp.linalg.norm(emb_mxE, axis=-1, keepdims=True), EMBED_NORM_MIN)
    sim_mxm = jnp.clip(jnp.matmul(unit_mxE, unit_mxE.T, precision=jax.lax.Precision.HIGHEST), 0.0, 1.0)
    m = correct_m.shape[0]
    others = valid_m[:, None] & valid_m[None, :] & ~jnp.eye(m, dtype=bool)
    same_set = others & (correct_m[:, None] == correct_m[None, :])
    n_others, n_same = jnp.sum(others, -1), jnp.sum(same_set, -1)
    mean_same = jnp.sum(jnp.where(same_set, sim_mxm, 0.0), -1) / jnp.maximum(n_same, 1)
    mean_others = jnp.sum(jnp.where(others, sim_mxm, 0.0), -1) / jnp.maximum(n_others, 1)
    # mean over the own correctness set; over all valid peers when the set has no other member
    mean_sim = jnp.where(n_same > 0, mean_same, mean_others)
    max_sim = jnp.where(n_others > 0, jnp.max(jnp.where(others, sim_mxm, 0.0), -1), 0.5)
    u_m = 1.0 - (0.5 * mean_sim + 0.5 * max_sim)
    # ũ = min–max of u within the correctness set; a set of one gets 1, a set without spread 0.5
    in_set = valid_m[:, None] & valid_m[None, :] & (correct_m[:, None] == correct_m[None, :])
    lo = jnp.min(jnp.where(in_set, u_m[None, :], jnp.inf), -1)
    hi = jnp.max(jnp.where(in_set, u_m[None, :], -jnp.inf), -1)
    spread = hi > lo
    u_tilde = jnp.where(spread, (u_m - lo) / jnp.where(spread, hi - lo, 1.0), 0.5)
    u_tilde = jnp.where(jnp.sum(in_set, -1) == 1, 1.0, u_tilde)
    shaped = jnp.where(correct_m, 0.5, -1.0) + 0.5 * u_tilde
    lone = jnp.where(correct_m, 1.0, -1.0)  # fewer than two valid responses: no novelty, plain ±1
    return jnp.where(valid_m, jnp.where(jnp.sum(valid_m) >= 2, shaped, lone), -1.0)


def embedding_novelty(embeddings, correct, valid):
    """EVOL-RL baseline: shaped rewards [P, m] from response embeddings [P, m, E] (external embedding model).

    Among valid responses S_ij = clip(cos(e_i, e_j), 0, 1); u_i = 1 − (½·mean of S_ij over the other members of
    i's correctness set + ½·max_{j≠i} S_ij); ũ = min–max of u within the correctness set; reward 0.5 + 0.5 ũ if
    correct, −1 + 0.5 ũ if wrong, −1 if invalid (EVOL-RL's public code). Where a group has fewer than two valid
    responses, the lone valid one gets its plain ±1 (EVOL-RL's code varies by case there).
    """
    _check_group("embeddings", embeddings, 3)
    _check_group("correct", correct, 2, like=embeddings)
    _check_group("valid", valid, 2, like=embeddings)
    return jax.vmap(_embedding_novelty_group)(embeddings, correct.astype(bool), valid.astype(bool))
