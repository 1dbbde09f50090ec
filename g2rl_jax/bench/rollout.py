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

`--long-tail` (random weights, no transformers): the workload of an RL step, where most responses end far below
the budget and a few run to it. Every V*8/T-th token id is a stop token, so with near-uniform random-weight
next-token distributions a response ends with probability ~8/T per token (mean length ~T/8). Printed: the length
distribution (mean, p50, p90, max), USEFUL tokens/s (the sum of the completion lengths, i.e. the tokens returned,
per second of warm wall time), and the same workload (same seed and stop set) at a budget `--budget-ratio` times
larger, with the time ratio (the goal on CPU: <= 1.3) and whether the completions agree up to the smaller budget.
It uses only `generate`, so the same harness times an older checkout (docs/performance.md's before/after).
"""
from __future__ import annotations

import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import cli
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig, load_pretrained
from g2rl_jax.rollout import batching, engine, generate


def _args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench rollout", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--long-tail", action="store_true",
                   help="long-tailed workload (stop set: mean length ~new-tokens/8), useful tokens/s, budget ratio")
    p.add_argument("--budget-ratio", type=int, default=8, help="--long-tail: also run at this many times the "
                   "budget and print the time ratio (1: skip)")
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


def _prefill_seconds(model, prompts, a) -> float:
    """Warm seconds of the jitted prefill alone (the call generate makes first)."""
    sizes = batching.buckets_for(prompts, a.new_tokens, 1)
    ids, mask = batching.left_pad(prompts, sizes.num_prompts, sizes.prompt_len)
    graphdef, state = nnx.split(model)
    cfg = model.config
    prefill = engine.prefill_fn(None, cfg.num_key_value_heads, cfg.num_hidden_layers)
    capacity = sizes.new_tokens  # the cache holds the budget (rollout/engine.py)
    jax.block_until_ready(prefill(graphdef, state, ids, mask, num_samples=a.samples, capacity=capacity))
    start = time.perf_counter()
    jax.block_until_ready(prefill(graphdef, state, ids, mask, num_samples=a.samples, capacity=capacity))
    return time.perf_counter() - start


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
    """Bytes our decode step reads, averaged over the steps: every weight once, the whole padded prefix cache,
    and the suffix slots of the read rung the step reads (attention reads the rung, masked)."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    ladder = engine.read_ladder(batching.new_tokens_bucket(new_tokens))
    slots = engine.read_slots(np.arange(2, new_tokens + 1), ladder)  # step t writes slot t, reads t + 1
    return cfg.num_params() * dtype_bytes + kv_per_token * (prefix_slots + batch * float(np.mean(slots or [0])))


def main(argv: list[str]) -> int:
    a = _args(argv)
    if a.long_tail:
        return long_tail(a)
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
        prefill_s = _prefill_seconds(model, prompts, a)
        decode_s = warm_s - prefill_s  # the decode segments, regroups and host work between them
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
                                       sizes.num_prompts * a.samples, T)
        step_s = decode_s / T
        print(f"  bytes our decode step touches (padded prefix, suffix capacity buckets): {touched / 1e6:,.1f} MB -> "
              f"achieved {touched / step_s / 1e9:,.0f} GB/s = {touched / bw / step_s:.0%} of copy bandwidth")
    return 0


def stop_set(vocab: int, budget: int) -> tuple[int, ...]:
    """Every (V / (8 V / budget))-th token id (from 1): ~8 / budget of the vocabulary, so a response drawn from a
    near-uniform distribution ends with probability ~8 / budget per token (mean length ~budget / 8)."""
    count = max(1, round(vocab * 8 / budget))
    return tuple(range(1, vocab, max(1, vocab // count)))[:count]


def _timed(model, prompts, a, budget, stops):
    """(the Rollout, warm seconds: median of a.repeats) of one long-tailed generate; the first call compiles."""
    kw = dict(max_new_tokens=budget, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
              num_samples=a.samples, stop_token_ids=stops, seed=1)
    generate(model, prompts, **kw)  # the same seed: the same segments, so every shape is compiled here
    times = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        r = generate(model, prompts, **kw)
        times.append(time.perf_counter() - start)
    return r, statistics.median(times)


def _lengths_line(r) -> str:
    n = np.array(r.completion_lengths)
    return (f"lengths mean {n.mean():.0f}, p50 {np.percentile(n, 50):.0f}, p90 {np.percentile(n, 90):.0f}, "
            f"max {n.max()}; {sum(f == 'stop' for f in r.finish_reasons)}/{len(n)} stopped")


def long_tail(a) -> int:
    cfg = _config(a)
    rt = RuntimeConfig(param_dtype=a.dtype, compute_dtype=a.dtype, kv_cache_dtype=a.dtype)
    model = Qwen3(cfg, rt, rngs=nnx.Rngs(0))
    prompts = _prompts(a, cfg.vocab_size)
    stops = stop_set(cfg.vocab_size, a.new_tokens)
    print(f"long-tailed rollout: {cfg.num_params() / 1e6:.1f}M params (random, {a.dtype}), {len(prompts)} prompts "
          f"x {a.samples} samples, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"{len(stops)} stop ids of {cfg.vocab_size}; jax {jax.default_backend()} ({jax.devices()[0].device_kind})")
    r, seconds = _timed(model, prompts, a, a.new_tokens, stops)
    useful = int(np.sum(r.completion_lengths))
    print(f"budget {a.new_tokens}: {_lengths_line(r)}")
    print(f"  useful tokens/s: {useful / seconds:,.0f} ({useful:,} tokens in {seconds:.2f} s warm, median of "
          f"{a.repeats}); {r.decode_steps} decode steps")
    if a.budget_ratio > 1:
        big = a.new_tokens * a.budget_ratio
        rb, seconds_b = _timed(model, prompts, a, big, stops)
        same = all(x == y[:a.new_tokens] for x, y in zip(r.completion_ids, rb.completion_ids))
        useful_b = int(np.sum(rb.completion_lengths))
        print(f"budget {big}: {_lengths_line(rb)}")
        print(f"  useful tokens/s: {useful_b / seconds_b:,.0f} ({useful_b:,} tokens in {seconds_b:.2f} s)")
        print(f"budget independence: time at {big} / time at {a.new_tokens} = {seconds_b / seconds:.2f} "
              f"(completions the same up to {a.new_tokens} tokens: {'yes' if same else 'NO'})")
    return 0
