"""Exploration methods, one registered name per method (`algorithm.exploration`); see `registry` for what a method
is and how the trainer calls it. One file per method (or per paper), imported below, its names listed in NAMES:

  grpo.py              grpo, entropy_bonus
  gradient_novelty.py  g2rl (the paper's equations; novelty after the standardisation as an option),
                       g2rl_mixed_correct, g2rl_correct_peers
  evol.py              evol
  covariance.py        clip_cov, kl_cov
  passk.py             passk
  unlikeliness.py      unlikeliness
  negative.py          nsr, w_reinforce
  forking.py           forking
  miner.py             miner
"""
from g2rl_jax.methods import (  # noqa: F401
           covariance,
           evol,
           forking,
           gradient_novelty,
           grpo,
           miner,
           negative,
           passk,
           unlikeliness,
)
from g2rl_jax.methods.registry import (
           NEED_KEYS,
           NEEDS,
           REGISTRY,
           Group,
           Method,
           Signal,
           Tokens,
           TokenTerms,
           get,
           register,
           token_fields,
           token_terms,
)

# every registered name, in the order help texts list them: the paper's method and baselines first
NAMES: tuple[str, ...] = ("grpo", "entropy_bonus", "evol", "g2rl", "g2rl_mixed_correct", "g2rl_correct_peers",
                          "clip_cov", "kl_cov", "passk", "unlikeliness", "nsr", "w_reinforce", "forking", "miner")
if set(NAMES) != set(REGISTRY) or len(NAMES) != len(REGISTRY):
    raise ImportError(f"methods.NAMES {NAMES} and the registered methods {tuple(REGISTRY)} differ: list each once")

__all__ = ["NAMES", "NEED_KEYS", "NEEDS", "REGISTRY", "Group", "Method", "Signal", "TokenTerms", "Tokens", "get",
           "register", "token_fields", "token_terms"]
