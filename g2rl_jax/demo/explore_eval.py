"""Held-out exploration measures of a Countdown policy: pass@k, maj@k, distinct correct answers, Φ geometry.

    python -m g2rl_jax.demo.explore_eval RUN_DIR [--samples 8] [--out RUN_DIR/explore.json]
    python -m g2rl_jax.demo.explore_eval --model-path DIR          # the warm-started policy before RL

For every held-out problem (`countdown_test`, or `--dataset countdown_study_test`) it samples n responses at
temperature 1 from the run's final checkpoint and judges them with the Countdown reward's own checker
(`g2rl_jax.demo.countdown.check`, what training rewarded). Per problem, with c of n correct, for k = 1, 2, 4, ...,
n (`problem_record`):

    pass@k      the unbiased estimator 1 − C(n−c, k)/C(n, k) (g2rl_jax.eval.pass_at_k)
    distinct@k  expected number of distinct correct answers among k of the n samples: Σ over distinct correct
                answers a (canonical forms: "3*5+7" = "7+5*3") of pass@k with c = a's count
    maj@k       majority vote over the first k samples' values (the expression is the path, its value the final
                answer, as a math answer is voted on): is the most frequent value the target? Responses that are not a
                well-formed expression of the given numbers do not vote (g2rl_jax.eval.majority_vote)

`measure` averages them over problems (with the old keys pass@1, pass@k = pass@n, distinct@k = distinct@n) and
adds truncated_fraction, the share of responses that reached max_new_tokens without the end token.
With `phi_samples`, `sample` also returns the gradient feature Φ of each problem's first responses from the
trainer's scoring pass (`g2rl_jax.train.step.score`), for the geometry of `g2rl_jax.analyze`.
"""
from __future__ import annotations

import argparse
import json
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from g2rl_jax import cli
from g2rl_jax.demo import countdown
from g2rl_jax.eval import majority_vote, pass_at_k, sample_ks


def judge(texts: Sequence[str], row: dict) -> tuple[list[bool], list[str | None], list[int | None], list[int]]:
    """Per response: correct, canonical form (correct ones, else None), a vote label (the index of its value among
    the problem's distinct values, None when it is not a well-formed expression of the given numbers with a value)
    and how many of the numbers it uses (0 when it is not well-formed)."""
    numbers, target = list(row["numbers"]), int(row["target"])
    correct, canonical, labels, used, values = [], [], [], [], {}
    for text in texts:
        tree = countdown.expression_tree(text, numbers)
        value = None if tree is None else countdown.value(tree)
        correct.append(value == target)
        canonical.append(countdown.canonical(tree) if value == target else None)
        labels.append(None if value is None else values.setdefault(value, len(values)))
        used.append(0 if tree is None else len(countdown.leaves(tree)))
    return correct, canonical, labels, used


def problem_record(texts: Sequence[str], row: dict, *, seed: int = 0, judge=judge) -> dict:
    """c, n and pass@k / distinct@k / maj@k for k in sample_ks(n) of one problem's n responses; what they are:
    the share that are well-formed (valid: they have a vote label), the share that use exactly two numbers (when
    the judge counts numbers used, as Countdown's), and the number of different response texts (unique). `judge`:
    the task's checker (Countdown's by default; the study's second task: g2rl_jax.demo.sumprod.judge)."""
    correct, canonical, labels, used = judge(texts, row)
    n, c = len(texts), sum(correct)
    counts = Counter(a for a in canonical if a is not None)
    rng = np.random.default_rng([seed, zlib.crc32(json.dumps(row, sort_keys=True).encode())])
    ks = sample_ks(n)
    return {"n": n, "c": c, "pass": {k: pass_at_k(n, c, k) for k in ks},
            "distinct": {k: sum(pass_at_k(n, count, k) for count in counts.values()) for k in ks},
            "maj": {k: majority_vote(labels, correct, k, rng) for k in ks},
            "valid": sum(label is not None for label in labels) / n, "unique": len({t.strip() for t in texts}),
            **({} if used is None else {"two_numbers": used.count(2) / n})}


