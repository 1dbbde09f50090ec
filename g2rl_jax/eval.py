"""Evaluation: pass@k, maj@k, verl's bootstrap metrics, the paper's results table, and the `python -m g2rl_jax.eval`
command that samples a model on benchmarks and writes them.

    python -m g2rl_jax.eval --model-path DIR --datasets math500,aime24 --samples 16 --temperature 0.8 --out DIR

    python -m g2rl_jax.eval --table runA/results.json runB/results.json   # one table, a row per run

Per problem it samples `--samples` responses, extracts and verifies their answers, and appends one record to
`OUT/records.jsonl` (a rerun with the same settings skips the problems already there). At the end it writes
`OUT/results.json` (records and per-dataset metrics) and `OUT/results.md` (one row per model; columns are benchmarks
x (pass@1, maj@16, pass@16), in percent, as in the paper's tables).

Metrics, averaged over problems:
- pass@k: the unbiased estimator of Chen et al. (2021) from n samples with c correct.
- maj@k: majority vote over the first k samples' extracted answers, equivalent answers counted as one; ties broken
  uniformly at random (seeded per problem); samples without an answer do not vote; scored 0 if none has one.
- verl/mean@n, verl/best@k, verl/maj@k: verl's `process_validation_metrics` (bootstrap, 1,000 draws with
  replacement of k of the n samples; maj votes on exact answer strings, ties to the answer drawn first), for
  comparison with verl-based papers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from g2rl_jax.data import Example, encode_prompts, load_dataset
from g2rl_jax.data.datasets import iter_jsonl

Equivalence = Callable[[str, str], bool]
TABLE_NAMES = {"math500": "MATH500", "amc23": "AMC", "aime24": "AIME24", "aime25": "AIME25", "gpqa_diamond": "GPQA",
               "mmlu_pro": "MMLU-Pro"}


# ---- metrics --------------------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c correct, is correct) = 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))  # stable product form


def answer_classes(answers: Sequence[str | None], equivalent: Equivalence) -> list[int | None]:
    """Class label per answer: equal to the first earlier answer it is equivalent to (None stays None)."""
    representatives: list[str] = []
    labels: list[int | None] = []
    for answer in answers:
        if answer is None:
            labels.append(None)
            continue
        label = next((i for i, rep in enumerate(representatives) if rep == answer or equivalent(answer, rep)), None)
        if label is None:
            label = len(representatives)
            representatives.append(answer)
        labels.append(label)
    return labels


def majority_vote(labels: Sequence[int | None], correct: Sequence[bool], k: int, rng: np.random.Generator) -> float:
    """Correctness of the most frequent answer class among the first k samples, ties broken uniformly at random."""
    counts = Counter(label for label in labels[:k] if label is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winner = rng.choice(sorted(label for label, count in counts.items() if count == top))
    return float(correct[list(labels).index(winner)])


def maj_at_k(
    answers: Sequence[str | None], correct: Sequence[bool], k: int, *, equivalent: Equivalence | None = None,
    seed: int = 0,
) -> float:
    """maj@k of one problem; by default answers are merged as g2rl_jax.rewards.is_equivalent would merge them
    (g2rl_jax.rewards.vote.answer_classes: hashing and fingerprints first, sympy only where needed)."""
    if not 1 <= k <= len(answers) or len(answers) != len(correct):
        raise ValueError(f"maj_at_k needs 1 <= k <= len(answers) == len(correct), got k={k}, "
                         f"{len(answers)} answers, {len(correct)} correctness flags")
    if equivalent is None:
        from g2rl_jax.rewards.vote import answer_classes as verifier_classes
        labels = verifier_classes(list(answers[:k]))
    else:
        labels = answer_classes(answers[:k], equivalent)
    return majority_vote(labels, correct, k, np.random.default_rng(seed))


def sample_ks(n: int) -> list[int]:
    """The k's reported for n samples: 1, 2, 4, ... below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def verl_metrics(correct: Sequence[bool], preds: Sequence[str], *, n_bootstrap: int = 1000, seed: int = 42):
    """verl's per-prompt validation metrics: mean@n and, for k in 2, 4, ... < n and n, bootstrap best@k and maj@k."""
    values = np.asarray(correct, dtype=np.float64)
    n = len(values)
    metrics = {f"verl/mean@{n}": float(values.mean())}
    codes = np.unique(np.asarray(preds, dtype=str), return_inverse=True)[1]
    rng = np.random.default_rng(seed)
    for k in sample_ks(n)[1:]:
        draws_BxK = rng.integers(0, n, size=(n_bootstrap, k))
        metrics[f"verl/best@{k}"] = float(values[draws_BxK].max(axis=1).mean())
        votes_BxK = codes[draws_BxK]
        counts_BxK = (votes_BxK[:, :, None] == votes_BxK[:, None, :]).sum(-1)
        first_top_B = (counts_BxK == counts_BxK.max(axis=1, keepdims=True)).argmax(axis=1)  # earliest drawn winner
        metrics[f"verl/maj@{k}"] = float(values[draws_BxK[np.arange(n_bootstrap), first_top_B]].mean())
    return metrics


