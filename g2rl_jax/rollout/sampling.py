"""Token sampling from one step's logits: temperature, top-k, top-p (nucleus), greedy, and behaviour log-probs.

`sample_tokens(logits_BxV, keys_B, temperature, top_p, spec)` returns one token per row and its log-prob.
Order of operations (as transformers' samplers): scale by 1/T, keep the k largest logits (top-k), renormalise over
the kept tokens, keep the smallest prefix of them (by descending probability) whose mass reaches top_p, sample
from the renormalised remainder with the Gumbel-max trick (argmax of logits + Gumbel noise is an exact sample
from softmax(logits)), in two stages over a large vocabulary (a block, then a token in it; see `categorical`).

Log-prob convention (what the PPO ratio and the G2RL features need):
  * sampling (T > 0): log softmax(logits / T)[token] over the FULL vocabulary. top-k / top-p only restrict what
    can be drawn; they do not renormalise the returned log-prob, so it equals what a scoring forward pass
    computes at the same temperature.
  * greedy (T = 0): the argmax token (lowest index on ties) and its log softmax(logits)[token] at T = 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -jnp.inf
BLOCK = 1024  # two-stage sampling block (see `categorical`)


def key_data(seed: int) -> np.ndarray:
    """jax.random.key_data(jax.random.key(seed)) made on the host (threefry2x32: [0, seed] for 0 <= seed < 2^31):
    the eager seeding compiles two programs, this none. Another PRNG implementation or seed: jax's own."""
    if jax.config.jax_default_prng_impl == "threefry2x32" and 0 <= int(seed) < 2**31:
        return np.array([0, int(seed)], np.uint32)
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def key(seed: int) -> jax.Array:
    """jax.random.key(seed), its data made on the host (`key_data`): no program."""
    return jax.random.wrap_key_data(key_data(seed))


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """The static (compile-time) part of the sampling choice; temperature and top_p stay dynamic.

    greedy: temperature == 0 (argmax).
    top_k: keep only the k most likely tokens (0 = off); a static shape, hence part of the compile key.
    use_top_p: whether top_p < 1 (nucleus filtering needs a sort, skipped when off).
    """

    greedy: bool
    top_k: int
    use_top_p: bool


def spec_for(temperature: float, top_p: float, top_k: int, vocab_size: int) -> SamplerSpec:
    """The static sampler spec of one `generate` call (top_k >= vocab is the same as off)."""
    greedy = temperature == 0
    k = 0 if greedy or top_k >= vocab_size else top_k
    return SamplerSpec(greedy=greedy, top_k=k, use_top_p=not greedy and top_p < 1.0)


def full_logprob(logits_BxV, tokens_B, temperature):
    """log softmax(logits / T)[token] over the whole vocabulary, in float32."""
    logp_BxV = jax.nn.log_softmax(logits_BxV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]


def nucleus_keep(sorted_logits_BxI, top_p):
    """Mask of the smallest descending-probability prefix whose mass reaches top_p (the first always kept)."""
    probs_BxI = jax.nn.softmax(sorted_logits_BxI, axis=-1)
    mass_before_BxI = jnp.cumsum(probs_BxI, axis=-1) - probs_BxI
    return mass_before_BxI < top_p


def _gumbel_argmax(logits_BxI, keys_B):
    """One exact draw per row from softmax(logits) (Gumbel-max); -inf logits are never drawn."""
    n = logits_BxI.shape[-1]
    gumbel_BxI = jax.vmap(lambda key: jax.random.gumbel(key, (n,), jnp.float32))(keys_B)
    return jnp.argmax(logits_BxI + gumbel_BxI, axis=-1)


def categorical(logits_BxI, keys_B, block: int = BLOCK):
    """One exact draw per row from softmax(logits), in two stages when I > block: draw one of Q blocks of
    C = `block` entries with probability ∝ its mass (Gumbel-max over the blocks' logsumexp), then an entry within
    it. P(i) = P(block(i)) * P(i | block) = softmax(logits)_i, with Q + C Gumbel draws instead of I."""
    B, n = logits_BxI.shape
    if n <= block:
        return _gumbel_argmax(logits_BxI, keys_B)
    nb = -(-n // block)
    padded_BxQxC = jnp.pad(logits_BxI, ((0, 0), (0, nb * block - n)), constant_values=_NEG_INF).reshape(B, nb, block)
    keys_Bx2 = jax.vmap(jax.random.split)(keys_B)
    block_B = _gumbel_argmax(jax.nn.logsumexp(padded_BxQxC, axis=-1), keys_Bx2[:, 0])
    within_BxC = jnp.take_along_axis(padded_BxQxC, block_B[:, None, None], axis=1)[:, 0]
    return block_B * block + _gumbel_argmax(within_BxC, keys_Bx2[:, 1])


def sample_tokens(logits_BxV, keys_B, temperature, top_p, spec: SamplerSpec):
    """One token per row and its log-prob (see the module docstring for the convention)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if spec.greedy:
        tokens_B = jnp.argmax(logits_BxV, axis=-1)
        return tokens_B.astype(jnp.int32), full_logprob(logits_BxV, tokens_B, 1.0)
    scaled_BxV = logits_BxV / temperature
    if spec.top_k == 0 and not spec.use_top_p:
        tokens_B = categorical(scaled_BxV, keys_B)
    else:
        # Candidates in descending order: the top k, or the whole vocabulary sorted when only top-p is on.
        cand_BxI, cand_ids_BxI = jax.lax.top_k(scaled_BxV, spec.top_k or logits_BxV.shape[-1])
        if spec.use_top_p:
            cand_BxI = jnp.where(nucleus_keep(cand_BxI, top_p), cand_BxI, _NEG_INF)
        picked_B = categorical(cand_BxI, keys_B)
        tokens_B = jnp.take_along_axis(cand_ids_BxI, picked_B[:, None], axis=-1)[:, 0]
    return tokens_B.astype(jnp.int32), full_logprob(logits_BxV, tokens_B, temperature)
