"""`python -m g2rl_jax.bench update`: the PPO update alone (`train.update.update`), time and MFU per setting.

    python -m g2rl_jax.bench update                       # CPU: a small random model, 8 rows of 32 + 64 tokens
    python -m g2rl_jax.bench update --hidden 512 --layers 4 --vocab 8192 ...   # another small random model
    python -m g2rl_jax.bench update --preset qwen3-1.7b --rows 32 --prompt-len 256 --response-len 1024 \\
        --variant remat=full,micro=16 --variant remat=dots,micro=16 --peak-tflops 989      # a GPU
    python -m g2rl_jax.bench update --long-tail --rows 16 --response-len 256 \\
        --variant micro=4,layout=padded --variant micro=4                                  # padding's cost

Random weights, one synthetic mini-batch of --rows responses, AdamW as the trainer builds it, the loss with the KL
term on. Without --long-tail every response token is real. With --long-tail the response lengths are long-tailed
(exponential with mean --response-len / 4, capped at --response-len, one row at the cap) and every variant also
runs an equal-length mini-batch with the same total response tokens: the ratio of the two times is what padding
still costs (about max/mean when every micro-batch is padded to the longest response). Each --variant
(comma-separated remat=, micro=, param_dtype=, attention=, layout=, overhead=, block=, narrow=) builds its own model;
then every variant runs one compiling update per mini-batch, one untimed (the params that the first update returns
compile once more), then --iters timed ones, round after round: each round runs every variant on every mini-batch,
so machine load hits all variants alike; a row's time is the median of its rounds. layout=grouped (default) is the
trainer's length-grouped micro-batches; layout=padded runs every micro-batch at the full width (before grouping);
layout=packed packs whole sequences into rows of prompt + response width (train/packing.py, the trainer's
algorithm.packing: micro-batches of micro, micro/2, ... packed rows and narrower rows for the last tokens; narrow=0
keeps the full-width rows only; its widths column reads rows x packed width), with block=N the blocked packed
attention of N-column blocks (model/packed_attention.py; the default) or block=0 the dense segment mask
(attention.xla); overhead= sets the plan's per-micro-batch cost in rows (shapes.layouts.OVERHEAD_ROWS) for that
variant. Columns "µs/resp token" (update seconds per response token trained), "padding" (share of the positions
computed that hold no token) and "attn work" (query-key pairs the attention scores over the pairs the response and
prompt tokens need, causally within their own sequence; xla scores the full square of a row, the blocked path its
windows).
--plan-only prints the micro-batch widths and the FLOP model's long-tailed / equal ratio without running anything;
--padding-only the packed layout's padding and attention work over 8 draws (bench/update_padding.py).
Model FLOPs, forward + backward (remat's recomputation is not counted), 6 * matmul params * tokens + 3 * 4 *
tokens * L * heads * head_dim * layers (full-square attention, as `forward`): "MFU" counts every position of the
padded [rows, L] batch, "resp MFU" only the response tokens (each over its whole sequence S + its length).
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

from g2rl_jax import cli
from g2rl_jax.bench import update_padding
from g2rl_jax.config import AlgorithmConfig, OptimConfig
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig, packed_attention
from g2rl_jax.shapes import layouts
from g2rl_jax.shapes.prices import train_flops
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import optim as train_optim
from g2rl_jax.train import packing, passes
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update

_KEYS = {"remat": str, "micro": int, "param_dtype": str, "attention": str, "layout": str, "overhead": float,
         "block": int, "narrow": int}
LAYOUTS = ("grouped", "padded", "packed")


def _args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench update", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published Qwen3 size (random weights)")
    p.add_argument("--hidden", type=int, default=256, help="without --preset: hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=2, help="without --preset: decoder layers")
    p.add_argument("--vocab", type=int, default=32000, help="without --preset: vocabulary size")
    p.add_argument("--rows", type=int, default=8, help="responses in the mini-batch (one optimizer update)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--long-tail", action="store_true",
                   help="long-tailed response lengths (mean --response-len/4), timed against equal lengths")
    p.add_argument("--seed", type=int, default=0, help="seed of the long-tailed lengths")
    p.add_argument("--variant", action="append", default=[],
                   help="e.g. remat=full,micro=4 (defaults: remat=full, micro=rows/2, param_dtype=float32, "
                        "attention=xla); repeat to compare settings")
    p.add_argument("--plan-only", action="store_true",
                   help="print each variant's micro-batch widths and the FLOP model's figures; build and run nothing")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (e.g. 989: H100 bf16)")
    p.add_argument("--padding-only", action="store_true",
                   help="print the packed variants' padding, attention work and compute off the tokens over 8 "
                        "long-tailed draws (bench/update_padding.py); build and run nothing")
    p.add_argument("--prompts-up-to", type=int, default=0,
                   help="--padding-only: prompts uniform in [P/2, P] in the --prompt-len bucket (0: P = --prompt-len)")
    p.add_argument("--row-shards", type=int, default=1, help="--padding-only: the smallest packed row count")
    args = p.parse_args(argv)
    for text in args.variant:
        try:
            parse_variant(text, args.rows)
        except ValueError as err:
            p.error(str(err))
    return args


def parse_variant(text: str, rows: int) -> dict:
    """'remat=dots,micro=8' -> {remat, micro, param_dtype, attention}, with defaults for what it leaves out."""
    out = {"remat": "full", "micro": max(1, rows // 2), "param_dtype": "float32", "attention": "xla",
           "layout": "grouped", "overhead": float(layouts.OVERHEAD_ROWS), "block": packed_attention.BLOCK,
           "narrow": 1}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY=VALUE with KEY one of {sorted(_KEYS)}")
        try:
            out[key] = _KEYS[key](value)
        except ValueError:
            raise ValueError(f"--variant {text!r}: {key}={value!r} is not {_KEYS[key].__name__}") from None
    if out["layout"] not in LAYOUTS:
        raise ValueError(f"--variant {text!r}: layout must be one of {LAYOUTS}")
    if out["micro"] < 1 or rows % out["micro"]:
        raise ValueError(f"--variant {text!r}: micro={out['micro']} does not divide --rows {rows}")
    return out


def _small(hidden: int, layers: int, vocab: int) -> Qwen3Config:
    heads = max(1, hidden // 64)
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                       tie_word_embeddings=True)


def long_tailed_lengths(rows: int, budget: int, seed: int) -> np.ndarray:
    """Response lengths [rows]: exponential with mean budget/4, in [1, budget], the longest at the budget."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.exponential(budget / 4, rows)), 1, budget).astype(int)
    lengths[np.argmax(lengths)] = budget
    return lengths


