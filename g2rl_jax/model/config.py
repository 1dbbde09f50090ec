"""Model configuration: the architecture (`Qwen3Config`, HF field names) and how to run it (`RuntimeConfig`).

`Qwen3Config` mirrors the fields of a Hugging Face Qwen3 `config.json` that change the computation, so
`Qwen3Config.from_hf_dict(json.load(...))` and `.to_hf_dict()` are the whole translation. `RuntimeConfig`
holds choices that do not change the maths (up to rounding): parameter / compute / KV-cache dtypes, the
rematerialisation policy, and the attention backend. `PRESETS` holds the published Qwen3 sizes (for planning,
benchmarks and random-weight runs; a real checkpoint's config.json always wins) and tiny test sizes.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "splash")
HF_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
_LOG = logging.getLogger(__name__)
_HARDWARE = {"cudnn": "gpu", "splash": "tpu"}  # the platform each fused kernel needs
_FUSED = {hw: kernel for kernel, hw in _HARDWARE.items()}  # "auto"'s pick on that platform
FUSED_ATTENTION_CC = (8, 0)  # cuDNN's fused attention needs Ampere (sm_80) or newer: not a T4 (7.5) or V100 (7.0)
_warned: set[str] = set()


def dtype_from_name(name: str, what: str = "dtype"):
    """The jnp dtype for `name` ("float32" | "bfloat16"); a clear error for anything else."""
    if name not in DTYPES:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_attention(requested: str, compute_dtype) -> None:
    """The rules of an attention request that hold on every platform; ValueError naming the fix."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"RuntimeConfig.attention={requested!r}; choose one of {ATTENTION_BACKENDS}")
    if requested == "cudnn" and jnp.dtype(compute_dtype) != jnp.bfloat16:
        raise ValueError("RuntimeConfig.attention='cudnn' needs compute_dtype='bfloat16' (cuDNN fused attention "
                         f"has no float32 kernel), got {jnp.dtype(compute_dtype).name!r}")


def device_compute_capability(device) -> tuple[int, int] | None:
    """A GPU device's (major, minor) CUDA compute capability (also a compile-only topology device's); None off GPU."""
    text = getattr(device, "compute_capability", None)  # a CUDA device's attribute, e.g. "9.0"
    if device.platform != "gpu" or not text:
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def resolve_attention(requested: str, compute_dtype, platform: str | None = None,
                      compute_capability: tuple[int, int] | None = None) -> str:
    """The attention kernel that runs for `requested` ("auto" | "xla" | "cudnn" | "splash") with this compute
    dtype on `platform` (default: jax's backend, and then its GPU's compute capability). The one place that decides:
      auto      splash on TPU, cudnn on GPU with bfloat16 compute, xla otherwise;
      cudnn     needs bfloat16 compute (ValueError otherwise);
      a fused kernel whose hardware is absent (cudnn on a GPU older than FUSED_ATTENTION_CC) falls back to xla,
      with one logged warning per kernel."""
    check_attention(requested, compute_dtype)
    if platform is None:
        platform, compute_capability = jax.default_backend(), device_compute_capability(jax.devices()[0])
    old_gpu = platform == "gpu" and compute_capability is not None and compute_capability < FUSED_ATTENTION_CC
    if requested == "auto":
        fused = _FUSED.get(platform, "xla")
        return "xla" if fused == "cudnn" and (old_gpu or jnp.dtype(compute_dtype) != jnp.bfloat16) else fused
    if requested == "xla" or (platform == _HARDWARE[requested] and not old_gpu):
        return requested
    if requested not in _warned:
        _warned.add(requested)
        where = (f"compute capability {compute_capability[0]}.{compute_capability[1]}" if old_gpu else platform)
        _LOG.warning("attention backend %r needs a %s%s but jax runs on %s; using 'xla' instead", requested,
                     _HARDWARE[requested], " of sm_80 or newer" if old_gpu else "", where)
    return "xla"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config:
    """Qwen3 architecture, with the field names of Hugging Face's `Qwen3Config`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"Qwen3Config.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"Qwen3Config.rope_theta must be > 0, got {self.rope_theta!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"Qwen3Config.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    def num_params(self) -> int:
        """Parameter count (the embedding counted once when tied)."""
        d, f, h, k, dh = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                          self.num_key_value_heads, self.head_dim)
        per_layer = d * dh * (2 * h + 2 * k) + 3 * d * f + 2 * d + 2 * dh
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + self.num_hidden_layers * per_layer + d

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> Qwen3Config:
        """Read a Hugging Face Qwen3 config dict; `source` names the file in errors."""
        if hf.get("model_type") != "qwen3":
            raise ValueError(f"{source}: model_type is {hf.get('model_type')!r}, expected 'qwen3'")
        archs = hf.get("architectures") or ["Qwen3ForCausalLM"]
        if any(a not in HF_ARCHITECTURES for a in archs):
            raise ValueError(f"{source}: architectures {archs} not supported; expected one of {HF_ARCHITECTURES}")
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (Qwen3 checkpoints use false)")
        # transformers >= 5 writes rope_parameters; published checkpoints write rope_theta + rope_scaling.
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"{source}: missing keys {missing}")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers' `Qwen3ForCausalLM` loads."""
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "use_sliding_window": False, "torch_dtype": torch_dtype,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How to run a `Qwen3Config`: dtypes, rematerialisation, attention backend.

    param_dtype: storage dtype of the parameters ("float32" | "bfloat16").
    compute_dtype: dtype of activations and matmul inputs; softmax, norms and logits are always float32.
    kv_cache_dtype: dtype of the decode KV cache; None means compute_dtype.
    remat: "none" (keep activations), "full" (recompute each layer in the backward pass), "dots" (save
      matmul outputs without batch dims, recompute the rest).
    attention: "auto" (the fused kernel of this platform), "xla" (einsum softmax, any device), "cudnn" (GPU
      fused kernel, bf16 compute only), "splash" (TPU Pallas kernel); the request is kept as given and decided
      where it runs by `resolve_attention`.
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    kv_cache_dtype: str | None = None
    remat: str = "none"
    attention: str = "xla"

    def __post_init__(self):
        dtype_from_name(self.param_dtype, "RuntimeConfig.param_dtype")
        dtype_from_name(self.compute_dtype, "RuntimeConfig.compute_dtype")
        if self.kv_cache_dtype is not None:
            dtype_from_name(self.kv_cache_dtype, "RuntimeConfig.kv_cache_dtype")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"RuntimeConfig.remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        check_attention(self.attention, self.compute_dtype)

    @property
    def param_jnp(self):
        return DTYPES[self.param_dtype]

    @property
    def compute_jnp(self):
        return DTYPES[self.compute_dtype]

    @property
    def kv_cache_jnp(self):
        return DTYPES[self.kv_cache_dtype or self.compute_dtype]


def _qwen3(hidden, inter, layers, heads, tied) -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128, tie_word_embeddings=tied)


PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    # Tiny sizes for tests (head_dim != hidden / heads on purpose).
    "tiny": Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=10000.0,
                        max_position_embeddings=256, tie_word_embeddings=True),
    "tiny-untied": Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
                               max_position_embeddings=256, tie_word_embeddings=False),
}
