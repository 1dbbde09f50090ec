"""Data: the dataset registry over the vendored files, prompt templates, and grain prompt pipelines.

- datasets.py: `Example`, `load_dataset(name_or_path)`, `register_dataset(name, loader)`, `DataError` (a file or
  name that cannot be read: the message names the file and line); vendored files in files/
  (sources and licenses in files/LICENSES.md).
- prompts.py: the paper's system prompt through the chat template, a plain-text template, lettered choices.
- tokenizer.py: `load_tokenizer(folder)`: a Hugging Face tokenizer folder, loaded without importing torch.
- pipeline.py: `make_prompt_loader` (shuffled, repeated, batched, sharded by process; get_state/set_state,
  checkpointed by g2rl_jax.train.checkpoint).
"""

from g2rl_jax.data.datasets import DataError, Example, dataset_names, load_dataset, register_dataset
from g2rl_jax.data.prompts import SYSTEM_PROMPT, encode_prompts, render_prompt

__all__ = [
    "SYSTEM_PROMPT",
    "DataError",
    "Example",
    "dataset_names",
    "encode_prompts",
    "load_dataset",
    "make_prompt_loader",
    "register_dataset",
    "render_prompt",
]


def __getattr__(name: str):
    """`make_prompt_loader` is imported on first use: registering or reading datasets (what a reward worker that
    imports a demo task does) must not pay for importing grain and JAX."""
    if name == "make_prompt_loader":
        from g2rl_jax.data.pipeline import make_prompt_loader

        return make_prompt_loader
    raise AttributeError(f"module 'g2rl_jax.data' has no attribute {name!r}")
