"""The embedded demo through the real command, `python -m g2rl_jax.train --config configs/demo.yaml` on one CPU
device, the demo policy built first (tests/conftest.py): a four-step run checked for what the command leaves behind
(`demo_run`), and, with G2RL_FULL_DEMO=1, the full 200-step run checked for the README's promise with a safe bound
on its margin (`demo_full_run`; over 200 s of CPU, so outside the default suite: the README's first command is the
same run, and its figures are measured on a fresh clone, docs/testing.md).

Measured on the 2-core CPU (README): held-out mean@4 0.384 -> 0.646 after 200 steps (+0.262; twelve runs of four
modes and three seeds gained +0.245 to +0.327). The bound below, +0.15, leaves room for CPU-to-CPU numeric
differences while still failing if RL stops improving the policy.
"""
import json
import pathlib

import numpy as np
import pytest

from g2rl_jax.config import load_config
from g2rl_jax.train import report
from g2rl_jax.train.metrics import read_metrics

from _helpers import DEMO_SHORT

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
MARGIN = 0.15
MAX_TRUNCATED = 0.05  # share of held-out responses that hit the token budget (issue: demo must not be hackable)
MAX_JUNK = 0.10  # share with text after the \boxed{} answer


def test_response_flags_count_format_junk_and_truncation():
    texts = ["\\boxed{85}", " \\boxed{85} \n", "\\boxed{85}9}}", "85", "\\boxed{8", "x \\boxed{1} then \\boxed{85}"]
    reasons = ["stop", "stop", "length", "stop", "length", "stop"]
    np.testing.assert_array_equal(report.response_flags(texts, reasons), [
        [1, 0, 0], [1, 0, 0], [0, 1, 1], [0, 0, 0], [0, 0, 1], [1, 0, 0]])
    validation = {"val/a/mean@4": 0.5, "val/a/junk_fraction": 0.1, "val/b/mean@4": 0.7, "val/b/junk_fraction": 0.3}
    assert report.accuracy(validation) == pytest.approx(0.6)
    assert report.accuracy(validation, "junk_fraction") == pytest.approx(0.2)


def finished(run):
    done, out = run
    assert done.returncode == 0, done.stderr[-4000:]
    return {"out": out, "stdout": done.stdout, "summary": json.loads((out / "summary.json").read_text())}


def check_files(run, steps):
    """What the command leaves behind after `steps` steps: summary.json, curves.png, one metrics row a step."""
    out, summary = run["out"], run["summary"]
    assert summary["steps"] == steps and summary["seconds"] > 0
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in read_metrics(out)] == list(range(steps + 1))
    assert '"accuracy_after"' in run["stdout"]


def test_demo_through_the_cli_leaves_its_files(demo_run):
    run = finished(demo_run)
    check_files(run, load_config(DEMO, ["run.output_dir=x", "model.path=x", *DEMO_SHORT]).run.total_steps)
    assert sorted(p.name for p in (run["out"] / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


def test_full_demo_learns_without_hacking(demo_full_run):
    """The README's promise: accuracy up, answers in the task's format, nothing run up to the token budget."""
    run = finished(demo_full_run)
    check_files(run, load_config(DEMO, ["run.output_dir=x", "model.path=x"]).run.total_steps)
    summary = run["summary"]
    assert summary["accuracy_after"] - summary["accuracy_before"] >= MARGIN, summary
    assert summary["truncated_fraction"] < MAX_TRUNCATED, summary
    assert summary["junk_fraction"] <= MAX_JUNK, summary
    assert summary["format_fraction"] >= 1.0 - MAX_JUNK, summary
