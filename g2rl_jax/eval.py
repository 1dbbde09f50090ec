"""Evaluation: pass@k, maj@k, verl's bootstrap metrics, the paper's results table, and the `python -m g2rl_jax.eval`
command that samples a model on benchmarks and writes them.

    python -m g2rl_jax.eval --model-path DIR --datasets math500,aime24 --samples 16 --temperature 0.8 --out DIR

    python -m g2rl_jax.eval --table runA/results.json runB/results.json   # one table, a row per run

Prompts longer than `--max-prompt-tokens` (training's `data.max_prompt_tokens` filter) are left out and counted.
Per problem it samples `--samples` responses, extracts and verifies their answers exactly as the training reward
does, and appends one record to `OUT/records/<key>.jsonl`, where the key names the checkpoint step (for
`--checkpoint`, resolved when the command starts) and a digest of every sampling setting (kept beside it in
`<key>.json`). A rerun with the same checkpoint and settings skips the problems already there; a later checkpoint or
other settings get records of their own. At the end it writes `OUT/results.json` (settings, records and
per-dataset metrics) and `OUT/results.md` (one row per model; columns are benchmarks x (pass@1, maj@16, pass@16),
in percent, as in the paper's tables).

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
import hashlib
import json
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from g2rl_jax import cli, storage
from g2rl_jax.data import Example, encode_prompts, load_dataset
from g2rl_jax.data.datasets import iter_jsonl

Equivalence = Callable[[str, str], bool]
RECORDS_DIR = "records"
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
    """maj@k of one problem: correctness of the most frequent answer class among the first k samples (classes from
    `score_responses`), ties broken uniformly at random by `rng`."""
    if not 1 <= k <= len(labels) or len(labels) != len(correct):
        raise ValueError(f"maj@k needs 1 <= k <= len(labels) == len(correct), got k={k}, {len(labels)} answer "
                         f"labels, {len(correct)} correctness flags")
    counts = Counter(label for label in labels[:k] if label is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winner = rng.choice(sorted(label for label, count in counts.items() if count == top))
    return float(correct[list(labels).index(winner)])


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
        draws = rng.integers(0, n, size=(n_bootstrap, k))  # [draw, sample]: sample indices of each draw
        metrics[f"verl/best@{k}"] = float(values[draws].max(axis=1).mean())
        votes = codes[draws]
        counts = (votes[:, :, None] == votes[:, None, :]).sum(-1)  # [draw, sample]: votes for that sample's answer
        first_top = (counts == counts.max(axis=1, keepdims=True)).argmax(axis=1)  # [draw]: earliest drawn winner
        metrics[f"verl/maj@{k}"] = float(values[draws[np.arange(n_bootstrap), first_top]].mean())
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

def read_records(path) -> list[dict[str, Any]]:
    """Records appended so far (a local path or a URL); a torn last line (a crash mid-write) is cut off the file."""
    if not storage.exists(path):
        return []
    text = storage.read_text(path)
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        storage.write_text(path, text)
    return [row for _, row in iter_jsonl(path, text)]


def append_record(path, record: dict[str, Any]) -> None:
    """One record appended at once (evaluate_dataset buffers its own: storage.Appender)."""
    storage.append_text(path, json.dumps(record) + "\n")  # on GCS: composed onto the object


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the samples depend on: records are kept per settings, so a change starts new records."""

    model: str  # the model dir, or for --checkpoint the resolved checkpoints/<step> dir
    checkpoint_step: int | None  # the training step of that checkpoint (None for --model-path)
    samples: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    template: str
    seed: int

    def key(self) -> str:
        """Name of this settings' records: the checkpoint step (if any) and a digest of every setting."""
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return (f"step{self.checkpoint_step}-" if self.checkpoint_step is not None else "") + digest


def records_path(out, settings: RunSettings):
    """OUT/records/<key>.jsonl of these settings, with the settings themselves beside it in <key>.json (written
    on first use, so a run that fails before sampling leaves nothing that blocks a retry with other settings)."""
    folder = storage.path(out, "--out") / RECORDS_DIR
    storage.makedirs(folder)
    meta = folder / f"{settings.key()}.json"
    if not storage.exists(meta):
        storage.write_text(meta, json.dumps(dataclasses.asdict(settings), indent=2))
    return folder / f"{settings.key()}.jsonl"


def write_results(out, model_name: str, datasets: dict[str, list[dict[str, Any]]], settings: RunSettings,
                  dropped_for_length: dict[str, int] | None = None) -> dict:
    """results.json (settings, per-dataset metrics, prompts left out for length and per-problem records) and
    results.md (the paper's table)."""
    metrics = {name: dataset_metrics(records, settings.seed) for name, records in datasets.items() if records}
    results = {"model": model_name, "settings": dataclasses.asdict(settings), "metrics": metrics,
               "dropped_for_length": dropped_for_length or {}, "problems": datasets}
    storage.write_text(out / "results.json", json.dumps(results, indent=1))
    storage.write_text(out / "results.md", results_table({model_name: metrics}, list(metrics)))
    return results


