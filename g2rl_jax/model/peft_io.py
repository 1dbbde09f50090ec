"""PEFT LoRA adapters in and out, so that `peft` (and vLLM) load what g2rl_jax trained, and the reverse.

    save_adapter(model, "out/adapter", base_model="models/Qwen3-1.7B-Base", base_sha256=sha)
    load_adapter(model, "out/adapter", base_sha256=sha)     # model.lora.init_from: the model's adapters overwritten

A PEFT adapter directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with, for layer i and projection P (HF module path M = model.layers.i.self_attn.q_proj,
...), `base_model.model.M.lora_A.weight` [r, in] and `base_model.model.M.lora_B.weight` [out, r]; PEFT's forward
adds (lora_alpha / r)·x·Aᵀ·Bᵀ, which is this project's x·A·(alpha/r)·B with A [*in, r] and B [r, *out] flattened
and transposed (the same flattening of grouped dims as hf_io). The safetensors metadata also carries the sha256 of
the base weights the adapter was trained on (`BASE_SHA256_KEY`, ignored by peft), so loading it onto another base
fails with a clear error; a foreign adapter without it is checked by its shapes only.
"""
from __future__ import annotations

import json
import math
import pathlib

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from g2rl_jax.model import lora
from g2rl_jax.model.hf_io import LAYER_HF

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
BASE_SHA256_KEY = "g2rl_jax.base_sha256"
_PREFIX = "base_model.model.model.layers"


def _module(layer: int, name: str) -> str:
    """PEFT's name of projection `name` of layer `layer` in a Qwen3ForCausalLM."""
    return f"{_PREFIX}.{layer}.{LAYER_HF[name][0].removesuffix('.weight')}"


def save_adapter(model, path, *, base_model: str, base_sha256: str | None = None) -> pathlib.Path:
    """Write the model's adapters as a PEFT LoRA adapter directory (tensors in the adapters' dtype)."""
    spec, cfg = model.adapters.spec, model.config
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name in spec.targets:
        a, b = (np.asarray(jax.device_get(x)) for x in model.adapters.factors(name))
        for i in range(cfg.num_hidden_layers):
            tensors[f"{_module(i, name)}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, spec.rank).T)
            tensors[f"{_module(i, name)}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(spec.rank, -1).T)
    metadata = {"format": "pt"} | ({BASE_SHA256_KEY: base_sha256} if base_sha256 else {})
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata=metadata)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
              "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "inference_mode": True, "init_lora_weights": True}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path


def _read_config(path: pathlib.Path, spec: lora.LoraSpec) -> dict:
    """The adapter's config, checked against the spec of model.lora; ValueError naming the key to set."""
    file = path / ADAPTER_CONFIG
    if not file.is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{str(path)!r} is not a PEFT adapter directory (it needs {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}; python -m g2rl_jax.export --adapter writes one)")
    config = json.loads(file.read_text())
    unsupported = {"peft_type": ("LORA",), "bias": ("none",), "use_rslora": (False,), "use_dora": (False,),
                   "fan_in_fan_out": (False,), "layers_to_transform": (None,), "rank_pattern": (None, {}),
                   "alpha_pattern": (None, {}), "modules_to_save": (None, [])}
    for key, allowed in unsupported.items():
        if config.get(key, allowed[0]) not in allowed:
            raise ValueError(f"{file}: {key}={config[key]!r} is not supported (only {allowed[0]!r}): a plain LoRA "
                             "adapter on the projections is")
    if config.get("r") != spec.rank or float(config.get("lora_alpha", -1)) != spec.alpha:
        raise ValueError(f"{file} has r={config.get('r')}, lora_alpha={config.get('lora_alpha')}, but model.lora "
                         f"asks for rank {spec.rank}, alpha {spec.alpha:g}: set model.lora.rank={config.get('r')} "
                         f"model.lora.alpha={config.get('lora_alpha')}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or set(targets) != set(spec.targets):
        names = {v: k for k, v in lora.TARGETS.items()}
        wanted = ",".join(names.get(t, t) for t in targets) if isinstance(targets, list) else targets
        raise ValueError(f"{file} adapts target_modules {targets!r}, but model.lora.targets gives "
                         f"{list(spec.targets)}: set model.lora.targets={wanted}")
    return config


def load_adapter(model, path, *, base_sha256: str | None = None) -> None:
    """Overwrite `model`'s adapters with the PEFT adapter at `path` (model.lora.init_from). ValueError, in one line
    naming what differs, when it does not fit: another rank, alpha or targets than the model's adapters, another
    base model (by the recorded weights hash, or by tensor shapes), or tensors missing or extra."""
    path = pathlib.Path(path)
    spec, cfg = model.adapters.spec, model.config
    config = _read_config(path, spec)
    base = f"its base {config.get('base_model_name_or_path')!r}"
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="numpy") as f:
        recorded = (f.metadata() or {}).get(BASE_SHA256_KEY)
        if recorded and base_sha256 and recorded != base_sha256:
            raise ValueError(f"{path} was trained on another base model ({base}, weights sha256 {recorded[:12]}…) "
                             f"than model.path (sha256 {base_sha256[:12]}…); point model.path at its base model")
        keys, factors = set(f.keys()), {}
        for name in spec.targets:
            a_shape, b_shape = lora.factor_shapes(cfg, spec, name)
            a_hf, b_hf = (spec.rank, math.prod(a_shape[1:-1])), (math.prod(b_shape[2:]), spec.rank)
            a, b = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
            for i in range(cfg.num_hidden_layers):
                for suffix, want, out in (("lora_A", a_hf, a), ("lora_B", b_hf, b)):
                    key = f"{_module(i, name)}.{suffix}.weight"
                    if key not in keys:
                        raise ValueError(f"{path / ADAPTER_WEIGHTS} has no tensor {key!r}: the adapter does not fit "
                                         f"this {cfg.num_hidden_layers}-layer model ({base})")
                    got = f.get_tensor(key)
                    if tuple(got.shape) != want:
                        raise ValueError(f"{path / ADAPTER_WEIGHTS}: {key} has shape {list(got.shape)}, but "
                                         f"model.path needs {list(want)}: the adapter was trained on another base "
                                         f"model ({base})")
                    keys.discard(key)
                    out[i] = got.T.reshape(out.shape[1:]).astype(np.float32)
            factors[name] = (a, b)
    if keys:
        raise ValueError(f"{path / ADAPTER_WEIGHTS} holds tensors this model has no place for, e.g. "
                         f"{sorted(keys)[0]!r}: only LoRA adapters on the decoder projections load")
    lora.set_factors(model, factors)
