"""The laptop demo: a synthetic verifiable task and a tiny warm-started Qwen3 policy the project builds itself.

    task.py       two-digit addition "37+48" answered as \\boxed{85}; train / held-out splits (datasets `demo`,
                  `demo_test`); the noisy teacher's carry slips
    tokenizer.py  a tiny BPE (digits always single tokens) saved as a Hugging Face tokenizer directory
    sft.py        the supervised warm start: imitate a teacher right 40% of the time (jitted AdamW loop)
    build.py      build_demo_model / build_demo_embedder (cached by a spec hash) and resolve_demo_paths, which
                  turns "demo:DIR" config values into built directories

Nothing here needs a network or downloaded weights: `python -m g2rl_jax.train --config configs/demo.yaml` builds
the model on first use (about half a minute of CPU) and then trains it with the real RL loop.
"""
from g2rl_jax.demo import task  # noqa: F401 - registers the datasets `demo` and `demo_test`
from g2rl_jax.demo.build import build_demo_embedder, build_demo_model, resolve_demo_paths

__all__ = ["build_demo_embedder", "build_demo_model", "resolve_demo_paths"]
