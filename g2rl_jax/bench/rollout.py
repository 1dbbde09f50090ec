"""Benchmark of `generate`: `python -m g2rl_jax.bench rollout [--prompts P --samples M --new-tokens T ...]`.

Default (CPU, a few minutes): a small random Qwen3 with the real vocabulary (151,936), built by transformers and
loaded into JAX from the same files; P=4 prompts x M=8 samples, prompts of 48..64 tokens, 64 new tokens,
temperature 1, no stop tokens (every sample generates exactly T tokens on both sides). Printed, from one run:
  * generated tokens/s of `generate` (warm) and of transformers PyTorch `generate(do_sample=True,
    num_return_sequences=M)` on the same model, batch, lengths and sampling, and their ratio;
  * compile time (first call minus a warm call), and the warm split prefill / decode (ms per step);
  * the prefill FLOPs saved by prefilling each prompt once instead of once per sample.
`--preset qwen3-1.7b --dtype bfloat16 --no-hf --roofline` runs a published size with random weights (for a GPU):
it also measures copy bandwidth with a big jnp copy and prints the share of the HBM roofline, where one decode
step must read all weights plus the KV it attends to: (weight bytes + KV bytes per step) / bandwidth over the
measured time per step.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig, load_pretrained
from g2rl_jax.rollout import batching, engine, generate
from g2rl_jax.rollout.sampling import spec_for


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published Qwen3 size (random weights)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="params, compute, KV")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt; lengths spread over [3/4, 1] of it")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="warm JAX calls (median reported)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers (e.g. sizes too big for PyTorch CPU)")
    p.add_argument("--roofline", action="store_true", help="measure copy bandwidth and print the roofline share")
    return p.parse_args(argv)


def _config(a) -> Qwen3Config:
    if a.preset:
        return PRESETS[a.preset]
    return Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       head_dim=a.head_dim, tie_word_embeddings=True)


def _prompts(a, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    lengths = np.linspace(max(1, 3 * a.prompt_len // 4), a.prompt_len, a.prompts).astype(int)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def prefill_flops(cfg: Qwen3Config, lengths: list[int]) -> float:
    """Forward FLOPs of prefilling prompts of these lengths: 2 x matmul params per token + causal attention
    (QK^T and PV, 2 x 2 x H x Dh x n(n+1)/2 per layer) + the LM head on the last token only."""
    D, F, H, G, K = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim)
    per_token = 2 * cfg.num_hidden_layers * (D * K * (2 * H + 2 * G) + 3 * D * F)
    attn = sum(4 * cfg.num_hidden_layers * H * K * n * (n + 1) / 2 for n in lengths)
    return sum(per_token * n for n in lengths) + attn + 2 * D * cfg.vocab_size * len(lengths)


def _hf_tokens_per_s(path, prompts, a) -> float:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=a.temperature > 0, num_return_sequences=a.samples,
              pad_token_id=0, eos_token_id=None, top_k=a.top_k, top_p=a.top_p)
    if a.temperature > 0:
        kw["temperature"] = a.temperature
    with torch.no_grad():
        model.generate(**{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = model.generate(**kw, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens)
        seconds = time.perf_counter() - start
    assert out.shape == (len(prompts) * a.samples, width + a.new_tokens), out.shape
    return len(prompts) * a.samples * a.new_tokens / seconds


def _split_timing(model, prompts, a) -> tuple[float, float]:
    """Warm seconds of the jitted prefill and of the decode loop alone (same calls generate makes)."""
    sizes = batching.buckets_for(prompts, a.new_tokens, 1)
    ids, mask = batching.left_pad(prompts, sizes.num_prompts, sizes.prompt_len)
    graphdef, state = nnx.split(model)
    cfg = model.config
    prefill = engine.prefill_fn(None, cfg.num_key_value_heads)
    decode = engine.decode_fn(None, cfg.num_key_value_heads)
    start = time.perf_counter()
    logits, prefix, suffix = jax.block_until_ready(
        prefill(graphdef, state, ids, mask, num_samples=a.samples, new_tokens=sizes.new_tokens))
    mid = time.perf_counter()
    jax.block_until_ready(decode(
        graphdef, state, logits, prefix, suffix, jax.random.key(1), jnp.float32(a.temperature),
        jnp.float32(a.top_p), batching.stop_array(()), jnp.int32(a.new_tokens), jnp.int32(len(prompts) * a.samples),
        num_samples=a.samples,
        spec=spec_for(a.temperature, a.top_p, a.top_k, cfg.vocab_size)))
    return mid - start, time.perf_counter() - mid


def copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a jitted copy of a `gib` GiB float32 array (read + write counted)."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    copy = jax.jit(lambda v: v * 1.0001)
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / min(times)


def decode_bytes_per_step(cfg: Qwen3Config, dtype_bytes: int, prompt_tokens: int, batch: int,
                          new_tokens: int) -> float:
    """Bytes a decode step must read, averaged over the T steps: every weight once, the real prompt tokens' KV
    once (shared by the group), and each sample's (T + 1) / 2 generated tokens' KV on average."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return cfg.num_params() * dtype_bytes + kv_per_token * (prompt_tokens + batch * (new_tokens + 1) / 2)


