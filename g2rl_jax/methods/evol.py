"""EVOL-RL baseline: rewards from an external embedding model's novelty (g2rl.embedding_novelty), then GRPO's
standardisation. Needs algorithm.embedding_model; the trainer embeds every response before the advantages."""
from __future__ import annotations

from g2rl_jax import g2rl
from g2rl_jax.methods.grpo import no_novelty, standardise
from g2rl_jax.methods.registry import Group, Method, Signal, register


def rewards(group: Group, algo) -> Signal:
    shaped_Pxm = g2rl.embedding_novelty(group.embeddings, group.correct, group.valid)
    return Signal(shaped_Pxm, standardise(shaped_Pxm, group, algo), no_novelty(group))


def check(cfg) -> tuple[str, str] | None:
    if cfg.algorithm.embedding_model is None:
        return "algorithm.embedding_model", ("is required with exploration=evol: a Qwen3-architecture embedding "
                                             "model (a local HF directory, gs://..., or a Hugging Face id)")
    return None


register(Method("evol", "EVOL-RL: novelty of response embeddings from an external model (the G2RL paper's "
                "baseline, arXiv 2512.15687)", rewards, check=check, needs=frozenset({"embeddings"})))
