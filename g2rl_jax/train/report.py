"""What a finished run leaves besides its checkpoints and metrics.jsonl: summary.json and curves.png.

    summary.json  accuracy_before / accuracy_after (mean over data.eval_datasets of the validation mean@k, before
                  the first update and after the last, under the same sampling); of the last validation's
                  responses, format_fraction (one `\\boxed{}` answer with nothing after it), junk_fraction (text
                  after the answer) and truncated_fraction (ended by max_new_tokens, not the end token); the
                  validation metrics themselves, steps, and seconds (wall time of the invocation that finished the
                  run, set-up and compilation included); programs_compiled, compile_seconds and compile_share
                  (of those seconds): what that invocation compiled (train/compiles.py)
    curves.png    accuracy, validation mean@k, response length, entropy and novelty against step (g2rl_jax.figures)

The "before" validation is metrics.jsonl's step-0 record (written as soon as it is measured, so a resumed run
still reports it, and the curves start from it). Only process 0 writes.
"""
from __future__ import annotations

import json

import jax
import numpy as np

from g2rl_jax import storage

SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"


SHARES = ("format_fraction", "junk_fraction", "truncated_fraction")  # per dataset: val/<dataset>/<share>
COMPILE = ("programs_compiled", "compile_seconds", "compile_share")  # summary.json: what the invocation compiled


def accuracy(validation: dict[str, float], measure: str = "mean@") -> float | None:
    """Mean over datasets of the val/<dataset>/mean@k entries, or of another `measure` such as "junk_fraction"
    (None when nothing was validated)."""
    values = [v for k, v in validation.items() if k.startswith("val/") and k.split("/")[-1].startswith(measure)]
    return sum(values) / len(values) if values else None


def response_flags(texts: list[str], finish_reasons: list[str]) -> np.ndarray:
    """bool [len(texts), len(SHARES)]: per validation response, whether it is in format / has junk after its
    answer / was truncated (see the module docstring); their column means are the shares."""
    from g2rl_jax.rewards.extract import text_after_answer

    tails = [text_after_answer(t) for t in texts]
    rows = [[tail is not None and not tail.strip(), tail is not None and bool(tail.strip()), reason == "length"]
            for tail, reason in zip(tails, finish_reasons)]
    return np.array(rows, dtype=bool).reshape(len(texts), len(SHARES))


def before(records: list[dict]) -> dict[str, float] | None:
    """The validation measured before the first update: the step-0 record of metrics.jsonl, if any."""
    first = [r for r in records if r["step"] == 0]
    return {k: v for k, v in first[0].items() if k != "step"} if first else None


def finish(run_dir, *, before: dict | None, after: dict | None, steps: int, seconds: float,
           compiled: tuple[int, float] = (0, 0.0)) -> dict | None:
    """Write summary.json and curves.png; returns the summary (None on processes other than 0). compiled: the
    programs the invocation compiled and the seconds it spent compiling (train/compiles.py)."""
    if jax.process_index() != 0:
        return None
    from g2rl_jax.figures import load_runs, training_figure

    summary = {"accuracy_before": accuracy(before or {}), "accuracy_after": accuracy(after or {}),
               **{share: accuracy(after or {}, share) for share in SHARES},
               "validation_before": before or {}, "validation_after": after or {},
               "steps": steps, "seconds": round(seconds, 1), "programs_compiled": compiled[0],
               "compile_seconds": round(compiled[1], 1), "compile_share": round(compiled[1] / max(seconds, 1e-9), 4)}
    storage.write_text(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    training_figure(load_runs([run_dir]), run_dir / CURVES_FILE)
    return summary