def decode_bytes_touched(cfg: Qwen3Config, dtype_bytes: int, prefix_slots: int, batch: int, new_tokens: int) -> float:
    """Bytes our decode step reads: every weight once, the whole padded prefix cache, and the whole suffix cache
    (attention runs over all T slots with a mask, so static shapes compile once)."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return cfg.num_params() * dtype_bytes + kv_per_token * (prefix_slots + batch * new_tokens)


def main(argv: list[str]) -> int:
    a = _args(argv)
    cfg = _config(a)
    rt = RuntimeConfig(param_dtype=a.dtype, compute_dtype=a.dtype, kv_cache_dtype=a.dtype)
    prompts = _prompts(a, cfg.vocab_size)
    B, T = len(prompts) * a.samples, a.new_tokens
    print(f"model: {cfg.num_params() / 1e6:.1f}M params (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {a.dtype}); {len(prompts)} prompts x {a.samples} samples, prompt "
          f"lengths {min(map(len, prompts))}..{max(map(len, prompts))}, {T} new tokens, temperature "
          f"{a.temperature}, top_p {a.top_p}, top_k {a.top_k}; jax {jax.default_backend()} "
          f"({jax.devices()[0].device_kind})")
    with tempfile.TemporaryDirectory() as tmp:
        if a.no_hf:
            model = Qwen3(cfg, rt, rngs=nnx.Rngs(0))
        else:
            import transformers

            transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf_dict())).save_pretrained(tmp)
            model = load_pretrained(tmp, a.dtype, runtime=rt)
        kw = dict(max_new_tokens=T, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, num_samples=a.samples)
        start = time.perf_counter()
        generate(model, prompts, seed=0, **kw)
        first = time.perf_counter() - start
        warm = []
        for seed in range(1, a.repeats + 1):
            start = time.perf_counter()
            r = generate(model, prompts, seed=seed, **kw)
            warm.append(time.perf_counter() - start)
        assert all(len(ids) == T for ids in r.completion_ids)
        warm_s = statistics.median(warm)
        jax_tps = B * T / warm_s
        prefill_s, decode_s = _split_timing(model, prompts, a)
        print(f"jax generate: {jax_tps:,.0f} tokens/s (warm {warm_s:.2f} s, median of {a.repeats}); compile "
              f"{first - warm_s:.1f} s (first call {first:.1f} s)")
        print(f"  prefill {prefill_s * 1e3:.1f} ms, decode {decode_s:.2f} s = {decode_s / T * 1e3:.2f} ms/step")
        if not a.no_hf:
            hf_tps = _hf_tokens_per_s(tmp, prompts, a)
            print(f"transformers generate: {hf_tps:,.0f} tokens/s; ratio jax / transformers = {jax_tps / hf_tps:.1f}x")
    lengths = list(map(len, prompts))
    shared, per_sample = prefill_flops(cfg, lengths), a.samples * prefill_flops(cfg, lengths)
    print(f"prefill FLOPs: {shared / 1e9:.2f} GFLOP shared vs {per_sample / 1e9:.2f} GFLOP once per sample; saved "
          f"{(per_sample - shared) / 1e9:.2f} GFLOP ({a.samples}x fewer)")
    if a.roofline:
        bw = copy_bandwidth()
        step_bytes = decode_bytes_per_step(cfg, jnp.dtype(a.dtype).itemsize, sum(lengths), B, T)
        ideal = step_bytes / bw
        print(f"roofline: copy bandwidth {bw / 1e9:.0f} GB/s; {step_bytes / 1e6:,.1f} MB read per decode step -> "
              f"{ideal * 1e3:.2f} ms ideal vs {decode_s / T * 1e3:.2f} ms measured = {ideal / (decode_s / T):.0%} "
              "of the bandwidth roofline")
        sizes = batching.buckets_for(prompts, T, 1)
        touched = decode_bytes_touched(cfg, jnp.dtype(a.dtype).itemsize, sizes.num_prompts * sizes.prompt_len,
                                       sizes.num_prompts * a.samples,
                                       sizes.new_tokens)
        print(f"  bytes our decode step touches (whole padded caches): {touched / 1e6:,.1f} MB -> achieved "
              f"{touched / (decode_s / T) / 1e9:,.0f} GB/s = {touched / bw / (decode_s / T):.0%} of copy bandwidth")
    return 0