# ---- the command ----------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.eval", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-path", help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    source.add_argument("--checkpoint", help="a g2rl_jax training run dir (its newest checkpoint) or one "
                        "<run>/checkpoints/<step> dir; the run's config.yaml gives the defaults below")
    source.add_argument("--table", nargs="+", metavar="RESULTS_JSON",
                        help="only print one table, a row per file, from earlier runs' results.json")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    p.add_argument("--datasets", default="math500,amc23,aime24,aime25", help="comma-separated names or jsonl paths")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--temperature", type=float, help="default: a --checkpoint run's data.eval_temperature, else 0.8")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int,
                   help="default: a --checkpoint run's data.eval_max_new_tokens, else 8192")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--template", choices=("chat", "plain"),
                   help="prompt template; default: a --checkpoint run's data.prompt_template, else chat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="first N problems of each dataset")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="longer prompts are left out (and counted), as in training; default: a --checkpoint run's "
                   "data.max_prompt_tokens, else the training default")
    p.add_argument("--out", default="runs/eval")
    p.add_argument("--model-name", help="row label in results.md (default: the model folder's name)")
    args = p.parse_args(argv)
    _run_defaults(p, args)
    if args.samples < 1 or args.batch_size < 1 or args.max_new_tokens < 1 or args.max_prompt_tokens < 1:
        p.error("--samples, --batch-size, --max-new-tokens and --max-prompt-tokens must be positive")
    return args


def _run_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill unset sampling flags from a --checkpoint run's config.yaml (its evaluation settings), else defaults.
    Stop tokens need no flag: they come from the run's tokenizer, as in training."""
    run = {}
    if args.checkpoint is not None:
        from g2rl_jax.train.checkpoint import run_defaults

        try:
            storage.check_readable(args.checkpoint, "--checkpoint")  # a server gone away: one line, not a hang
            run = run_defaults([args.checkpoint], lambda c: {
                "temperature": c.data.eval_temperature, "max_new_tokens": c.data.eval_max_new_tokens,
                "template": c.data.prompt_template, "max_prompt_tokens": c.data.max_prompt_tokens}, args)
        except (FileNotFoundError, ValueError) as err:
            p.error(str(err))
    from g2rl_jax.config import DataConfig

    for flag, fallback in (("temperature", 0.8), ("max_new_tokens", 8192), ("template", "chat"),
                           ("max_prompt_tokens", DataConfig().max_prompt_tokens)):
        if getattr(args, flag) is None:
            setattr(args, flag, run.get(flag, fallback))


def score_responses(example: Example, texts: Sequence[str]) -> tuple[list[str | None], list[bool], list[int | None]]:
    """(extracted answers, correctness, maj@k answer classes) for one problem's responses. Correctness is the
    training reward's (`rewards.score_batch`, the text as it is: evaluation applies no truncation policy; records
    keep finish_reasons), the answers are the ones it compares with the gold."""
    from g2rl_jax import rewards
    from g2rl_jax.rewards.vote import answer_classes as verifier_classes

    scores = rewards.score_batch(list(texts), [example.answer] * len(texts), example.kind)
    if example.kind == "choice":
        answers = [rewards.choice_answer(t, example.answer) for t in texts]
        return answers, [bool(s > 0) for s in scores], answer_classes(answers, str.__eq__)
    answers = [rewards.extract_answer(t) for t in texts]
    return answers, [bool(s > 0) for s in scores], verifier_classes(answers)


def tokenizer_of(args: argparse.Namespace, settings: RunSettings):
    """--tokenizer, else the model folder's (for --checkpoint: the run's base model's)."""
    from g2rl_jax.data.tokenizer import load_tokenizer

    if args.tokenizer or args.checkpoint is None:
        from g2rl_jax.model.sources import local_model_dir

        flag = "--tokenizer" if args.tokenizer else "--model-path"
        folder = local_model_dir(args.tokenizer or args.model_path, flag)
        if not storage.is_dir(folder):
            raise FileNotFoundError(f"{flag} {folder!r} is not a directory here; pass a Hugging Face model folder "
                                    "(local, gs://..., or a Hugging Face id)")
        return load_tokenizer(folder)
    from g2rl_jax.train.checkpoint import base_model_dir

    return load_tokenizer(base_model_dir(settings.model))


def load_policy(args: argparse.Namespace, settings: RunSettings):
    """The model of --model-path, or of the checkpoint step `settings` resolved --checkpoint to."""
    if args.checkpoint is not None:  # trained params restored onto the run's base model
        from g2rl_jax.train.checkpoint import load_policy as load_checkpoint

        return load_checkpoint(settings.model)[0]  # the step the records are keyed by
    from g2rl_jax.model import load_pretrained
    from g2rl_jax.model.sources import local_model_dir

    return load_pretrained(local_model_dir(args.model_path, "--model-path"))