def _mini_batch(cfg: Qwen3Config, rows: int, s: int, t: int, lengths=None) -> train_step.MiniBatch:
    """A mini-batch of rows x (s + t); responses right-padded to `lengths` (default: all t tokens real)."""
    rng = np.random.default_rng(0)
    lengths = np.full(rows, t) if lengths is None else np.asarray(lengths)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    batch = train_step.build_batch(rng.integers(1, cfg.vocab_size, (rows, s)), np.ones((rows, s), np.int32),
                                   rng.integers(1, cfg.vocab_size, (rows, t)) * mask, mask,
                                   rng.choice([-1.0, 1.0], rows), rng.random(rows) < 0.5, group_size=rows)
    logp = jnp.asarray(-rng.random((rows, t)) * 5, jnp.float32)
    return train_step.MiniBatch(batch, old_logp_BxT=logp, ref_logp_BxT=logp + 0.01,
                                advantages_B=jnp.asarray(rng.standard_normal(rows), jnp.float32))


def response_flops(cfg: Qwen3Config, prompt_len: int, lengths) -> float:
    """FLOPs of the response tokens alone, each row's over its own sequence prompt_len + its length."""
    return sum(train_flops(cfg, 1, prompt_len + int(r), tokens=int(r)) for r in lengths)


class Runner:
    """One variant's model, optimizer and mini-batches: each call runs one optimizer update on mini-batch k and
    returns its seconds."""

    def __init__(self, cfg: Qwen3Config, v: dict, minis: list[train_step.MiniBatch]):
        rt = RuntimeConfig(param_dtype=v["param_dtype"], compute_dtype="bfloat16", remat=v["remat"],
                           attention=v["attention"])
        self.v, self.minis = v, minis
        self.graphdef, params = nnx.split(Qwen3(cfg, rt, rngs=nnx.Rngs(0)))
        self.optimizer = train_optim.make_optimizer(OptimConfig(), total_updates=1000)
        # committed to the device, as apply_gradients returns them: else round 2 compiles the update again
        self.params = jax.device_put(params, jax.devices()[0])
        self.opt_state = jax.device_put(train_optim.init_optimizer(self.optimizer, self.params), jax.devices()[0])
        self.settings = train_update.LossSettings.from_config(dataclasses.replace(AlgorithmConfig(), kl_coef=1e-3), 1.0)

    def __call__(self, k: int) -> float:
        v, mini = self.v, self.minis[k]
        layouts.OVERHEAD_ROWS = v["overhead"]  # the plan's cost model for this variant (main restores it)
        start = time.perf_counter()
        self.params, self.opt_state, info = passes.update(
            self.graphdef, self.params, self.opt_state, mini, optimizer=self.optimizer, settings=self.settings,
            micro=v["micro"], shapes=_layout(v, mini), padded=v["layout"] == "padded")
        jax.block_until_ready(info["loss"])
        seconds = time.perf_counter() - start
        assert int(info["skipped"]) == 0 and np.isfinite(float(info["loss"])), info
        return seconds


