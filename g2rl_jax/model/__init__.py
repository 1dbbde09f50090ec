"""Qwen3 in Flax NNX, its configs and Hugging Face interop.

    config.py     Qwen3Config (HF field names), RuntimeConfig (dtypes, remat, attention backend), PRESETS
    qwen3.py      the model: forward, hidden_states, lm_head_weight, KV-cache prefill / decode_step
    attention.py  attention backends (xla / cudnn / splash) and the prefix+suffix decode attention
    hf_io.py      load_pretrained / save_pretrained for local HF directories (safetensors)
    lora.py       LoRA adapters on the projections: attach, trainable/frozen split, reference graphdef, merge
    peft_io.py    LoRA adapters as PEFT adapter directories: save_adapter / load_adapter
"""
from g2rl_jax.model.config import PRESETS, Qwen3Config, RuntimeConfig
from g2rl_jax.model.hf_io import load_pretrained, save_pretrained
from g2rl_jax.model.qwen3 import PrefixCache, Qwen3, SuffixCache

__all__ = ["PRESETS", "PrefixCache", "Qwen3", "Qwen3Config", "RuntimeConfig", "SuffixCache", "load_pretrained",
           "save_pretrained"]
