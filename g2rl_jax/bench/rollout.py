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
larger, the two budgets' calls interleaved over --repeats rounds, with the time ratio in wall and in this process's
CPU seconds (the goal on CPU: <= 1.15) and whether the completions agree up to the smaller budget.
It uses only `generate`, so the same harness times an older checkout (docs/performance.md's before/after).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import cli
from g2rl_jax.bench import capacity_ladder
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig, load_pretrained
from g2rl_jax.rollout import batching, engine, generate

VARIANTS = ("rungs", "phased", "switch", "ladder")

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
    p.add_argument("--variant", action="append", choices=VARIANTS, default=[],
                   help="the decode to time (repeatable; default rungs): rungs, the sampler's (the cache at the "
                   "budget, each step reading its read rung: a while loop per rung on GPU, a lax.switch in each "
                   "layer elsewhere, engine.PHASED_READS); phased and switch, either of those on any platform; "
                   "ladder, the cache grown through the capacity ladder (bench/capacity_ladder.py, the decode "
                   "before 2026-11-28)")
    p.add_argument("--compile-threads", type=int, default=0, help="--long-tail: compile every program the decode "
                   "loop can reach on this many threads first (generate's compile_threads; 0: each when met)")
    p.add_argument("--split", action="store_true", help="--long-tail: also print each budget's CPU seconds by "
                   "jitted piece (prefill, decode segments, compactions, ...), each timed alone (blocked on it)")
    p.add_argument("--json", default="", help="also write the figures to this JSON file (bench gpu reads it)")
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


def _prefill_seconds(model, prompts, a, capacity: int) -> float:
    """Warm seconds of the jitted prefill alone (the call generate makes first), with a cache of `capacity` slots."""
    sizes = batching.buckets_for(prompts, a.new_tokens, 1)
    ids, mask = batching.left_pad(prompts, sizes.num_prompts, sizes.prompt_len)
    graphdef, state = nnx.split(model)
    cfg = model.config
    prefill = engine.prefill_fn(None, cfg.num_key_value_heads, cfg.num_hidden_layers)
    jax.block_until_ready(prefill(graphdef, state, ids, mask, num_samples=a.samples, capacity=capacity))
    start = time.perf_counter()
    jax.block_until_ready(prefill(graphdef, state, ids, mask, num_samples=a.samples, capacity=capacity))
    return time.perf_counter() - start


@contextlib.contextmanager
def read_strategy(variant: str):
    """engine.PHASED_READS for `variant` while inside (phased: every platform; switch: none; else as it is)."""
    phased, before = {"phased": ("cpu", "gpu", "tpu"), "switch": ()}.get(variant, engine.PHASED_READS), \
        engine.PHASED_READS
    if phased == before:
        yield
        return
    engine.PHASED_READS = phased
    engine.segment_fn.cache_clear()  # segment_fn decides when it builds the jitted segment (a new one compiles)
    try:
        yield
    finally:
        engine.PHASED_READS = before
        engine.segment_fn.cache_clear()


def _sample(model, prompts, a, variant: str, seed: int) -> np.ndarray:
    """[B, T] tokens of one fixed-length call of `variant` (no stop tokens: every sample draws T tokens)."""
    kw = dict(max_new_tokens=a.new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
              num_samples=a.samples, seed=seed)
    if variant == "ladder":
        return capacity_ladder.ladder_generate(model, prompts, **kw)[0]
    return generate(model, prompts, **kw).completion_ids_BxT


def decode_figures(model, prompts, a, variant: str) -> tuple[dict, np.ndarray]:
    """One variant's figures (warm seconds, compile, prefill, decode ms per step, tokens/s) and the tokens of its
    last warm call: a first call that compiles, then a.repeats warm ones."""
    B, T = len(prompts) * a.samples, a.new_tokens
    with read_strategy(variant):
        start = time.perf_counter()
        _sample(model, prompts, a, variant, 0)
        first = time.perf_counter() - start
        warm = []
        for seed in range(1, a.repeats + 1):
            start = time.perf_counter()
            tokens = _sample(model, prompts, a, variant, seed)
            warm.append(time.perf_counter() - start)
    warm_s = statistics.median(warm)
    slots = batching.new_tokens_bucket(T)
    prefill_s = _prefill_seconds(model, prompts, a, engine.read_ladder(slots)[0] if variant == "ladder" else slots)
    decode_s = warm_s - prefill_s  # the decode segments, the moves and the host work between them
    return {"warm_s": warm_s, "compile_s": first - warm_s, "prefill_ms": prefill_s * 1e3,
            "ms_per_step": decode_s / T * 1e3, "tokens_per_s": B * T / warm_s}, tokens


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
    mean_slots = float(np.mean(slots)) if len(slots) else 0.0
    return cfg.num_params() * dtype_bytes + kv_per_token * (prefix_slots + batch * mean_slots)


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
    variants = a.variant or ["rungs"]
    figures: dict = {"model_params": cfg.num_params(), "rows": B, "new_tokens": T, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if a.no_hf:
            model = Qwen3(cfg, rt, rngs=nnx.Rngs(0))
        else:
            import transformers

            transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf_dict())).save_pretrained(tmp)
            model = load_pretrained(tmp, a.dtype, runtime=rt)
        tokens = {}
        for variant in variants:
            f, tokens[variant] = decode_figures(model, prompts, a, variant)
            figures["variants"][variant] = f
            print(f"jax generate ({variant}): {f['tokens_per_s']:,.0f} tokens/s (warm {f['warm_s']:.2f} s, median of "
                  f"{a.repeats}); compile {f['compile_s']:.1f} s; prefill {f['prefill_ms']:.1f} ms, decode "
                  f"{f['ms_per_step']:.2f} ms/step", flush=True)
        if len(variants) > 1:
            figures["same_tokens"] = "yes" if all(np.array_equal(tokens[variants[0]], x) for x in tokens.values()) \
                else "NO"
            print(f"the same tokens from every variant: {figures['same_tokens']}")
        if not a.no_hf:
            hf_tps = _hf_tokens_per_s(tmp, prompts, a)
            jax_tps = figures["variants"][variants[0]]["tokens_per_s"]
            print(f"transformers generate: {hf_tps:,.0f} tokens/s; ratio jax / transformers = {jax_tps / hf_tps:.1f}x")
    lengths = list(map(len, prompts))
    shared, per_sample = prefill_flops(cfg, lengths), a.samples * prefill_flops(cfg, lengths)
    print(f"prefill FLOPs: {shared / 1e9:.2f} GFLOP shared vs {per_sample / 1e9:.2f} GFLOP once per sample; saved "
          f"{(per_sample - shared) / 1e9:.2f} GFLOP ({a.samples}x fewer)")
    if a.roofline:
        bw = copy_bandwidth()
        step_bytes = decode_bytes_per_step(cfg, jnp.dtype(a.dtype).itemsize, sum(lengths), B, T)
        ideal = step_bytes / bw
        sizes = batching.buckets_for(prompts, T, 1)
        touched = decode_bytes_touched(cfg, jnp.dtype(a.dtype).itemsize, sizes.num_prompts * sizes.prompt_len,
                                       sizes.num_prompts * a.samples, T)
        figures.update(copy_gbps=bw / 1e9, bytes_per_step=step_bytes, bytes_touched=touched)
        print(f"roofline: copy bandwidth {bw / 1e9:.0f} GB/s; {step_bytes / 1e6:,.1f} MB read per decode step -> "
              f"{ideal * 1e3:.2f} ms ideal; bytes our decode step touches (padded prefix, suffix read rungs): "
              f"{touched / 1e6:,.1f} MB")
        for variant, f in figures["variants"].items():
            step_s = f["ms_per_step"] / 1e3
            f.update(roofline_ms=ideal * 1e3, roofline_share=ideal / step_s, touched_share=touched / bw / step_s)
            print(f"  {variant}: {f['ms_per_step']:.2f} ms measured = {ideal / step_s:.0%} of the bandwidth "
                  f"roofline; touched bytes at {touched / step_s / 1e9:,.0f} GB/s = {touched / bw / step_s:.0%} of "
                  "copy bandwidth")
    _write_json(a.json, figures)
    return 0


