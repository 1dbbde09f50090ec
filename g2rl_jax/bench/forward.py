"""Forward throughput: our jitted Qwen3 against transformers' PyTorch Qwen3 on the same config, in one run.

    python -m g2rl_jax.bench forward                         # CPU, f32: 4 layers, hidden 512, vocab 32k, 8 x 512
    python -m g2rl_jax.bench forward --layers 2 --seq 256    # smaller
    python -m g2rl_jax.bench forward --preset qwen3-1.7b --random --dtype bfloat16 --no-torch   # accelerator: MFU

Prints compile time separately from steady-state tokens/s (median of --iters timed calls after one warm-up).
MFU = (2 * matmul params * tokens + attention FLOPs) / time / peak, with attention counted as
4 * B * L^2 * heads * head_dim per layer (full square, the usual convention); the peak comes from --peak-tflops
or a table of dense bf16 peaks by device kind.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import cli
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.shapes.prices import PEAK_BF16_TFLOPS  # one table of the chips' peaks


def _config(args) -> Qwen3Config:
    if args.preset:
        return PRESETS[args.preset]
    heads = args.hidden // 64
    return Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=64, tie_word_embeddings=True)


def _timed(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _flops(cfg: Qwen3Config, batch: int, seq: int) -> float:
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attention = 4 * batch * seq * seq * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 2.0 * matmul_params * batch * seq + attention


def _peak_tflops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    kind = jax.devices()[0].device_kind
    matches = [k for k in PEAK_BF16_TFLOPS if k in kind]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches and args.dtype == "bfloat16" else None


def _ours(cfg, args, ids_BxL):
    runtime = RuntimeConfig(param_dtype=args.dtype, compute_dtype=args.dtype, attention=args.attention)
    graphdef, state = nnx.split(Qwen3(cfg, runtime, rngs=nnx.Rngs(0)))
    fwd = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    t0 = time.perf_counter()
    compiled = fwd.lower(state, ids_BxL).compile()
    compile_s = time.perf_counter() - t0
    step_s = _timed(lambda: compiled(state, ids_BxL).block_until_ready(), args.iters)
    return compile_s, step_s


def _torch(cfg, args, ids):
    import torch
    import transformers

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.Qwen3ForCausalLM(hf_cfg).to(dtype).eval()
    ids_t = torch.tensor(ids)

    def run():
        with torch.inference_mode():
            model(ids_t)

    return _timed(run, args.iters)


def main(argv: list[str]) -> int:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench forward", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--attention", choices=["xla", "cudnn", "splash"], default="xla")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named config instead of the size flags")
    p.add_argument("--random", action="store_true", help="random weights (required with --preset; no checkpoint)")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers PyTorch side")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: table by device kind, bf16)")
    args = p.parse_args(argv)
    if args.preset and not args.random:
        p.error("--preset runs on random weights only; pass --random")

    cfg = _config(args)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    tokens = args.batch * args.seq
    print(f"config: {cfg}\nbatch {args.batch} x seq {args.seq}, {args.dtype}, attention={args.attention}, "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    compile_s, ours_s = _ours(cfg, args, jnp.asarray(ids))
    print(f"ours (jax.jit):        compile {compile_s:.2f} s, step {ours_s * 1e3:.1f} ms, "
          f"{tokens / ours_s:,.0f} tokens/s")
    peak = _peak_tflops(args)
    if peak:
        tflops = _flops(cfg, args.batch, args.seq) / ours_s / 1e12
        print(f"model FLOPs {tflops:.1f} TFLOP/s of peak {peak:.0f}: MFU {tflops / peak:.1%}")
    if not args.no_torch:
        torch_s = _torch(cfg, args, ids)
        print(f"transformers PyTorch:  step {torch_s * 1e3:.1f} ms, {tokens / torch_s:,.0f} tokens/s")
        print(f"ratio ours / torch tokens/s: {torch_s / ours_s:.2f}x")
    return 0
