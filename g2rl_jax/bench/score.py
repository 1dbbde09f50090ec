"""Benchmark of the score pass: `python -m g2rl_jax.bench score [--batch B --length L --dtype bfloat16 ...]`.

Defaults: Qwen3-1.7B's head (D = 2,048, V = 151,936), 2 × 1,024 tokens, float32, random inputs. Measured side by
side in one run, on whatever JAX backend is active:
  (a) time of token_stats (log-probs + entropy + Φ) over token_logprobs alone, same chunking (goal ≤ 1.05);
  (b) peak temporary memory of token_stats, from XLA's compiled memory analysis, over the f32 [B, L, V] logits it
      avoids (goal ≤ 1/10), and over the naive path that materialises them;
  (c) forward + backward of the log-prob loss Σ mask·log p, fused (custom VJP) against autodiff of the naive
      formula: time and temporary memory.
--memory-only compiles without running: (b) and (c)'s memory, no timings (fast at any size).
"""
import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from g2rl_jax import cli
from g2rl_jax.g2rl import DEFAULT_CHUNK, EPS, token_logprobs, token_stats


def naive_stats(hidden, lm_head, targets, mask, temperature):
    """Reference path with the full [B, L, V] logits in float32: log-probs, entropy and Φ."""
    logits = jnp.einsum("bld,vd->blv", hidden, lm_head, preferred_element_type=jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(logp_all)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(p * logp_all, axis=-1)
    alpha = mask / (jnp.sum(mask, axis=-1, keepdims=True) + EPS)
    resid_BxV = jnp.einsum("bl,blv->bv", alpha, jax.nn.one_hot(targets, lm_head.shape[0]) - p)
    phi = jnp.einsum("bv,vd->bd", resid_BxV.astype(lm_head.dtype), lm_head, preferred_element_type=jnp.float32)
    return logp, entropy, phi


def naive_logprobs(hidden, lm_head, targets, temperature):
    logits = jnp.einsum("bld,vd->blv", hidden, lm_head, preferred_element_type=jnp.float32) / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def _loss_grad(logprob_fn):
    def loss(hidden, lm_head, targets, mask):
        return jnp.sum(logprob_fn(hidden, lm_head, targets) * mask)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _temp_bytes(jitted, *args):
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _time_interleaved(fns, args, repeats):
    """Median seconds per call of each fn, calls interleaved so machine noise hits all of them alike."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(prog="python -m g2rl_jax.bench score", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2, help="sequences B")
    parser.add_argument("--length", type=int, default=1024, help="positions L per sequence")
    parser.add_argument("--dim", type=int, default=2048, help="hidden size D (Qwen3-1.7B: 2048)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary V (Qwen3: 151936)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="positions per chunk")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="hidden and lm_head")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per function in (a) (median reported)")
    parser.add_argument("--grad-repeats", type=int, default=2, help="timed calls per function in (c)")
    parser.add_argument("--skip-backward", action="store_true", help="skip (c), the slowest part")
    parser.add_argument("--memory-only", action="store_true", help="only XLA's memory analysis: compile, never run")
    args = parser.parse_args(argv)

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    dtype = jnp.dtype(args.dtype)
    b, length, d, v = args.batch, args.length, args.dim, args.vocab
    make = jax.eval_shape if args.memory_only else (lambda f: f())
    hidden = make(lambda: jax.random.normal(keys[0], (b, length, d), jnp.float32).astype(dtype))
    lm_head = make(lambda: (0.02 * jax.random.normal(keys[1], (v, d), jnp.float32)).astype(dtype))
    targets = make(lambda: jax.random.randint(keys[2], (b, length), 0, v))
    mask = make(lambda: (jax.random.uniform(keys[3], (b, length)) < 0.9).astype(jnp.float32))
    fused_stats = jax.jit(lambda h, w, y, m: token_stats(h, w, y, m, chunk_size=args.chunk))
    fused_logprobs = jax.jit(lambda h, w, y, m: token_logprobs(h, w, y, chunk_size=args.chunk))
    naive = jax.jit(lambda h, w, y, m: naive_stats(h, w, y, m, 1.0))
    inputs = (hidden, lm_head, targets, mask)

    print(f"command: python -m g2rl_jax.bench score {' '.join(argv)}".rstrip())
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), B={b} L={length} ({b * length} tokens) "
          f"D={d} V={v} chunk={args.chunk} dtype={args.dtype}; medians of {args.repeats} / {args.grad_repeats} calls")
    mem_fused, mem_naive = _temp_bytes(fused_stats, *inputs), _temp_bytes(naive, *inputs)
    logits_bytes = b * length * v * 4
    print("| measure | fused | reference | ratio | goal |\n|---|---|---|---|---|")
    if not args.memory_only:
        times = _time_interleaved({"stats": fused_stats, "logprobs": fused_logprobs}, inputs, args.repeats)
        print(f"| (a) time: token_stats vs token_logprobs | {times['stats']:.3f} s | {times['logprobs']:.3f} s "
              f"| {times['stats'] / times['logprobs']:.3f} | ≤ 1.05 |")
    print(f"| (b) temp memory: token_stats vs the f32 logits | {mem_fused / 2**20:.1f} MiB "
          f"| {logits_bytes / 2**20:.1f} MiB | {mem_fused / logits_bytes:.3f} | ≤ 0.1 |")
    print(f"| (b) temp memory: token_stats vs naive logits | {mem_fused / 2**20:.1f} MiB | {mem_naive / 2**20:.1f} MiB "
          f"| {mem_fused / mem_naive:.3f} | |")
    if not args.skip_backward:
        grad_fused = _loss_grad(lambda h, w, y: token_logprobs(h, w, y, chunk_size=args.chunk))
        grad_naive = _loss_grad(lambda h, w, y: naive_logprobs(h, w, y, 1.0))
        if not args.memory_only:
            gtimes = _time_interleaved({"fused": grad_fused, "naive": grad_naive}, inputs, args.grad_repeats)
            print(f"| (c) fwd+bwd time: fused vs naive | {gtimes['fused']:.3f} s | {gtimes['naive']:.3f} s "
                  f"| {gtimes['fused'] / gtimes['naive']:.3f} | |")
        gmem_fused, gmem_naive = _temp_bytes(grad_fused, *inputs), _temp_bytes(grad_naive, *inputs)
        print(f"| (c) fwd+bwd temp memory: fused vs naive | {gmem_fused / 2**20:.1f} MiB "
              f"| {gmem_naive / 2**20:.1f} MiB "
              f"| {gmem_fused / gmem_naive:.3f} | |")
    head_mib = lm_head.size * lm_head.dtype.itemsize / 2**20
    print(f"(f32 logits alone would take {logits_bytes / 2**20:.1f} MiB; lm_head {head_mib:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