def out_of_memory(cfg: Qwen3Config, variants: list[dict]) -> str:
    """The one line for a device that ran out of memory: every variant holds its params and AdamW's two moments
    (optax keeps them in the params' dtype) between updates, all variants at once."""
    held = [cfg.num_params() * 3 * np.dtype(v["param_dtype"]).itemsize / 1e9 for v in variants]
    return (f"bench update: the device ran out of memory with {len(variants)} variants held at once (each keeps its "
            f"params and AdamW's two moments between updates: {' + '.join(f'{g:.1f}' for g in held)} GB, before "
            "any update's own memory); run fewer --variant per call")


def run_variants(runners: list[Runner], iters: int) -> list[list[tuple[float, float]]]:
    """Per runner, per mini-batch: (compile + first call seconds, median warm seconds). Round 1 compiles, round 2
    warms (untimed; nothing compiles again, the params and optimizer state being committed from the start), then
    `iters` timed rounds; each round runs every runner on every mini-batch in turn (interleaved, so machine noise
    hits all of them alike)."""
    times = [[[] for _ in r.minis] for r in runners]
    for _ in range(iters + 2):
        for r, per_mini in zip(runners, times):
            for k, t in enumerate(per_mini):
                t.append(r(k))
    gc.collect()
    return [[(t[0], statistics.median(t[2:])) for t in per_mini] for per_mini in times]


def _layout(v: dict, mini: train_step.MiniBatch):
    """The passes' layout of a variant: packed rows of the mini-batch's S + T (layout=packed), else None (every
    shape of the length-grouped plan)."""
    if v["layout"] != "packed":
        return None
    return update_padding.packed_shape(v, 1, mini.batch.prompt_len, mini.batch.response_mask.shape[1])



def _shapes(plan) -> str:
    """'4x32 4x64 2x512': rows x response width of each micro-batch (packed: rows x packed width)."""
    if isinstance(plan, packing.PackedPlan):
        return " ".join(f"{m.ids_RxW.shape[0]}x{m.ids_RxW.shape[1]}p" for m in plan.micros)
    return " ".join(f"{len(rows)}x{w}" for rows, w in zip(plan.rows, plan.widths))


def _plan(v: dict, lengths, rows: int, prompt_len: int, response_len: int):
    """The micro-batch plan of a variant for response lengths `lengths` (prompts all real)."""
    mask = np.arange(response_len)[None] < lengths[:, None]
    attn = np.concatenate([np.ones((rows, prompt_len), bool), mask], axis=1)
    if v["layout"] == "packed":
        return packing.plan_packed(np.ones_like(attn, np.int32), attn, mask,
                                   update_padding.packed_shape(v, 1, prompt_len, response_len))
    return micro_lib.plan_micro(mask, v["micro"], attn, padded=v["layout"] == "padded")


def _plan_flops(cfg, plan, prompt_len: int) -> float:
    if isinstance(plan, packing.PackedPlan):
        return sum(train_flops(cfg, *m.ids_RxW.shape) for m in plan.micros)
    return sum(train_flops(cfg, len(rows), prompt_len + w) for rows, w in zip(plan.rows, plan.widths))


def _attention_work(v: dict, plan, needed: int, prompt_len: int) -> float:
    """Query-key pairs the variant's attention scores over the pairs the tokens need (`needed`): the full square of
    each row (xla, dense segment mask), or the blocked path's windows."""
    if not isinstance(plan, packing.PackedPlan):
        computed = sum(len(rows) * (prompt_len + w) ** 2 for rows, w in zip(plan.rows, plan.widths))
    elif v["block"]:
        computed = sum(packed_attention.pair_counts(m.segments_RxW, v["block"])[0] for m in plan.micros)
    else:
        computed = sum(m.ids_RxW.shape[0] * m.ids_RxW.shape[1] ** 2 for m in plan.micros)
    return computed / needed


def _row(name: str, widths: str, first: float, warm: float, flops: float, resp_flops: float, resp_tokens: int,
         peak: float, extra: str, ratio: str = "") -> str:
    mfu = (lambda f: f"{f / warm / 1e12 / peak:.1%}") if peak else (lambda f: "-")  # noqa: E731
    return (f"| {name} | {widths} | {first:.1f} | {warm:.3f} | {resp_tokens / warm:,.0f} "
            f"| {warm / resp_tokens * 1e6:.0f} | {extra} | {flops / warm / 1e12:.2f} | {mfu(flops)} "
            f"| {mfu(resp_flops)} |{ratio}")


