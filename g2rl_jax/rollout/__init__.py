"""Rollout: sample groups of completions from a Qwen3 model with a shared-prefix KV cache.

    from g2rl_jax.rollout import generate
    rollout = generate(model, prompts, max_new_tokens=..., temperature=1.0, top_p=1.0, top_k=0,
                       num_samples=16, stop_token_ids=(eos,), seed=step)

Modules: generate.py (the public `generate` and `Rollout`),
engine.py (jitted prefill and segmented `lax.while_loop` decode reading rungs of a cache at the budget, with a
shrinking batch compacted in place,
cached per shape bucket and mesh), sampling.py (temperature / top-k / top-p / greedy and the log-prob
convention), batching.py (validation, power-of-two buckets, left padding).
"""
from g2rl_jax.rollout.generate import Rollout, generate

__all__ = ["Rollout", "generate"]
