"""Held-out exploration measures of a Countdown run (configs/demo_explore.yaml): pass@1, pass@k, distinct answers.

    python -m g2rl_jax.demo.explore_eval RUN_DIR [--samples 8] [--out RUN_DIR/explore.json]
    python -m g2rl_jax.demo.explore_eval --model-path DIR          # the warm-started policy before RL

For every `countdown_test` problem it samples k responses at temperature 1 from the run's final checkpoint and
scores them with the Countdown reward (`g2rl_jax.demo.countdown.reward`, the function training used). Per
problem: c correct of k; averaged over problems:

    pass@1             mean of c/k
    pass@k             share of problems with c >= 1
    distinct@k         distinct correct answers among the k samples (canonical forms: "3*5+7" = "7+5*3")
    truncated_fraction share of responses that reached max_new_tokens without the end token
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from g2rl_jax import cli
from g2rl_jax.demo import countdown


def problem_measures(texts: Sequence[str], row: dict) -> dict[str, float]:
    """c/k, any correct, distinct correct answers of one problem's k responses (row: numbers and target)."""
    trees = [countdown.check(t, list(row["numbers"]), int(row["target"])) for t in texts]
    correct = [t for t in trees if t is not None]
    return {"pass@1": len(correct) / len(texts), "pass@k": float(bool(correct)),
            "distinct@k": float(len({countdown.canonical(t) for t in correct}))}


def measure(texts_Pxm: Sequence[Sequence[str]], rows: Sequence[dict], truncated_Pxm: np.ndarray) -> dict:
    per = [problem_measures(texts, row) for texts, row in zip(texts_Pxm, rows)]
    out = {k: float(np.mean([m[k] for m in per])) for k in per[0]}
    return out | {"truncated_fraction": float(np.mean(truncated_Pxm)), "problems": len(rows),
                  "samples": len(texts_Pxm[0])}


def sample(model, tokenizer, examples, *, samples: int, max_new_tokens: int, batch_size: int, seed: int):
    """(texts [G][k], truncated [G, k]) at temperature 1, the prompts as training renders them (plain)."""
    from g2rl_jax.data import encode_prompts
    from g2rl_jax.rollout import generate
    from g2rl_jax.train.setup import stop_token_ids

    stop_ids = stop_token_ids(tokenizer)
    texts, truncated = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        rollout = generate(model, encode_prompts(chunk, tokenizer, "plain"), max_new_tokens=max_new_tokens,
                           temperature=1.0, num_samples=samples, stop_token_ids=stop_ids, seed=seed + start)
        decoded = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        texts += [decoded[i * samples:(i + 1) * samples] for i in range(len(chunk))]
        truncated.append(np.array([r == "length" for r in rollout.finish_reasons]).reshape(len(chunk), samples))
    return texts, np.concatenate(truncated)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.demo.explore_eval", description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("run_dir", nargs="?", type=Path, help="a finished demo_explore run (its last checkpoint)")
    source.add_argument("--model-path", type=Path, help="a Hugging Face model directory (e.g. the warm start)")
    p.add_argument("--samples", type=int, default=8, help="k: responses per problem")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON output (default: RUN_DIR/explore.json, or printed only)")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    from transformers import AutoTokenizer

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.run_dir is not None:
            from g2rl_jax.train.checkpoint import load_policy

            model, tokenizer_dir = load_policy(args.run_dir)
        else:
            from g2rl_jax.model import load_pretrained

            model, tokenizer_dir = load_pretrained(args.model_path, "float32"), args.model_path
    except cli.USER_ERRORS as err:  # no run or model there
        return cli.fail("demo.explore_eval", err)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    examples = countdown.examples("test")
    texts, truncated = sample(model, tokenizer, examples, samples=args.samples, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, seed=args.seed)
    result = measure(texts, [ex.row for ex in examples], truncated)
    result["examples"] = {ex.problem: texts[i][:4] for i, ex in enumerate(examples[:8])}
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
    out = args.out or (args.run_dir / "explore.json" if args.run_dir is not None else None)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
