"""What a checkpoint records about the model it trained, and the checks that hold a resume or a load to it.

Every checkpoint step holds an item `model/model.json` (written by train.checkpoint.Checkpointer):

    {"lora": null}                                   a full fine-tune: the checkpoint's params are every weight
    {"lora": {"rank": 8, "alpha": 8.0, "targets": ["q_proj", ...]},
     "base": {"path": "models/Qwen3-1.7B-Base", "sha256": "..."}}
                                                     LoRA: the checkpoint's params are the adapters only; the base is
                                                     model.path, whose safetensors hash (hf_io.weights_sha256) to sha256

A checkpoint without the item predates it and is a full fine-tune. `check` refuses, in one line naming the fix, a
resume or a load whose config disagrees with the checkpoint: LoRA adapters onto a run without LoRA or the reverse,
adapters of another rank, alpha or targets, and adapters onto a base whose weights are not the ones they were
trained on (whatever model.path says).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from g2rl_jax import storage
from g2rl_jax.model import lora
from g2rl_jax.model.hf_io import weights_sha256

MODEL_ITEM, MODEL_FILE = "model", "model.json"


def base_sha256(path: str | os.PathLike) -> str:
    """The sha256 of the base model's weights (a few seconds per GB; printed when it takes long)."""
    t0 = time.perf_counter()
    digest = weights_sha256(path)
    if time.perf_counter() - t0 > 5:
        print(f"model.lora: hashed the base model's weights in {time.perf_counter() - t0:.0f} s", flush=True)
    return digest


def record(model_cfg, sha256: str | None) -> dict[str, Any]:
    """The model.json of a run with config group `model` (sha256 of model.path's weights: LoRA only)."""
    spec = lora.LoraSpec.from_config(model_cfg.lora)
    pinned = {"revision": model_cfg.revision} if model_cfg.revision else {}  # a Hugging Face id's commit
    if spec is None:
        return {"lora": None, **pinned}
    return {"lora": {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)},
            "base": {"path": model_cfg.path, "sha256": sha256}, **pinned}


def saved(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The model.json a checkpoint step holds ({"lora": None} for a checkpoint written before it existed)."""
    path = storage.path(step_dir) / MODEL_ITEM / MODEL_FILE
    return json.loads(storage.read_text(path)) if storage.is_file(path) else {"lora": None}


def _describe(lora_rec: dict[str, Any]) -> str:
    return f"rank {lora_rec['rank']}, alpha {lora_rec['alpha']:g}, targets {','.join(lora_rec['targets'])}"


def check(have: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """ValueError (one line naming the fix) when checkpoint record `have` (at `where`) does not fit record `want`
    of the run or load at hand."""
    old, new = have["lora"], want["lora"]
    if old is None and new is not None:
        raise ValueError(f"{where} holds a full fine-tune (every weight trained), but this run sets "
                         f"model.lora.rank={new['rank']}: resume it with model.lora.rank=0, or train LoRA in a new "
                         "run.output_dir (python -m g2rl_jax.export writes the checkpoint's policy as a model.path)")
    if old is not None and new is None:
        raise ValueError(f"{where} holds LoRA adapters ({_describe(old)}) on the base {old_base(have)}, but this "
                         f"run has model.lora.rank=0: resume it with the run's model.lora settings (rank "
                         f"{old['rank']}), or fine-tune fully in a new run.output_dir from the merged policy "
                         "(python -m g2rl_jax.export)")
    if old is None:
        return
    if old != new:
        raise ValueError(f"{where} holds LoRA adapters with {_describe(old)}, but this run asks for "
                         f"{_describe(new)}: use the checkpoint's model.lora settings, or a new run.output_dir")
    if have["base"]["sha256"] != want["base"]["sha256"]:
        raise ValueError(f"{where} holds LoRA adapters trained on the base {old_base(have)}, but model.path "
                         f"{want['base']['path']!r} holds other weights (sha256 {want['base']['sha256'][:12]}…): "
                         "point model.path at the base model the adapters were trained on")


def old_base(rec: dict[str, Any]) -> str:
    return f"{rec['base']['path']!r} (weights sha256 {rec['base']['sha256'][:12]}…)"