def main(argv: list[str]) -> int:
    default_overhead = layouts.OVERHEAD_ROWS
    try:
        return _main(_args(argv))
    finally:
        layouts.OVERHEAD_ROWS = default_overhead


def _name(v: dict) -> str:
    return ",".join(f"{k}={v[k]}" for k in _KEYS if k not in ("block", "narrow") or v["layout"] == "packed")


def _main(a: argparse.Namespace) -> int:
    cfg = PRESETS[a.preset] if a.preset else _small(a.hidden, a.layers, a.vocab)
    if a.padding_only:
        print("\n".join(update_padding.report(cfg, [parse_variant(t, a.rows) for t in a.variant], rows=a.rows,
                                              prompt_len=a.prompt_len, prompt_up_to=a.prompts_up_to or a.prompt_len,
                                              budget=a.response_len, row_shards=a.row_shards)))
        return 0
    length = a.prompt_len + a.response_len
    batches = {"": np.full(a.rows, a.response_len)}
    if a.long_tail:
        tail = long_tailed_lengths(a.rows, a.response_len, a.seed)
        equal = np.full(a.rows, tail.sum() // a.rows)
        equal[:tail.sum() % a.rows] += 1  # the same total response tokens
        batches = {"long-tailed": tail, "equal": equal}
        print(f"long-tailed response lengths {sorted(tail.tolist())}: mean {tail.mean():.1f}, max {tail.max()}, "
              f"max/mean {tail.max() / tail.mean():.2f}; equal: {equal.min()}-{equal.max()} tokens per row")
    flops = train_flops(cfg, a.rows, length)
    print(f"model {cfg.num_params() / 1e6:.1f}M params; {a.rows} rows x ({a.prompt_len} + {a.response_len}) tokens "
          f"per update; {flops / 1e12:.1f} model TFLOP; jax {jax.__version__} on {jax.devices()[0].device_kind}")
    variants, plans, flops_by = [], [], []
    for text in a.variant or [""]:
        v = parse_variant(text, a.rows)
        layouts.OVERHEAD_ROWS = v["overhead"]  # the plan's cost model for this variant (main restores it)
        variants.append(v)
        plans.append({label: _plan(v, lengths, a.rows, a.prompt_len, a.response_len)
                      for label, lengths in batches.items()})
        flops_by.append({label: _plan_flops(cfg, plan, a.prompt_len) for label, plan in plans[-1].items()})
        if a.plan_only:
            for label, plan in plans[-1].items():
                model = f"; FLOP model long-tailed / equal {flops_by[-1]['long-tailed'] / flops_by[-1]['equal']:.2f}" \
                    if label == "equal" else ""
                print(f"{_name(v)} {label}: rows x widths {_shapes(plan)}, "
                      f"{flops_by[-1][label] / 1e12:.3f} model TFLOP{model}".strip())
    if a.plan_only:
        return 0
    minis = [_mini_batch(cfg, a.rows, a.prompt_len, a.response_len, lengths) for lengths in batches.values()]
    try:
        results = run_variants([Runner(cfg, v, minis) for v in variants], a.iters)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(out_of_memory(cfg, variants))
        return 2
    columns = 12 if a.long_tail else 11
    print("| variant | micro-batches (rows x width) | compile+first s | update s | resp tokens/s | µs/resp token "
          "| padding | attn work | TFLOP/s | MFU | resp MFU |"
          + (" long-tailed / equal: time (FLOP model; time / model) |" if a.long_tail else "")
          + "\n|" + "---|" * columns)
    for v, plan_by, flop_by, result in zip(variants, plans, flops_by, results):
        warm_by = {label: warm for label, (_, warm) in zip(batches, result)}
        for (label, lengths), (first, warm) in zip(batches.items(), result):
            plan = plan_by[label]
            needed = int(sum((a.prompt_len + n) * (a.prompt_len + n + 1) // 2 for n in lengths))
            extra = f"{plan.padding / plan.positions:.1%} | {_attention_work(v, plan, needed, a.prompt_len):.2f}"
            ratio = " |" if a.long_tail else ""
            if label == "equal":
                measured, model = warm_by["long-tailed"] / warm_by["equal"], flop_by["long-tailed"] / flop_by["equal"]
                ratio = f" **{measured:.2f}** ({model:.2f}; {measured / model:.2f}) |"
            print(_row(f"{_name(v)} {label}".strip(), _shapes(plan), first, warm, flop_by[label],
                       response_flops(cfg, a.prompt_len, lengths), int(lengths.sum()), a.peak_tflops, extra, ratio))
    return 0
