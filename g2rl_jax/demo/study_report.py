"""The study's report: means with 95% bootstrap intervals, differences, the tables and the three figures.

    write_report(out)  -> [OUT/study.md, OUT/study.json, OUT/passk.png, OUT/tradeoff.png, OUT/geometry.png]
    write_report(out, earlier=Path("docs/study.md"))  # tradeoff.png also draws another report's other variants

Inputs are what `g2rl_jax.demo.study` leaves in OUT/runs/NAME/: study_eval.json (held-out measures per
problem), study_time.json and the training run's metrics.jsonl. Runs are grouped by variant (the run name less
its `_s<seed>`).

Intervals (`bootstrap`): the held-out measures form a [seeds, problems] array per variant; each bootstrap draw
resamples seeds and problems with replacement, independently, and takes the mean, so the interval covers both
the spread between training runs and the finite problem set. A difference between two variants resamples the
problems once for both (the same held-out problems, paired) and the seeds of each variant separately. Measures
that exist once per run (training accuracy, single-class shares and advantages) resample seeds only. 2,000
draws, percentile intervals, a fixed seed.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DRAWS = 2000
BOOT_SEED = 0
LAST_STEPS = 10  # training accuracy = mean over the last LAST_STEPS steps' rollouts
HELD_OUT = {"pass@1": ("pass", "1"), "maj@{n}": ("maj", "n"), "pass@{n}": ("pass", "n"),
            "distinct@{n}": ("distinct", "n"), "gradient cosine": ("cosine_mean", None),
            "negative pairs": ("negative_ratio", None)}
WRITES = {"valid responses": "valid", "two-number responses": "two_numbers", "different responses of {n}": "unique"}
TRAINING = ("train accuracy", "held-out − train", "single-class share", "all-wrong share",
            "A(most novel), single-class", "A(least novel), single-class", "A(most novel), all-wrong",
            "A(least novel), all-wrong")
ORDER = ("warmstart", "grpo", "entropy_bonus", "g2rl_shaped", "g2rl_zero", "clip_cov", "kl_cov", "passk",
         "unlikeliness", "nsr", "w_reinforce", "forking", "g2rl_mixed_correct", "g2rl_correct_peers", "miner",
         "g2rl_after_text", "g2rl_after_literal", "g2rl_after_literal_mixed")
# differences besides those against grpo, where both variants ran: the paper's shaping against GRPO's outcome for
# single-class groups, the novelty term's placement (after the standardisation against the paper's), its reading,
# and what the single-class groups contribute to it
PAIRS = (("g2rl_shaped", "g2rl_zero"), ("g2rl_after_text", "g2rl_shaped"), ("g2rl_after_literal", "g2rl_after_text"),
         ("g2rl_after_literal", "g2rl_after_literal_mixed"))


# ------------------------------------------------------------------------------------------------ statistics
def _weights(rng: np.random.Generator, draws: int, size: int) -> np.ndarray:
    """[draws, size] counts of each index in a resample of size `size` with replacement."""
    idx = rng.integers(0, size, (draws, size))
    return np.apply_along_axis(np.bincount, 1, idx, minlength=size).astype(np.float64)


def bootstrap(x_SxP, y_SxP=None, *, draws: int = DRAWS, seed: int = BOOT_SEED) -> dict[str, float]:
    """Mean of x (or of x − y, problems paired) and its 95% percentile interval, resampling seeds and problems."""
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(a, np.float64) for a in (x_SxP, y_SxP) if a is not None]
    p = arrays[0].shape[1]
    if any(a.ndim != 2 or a.shape[1] != p for a in arrays):
        raise ValueError(f"bootstrap needs [seeds, problems] arrays over the same problems, got "
                         f"{[a.shape for a in arrays]}")
    wp_DxP = _weights(rng, draws, p)
    stats = []
    for a in arrays:
        ws_DxS = _weights(rng, draws, a.shape[0])
        stats.append(np.einsum("ds,sp,dp->d", ws_DxS, a, wp_DxP) / (a.shape[0] * p))
    d = stats[0] - (stats[1] if len(stats) > 1 else 0.0)
    mean = arrays[0].mean() - (arrays[1].mean() if len(arrays) > 1 else 0.0)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"mean": float(mean), "lo": float(lo), "hi": float(hi)}


def bootstrap_runs(x_S, y_S=None, **kw) -> dict[str, float]:
    """bootstrap of per-run values (one per seed): seeds resampled; y is another variant's, resampled apart."""
    col = lambda v: None if v is None else np.asarray(v, np.float64)[:, None]  # noqa: E731
    return bootstrap(col(x_S), col(y_S), **kw)


