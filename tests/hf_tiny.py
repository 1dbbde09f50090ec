"""Shared test helper: tiny random Qwen3 checkpoints written by transformers itself (float32).

    from hf_tiny import make_tiny_qwen3_dir
    path = make_tiny_qwen3_dir(tmp_path / "m", num_key_value_heads=1, tie_word_embeddings=False)
    path = make_tiny_qwen3_dir(tmp_path / "e", encoder=True)  # a bare Qwen3Model, as Qwen3-Embedding

Defaults give a 2-layer model with vocab 128, hidden 64, 4 heads, 2 KV heads and head_dim 24 (!= 64 / 4);
any `transformers.Qwen3Config` field can be overridden. Weights are random (seeded) with non-trivial norms.
"""
from __future__ import annotations

import pathlib

DEFAULTS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=256, tie_word_embeddings=True)


def make_tiny_qwen3_dir(path, seed: int = 0, encoder: bool = False, **config_overrides) -> pathlib.Path:
    """Save a random tiny `Qwen3ForCausalLM` (float32, safetensors) to `path` and return the path. `encoder`:
    a `Qwen3Model` instead (keys without `model.`, no lm_head.weight, architectures ["Qwen3Model"])."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{**DEFAULTS, **config_overrides})
    model = (transformers.Qwen3Model if encoder else transformers.Qwen3ForCausalLM)(cfg).float().eval()
    with torch.no_grad():  # random norm weights, so a wrong norm wiring cannot hide behind ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    path = pathlib.Path(path)
    model.save_pretrained(path)
    return path