def problem_metrics(record: dict[str, Any], seed: int = 0) -> dict[str, float]:
    """All metrics of one problem's record (answers, correct, classes) for every k that fits its samples."""
    correct = [bool(x) for x in record["correct"]]
    n, c = len(correct), sum(correct)
    rng = np.random.default_rng([seed, zlib.crc32(f"{record['dataset']}:{record['id']}".encode())])
    metrics = {f"pass@{k}": pass_at_k(n, c, k) for k in sample_ks(n)}
    metrics |= {f"maj@{k}": majority_vote(record["classes"], correct, k, rng) for k in sample_ks(n)}
    preds = ["" if a is None else a for a in record["answers"]]
    return metrics | verl_metrics(correct, preds)


def dataset_metrics(records: Sequence[dict[str, Any]], seed: int = 0) -> dict[str, float]:
    """Per-problem metrics averaged over the problems (only keys every problem has)."""
    per_problem = [problem_metrics(r, seed) for r in records]
    keys = [key for key in per_problem[0] if all(key in m for m in per_problem)]
    return {key: float(np.mean([m[key] for m in per_problem])) for key in keys} | {"problems": len(records)}


def results_table(rows: dict[str, dict[str, dict[str, float]]], datasets: Sequence[str], k: int = 16) -> str:
    """Markdown table in the paper's layout: a row per model, benchmarks x (pass@1, maj@k, pass@k) in percent.

    Where fewer than k samples were drawn, the largest k that fits is shown; where more, pass@n is added.
    """
    columns = []
    for name in datasets:
        n = max(int(key.split("@")[1]) for m in rows.values() for key in m.get(name, {}) if key.startswith("pass@"))
        kk = min(k, n)
        columns += [(name, key) for key in (["pass@1", f"maj@{kk}", f"pass@{kk}"] + ([f"pass@{n}"] if n > kk else []))]
    header = "| Model | " + " | ".join(f"{TABLE_NAMES.get(d, d)} {key}" for d, key in columns) + " |"
    lines = [header, "|---" * (len(columns) + 1) + "|"]
    for model, metrics in rows.items():
        cells = [f"{100 * metrics[d][key]:.1f}" if key in metrics.get(d, {}) else "–" for d, key in columns]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- resume bookkeeping ---------------------------------------------------------------------------------------

def read_records(path: Path) -> list[dict[str, Any]]:
    """Records appended so far; a torn last line (a crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    return [row for _, row in iter_jsonl(path, text)]


def append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the samples depend on; a resumed run must match the one that wrote the records."""

    model: str
    samples: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    template: str
    seed: int


def check_settings(out: Path, settings: RunSettings) -> None:
    """Write OUT/settings.json, or check that an earlier run's settings match these."""
    path = out / "settings.json"
    current = dataclasses.asdict(settings)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != current:
            diff = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
            raise ValueError(f"{out} holds records of a run with other settings (saved, now): {diff}; "
                             "pass another --out or delete the folder")
    else:
        path.write_text(json.dumps(current, indent=2))


def write_results(out: Path, model_name: str, datasets: dict[str, list[dict[str, Any]]], seed: int) -> dict:
    """results.json (per-dataset metrics and per-problem records) and results.md (the paper's table)."""
    metrics = {name: dataset_metrics(records, seed) for name, records in datasets.items() if records}
    results = {"model": model_name, "metrics": metrics, "problems": datasets}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(results_table({model_name: metrics}, list(metrics)))
    return results


# ---- the command ----------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.eval", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    source.add_argument("--checkpoint", help="a g2rl_jax training checkpoint folder")
    source.add_argument("--table", nargs="+", metavar="RESULTS_JSON",
                        help="only print one table, a row per file, from earlier runs' results.json")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    p.add_argument("--datasets", default="math500,amc23,aime24,aime25", help="comma-separated names or jsonl paths")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--template", choices=("chat", "plain"), default="chat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="first N problems of each dataset")
    p.add_argument("--out", default="runs/eval")
    p.add_argument("--model-name", help="row label in results.md (default: the model folder's name)")
    args = p.parse_args(argv)
    if args.samples < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        p.error("--samples, --batch-size and --max-new-tokens must be positive")
    return args


