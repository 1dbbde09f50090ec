"""The laptop demo: a synthetic verifiable task and a tiny warm-started Qwen3 policy the project builds itself.

    task.py       two-digit addition "37+48" answered as \\boxed{85}; train / held-out splits (datasets `demo`,
                  `demo_test`); the noisy teacher's carry slips
    tokenizer.py  a tiny BPE (digits always single tokens) saved as a Hugging Face tokenizer directory
    sft.py        the supervised warm start: imitate a teacher right 40% of the time (jitted AdamW loop)
    build.py      build_demo_model / build_demo_embedder (cached by a spec hash) and resolve_demo_paths, which
                  turns "demo:DIR" / "countdown:DIR" / "countdown-study:DIR" / "sumprod:DIR" config values into
                  built directories (showing the warm start's progress)
    countdown.py  Countdown (configs/study_countdown.yaml; the MEMORISE set of tests): problem sets with several
                  correct answers per problem, a safe expression parser and the reward function the configs plug in
    sumprod.py    the study's second task: a sum of products worked out step by step (71-83 tokens), its checker
                  and reward, splits and the warm start's teacher
    explore_eval.py  pass@k, maj@k, distinct correct answers (and Φ) of a policy on held-out problems (Countdown's
                  judge by default)
    study.py      `python -m g2rl_jax.demo.study`: the grid of variants x seeds of the study, run and evaluated
    study_report.py  its bootstrap intervals, tables (study.md, study.json) and figures (passk.png, tradeoff.png,
                  geometry.png)

Nothing here needs a network or downloaded weights: `python -m g2rl_jax.train --config configs/demo.yaml` builds
the model on first use (about half a minute of CPU) and then trains it with the real RL loop.
"""
from g2rl_jax.demo import task  # noqa: F401 - registers the demo's datasets

__all__ = ["build_demo_embedder", "build_demo_model", "resolve_demo_paths"]


def __getattr__(name: str):
    """The builders, imported on first use: `import g2rl_jax.demo.countdown` (what a reward worker process
    does for `reward.function`) must not pay for importing JAX and Flax."""
    if name in __all__:
        from g2rl_jax.demo import build

        return getattr(build, name)
    raise AttributeError(f"module 'g2rl_jax.demo' has no attribute {name!r}")