def measure(texts_Pxn: Sequence[Sequence[str]], rows: Sequence[dict], truncated_Pxn: np.ndarray) -> dict:
    """Means over problems of every problem_record measure (keys like "pass@4"), the old summary keys and the
    share of truncated responses."""
    records = [problem_record(texts, row) for texts, row in zip(texts_Pxn, rows)]
    n = records[0]["n"]
    out = {f"{name}@{k}": float(np.mean([r[name][k] for r in records]))
           for name in ("pass", "distinct", "maj") for k in sample_ks(n)}
    return out | {"pass@k": out[f"pass@{n}"], "distinct@k": out[f"distinct@{n}"],
                  "truncated_fraction": float(np.mean(truncated_Pxn)), "problems": len(rows), "samples": n}


def sample(model, tokenizer, examples, *, samples: int, max_new_tokens: int, batch_size: int, seed: int,
           phi_samples: int = 0):
    """(texts [P][n], truncated [P, n], Φ [P, phi_samples, D] or None) at temperature 1, the prompts rendered as
    training renders them (plain); Φ of each problem's first phi_samples responses, scored at T = 1."""
    from flax import nnx

    from g2rl_jax.data import encode_prompts
    from g2rl_jax.rollout import generate
    from g2rl_jax.train import step as train_step
    from g2rl_jax.train.setup import stop_token_ids

    stop_ids = stop_token_ids(tokenizer)
    graphdef, params = nnx.split(model)
    texts, truncated, phis = [], [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        rollout = generate(model, encode_prompts(chunk, tokenizer, "plain"), max_new_tokens=max_new_tokens,
                           temperature=1.0, num_samples=samples, stop_token_ids=stop_ids, seed=seed + start)
        decoded = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        texts += [decoded[i * samples:(i + 1) * samples] for i in range(len(chunk))]
        truncated.append(np.array([r == "length" for r in rollout.finish_reasons]).reshape(len(chunk), samples))
        if phi_samples:
            rows = (np.arange(len(chunk))[:, None] * samples + np.arange(phi_samples)[None]).ravel()
            zeros = np.zeros(len(rows), np.float32)
            batch = train_step.build_batch(rollout.prompt_ids_BxS[rows], rollout.prompt_mask_BxS[rows],
                                           rollout.completion_ids_BxT[rows], rollout.completion_mask_BxT[rows],
                                           zeros, zeros > 0, phi_samples)
            phi_BxD = train_step.score(graphdef, params, batch, temperature=1.0, micro=len(rows)).phi_BxD
            phis.append(np.asarray(phi_BxD, np.float64).reshape(len(chunk), phi_samples, -1))
    return texts, np.concatenate(truncated), (np.concatenate(phis) if phi_samples else None)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.demo.explore_eval", description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("run_dir", nargs="?", type=Path, help="a finished Countdown run (its last checkpoint)")
    source.add_argument("--model-path", type=Path, help="a Hugging Face model directory (e.g. the warm start)")
    p.add_argument("--dataset", default="countdown_test", choices=("countdown_test", "countdown_study_test"))
    p.add_argument("--samples", type=int, default=8, help="n: responses per problem")
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

    from g2rl_jax.data import load_dataset
    from g2rl_jax.data.tokenizer import load_tokenizer

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
    tokenizer = load_tokenizer(tokenizer_dir)
    examples = load_dataset(args.dataset)
    texts, truncated, _ = sample(model, tokenizer, examples, samples=args.samples,
                                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed)
    result = measure(texts, [ex.row for ex in examples], truncated)
    result["examples"] = {ex.problem: texts[i][:4] for i, ex in enumerate(examples[:8])}
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
    out = args.out or (args.run_dir / "explore.json" if args.run_dir is not None else None)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
