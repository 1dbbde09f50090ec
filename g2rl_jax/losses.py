"""Policy losses for the update step: per-token KL estimators, PPO-clip with DAPO-style asymmetric clipping and an
optional dual clip, token- or sequence-level importance ratios (GSPO), truncated importance weights against the
sampler's own log-probs, loss aggregation over [B, T] tokens, the entropy bonus, the per-token terms an exploration
method may set (g2rl_jax/methods/: a token weight, a |log ρ| penalty, no clip), and per-step diagnostics.

All per-token arrays are [B, T] (B sequences, T response positions; the shape letters of `g2rl_jax`) with a 0/1
`mask` marking response tokens; advantages are one per sequence, [B] (outcome rewards, eq. grpo-adv of the G2RL
paper, arXiv 2512.15687).
"""
import jax.numpy as jnp

KL_KINDS = ("k1", "k2", "k3")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIO_LEVELS = ("token", "sequence")
# Clamps as verl applies them to "low_var_kl" (k3): the log-ratio ref − logp is clamped to ±20 before exp,
# and the estimate to ±10, so one token whose probability collapsed cannot blow up the loss. The same ±20
# clamp guards the PPO ratio exp(logp − old_logp).
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def kl_penalty(logp, ref_logp, kind):
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled-token log-probs (Schulman's k1, k2, k3 estimators).

    k1 = logp − ref; k2 = ½ (logp − ref)²; k3 = exp(ref − logp) − (ref − logp) − 1 ("low_var_kl"), with
    ref − logp clamped to ±20 and the result to ±10 as verl does.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}; got {kind!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {logp.shape} and ref_logp {ref_logp.shape} must have the same shape")
    diff = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff**2
    log_r = jnp.clip(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -K3_CLAMP, K3_CLAMP)


def masked_mean(x_BxT, mask_BxT):
    """Mean of x over the masked tokens of the whole batch (0 when the mask is empty)."""
    return jnp.sum(x_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def aggregate(x_BxT, mask_BxT, mode="token-mean"):
    """Reduce per-token values to a scalar loss.

    token-mean: Σ x·mask / Σ mask over the batch. seq-mean-token-mean: each sequence's token mean, averaged over
    the B sequences. seq-mean-token-sum: each sequence's token sum, averaged over the B sequences.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}; got {mode!r}")
    if mode == "token-mean":
        return masked_mean(x_BxT, mask_BxT)
    seq_sum_B = jnp.sum(x_BxT * mask_BxT, axis=-1)
    if mode == "seq-mean-token-sum":
        return jnp.mean(seq_sum_B)
    return jnp.mean(seq_sum_B / jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0))


def _check_ppo_args(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, entropy, entropy_coef,
                    ref_logp, kl_coef, kl_kind, ratio_level, sampler_logp, is_cap, token_weight=None,
                    abs_log_ratio_coef=None):
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T]; got shape {logp.shape}")
    for name, x in (("old_logp", old_logp), ("mask", mask), ("entropy", entropy), ("ref_logp", ref_logp),
                    ("sampler_logp", sampler_logp), ("token_weight", token_weight),
                    ("abs_log_ratio_coef", abs_log_ratio_coef)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} must be [B, T] = {logp.shape} like logp; got shape {x.shape}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be one per sequence, [B] = {logp.shape[:1]}; got shape {advantages.shape}")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss of negative-advantage tokens); got {dual_clip}")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy (token_stats' second output) as entropy=")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef != 0 needs the reference model's per-token log-probs as ref_logp=")
    if kl_kind not in KL_KINDS:
        raise ValueError(f"kl_kind must be one of {KL_KINDS}; got {kl_kind!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}; got {ratio_level!r}")
    if (is_cap is None) != (sampler_logp is None):
        given = "given" if sampler_logp is not None else "None"
        raise ValueError("is_cap and sampler_logp go together: the truncated importance weight min(π_old/π_sampler, "
                         f"is_cap) needs both (got is_cap={is_cap}, sampler_logp {given})")
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap must be > 0 (it caps the weight π_old/π_sampler); got {is_cap}")


def importance_log_ratio(logp, old_logp, mask, level="token"):
    """log ρ [B, L], clamped to ±20. token: log π_θ(y_t) − log π_old(y_t) per token (verl's practice). sequence:
    GSPO's length-normalised ratio, the mean token log-ratio of each response, the same at all of its tokens, so
    ρ_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|) is clipped once per response (eq. ratio-clip, per |y_i|-th root)."""
    diff_BxL = logp.astype(jnp.float32) - old_logp.astype(jnp.float32)
    if level == "sequence":
        mean_B = jnp.sum(diff_BxL * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        diff_BxL = jnp.broadcast_to(mean_B[:, None], diff_BxL.shape)
    return jnp.clip(diff_BxL, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def truncated_is_weights(old_logp, sampler_logp, cap):
    """Per-token min(π_old(y_t) / π_sampler(y_t), cap) (truncated importance sampling for the mismatch between the
    sampler's numerics and the trainer's), and whether the cap engaged; both [B, L], constants (no gradient)."""
    log_w = jnp.clip(old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), -LOG_RATIO_CLAMP,
                     LOG_RATIO_CLAMP)
    raw = jnp.exp(log_w)
    return jnp.minimum(raw, cap), raw > cap


def ppo_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean",
             entropy=None, entropy_coef=0.0, ref_logp=None, kl_coef=0.0, kl_kind="k3", ratio_level="token",
             sampler_logp=None, is_cap=None, clip=True, token_weight=None, abs_log_ratio_coef=None):
    """PPO-clip objective as a loss to minimise (eq. grpo-obj with DAPO's separate ε_low / ε_high), plus
    kl_coef · KL(π_θ ‖ π_ref) and minus entropy_coef · entropy (the paper's "Entropy Bonus" baseline).

    Per token: ρ = exp(importance_log_ratio(ratio_level)); ℓ = max(−A ρ, −A clip(ρ, 1 − clip_low, 1 + clip_high));
    with dual_clip = c, tokens with A < 0 take min(ℓ, −A c); with is_cap = C, ℓ is weighted by
    min(π_old / π_sampler, C) from sampler_logp. An exploration method's per-token terms ([B, L], constants):
    clip=False takes ℓ = −A ρ unclipped; abs_log_ratio_coef adds coef·|log ρ| to ℓ (KL-Cov); token_weight multiplies
    ℓ (Clip-Cov's detached tokens, forking tokens). Returns (loss, diagnostics): pg_loss, clip_frac_low (A < 0 and
    ρ < 1 − clip_low), clip_frac_high (A > 0 and ρ > 1 + clip_high), dual_clip_frac (A < 0 and ρ > c, if set),
    approx_kl (k3 estimate of KL(π_old ‖ π_θ) on the sampled tokens), rollout_is_weight_mean and
    rollout_is_capped_frac (if is_cap is set), and entropy / kl when given; all token means.
    """
    _check_ppo_args(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, entropy, entropy_coef,
                    ref_logp, kl_coef, kl_kind, ratio_level, sampler_logp, is_cap, token_weight, abs_log_ratio_coef)
    mask = mask.astype(jnp.float32)
    adv_Bx1 = advantages.astype(jnp.float32)[:, None]
    token_log_ratio = importance_log_ratio(logp, old_logp, mask, "token")
    log_ratio = token_log_ratio if ratio_level == "token" else importance_log_ratio(logp, old_logp, mask, "sequence")
    ratio = jnp.exp(log_ratio)
    if clip:
        per_token = jnp.maximum(-adv_Bx1 * ratio, -adv_Bx1 * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    else:
        per_token = -adv_Bx1 * ratio
    diagnostics = {
        "clip_frac_low": masked_mean(((adv_Bx1 < 0) & (ratio < 1.0 - clip_low)).astype(jnp.float32), mask),
        "clip_frac_high": masked_mean(((adv_Bx1 > 0) & (ratio > 1.0 + clip_high)).astype(jnp.float32), mask),
        "approx_kl": masked_mean(jnp.expm1(token_log_ratio) - token_log_ratio, mask),
    }
    if dual_clip is not None:
        per_token = jnp.where(adv_Bx1 < 0, jnp.minimum(per_token, -adv_Bx1 * dual_clip), per_token)
        diagnostics["dual_clip_frac"] = masked_mean(((adv_Bx1 < 0) & (ratio > dual_clip)).astype(jnp.float32), mask)
    if is_cap is not None:
        weight_BxL, capped_BxL = truncated_is_weights(old_logp, sampler_logp, is_cap)
        per_token = per_token * weight_BxL
        diagnostics["rollout_is_weight_mean"] = masked_mean(weight_BxL, mask)
        diagnostics["rollout_is_capped_frac"] = masked_mean(capped_BxL.astype(jnp.float32), mask)
    if abs_log_ratio_coef is not None:
        per_token = per_token + abs_log_ratio_coef.astype(jnp.float32) * jnp.abs(token_log_ratio)
    if token_weight is not None:
        per_token = per_token * token_weight.astype(jnp.float32)
    pg_loss = aggregate(per_token, mask, agg)
    loss = pg_loss
    diagnostics["pg_loss"] = pg_loss
    if entropy is not None:
        loss = loss - entropy_coef * aggregate(entropy.astype(jnp.float32), mask, agg)
        diagnostics["entropy"] = masked_mean(entropy.astype(jnp.float32), mask)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_kind)
        loss = loss + kl_coef * aggregate(kl, mask, agg)
        diagnostics["kl"] = masked_mean(kl, mask)
    return loss, diagnostics