def excludes_zero(ci: dict[str, float]) -> bool:
    return ci["lo"] > 0 or ci["hi"] < 0


# ------------------------------------------------------------------------------------------------ loading
def training_summary(records: Sequence[dict]) -> dict[str, float]:
    """Per-run training figures from metrics.jsonl records: accuracy of the last LAST_STEPS steps' rollouts, the
    mean shares of single-class and all-wrong groups, and the advantages those groups gave their most and least
    novel response averaged over every such group of the run (each step's mean weighted by its group count)."""
    steps = [r for r in records if r.get("step", 0) >= 1 and "accuracy" in r]
    if not steps:
        return {}
    out = {"train accuracy": float(np.mean([r["accuracy"] for r in steps[-LAST_STEPS:]])),
           "single-class share": float(np.mean([r["single_class_fraction"] for r in steps])),
           "all-wrong share": float(np.mean([r["all_wrong_fraction"] for r in steps]))}
    for which in ("most", "least"):
        for group, share in (("single_class", "single_class_fraction"), ("all_wrong", "all_wrong_fraction")):
            pairs = [(r[share], r[f"{group}_adv_{which}_novel"]) for r in steps
                     if r.get(f"{group}_adv_{which}_novel") is not None]
            if pairs:
                w, v = np.array(pairs).T
                label = f"A({which} novel), {group.replace('_', '-')}"
                out[label] = float(np.sum(w * v) / np.sum(w)) if np.sum(w) else float("nan")
    out |= {"entropy first": steps[0]["entropy"], "entropy last": steps[-1]["entropy"]}
    if "novelty" in steps[0]:
        out |= {"novelty first": steps[0]["novelty"], "novelty last": steps[-1]["novelty"]}
    return out


def load_runs(out: Path) -> dict[str, list[dict]]:
    """{variant: [run, ...] by seed}; run = study_eval.json's content + "training" + "time" + "name"."""
    from g2rl_jax.train.metrics import read_metrics

    variants: dict[str, list[dict]] = {}
    for path in sorted((out / "runs").glob("*/study_eval.json")):
        run = json.loads(path.read_text())
        run_dir = path.parent
        time_file = run_dir / "study_time.json"
        run |= {"name": run_dir.name, "training": training_summary(read_metrics(run_dir)),
                "time": json.loads(time_file.read_text()) if time_file.is_file() else {}}
        variants.setdefault(run["run"]["variant"], []).append(run)
    for runs in variants.values():
        runs.sort(key=lambda r: r["run"]["seed"])
    ids = {tuple(r["problem_ids"]) for runs in variants.values() for r in runs}
    if len(ids) > 1:
        raise ValueError(f"the runs in {out / 'runs'} were evaluated on different held-out problems; rerun them "
                         "with the same --problems")
    return dict(sorted(variants.items(), key=lambda kv: _order(kv[0])))


def _base(variant: str) -> str:
    """The variant a λ point ("g2rl_zero_lam0.25") varies; any other variant itself."""
    return re.sub(r"_lam[0-9.e+-]+$", "", variant)


def _order(variant: str) -> tuple:
    base = _base(variant)
    return (ORDER.index(base) if base in ORDER else len(ORDER), variant)


def per_problem(runs: Sequence[dict], key: str, k: str | None) -> np.ndarray:
    """[seeds, problems] of one held-out measure."""
    return np.array([r[key] if k is None else r[key][k] for r in runs], np.float64)