def score_responses(example: Example, texts: Sequence[str]) -> tuple[list[str | None], list[bool], list[int | None]]:
    """(extracted answers, correctness, maj@k answer classes) for one problem's responses, as the training reward
    scores them (the text as it is: evaluation applies no truncation policy; records keep finish_reasons)."""
    from g2rl_jax import rewards
    from g2rl_jax.rewards.vote import answer_classes as verifier_classes

    if example.kind == "choice":
        answers = [rewards.extract_choice(t, num_choices=len(example.choices)) for t in texts]
        return answers, [a == example.answer for a in answers], answer_classes(answers, str.__eq__)
    answers = [rewards.extract_answer(t) for t in texts]
    scores = rewards.score_batch(list(texts), [example.answer] * len(texts), "math")
    return answers, [bool(s > 0) for s in scores], verifier_classes(answers)


def load_policy(args: argparse.Namespace):
    """(model, tokenizer) from --model-path or --checkpoint."""
    from transformers import AutoTokenizer

    if args.checkpoint is not None:  # trained params restored onto the run's base model
        from g2rl_jax.analyze import load_policy as load_checkpoint

        model, tokenizer_dir = load_checkpoint(args.checkpoint)
        return model, AutoTokenizer.from_pretrained(args.tokenizer or tokenizer_dir)
    from g2rl_jax.model import load_pretrained

    return load_pretrained(args.model_path), AutoTokenizer.from_pretrained(args.tokenizer or args.model_path)


def evaluate_dataset(name, examples, done, model, tokenizer, args, records_path) -> None:
    """Sample, score and append a record for every example not in `done`, `--batch-size` prompts at a time."""
    from g2rl_jax.rollout import generate
    from g2rl_jax.train.setup import stop_token_ids

    stop_ids = stop_token_ids(tokenizer)
    pending = [e for e in examples if e.id not in done]
    with tqdm(total=len(examples), initial=len(examples) - len(pending), desc=name, unit="problem") as bar:
        for start in range(0, len(pending), args.batch_size):
            chunk = pending[start:start + args.batch_size]
            seed = zlib.crc32(f"{args.seed}:{name}:{chunk[0].id}".encode()) & 0x7FFFFFFF
            rollout = generate(model, encode_prompts(chunk, tokenizer, args.template),
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                               top_k=args.top_k, num_samples=args.samples, stop_token_ids=stop_ids, seed=seed)
            for i, example in enumerate(chunk):
                group = slice(i * args.samples, (i + 1) * args.samples)  # completions are group-major
                ids = rollout.completion_ids[group]
                texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
                answers, correct, classes = score_responses(example, texts)
                append_record(records_path, {
                    "dataset": name, "id": example.id, "gold": example.answer, "answers": answers,
                    "correct": correct, "classes": classes,
                    "lengths": [len(x) for x in ids], "finish_reasons": list(rollout.finish_reasons[group])})
                bar.update()


def merged_table(paths: Sequence[str]) -> str:
    """One results table from several runs' results.json, a row per run, the benchmarks of the first run first."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    names = Counter(run["model"] for run in runs)
    rows = {run["model"] if names[run["model"]] == 1 else f"{run['model']} ({path})": run["metrics"]
            for run, path in zip(runs, paths)}
    return results_table(rows, list(dict.fromkeys(name for run in runs for name in run["metrics"])))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table:
        print(merged_table(args.table), end="")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_path or args.checkpoint
    settings = RunSettings(model=str(Path(model_dir).resolve()), samples=args.samples,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                           max_new_tokens=args.max_new_tokens, template=args.template, seed=args.seed)
    check_settings(out, settings)
    datasets = {name: load_dataset(name, limit=args.limit) for name in args.datasets.split(",") if name}
    records_path = out / "records.jsonl"
    records = read_records(records_path)
    done = {(r["dataset"], r["id"]) for r in records}
    if any((name, e.id) not in done for name, examples in datasets.items() for e in examples):
        model, tokenizer = load_policy(args)
        for name, examples in datasets.items():
            ids = {r_id for d, r_id in done if d == name}
            evaluate_dataset(name, examples, ids, model, tokenizer, args, records_path)
        records = read_records(records_path)
    by_key = {(r["dataset"], r["id"]): r for r in records}
    chosen = {name: [by_key[(name, e.id)] for e in examples] for name, examples in datasets.items()}
    results = write_results(out, args.model_name or Path(model_dir).name, chosen, args.seed)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} ({sum(map(len, chosen.values()))} problems)")
    return 0 if results["metrics"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
