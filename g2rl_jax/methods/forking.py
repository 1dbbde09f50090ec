"""High-entropy "forking" tokens only (Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective Reinforcement Learning for LLM Reasoning", arXiv 2506.01939): the policy gradient of a mini-batch keeps
only its top ρ = 20% response tokens by entropy, ⌈ρN⌉ of its N tokens (the authors' int(ρN + 0.9999)), at least one.

The authors aggregate the policy-gradient loss over the chosen tokens (token-mean: Σ_chosen ℓ / #chosen) and the
KL term over all response tokens; here that is a per-token weight N/#chosen on the chosen tokens and 0 on the
others under the usual mean over the N response tokens, which is the same number and stays exact when a
mini-batch is cut into micro-batches. Entropies are the current policy's, as the authors': those of the params
the mini-batch's update starts from, detached (train/step.py decides the tokens inside each update); the authors
choose per micro-batch, here per mini-batch, so the choice does not depend on memory settings (docs/peers.md).
"""
from __future__ import annotations

import jax.numpy as jnp

from g2rl_jax.methods.covariance import ranks_descending
from g2rl_jax.methods.grpo import rewards
from g2rl_jax.methods.registry import Method, Tokens, TokenTerms, register


def forking_tokens(tok: Tokens, algo) -> TokenTerms:
    on = tok.mask > 0
    n = jnp.sum(on).astype(jnp.float32)
    keep = jnp.maximum(jnp.floor(algo.forking_ratio * n + 0.9999), 1.0)  # ⌈ρN⌉ as the authors write it
    chosen = on & (ranks_descending(jnp.where(on, tok.entropy.astype(jnp.float32), -jnp.inf)) < keep)
    return TokenTerms(weight=chosen.astype(jnp.float32) * n / keep)


register(Method("forking", "policy gradient on the top 20% tokens by entropy only (Wang et al., arXiv 2506.01939)",
                rewards, tokens=forking_tokens))
