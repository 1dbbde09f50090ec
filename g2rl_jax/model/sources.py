"""Where a model directory comes from: `local_model_dir(value, key)` turns a model.path (algorithm.embedding_model,
model.lora.init_from, --model-path) into a local directory, before any model loads.

- a local directory: itself;
- a URL (gs://bucket/models/Qwen3-1.7B-Base): its files copied once to the local cache (g2rl_jax.storage.local_copy,
  copied again only when an object changed). Copied rather than read in place because the weights are memory-mapped
  and read slice by slice (model/hf_io.py: each device's slice of each tensor), which costs a request per slice on
  an object store and nothing extra on a local disk; the tokenizer loads from a local directory too;
- a Hugging Face id (`org/name`, not a local directory): huggingface_hub's snapshot in its cache (HF_HOME), downloaded
  there on first use; with HF_HUB_OFFLINE=1 only the cache is read. Neither there nor downloadable: one line that
  quotes the hub's error whole and names `hf download ORG/NAME` and huggingface_hub.snapshot_download. The
  cache is content-addressed already (`snapshots/<commit>`, files written under its own file locks), so processes
  that fetch the same commit at once share it. `hub_commit` names the commit a revision (a branch, a tag, "" for
  main) resolves to; the trainer records it as model.revision (train/lifecycle.pin_revision) so every resume loads
  the same weights and tokenizer.
"""
from __future__ import annotations

import os
import re

from g2rl_jax import storage
from g2rl_jax.config_groups import ConfigError

HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what a model directory needs of a hub repository: config, weights, tokenizer, generation defaults
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def is_hub_id(value: str) -> bool:
    """`org/name` that is not a local directory."""
    return bool(HF_ID.match(value)) and not storage.is_dir(value)


def local_model_dir(value: str, key: str, revision: str = "") -> str:
    """A local directory holding the model `value` names (see the module docstring; `revision`: a Hugging Face
    id's commit, branch or tag, "" for main); ConfigError naming `key`."""
    if storage.is_url(value):
        try:
            return storage.local_copy(value, key)
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from None
    return hub_snapshot(value, key, revision) if is_hub_id(value) else value


def hub_commit(repo_id: str, key: str, revision: str = "") -> str:
    """The commit hash that `revision` ("" for main) of Hugging Face repository `repo_id` resolves to (fetched to
    the cache if missing: the name of its snapshot directory)."""
    return os.path.basename(os.path.normpath(hub_snapshot(repo_id, key, revision)))


def hub_snapshot(repo_id: str, key: str, revision: str = "") -> str:
    """The local snapshot of Hugging Face repository `repo_id` at `revision` ("" for main; its cache, downloading
    what is missing)."""
    from huggingface_hub import constants, snapshot_download

    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_FILES)
    except (OSError, ValueError) as err:  # not cached and offline, no such repository, gated, no network
        offline = " (HF_HUB_OFFLINE=1: the cache only)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(f"{key}: {repo_id!r} is not a local directory, and as a Hugging Face id{at} it is neither in "
                          f"the cache {constants.HF_HUB_CACHE}{offline} nor downloadable. The hub said: "
                          f"{type(err).__name__}: {' '.join(str(err).split())} Fetch it into that cache where there "
                          f"is network: {fetch_commands(repo_id, revision)}; or point {key} at a model "
                          "directory") from None


def fetch_commands(repo_id: str, revision: str = "") -> str:
    """The two ways to put a hub model in the cache: huggingface_hub's command line and its Python call."""
    cli = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    call = f"huggingface_hub.snapshot_download({repo_id!r}" + (f", revision={revision!r}" if revision else "") + ")"
    return f"`{cli}` (or in Python `{call}`)"
