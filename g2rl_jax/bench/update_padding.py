"""`python -m g2rl_jax.bench update --padding-only`: how much of an update's compute the packed layout spends off
the tokens, from the plan alone (nothing runs; any model size, e.g. Qwen3-1.7B at the paper's budget).

    python -m g2rl_jax.bench update --padding-only --preset qwen3-1.7b --rows 32 --prompt-len 1024 \\
        --prompts-up-to 256 --response-len 8192 --row-shards 4 --variant micro=16,layout=packed

Over 8 long-tailed draws (shapes.choice.long_tailed_lengths, seeds 0-7; prompts uniform in [P/2, P], P =
--prompts-up-to, in the --prompt-len bucket): the packed plan's padding (positions computed that hold no token), its
attention work (query-key pairs scored over the causal pairs of the sequences: the blocked path's windows, or the
full square of each row with block=0) and the FLOP model's share of the update off the tokens, forward + backward:
6 x matmul params per padding position plus 12 x heads x head_dim x layers per unneeded pair, over the same for every
position and pair computed, LM head left out; and with it: 6 x vocabulary x hidden per output column computed (a row
computes the head at as many columns as PackShape.outputs gives it, its response tokens gathered to the front) over
the same per response token.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from g2rl_jax.model import packed_attention
from g2rl_jax.model.config import Qwen3Config
from g2rl_jax.shapes.choice import long_tailed_lengths
from g2rl_jax.shapes.layouts import PackShape
from g2rl_jax.train import packing

DRAWS = 8


def draw(rows: int, prompt_up_to: int, budget: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, response lengths) [rows] of one long-tailed draw."""
    rng = np.random.default_rng(seed + 1000)
    return rng.integers(prompt_up_to // 2, prompt_up_to + 1, rows), long_tailed_lengths(rows, budget, seed)


def packed_shape(v: dict, min_rows: int, prompt_len: int, resp_len: int) -> PackShape:
    """A packed variant's layout (PackShape.of); narrow=0: its rows of the full width only (no narrower rows)."""
    shape = PackShape.of(v["micro"], min_rows, prompt_len=prompt_len, resp_len=resp_len, block=v["block"])
    if v["narrow"]:
        return shape
    return dataclasses.replace(shape, micros=tuple(m for m in shape.micros if m[1] == shape.width))


def packed_figures(cfg: Qwen3Config, prompt_B, resp_B, shape: PackShape) -> dict[str, float]:
    """positions, padding, pairs computed and needed, and the FLOP model's compute of the packed plan of one
    mini-batch of sequences (prompt_B + resp_B tokens)."""
    b, t, s = len(prompt_B), int(resp_B.max()), int(prompt_B.max())
    attn = np.zeros((b, s + t), bool)
    for i in range(b):
        attn[i, s - prompt_B[i]:s + resp_B[i]] = True
    resp = attn[:, s:]
    plan = packing.plan_packed(attn.astype(np.int32), attn, resp, shape)
    n_B = prompt_B + resp_B
    needed = int((n_B * (n_B + 1) // 2).sum())
    if shape.block:
        computed = sum(packed_attention.pair_counts(m.segments_RxW, shape.block)[0] for m in plan.micros)
    else:
        computed = sum(m.segments_RxW.shape[0] * m.segments_RxW.shape[1] ** 2 for m in plan.micros)
    matmul = 6 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (1 + (not cfg.tie_word_embeddings)))
    pair = 12 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    total = matmul * plan.positions + pair * computed
    useful = matmul * (plan.positions - plan.padding) + pair * needed
    head = 6 * cfg.vocab_size * cfg.hidden_size  # the LM head, at every output column of a row
    outputs = sum(m.targets_RxC.size for m in plan.micros)
    return {"positions": plan.positions, "padding": plan.padding, "computed": computed, "needed": needed,
            "total": total, "useful": useful, "micros": len(plan.micros), "head_total": total + head * outputs,
            "head_useful": useful + head * int(resp_B.sum())}


def report(cfg: Qwen3Config, variants: list[dict], *, rows: int, prompt_len: int, prompt_up_to: int, budget: int,
           row_shards: int) -> list[str]:
    """Markdown lines: per packed variant, padding, attention work and off-token compute over DRAWS draws."""
    lines = ["| variant | rows | shapes | micro-batches | padding | attn work | compute off the tokens "
             "| with the LM head |",
             "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        if v["layout"] != "packed":
            continue
        shape = packed_shape(v, row_shards, prompt_len, budget)
        figs = [packed_figures(cfg, *draw(rows, prompt_up_to, budget, seed), shape) for seed in range(DRAWS)]
        tot = {k: sum(f[k] for f in figs) for k in figs[0]}
        lines.append(f"| micro={v['micro']},block={v['block']},narrow={v['narrow']} (width {shape.width}) | {rows} "
                     f"| {len(shape.micros)} | {tot['micros'] / DRAWS:.1f} | {tot['padding'] / tot['positions']:.1%} "
                     f"| {tot['computed'] / tot['needed']:.2f} "
                     f"| {1 - tot['useful'] / tot['total']:.1%} | {1 - tot['head_useful'] / tot['head_total']:.1%} |")
    return lines