def earlier_rows(path: Path) -> dict[str, dict]:
    """The held-out table of another study's report (the first table of its study.md, as `markdown` writes it, or a
    page that quotes it): {variant: {"seeds": n, measure: {"mean", "lo", "hi"}}}."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| variant | seeds | pass@1 |")), None)
    if start is None:
        raise SystemExit(f"study error: {path} holds no held-out table (a line '| variant | seeds | pass@1 | ...'); "
                         "name a study's study.md")
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        row: dict = {"seeds": int(cells[1])}
        for name, cell in zip(head[2:], cells[2:]):
            mean, lo, hi = (float(x) for x in re.fullmatch(r"(\S+) \[(\S+), (\S+)\]", cell).groups())
            row[name] = {"mean": mean, "lo": lo, "hi": hi}
        rows[cells[0]] = row
    return rows


# ------------------------------------------------------------------------------------------------ the report
def summarise(variants: dict[str, list[dict]]) -> dict:
    """Every measure of every variant with its interval, and the differences against grpo (and PAIRS, and each λ
    point against its variant at the config's λ)."""
    n = str(next(iter(variants.values()))[0]["samples"])
    measures = {name.format(n=n): (key, n if k == "n" else k) for name, (key, k) in HELD_OUT.items()}
    table: dict[str, dict] = {}
    for variant, runs in variants.items():
        row = {name: bootstrap(per_problem(runs, key, k)) for name, (key, k) in measures.items()}
        row |= {name.format(n=n): bootstrap(per_problem(runs, key, None)) for name, key in WRITES.items()
                if all(key in r for r in runs)}
        if variant != "warmstart":
            train = [r["training"] for r in runs]
            gaps = [float(np.mean(r["pass"]["1"])) - t["train accuracy"] for r, t in zip(runs, train)]
            row["held-out − train"] = bootstrap_runs(gaps)
            for name in TRAINING:
                values = [t[name] for t in train if np.isfinite(t.get(name, np.nan))]
                if name != "held-out − train" and len(values) == len(runs):
                    row[name] = bootstrap_runs(values)
        table[variant] = {"seeds": len(runs), **row}
    pairs = [(v, "grpo") for v in variants if v not in ("grpo", "warmstart") and "grpo" in variants]
    pairs += [pair for pair in PAIRS if set(pair) <= set(variants)]
    pairs += [(v, _base(v)) for v in variants if _base(v) != v and _base(v) in variants]  # a λ point may run alone
    diffs = {}
    for a, b in pairs:
        row = {name: bootstrap(per_problem(variants[a], key, k), per_problem(variants[b], key, k))
               for name, (key, k) in measures.items()}
        diffs[f"{a} − {b}"] = {name: ci | {"excludes_zero": excludes_zero(ci)} for name, ci in row.items()}
    times = {r["name"]: r["time"] for runs in variants.values() for r in runs}
    return {"measures": list(measures), "table": table, "differences": diffs, "times": times,
            "samples": int(n), "problems": len(next(iter(variants.values()))[0]["problem_ids"])}


def _cell(ci: dict | None, digits: int = 3) -> str:
    if ci is None:
        return ""
    return f"{ci['mean']:.{digits}f} [{ci['lo']:.{digits}f}, {ci['hi']:.{digits}f}]"


def markdown(summary: dict) -> str:
    measures, table = summary["measures"], summary["table"]
    head = ["variant", "seeds", *measures]
    lines = [f"Held-out: {summary['problems']} problems x {summary['samples']} samples at temperature 1; mean "
             "[95% bootstrap interval over seeds and problems].", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, row in table.items():
        lines.append(f"| {variant} | {row['seeds']} | " + " | ".join(_cell(row.get(m)) for m in measures) + " |")
    writes = [c.format(n=summary["samples"]) for c in WRITES]
    writes = [c for c in writes if all(c in row for row in table.values())]
    if writes:
        lines += ["", "What the policies write (held-out responses; interval over seeds and problems): the share "
                  "that are well-formed (Countdown: an expression of the given numbers; sum of products: step lines "
                  "and a box), for Countdown the share that use exactly two of the numbers, and how many different "
                  "responses a problem's samples hold.", "",
                  "| variant | " + " | ".join(writes) + " |", "|" + "---|" * (len(writes) + 1)]
        lines += [f"| {v} | " + " | ".join(_cell(row[c]) for c in writes) + " |" for v, row in table.items()]
    train_cols = [c for c in TRAINING if any(c in row for row in table.values())]
    lines += ["", "Training (interval over seeds): train accuracy is the rollouts' over the last "
              f"{LAST_STEPS} steps; A(...) is the mean advantage a single-class (or all-wrong) group gave its most "
              "or least novel response (g2rl only).", "", "| variant | " + " | ".join(train_cols) + " |",
              "|" + "---|" * (len(train_cols) + 1)]
    for variant, row in table.items():
        if variant != "warmstart":
            lines.append(f"| {variant} | " + " | ".join(_cell(row.get(c)) for c in train_cols) + " |")
    lines += ["", "Differences (first minus second; problems paired); **bold**: the interval excludes 0.", "",
              "| difference | " + " | ".join(measures) + " |", "|" + "---|" * (len(measures) + 1)]
    for name, row in summary["differences"].items():
        cells = [(f"**{_cell(row[m])}**" if row[m]["excludes_zero"] else _cell(row[m])) for m in measures]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Time (minutes, wall / CPU): the warm start's build (from its own record, whichever invocation "
              "built it), its evaluation, every run's training and evaluation, and all of it.", "",
              "| part | wall | CPU |", "|---|---|---|"]
    lines += [f"| {part} | {_minutes(t['wall_s'])} | {_minutes(t['cpu_s'])} |"
              for part, t in time_totals(summary).items()]
    lines += ["", "Time per run (s): training wall / CPU, evaluation wall / CPU.", "",
              "| run | train wall | train CPU | eval wall | eval CPU |", "|---|---|---|---|---|"]
    for name, t in summary["times"].items():
        if "train" in t:
            lines.append(f"| {name} | {t['train']['wall_s']:.0f} | {t['train']['cpu_s']:.0f} | "
                         f"{t['eval']['wall_s']:.0f} | {t['eval']['cpu_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _minutes(seconds) -> str:
    return "" if seconds is None else f"{seconds / 60:.1f}"


def time_totals(summary: dict) -> dict[str, dict]:
    """{part: {"wall_s", "cpu_s"}}: warm start build and evaluation, training and evaluation over all runs, total
    (None where a part did not record it: a build from before builds recorded their CPU time)."""
    warm = summary["times"].get("warmstart", {})
    runs = [t for t in summary["times"].values() if "train" in t]

    def add(parts):
        return {k: (None if any(p.get(k) is None for p in parts) else sum(p[k] for p in parts))
                for k in ("wall_s", "cpu_s")}

    out = {"warm start build": warm.get("build") or {"wall_s": None, "cpu_s": None},
           # "build_and_eval": the record of runs made before builds and evaluations were timed apart
           "warm start evaluation": warm.get("eval") or warm.get("build_and_eval") or {"wall_s": None, "cpu_s": None},
           f"training, {len(runs)} runs": add([t["train"] for t in runs]),
           f"evaluation, {len(runs)} runs": add([t["eval"] for t in runs])}
    return out | {"total": add(list(out.values()))}


def _pyplot():
    from g2rl_jax import figures  # pyplot on the Agg backend, as every figure of the project

    return figures.plt


def _colours(n: int) -> list:
    from g2rl_jax.figures import colours

    return colours(n)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def passk_figure(variants: dict[str, list[dict]], path: Path) -> Path:
    """pass@k, maj@k and distinct@k against k per variant: the mean over seeds and problems and its interval."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for (variant, runs), colour in zip(variants.items(), _colours(len(variants))):
        ks = [int(k) for k in runs[0]["ks"]]
        for ax, key in zip(axes, ("pass", "maj", "distinct")):
            cis = [bootstrap(per_problem(runs, key, str(k))) for k in ks]
            style = {"linestyle": "--", "color": "black"} if variant == "warmstart" else {"color": colour}
            ax.plot(ks, [c["mean"] for c in cis], marker="o", markersize=3, label=f"{variant} ({len(runs)})",
                    **style)
            ax.fill_between(ks, [c["lo"] for c in cis], [c["hi"] for c in cis], alpha=0.15, color=style["color"])
    for ax, title in zip(axes, ("pass@k", "maj@k (vote on the value)", "distinct correct answers among k")):
        ax.set(title=title, xlabel="k", xscale="log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    return _save(fig, path)


def tradeoff_figure(variants: dict[str, list[dict]], path: Path, earlier: dict[str, dict] | None = None) -> Path:
    """Held-out pass@1 against pass@n per variant, each with its 95% interval (seeds and problems resampled), the
    warm start marked: which methods trade breadth (pass@n) for accuracy (pass@1). `earlier` (earlier_rows): the
    variants of another report that this study did not run, drawn hollow beside them."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11.5, 6.5))
    n = str(next(iter(variants.values()))[0]["samples"])
    points = {v: (len(runs), bootstrap(per_problem(runs, "pass", "1")), bootstrap(per_problem(runs, "pass", n)), True)
              for v, runs in variants.items()}
    points |= {v: (row["seeds"], row["pass@1"], row[f"pass@{n}"], False) for v, row in (earlier or {}).items()
               if v not in variants}
    points = dict(sorted(points.items(), key=lambda kv: _order(kv[0])))
    for (variant, (seeds, x, y, here)), colour in zip(points.items(), _colours(len(points))):
        warm = variant == "warmstart"
        ax.errorbar(x["mean"], y["mean"], xerr=[[x["mean"] - x["lo"]], [x["hi"] - x["mean"]]],
                    yerr=[[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]], fmt="*" if warm else "o",
                    markersize=14 if warm else 6, color="black" if warm else colour, capsize=3,
                    markerfacecolor=None if here else "white",
                    label=f"{variant} ({seeds}{'' if here else ', earlier'})")
        ax.annotate(variant, (x["mean"], y["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        if warm:
            ax.axhline(y["mean"], color="grey", linewidth=0.8, linestyle="--")
            ax.axvline(x["mean"], color="grey", linewidth=0.8, linestyle="--")
    hollow = "; hollow: an earlier report's" if len(points) > len(variants) else ""
    ax.set(title=f"accuracy against breadth (held-out, 95% intervals; dashed: the warm start{hollow})",
           xlabel="pass@1", ylabel=f"pass@{n}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="variant (seeds)", title_fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def geometry_figure(variants: dict[str, list[dict]], path: Path) -> Path:
    """As the paper's geometry figure: the distribution of pairwise Φ cosines within a problem's responses
    (pooled over seeds), and the share of negative pairs with its interval."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    palette = ["black" if v == "warmstart" else c for v, c in zip(variants, _colours(len(variants)))]
    for (variant, runs), colour in zip(variants.items(), palette):
        hists = [r["geometry"]["gradient_cosine_histogram"] for r in runs]
        edges = np.asarray(hists[0]["edges"])
        counts = np.sum([h["counts"] for h in hists], axis=0).astype(np.float64)
        density = counts / max(counts.sum(), 1.0) / np.diff(edges)
        left.stairs(density, edges, color=colour, label=variant, linewidth=1.5)
    left.axvline(0.0, color="grey", linewidth=0.8, linestyle="--")
    left.set(title="gradient-space cosine (Φ) within a problem", xlabel="pairwise cosine similarity",
             ylabel="density")
    left.grid(alpha=0.3)
    cis = [bootstrap(per_problem(runs, "negative_ratio", None)) for runs in variants.values()]
    x = np.arange(len(variants))
    right.bar(x, [100 * c["mean"] for c in cis], color=palette)
    right.errorbar(x, [100 * c["mean"] for c in cis], yerr=[[100 * (c["mean"] - c["lo"]) for c in cis],
                                                            [100 * (c["hi"] - c["mean"]) for c in cis]],
                   fmt="none", ecolor="black", capsize=3)
    right.set(title="negative-similarity pairs", ylabel="share of pairs with cos < 0 (%)")
    right.set_xticks(x, list(variants), rotation=30, ha="right")
    left.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def write_report(out: Path, earlier: Path | None = None) -> list[Path]:
    """study.md, study.json and the three figures from the finished runs under OUT/runs; `earlier`: another
    study's report whose other variants tradeoff.png draws too (earlier_rows)."""
    variants = load_runs(out)
    if not variants:
        raise SystemExit(f"study error: no finished run under {out / 'runs'}; run the study first")
    summary = summarise(variants)
    md, js = out / "study.md", out / "study.json"
    md.write_text(markdown(summary))
    per_run = {r["name"]: {"variant": v, "seed": r["run"]["seed"], "training": r["training"],
                           "held_out_pass@1": float(np.mean(r["pass"]["1"])), "time": r["time"],
                           "responses": r["responses"]} for v, runs in variants.items() for r in runs}
    js.write_text(json.dumps(summary | {"runs": per_run}, indent=1) + "\n")
    rows = None if earlier is None else earlier_rows(earlier)
    return [md, js, passk_figure(variants, out / "passk.png"),
            tradeoff_figure(variants, out / "tradeoff.png", rows), geometry_figure(variants, out / "geometry.png")]
