"""Figures: training dynamics from runs' metrics.jsonl, and the exploration-geometry panels of `analyze`.

A library module: the `plot` command (g2rl_jax/plot.py), the trainer's end-of-run report (train/report.py) and
`analyze` all draw with it.

`training_figure` draws accuracy, any validation mean@k (`val/<dataset>/mean@k`), response length, entropy
and novelty against step, one colour per run (legend: the run dir's name), as the paper's training-dynamics
figure. `geometry_figure` draws the three panels of the paper's exploration-geometry figure from
`analysis.json`'s per-model stats: gradient-cosine distributions, semantic-cosine distributions and the
negative-pair ratios. Both write PNGs with matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from g2rl_jax import storage  # noqa: E402

# metric key -> axis label, in panel order; validation keys (val/<dataset>/mean@k) go right after accuracy
CURVES = {"accuracy": "training accuracy", "response_length": "response length (tokens)", "entropy": "entropy",
          "novelty": "novelty ν"}
VAL_PREFIX = "val/"


def colours(n: int) -> list:
    """One distinct colour per model/run, the same order in every panel."""
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that have a finite `key` (null marks a non-finite value)."""
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and np.isfinite(r[key])]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], np.float64)


def panel_title(key: str) -> str:
    """"val/aime25/mean@8" -> "aime25 mean@8 (validation)"; other keys as they are."""
    parts = key.split("/")
    return f"{parts[1]} {parts[2]} (validation)" if key.startswith(VAL_PREFIX) and len(parts) == 3 else key


def curve_keys(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Panels to draw: accuracy, every validation mean@k any run logged (sorted), then the other CURVES."""
    val = sorted({k for records in runs.values() for r in records for k in r
                  if k.startswith(VAL_PREFIX) and k.split("/")[-1].startswith("mean@")})  # not the format shares
    return ["accuracy", *val, *[k for k in CURVES if k != "accuracy"]]


def training_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path) -> Path:
    """Training dynamics of several runs ({label: metrics records}) as one PNG; returns the path."""
    if not runs:
        raise ValueError("training_figure needs at least one run")
    keys = curve_keys(runs)
    cols = min(len(keys), 3)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for (label, records), colour in zip(runs.items(), colours(len(runs))):
        for ax, key in zip(axes.flat, keys):
            steps, values = _series(records, key)
            if len(steps):
                ax.plot(steps, values, color=colour, label=label, marker="o" if len(steps) == 1 else None)
    for ax, key in zip(axes.flat, keys):
        ax.set_title(CURVES.get(key) or panel_title(key))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 5), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _save(fig, path)


def _hist_panel(ax, models: Mapping[str, Mapping[str, Any]], key: str, palette) -> bool:
    """Density step-histograms of `key` ({"edges", "counts"}) per model; False if no model has it."""
    drawn = False
    for (label, stats), colour in zip(models.items(), palette):
        hist = stats.get(key)
        if hist is None:
            continue
        edges, counts = np.asarray(hist["edges"]), np.asarray(hist["counts"], np.float64)
        density = counts / max(counts.sum(), 1.0) / np.diff(edges)
        ax.stairs(density, edges, color=colour, fill=True, alpha=0.25)
        ax.stairs(density, edges, color=colour, label=label, linewidth=1.5)
        drawn = True
    return drawn


def geometry_figure(models: Mapping[str, Mapping[str, Any]], path: str | Path, *, title: str | None = None) -> Path:
    """The paper's three geometry panels from per-model `analyze.geometry_stats` dicts; returns the path."""
    if not models:
        raise ValueError("geometry_figure needs at least one model's stats")
    palette = colours(len(models))
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    _hist_panel(left, models, "gradient_cosine_histogram", palette)
    left.set(title="gradient-space cosine (Φ)", xlabel="pairwise cosine similarity", ylabel="density")
    if _hist_panel(middle, models, "semantic_cosine_histogram", palette):
        middle.set(title="semantic-space cosine", xlabel="pairwise cosine similarity", ylabel="density")
    else:
        middle.text(0.5, 0.5, "no semantic cosines\n(run analyze with --embedding-model)", ha="center",
                    va="center", transform=middle.transAxes)
        middle.set(title="semantic-space cosine", xticks=[], yticks=[])
    for ax in (left, middle):
        ax.axvline(0.0, color="grey", linewidth=0.8, linestyle="--")
        ax.grid(alpha=0.3)
    labels = list(models)
    ratios = [100 * models[label]["negative_pair_ratio"] for label in labels]
    bars = right.bar(range(len(labels)), ratios, color=palette)
    right.bar_label(bars, fmt="%.2f%%")
    right.set(title="negative-similarity pairs", ylabel="share of pairs with cos < 0 (%)",
              xticks=range(len(labels)), xticklabels=labels, ylim=(0, max(max(ratios) * 1.2, 1.0)))
    handles, names = left.get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=min(len(models), 5), frameon=False)
    if title:
        fig.suptitle(title, y=0.02, va="bottom", fontsize=9, color="grey")
    fig.tight_layout(rect=(0, 0.04, 1, 0.9))
    return _save(fig, path)


def _save(fig, path):
    """The figure as a PNG at `path` (local or a URL), written whole."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    storage.write_bytes(path, buffer.getvalue())
    return storage.path(path)


def load_runs(run_dirs: Sequence[str | Path]) -> dict[str, list[dict]]:
    """{run dir name: its metrics records}; a dir without metrics.jsonl is an error naming it."""
    from g2rl_jax.train.metrics import METRICS_FILE, read_metrics

    runs: dict[str, list[dict]] = {}
    for run_dir in map(storage.path, run_dirs):
        records = read_metrics(run_dir)
        if not records:
            raise FileNotFoundError(f"{run_dir / METRICS_FILE}: missing or empty; pass run directories written by "
                                    "python -m g2rl_jax.train")
        label = (run_dir if storage.is_url(run_dir) else run_dir.resolve()).name
        if label in runs:  # two runs named alike in different parents
            label = str(run_dir)
        runs[label] = records
    return runs
