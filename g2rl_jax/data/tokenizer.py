"""Loading a Hugging Face tokenizer folder, as `transformers.AutoTokenizer` does, without importing torch.

`AutoTokenizer`'s module imports transformers' model-configuration code, and that imports torch wherever torch is
installed (the test extra, a GPU image): about 1.2 s and a few hundred MB more at every start of a command that
needs no torch. A folder with a `tokenizer.json` (every Qwen3 release, the demo's own tokenizer) holds the whole
tokenizer, special tokens and chat template in `tokenizer_config.json`: `PreTrainedTokenizerFast` reads the same files
and encodes, decodes and renders chat templates identically (tests/test_tokenizer.py, on the real Qwen3 tokenizer).
Anything else (a hub id, a folder with only a slow tokenizer's files) goes to `AutoTokenizer`.
"""
from __future__ import annotations

import os

from g2rl_jax import storage

FAST_FILE = "tokenizer.json"


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer in `path` (a local folder, or what `AutoTokenizer.from_pretrained` accepts)."""
    if not storage.is_url(path) and storage.is_file(storage.path(path) / FAST_FILE):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