def _write_json(path: str, figures: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


def stop_set(vocab: int, budget: int) -> tuple[int, ...]:
    """Every (V / (8 V / budget))-th token id (from 1): ~8 / budget of the vocabulary, so a response drawn from a
    near-uniform distribution ends with probability ~8 / budget per token (mean length ~budget / 8)."""
    count = max(1, round(vocab * 8 / budget))
    return tuple(range(1, vocab, max(1, vocab // count)))[:count]


def _long_tail_kw(a, budget: int, stops) -> dict:
    return dict(max_new_tokens=budget, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                num_samples=a.samples, stop_token_ids=stops, seed=1, compile_threads=a.compile_threads)


SPLIT = {"prefill_fn": "prefill", "start_fn": "first token", "decode_layers_fn": "decode weights",
         "segment_fn": "decode segments", "live_rows_fn": "live rows", "regroup_fn": "compactions"}


@contextlib.contextmanager
def split_seconds(acc: dict):
    """While inside, each engine piece `generate` calls (SPLIT) adds this process's CPU seconds to acc[its name],
    blocked on its result (so a piece's time is its own, at the price of the overlap between them)."""
    def timed(name, factory):
        def make(*args, **kw):
            fn = factory(*args, **kw)

            def call(*x, **k):
                start = time.process_time()
                out = jax.block_until_ready(fn(*x, **k))
                acc[name] = acc.get(name, 0.0) + time.process_time() - start
                return out
            call.lower = fn.lower
            return call
        return make

    originals = {f: getattr(engine, f) for f in SPLIT}
    for f, name in SPLIT.items():
        setattr(engine, f, timed(name, originals[f]))
    try:
        yield
    finally:
        for f, fn in originals.items():
            setattr(engine, f, fn)


def _timed_rounds(model, prompts, a, budgets: list[int], stops) -> tuple[dict, dict, dict]:
    """{budget: Rollout}, {budget: [warm wall s]}, {budget: [warm CPU s of this process]}: one long-tailed generate
    per budget first (it compiles), then a.repeats rounds with the budgets interleaved, so the machine's load falls
    on both alike. The same seed every call: the same segments, so every shape is compiled by the first."""
    rollouts = {b: generate(model, prompts, **_long_tail_kw(a, b, stops)) for b in budgets}
    wall: dict[int, list[float]] = {b: [] for b in budgets}
    cpu: dict[int, list[float]] = {b: [] for b in budgets}
    for _ in range(a.repeats):
        for b in budgets:
            start, start_cpu = time.perf_counter(), time.process_time()
            rollouts[b] = generate(model, prompts, **_long_tail_kw(a, b, stops))
            wall[b].append(time.perf_counter() - start)
            cpu[b].append(time.process_time() - start_cpu)
    if a.split:  # more rounds, each piece timed alone: what each budget's CPU seconds go to
        split: dict[int, list[dict]] = {b: [] for b in budgets}
        for _ in range(a.repeats):
            for b in budgets:
                acc, start_cpu = {}, time.process_time()
                with split_seconds(acc):
                    generate(model, prompts, **_long_tail_kw(a, b, stops))
                split[b].append(dict(acc, total=time.process_time() - start_cpu))
        for b in budgets:
            print(f"budget {b}, CPU s by piece (medians of {a.repeats}): " + ", ".join(
                f"{k} {statistics.median(r.get(k, 0.0) for r in split[b]):.3f}" for k in [*SPLIT.values(), "total"]))
    return rollouts, wall, cpu


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
    small, big = a.new_tokens, a.new_tokens * a.budget_ratio
    budgets = [small, big] if a.budget_ratio > 1 else [small]
    rollouts, wall, cpu = _timed_rounds(model, prompts, a, budgets, stops)
    figures: dict = {"model_params": cfg.num_params(), "rows": len(prompts) * a.samples, "budget": small}
    for b in budgets:
        r, useful = rollouts[b], int(np.sum(rollouts[b].completion_lengths))
        seconds = statistics.median(wall[b])
        if b == small:
            figures.update(useful_tokens_per_s=useful / seconds, tokens=useful, seconds=seconds,
                           decode_steps=r.decode_steps, lengths=_lengths_line(r))
        print(f"budget {b}: {_lengths_line(r)}")
        print(f"  useful tokens/s: {useful / seconds:,.0f} ({useful:,} tokens in {seconds:.2f} s warm, "
              f"{statistics.median(cpu[b]):.2f} CPU s; medians of {a.repeats}); {r.decode_steps} decode steps")
    if a.budget_ratio > 1:
        same = all(x == y[:small] for x, y in zip(rollouts[small].completion_ids, rollouts[big].completion_ids))
        ratio = statistics.median(wall[big]) / statistics.median(wall[small])
        cpu_ratio = statistics.median(cpu[big]) / statistics.median(cpu[small])
        print(f"budget independence: time at {big} / time at {small} = {ratio:.2f} (CPU seconds {cpu_ratio:.2f}; "
              f"interleaved rounds; completions the same up to {small} tokens: {'yes' if same else 'NO'})")
        figures.update(time_ratio=ratio, cpu_ratio=cpu_ratio, same_completions=same)
    _write_json(a.json, figures)
    return 0
