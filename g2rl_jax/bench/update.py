"""`python -m g2rl_jax.bench update`: the PPO update alone (`train.step.update`), time and MFU per setting.

    python -m g2rl_jax.bench update                       # CPU: a small random model, 8 rows of 32 + 64 tokens
    python -m g2rl_jax.bench update --preset qwen3-1.7b --rows 32 --prompt-len 256 --response-len 1024 \\
        --variant remat=full,micro=16 --variant remat=dots,micro=16 --peak-tflops 989      # a GPU

Random weights, one synthetic mini-batch of --rows responses (every token real), AdamW as the trainer builds it,
the loss with the KL term on. Each --variant (comma-separated remat=, micro=, param_dtype=, attention=) builds its
own model and runs one compiling update, then --iters timed ones; all variants run side by side in one process.
Model FLOPs count every token of the joined sequence, forward + backward (remat's recomputation is not counted):
6 * matmul params * tokens + 3 * 4 * rows * L^2 * heads * head_dim * layers (full-square attention, as `forward`).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax.config import AlgorithmConfig, OptimConfig
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.train import step as train_step

_KEYS = {"remat": str, "micro": int, "param_dtype": str, "attention": str}


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench update", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published Qwen3 size (random weights)")
    p.add_argument("--rows", type=int, default=8, help="responses in the mini-batch (one optimizer update)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--variant", action="append", default=[],
                   help="e.g. remat=full,micro=4 (defaults: remat=full, micro=rows/2, param_dtype=float32, "
                        "attention=xla); repeat to compare settings")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (e.g. 989: H100 bf16)")
    return p.parse_args(argv)


def parse_variant(text: str, rows: int) -> dict:
    """'remat=dots,micro=8' -> {remat, micro, param_dtype, attention}, with defaults for what it leaves out."""
    out = {"remat": "full", "micro": max(1, rows // 2), "param_dtype": "float32", "attention": "xla"}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS:
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE with KEY one of {sorted(_KEYS)}")
        out[key] = _KEYS[key](value)
    if rows % out["micro"]:
        raise SystemExit(f"--variant {text!r}: micro={out['micro']} does not divide --rows {rows}")
    return out


def _small() -> Qwen3Config:
    return Qwen3Config(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


def _mini_batch(cfg: Qwen3Config, rows: int, s: int, t: int) -> train_step.MiniBatch:
    rng = np.random.default_rng(0)
    batch = train_step.build_batch(rng.integers(1, cfg.vocab_size, (rows, s)), np.ones((rows, s), np.int32),
                                   rng.integers(1, cfg.vocab_size, (rows, t)), np.ones((rows, t), np.int32),
                                   rng.choice([-1.0, 1.0], rows), rng.random(rows) < 0.5, group_size=rows)
    logp = jnp.asarray(-rng.random((rows, t)) * 5, jnp.float32)
    return train_step.MiniBatch(batch, old_logp_BxT=logp, ref_logp_BxT=logp + 0.01,
                                advantages_B=jnp.asarray(rng.standard_normal(rows), jnp.float32))


def train_flops(cfg: Qwen3Config, rows: int, length: int) -> float:
    """Forward + backward model FLOPs of one update over rows x length tokens (see the module docstring)."""
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attention = 4 * rows * length ** 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 3 * (2.0 * matmul_params * rows * length + attention)


def run_variant(cfg: Qwen3Config, v: dict, mini: train_step.MiniBatch, iters: int) -> tuple[float, float]:
    """(compile + first call seconds, median warm seconds) of one optimizer update under variant v."""
    rt = RuntimeConfig(param_dtype=v["param_dtype"], compute_dtype="bfloat16", remat=v["remat"],
                       attention=v["attention"])
    graphdef, params = nnx.split(Qwen3(cfg, rt, rngs=nnx.Rngs(0)))
    optimizer = train_step.make_optimizer(OptimConfig(), total_updates=1000)
    opt_state = jax.jit(optimizer.init)(params)
    settings = train_step.LossSettings.from_config(dataclasses.replace(AlgorithmConfig(), kl_coef=1e-3), 1.0)
    times = []
    for _ in range(iters + 1):
        start = time.perf_counter()
        params, opt_state, info = train_step.update(graphdef, params, opt_state, mini, optimizer=optimizer,
                                                    settings=settings, micro=v["micro"])
        jax.block_until_ready(info["loss"])
        times.append(time.perf_counter() - start)
    assert int(info["skipped"]) == 0 and np.isfinite(float(info["loss"])), info
    del params, opt_state
    gc.collect()
    return times[0], statistics.median(times[1:])


def main(argv: list[str]) -> int:
    a = _args(argv)
    cfg = PRESETS[a.preset] if a.preset else _small()
    length = a.prompt_len + a.response_len
    mini = _mini_batch(cfg, a.rows, a.prompt_len, a.response_len)
    flops = train_flops(cfg, a.rows, length)
    print(f"model {cfg.num_params() / 1e6:.1f}M params; {a.rows} rows x ({a.prompt_len} + {a.response_len}) tokens "
          f"per update; {flops / 1e12:.1f} model TFLOP; jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print("| variant | compile+first s | update s | tokens/s | TFLOP/s | MFU |\n|---|---|---|---|---|---|")
    for text in a.variant or [""]:
        v = parse_variant(text, a.rows)
        first, warm = run_variant(cfg, v, mini, a.iters)
        tflops = flops / warm / 1e12
        mfu = f"{tflops / a.peak_tflops:.1%}" if a.peak_tflops else "-"
        name = ",".join(f"{k}={v[k]}" for k in _KEYS)
        print(f"| {name} | {first:.1f} | {warm:.3f} | {a.rows * length / warm:,.0f} | {tflops:.1f} | {mfu} |")
    return 0