def length_filtered(datasets: dict[str, list[Example]], tokenizer, args) -> tuple[dict[str, list[Example]],
                                                                                   dict[str, int]]:
    """(the examples whose prompt fits --max-prompt-tokens, {name: number left out}): training's filter, with the
    count printed as training prints it; ValueError when no prompt of a dataset fits."""
    from g2rl_jax.config import DataConfig
    from g2rl_jax.train.setup import length_filter

    data_cfg = DataConfig(prompt_template=args.template, max_prompt_tokens=args.max_prompt_tokens)
    kept, dropped = {}, {}
    for name, examples in datasets.items():
        kept[name], dropped[name] = length_filter(examples, tokenizer, data_cfg)
        if dropped[name]:
            print(f"--datasets: {dropped[name]} of {len(examples)} prompts of {name!r} are longer than "
                  f"--max-prompt-tokens={args.max_prompt_tokens} tokens and are left out", flush=True)
        if examples and not kept[name]:
            raise ValueError(f"no prompt of {name!r} fits --max-prompt-tokens={args.max_prompt_tokens}; raise it or "
                             "drop the dataset from --datasets")
    return kept, dropped


def run_settings(args: argparse.Namespace) -> RunSettings:
    """The settings of this invocation; --checkpoint is resolved to its step now (a run that trained on since an
    earlier evaluation gets new records)."""
    model, step = args.model_path, None
    if args.checkpoint is not None:
        from g2rl_jax.train.checkpoint import resolve_checkpoint

        model = resolve_checkpoint(args.checkpoint)[1]
        step = int(model.name)
    if storage.is_dir(model) and not storage.is_url(model):  # a local folder: its absolute path (URLs, ids as given)
        model = storage.path(model).resolve()
    return RunSettings(model=str(model), checkpoint_step=step, samples=args.samples, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
                       template=args.template, seed=args.seed)


def evaluate_dataset(name, examples, done, model, tokenizer, args, records_path) -> None:
    """Sample, score and append a record for every example not in `done`, `--batch-size` prompts at a time."""
    from g2rl_jax.rollout import generate
    from g2rl_jax.train.setup import stop_token_ids

    stop_ids = stop_token_ids(tokenizer)
    pending = [e for e in examples if e.id not in done]
    # on GCS buffered: composed onto the object every G2RL_JAX_FLUSH_SECONDS and at the end (a kill loses the
    # records since the last flush; the rerun samples those problems again)
    with storage.Appender(records_path) as records, \
            tqdm(total=len(examples), initial=len(examples) - len(pending), desc=name, unit="problem") as bar:
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
                records.write(json.dumps({
                    "dataset": name, "id": example.id, "gold": example.answer, "answers": answers,
                    "correct": correct, "classes": classes,
                    "lengths": [len(x) for x in ids], "finish_reasons": list(rollout.finish_reasons[group])}) + "\n")
                bar.update()


def merged_table(paths: Sequence[str]) -> str:
    """One results table from several runs' results.json, a row per run, the benchmarks of the first run first."""
    runs = [json.loads(storage.read_text(path)) for path in paths]
    names = Counter(run["model"] for run in runs)
    rows = {run["model"] if names[run["model"]] == 1 else f"{run['model']} ({path})": run["metrics"]
            for run, path in zip(runs, paths)}
    return results_table(rows, list(dict.fromkeys(name for run in runs for name in run["metrics"])))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table:
        print(merged_table(args.table), end="")
        return 0
    try:
        out = storage.path(args.out, "--out")
        storage.check_writable(out, "--out")  # a missing bucket, no credentials: one line before any model loads
        storage.check_readable(args.model_path or "", "--model-path")  # a server gone away: one line, not a hang
        settings = run_settings(args)
        datasets = {name: load_dataset(name, limit=args.limit) for name in args.datasets.split(",") if name}
        tokenizer = tokenizer_of(args, settings)
        datasets, dropped = length_filtered(datasets, tokenizer, args)
    except (OSError, ValueError) as err:  # no model or tokenizer there, a bad dataset, or no prompt of one fits
        return cli.fail("eval", err)
    path = records_path(out, settings)
    storage.remove_orphan_parts(path.parent, older_than=600)  # a killed eval's compose parts (not a live one's)
    records = read_records(path)
    done = {(r["dataset"], r["id"]) for r in records}
    if any((name, e.id) not in done for name, examples in datasets.items() for e in examples):
        model = load_policy(args, settings)
        for name, examples in datasets.items():
            ids = {r_id for d, r_id in done if d == name}
            evaluate_dataset(name, examples, ids, model, tokenizer, args, path)
        records = read_records(path)
    by_key = {(r["dataset"], r["id"]): r for r in records}
    chosen = {name: [by_key[(name, e.id)] for e in examples] for name, examples in datasets.items()}
    results = write_results(out, args.model_name or storage.path(args.model_path or args.checkpoint).name, chosen,
                            settings, dropped)
    print(storage.read_text(out / "results.md"))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} ({sum(map(len, chosen.values()))} problems)")
    return 0 if results["metrics"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
