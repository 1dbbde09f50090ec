"""g2rl_jax: G2RL (gradient-guided RL for LLM reasoning) in JAX/Flax.

Where things live, in the order one RL step uses them:

  data/      dataset registry over vendored files, prompt templates, grain pipelines
  rollout/   jitted group sampler: prefill each prompt once, share its KV cache, while_loop decode
  rewards/   answer extraction and safe, time-bounded sympy equivalence (the ±1 reward)
  g2rl.py    the paper's equations: token_stats (log-probs, entropy, Φ), novelty, shaping, advantages
  losses.py  PPO-clip policy loss, KL estimators, aggregation, entropy bonus
  train/     state, update step, the training loop, Orbax checkpoints
  model/     Qwen3 in Flax NNX, attention backends, Hugging Face import/export
  parallel.py  device mesh and the logical-axis → mesh-axis table
  eval.py    pass@k, maj@k, the evaluation CLI
  bench/     python -m g2rl_jax.bench NAME: the measured figures the README quotes
"""

__version__ = "0.1.0"
