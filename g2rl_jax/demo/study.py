"""The study of exploration methods on generated tasks: one command runs the grid and writes the report.

    python -m g2rl_jax.demo.study --out runs/study                    # the whole grid, then the report
    python -m g2rl_jax.demo.study --out runs/study --report-only      # the report of the runs finished so far
    python -m g2rl_jax.demo.study --task sumprod --out runs/study_sumprod --best-from runs/study   # the second task
    python -m g2rl_jax.demo.study --out runs/study --report-only --earlier-report docs/study.md  # + earlier rows
    python -m g2rl_jax.demo.study --out /tmp/s --variants grpo,g2rl_shaped --seeds 1 --lambda-seeds 0 \\
        --problems 8 --samples 4 run.total_steps=2                    # key=value: overrides for every run

The grid: every variant of VARIANTS (GRPO and the G2RL paper's baselines, G2RL with single_class_groups shaped and
zero, the published alternatives of docs/peers.md at their papers' settings, the two G2RL variants that follow
the first study's diagnosis, and the methods that target single-class groups: Miner and G2RL's novelty added after
the standardisation) with seeds 0 .. --seeds−1, seeds interleaved (seed 0 of every variant first); then, for
whichever of g2rl_shaped and g2rl_zero has the higher mean held-out pass@1 (ties: shaped, the paper's equations),
λ ∈ LAMBDAS besides the config's 0.5 with seeds 0 .. --lambda-seeds−1. A run is the real training command
(`g2rl_jax.train.command.main` with the task's config and the run's overrides: run.seed = data.shuffle_seed = seed)
followed by its held-out evaluation (`evaluate`: n samples per problem at temperature 1 from the final checkpoint,
judged by the task's own checker; pass@k, distinct@k, maj@k per problem; the pairwise cosines of Φ of the first
`--geometry-samples` responses per problem, as `g2rl_jax.analyze` takes them). The warm start is built (once,
with a progress bar) and evaluated the same way. Each run leaves OUT/runs/NAME/ (the training run) with
study_eval.json; a run that has one is skipped when the command is started again (`--reevaluate`: evaluated again,
its training kept), and an interrupted run resumes from its last checkpoint.
Tasks (TASKS): `countdown` (configs/study_countdown.yaml, 16-token answers) and `sumprod`, a sum of products
worked out in 71-83 tokens (configs/study_sumprod.yaml); for the second, `--best-from STUDY_DIR` runs GRPO, the
peer and the gradient-guided variant with the highest mean held-out pass@n in that finished study, 3 seeds each.
Per run it records wall and CPU seconds of training and of evaluation (process CPU time of this process, threads
included, plus that of children that ended; the reward worker processes keep running, so their share is missing),
and for the warm start its build's (from the build's own record, whichever invocation built it).
At the end `g2rl_jax.demo.study_report.write_report` writes OUT/study.md, OUT/study.json, OUT/passk.png,
OUT/tradeoff.png and OUT/geometry.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

VARIANTS: dict[str, tuple[str, ...]] = {
    "grpo": ("algorithm.exploration=grpo",),
    "entropy_bonus": ("algorithm.exploration=entropy_bonus", "algorithm.entropy_coef=0.01"),
    "g2rl_shaped": ("algorithm.exploration=g2rl", "algorithm.single_class_groups=shaped"),
    "g2rl_zero": ("algorithm.exploration=g2rl", "algorithm.single_class_groups=zero"),
    # the published alternatives (docs/peers.md), each at its paper's settings
    "clip_cov": ("algorithm.exploration=clip_cov",),
    "kl_cov": ("algorithm.exploration=kl_cov",),
    "passk": ("algorithm.exploration=passk",),
    "unlikeliness": ("algorithm.exploration=unlikeliness",),
    "nsr": ("algorithm.exploration=nsr",),
    "w_reinforce": ("algorithm.exploration=w_reinforce",),
    "forking": ("algorithm.exploration=forking",),
    # gradient-guided variants that follow the first study's diagnosis (docs/peers.md)
    "g2rl_mixed_correct": ("algorithm.exploration=g2rl_mixed_correct",),
    "g2rl_correct_peers": ("algorithm.exploration=g2rl_correct_peers", "algorithm.single_class_groups=zero"),
    # the methods that target single-class groups (docs/peers.md): Miner, and G2RL's novelty term added after the
    # group standardisation (ExTra's placement) in the paper's two readings of eq. scale
    "miner": ("algorithm.exploration=miner",),
    "g2rl_after_text": ("algorithm.exploration=g2rl", "algorithm.novelty_placement=advantage",
                        "algorithm.shaping_mode=text"),
    "g2rl_after_literal": ("algorithm.exploration=g2rl", "algorithm.novelty_placement=advantage",
                           "algorithm.shaping_mode=literal"),
    # the same with single-class groups zeroed: how much of its effect comes from those groups
    "g2rl_after_literal_mixed": ("algorithm.exploration=g2rl", "algorithm.novelty_placement=advantage",
                                 "algorithm.shaping_mode=literal", "algorithm.single_class_groups=zero"),
}
G2RL_VARIANTS = ("g2rl_shaped", "g2rl_zero")  # the pair the λ points follow
PEERS = ("entropy_bonus", "clip_cov", "kl_cov", "passk", "unlikeliness", "nsr", "w_reinforce", "forking")
# --best-from chooses among PEERS and GRADIENT_GUIDED (the first grid's families)
GRADIENT_GUIDED = ("g2rl_shaped", "g2rl_zero", "g2rl_mixed_correct", "g2rl_correct_peers")
# the methods that target single-class groups, and the control that zeroes those groups
SINGLE_CLASS = ("miner", "g2rl_after_text", "g2rl_after_literal", "g2rl_after_literal_mixed")
LAMBDAS = (0.25, 1.0)
EVAL_FILE = "study_eval.json"
TIME_FILE = "study_time.json"
WARM_START = "warmstart"
EVAL_SEED = 0  # the same sampling seed for every policy: the held-out draws differ only through the policy


@dataclasses.dataclass(frozen=True)
class Task:
    """A study task: its config, the checker that judges held-out responses (explore_eval.judge's answer shape),
    the evaluation's response budget and the default seeds."""

    config: str
    judge: str  # "module:function"
    max_new_tokens: int
    seeds: int
    lambda_seeds: int
    problems: int  # held-out problems evaluated (32 samples of up to max_new_tokens each)


TASKS = {"countdown": Task("configs/study_countdown.yaml", "g2rl_jax.demo.explore_eval:judge", 16, 5, 3, 512),
         # 256 held-out problems: 32 samples of ~80 tokens for 512 would cost ~4 min of CPU per run
         "sumprod": Task("configs/study_sumprod.yaml", "g2rl_jax.demo.sumprod:judge", 128, 3, 0, 256)}


@dataclasses.dataclass(frozen=True)
class Run:
    variant: str  # a VARIANTS name, or "<g2rl variant>_lam<λ>"
    seed: int
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.variant}_s{self.seed}"


def grid(variants: Sequence[str], seeds: int) -> list[Run]:
    """Every variant x seed, seed-major (seed 0 of every variant, then seed 1, ...)."""
    return [Run(v, s, variant_overrides(v)) for s in range(seeds) for v in variants]


def lambda_runs(better: str, lambdas: Sequence[float], seeds: int) -> list[Run]:
    return [Run(f"{better}_lam{lam:g}", s, variant_overrides(f"{better}_lam{lam:g}"))
            for s in range(seeds) for lam in lambdas]


def best_variants(study: Path) -> tuple[str, str]:
    """(the peer, the gradient-guided variant) with the highest mean held-out pass@n over its finished runs in the
    study at `study` (pass@n: n the samples per problem that study drew; λ points count as gradient-guided)."""
    scores: dict[str, list[float]] = {}
    for path in sorted((study / "runs").glob(f"*/{EVAL_FILE}")):
        result = json.loads(path.read_text())
        scores.setdefault(result["run"]["variant"], []).append(float(np.mean(result["pass"][str(result["samples"])])))
    def best(family: Sequence[str]) -> str:
        means = {v: float(np.mean(x)) for v, x in scores.items() if v in family or v.split("_lam")[0] in family}
        if not means:
            raise SystemExit(f"study error: {study} has no finished run of {', '.join(family)}; run that study first "
                             "(or name --variants yourself)")
        return max(means, key=means.get)
    return best(PEERS), best(GRADIENT_GUIDED)


def variant_overrides(variant: str) -> tuple[str, ...]:
    """A VARIANTS entry, or a λ point of one ("g2rl_zero_lam0.25")."""
    base, _, lam = variant.partition("_lam")
    return VARIANTS[variant] if not lam else (*VARIANTS[base], f"algorithm.lam={lam}")


def better_g2rl(pass1_by_variant: dict[str, list[float]]) -> str:
    """The g2rl variant with the higher mean held-out pass@1 over its seeds (ties, or missing runs: shaped)."""
    means = {v: float(np.mean(pass1_by_variant[v])) for v in G2RL_VARIANTS if pass1_by_variant.get(v)}
    if len(means) < 2:
        return "g2rl_shaped" if "g2rl_shaped" in means or not means else next(iter(means))
    return "g2rl_zero" if means["g2rl_zero"] > means["g2rl_shaped"] else "g2rl_shaped"


# ------------------------------------------------------------------------------------------------ measuring
class Clock:
    """Wall and CPU seconds since creation: CPU = this process (all threads) + its children that ended."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def read(self) -> dict[str, float]:
        return {"wall_s": round(time.perf_counter() - self.wall, 1), "cpu_s": round(self._cpu() - self.cpu, 1)}


def evaluate(model, tokenizer, examples, *, samples: int, geometry_samples: int, max_new_tokens: int,
             batch_size: int, judge=None) -> dict:
    """Held-out measures of one policy: per problem (lists in `examples` order) c, pass@k, distinct@k, maj@k for
    k in sample_ks(samples), the shares of valid and two-number responses and the number of different ones
    (explore_eval.problem_record), the mean cosine and negative-pair share of Φ among its first geometry_samples
    responses; the pooled geometry (analyze.geometry_stats); the truncated share; a few responses to read."""
    from g2rl_jax.analyze import geometry_stats, pairwise_cosines
    from g2rl_jax.demo.explore_eval import problem_record, sample
    from g2rl_jax.eval import sample_ks

    texts, truncated, phi_PxmxD = sample(model, tokenizer, examples, samples=samples, max_new_tokens=max_new_tokens,
                                         batch_size=batch_size, seed=EVAL_SEED, phi_samples=geometry_samples)
    records = [problem_record(t, ex.row, seed=EVAL_SEED, judge=judge) for t, ex in zip(texts, examples)]
    cos_PxY = pairwise_cosines(phi_PxmxD)
    ks = sample_ks(samples)
    return {"problem_ids": [ex.id for ex in examples], "samples": samples, "ks": ks,
            "correct": [r["c"] for r in records],
            **{name: {str(k): [r[name][k] for r in records] for k in ks} for name in ("pass", "distinct", "maj")},
            **{name: [r[name] for r in records] for name in ("valid", "two_numbers", "unique") if name in records[0]},
            "cosine_mean": cos_PxY.mean(1).tolist(), "negative_ratio": (cos_PxY < 0).mean(1).tolist(),
            "geometry": geometry_stats(cos_PxY), "truncated_fraction": float(np.mean(truncated)),
            "responses": {ex.problem: texts[i][:8] for i, ex in enumerate(examples[:6])}}


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)  # a kill mid-write never leaves a half file that would count as finished


def evaluate_dir(out: Path, model_or_run: Path, *, is_run: bool, examples, args) -> dict:
    from g2rl_jax.data.tokenizer import load_tokenizer

    if is_run:
        from g2rl_jax.train.checkpoint import load_policy

        model, tokenizer_dir = load_policy(model_or_run)
    else:
        from g2rl_jax.model import load_pretrained

        model, tokenizer_dir = load_pretrained(model_or_run, "float32"), model_or_run
    module, name = TASKS[args.task].judge.split(":")
    return evaluate(model, load_tokenizer(tokenizer_dir), examples, samples=args.samples,
                    geometry_samples=args.geometry_samples, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, judge=getattr(importlib.import_module(module), name))


# ------------------------------------------------------------------------------------------------ the command
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.demo.study", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/study"))
    p.add_argument("--task", choices=tuple(TASKS), default="countdown", help="which generated task (see TASKS)")
    p.add_argument("--config", type=Path, default=None, help="the task's config (default: TASKS' for --task)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--best-from", type=Path, default=None,
                   help="a finished study: run grpo, its best peer and its best gradient-guided variant (pass@n)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: 5, sumprod 3)")
    p.add_argument("--lambdas", default=",".join(f"{x:g}" for x in LAMBDAS), help="λ points besides the config's")
    p.add_argument("--lambda-seeds", type=int, default=None, help="seeds per λ point (0: none; default 3, sumprod 0)")
    p.add_argument("--problems", type=int, default=None,
                   help="held-out problems, the first N of the test split (default: 512, sumprod 256)")
    p.add_argument("--samples", type=int, default=32, help="n: responses per held-out problem (pass@k up to n)")
    p.add_argument("--geometry-samples", type=int, default=8, help="responses per problem whose Φ cosines are taken")
    p.add_argument("--max-new-tokens", type=int, default=None, help="evaluation budget (default: 16, sumprod 128)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call in the evaluation")
    p.add_argument("--report-only", action="store_true", help="write the report from the finished runs only")
    p.add_argument("--earlier-report", type=Path, default=None,
                   help="another study's study.md: tradeoff.png also draws its variants this study did not run")
    p.add_argument("--reevaluate", action="store_true",
                   help="evaluate finished runs again (after a change to the evaluation); their training is kept")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    args = p.parse_args(argv)
    task = TASKS[args.task]
    for name, value in (("config", Path(task.config)), ("seeds", task.seeds), ("lambda_seeds", task.lambda_seeds),
                        ("max_new_tokens", task.max_new_tokens), ("problems", task.problems)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.best_from is not None and args.variants is not None:
        p.error("--best-from chooses the variants; drop --variants (or --best-from)")
    if args.earlier_report is not None and not args.earlier_report.is_file():
        p.error(f"--earlier-report {args.earlier_report}: no such file; name a study's study.md")
    if args.best_from is not None and not (args.best_from / "runs").is_dir():
        p.error(f"--best-from {args.best_from}: no finished study there (no runs/); run that study first")
    variants = [v for v in (args.variants or ",".join(VARIANTS)).split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {unknown or 'empty list'}; choose from {', '.join(VARIANTS)}")
    args.variants = variants
    try:
        args.lambdas = [float(x) for x in args.lambdas.split(",") if x]
    except ValueError:
        p.error(f"--lambdas must be comma-separated numbers, got {args.lambdas!r}")
    for name in ("seeds", "problems", "samples", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lambda_seeds < 0 or not 2 <= args.geometry_samples <= args.samples:
        p.error("--lambda-seeds must be >= 0 and --geometry-samples in [2, --samples]")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"overrides must be key=value, got {bad}")
    return args


def _train(run: Run, run_dir: Path, args) -> int:
    from g2rl_jax.train.command import main as train_main

    return train_main(["--config", str(args.config), *run.overrides, f"run.seed={run.seed}",
                       f"data.shuffle_seed={run.seed}", *args.overrides, f"run.output_dir={run_dir}"])


def _finished_pass1(out: Path, runs: Sequence[Run]) -> dict[str, list[float]]:
    by_variant: dict[str, list[float]] = {}
    for run in runs:
        path = out / "runs" / run.name / EVAL_FILE
        if path.is_file():
            by_variant.setdefault(run.variant, []).append(float(np.mean(json.loads(path.read_text())["pass"]["1"])))
    return by_variant


def do_run(run: Run, index: int, total: int, out: Path, examples, args, started: float) -> None:
    run_dir = out / "runs" / run.name
    finished = (run_dir / EVAL_FILE).is_file()
    if finished and not args.reevaluate:
        print(f"[{index}/{total}] {run.name}: done earlier, skipped", flush=True)
        return
    if finished:  # evaluated again with the current evaluation code; the training and its time are kept
        timing = json.loads((run_dir / TIME_FILE).read_text())
    else:
        print(f"[{index}/{total}] {run.name}: training ({' '.join(run.overrides)})", flush=True)
        clock = Clock()
        code = _train(run, run_dir, args)
        if code != 0:
            raise SystemExit(f"study error: training {run.name} exited with {code}; fix the cause above and rerun "
                             "the same command (finished runs are kept and skipped)")
        timing = {"train": clock.read()}
    print(f"[{index}/{total}] {run.name}: evaluating {len(examples)} held-out problems x {args.samples}", flush=True)
    clock = Clock()
    result = evaluate_dir(out, run_dir, is_run=True, examples=examples, args=args)
    timing["eval"] = clock.read()
    _write_json(run_dir / TIME_FILE, timing)
    _write_json(run_dir / EVAL_FILE, {"run": dataclasses.asdict(run), **result})
    print(f"[{index}/{total}] {run.name}: held-out pass@1 {np.mean(result['pass']['1']):.3f}; train "
          f"{timing['train']['wall_s']:.0f} s wall / {timing['train']['cpu_s']:.0f} s CPU, eval "
          f"{timing['eval']['wall_s']:.0f} s / {timing['eval']['cpu_s']:.0f} s; study so far "
          f"{(time.perf_counter() - started) / 60:.1f} min", flush=True)


def build_time(model_dir: Path) -> dict:
    """Wall and CPU seconds of the warm start's build, from the build's own record (demo_build.json; CPU only for
    builds that recorded it); {} for a model directory that is no demo build."""
    marker = model_dir / "demo_build.json"
    if not marker.is_file():
        return {}
    record = json.loads(marker.read_text())
    return {"wall_s": record.get("build_seconds"), "cpu_s": record.get("build_cpu_seconds")}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from g2rl_jax.config import ConfigError, load_config
    from g2rl_jax.data import load_dataset
    from g2rl_jax.demo.build import resolve_demo_paths
    from g2rl_jax.demo.study_report import write_report

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        try:
            cfg = load_config(args.config, list(args.overrides))
        except (ConfigError, FileNotFoundError) as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        if args.best_from is not None:
            peer, guided = best_variants(args.best_from)
            args.variants = ["grpo", peer, guided]
            print(f"from {args.best_from}: the best peer is {peer}, the best gradient-guided variant {guided} "
                  "(highest mean held-out pass@n)", flush=True)
        started = time.perf_counter()
        print(f"study of {args.task} ({args.config}) in {args.out}: {len(args.variants)} variants x {args.seeds} "
              "seeds; the warm start first (built once, then reused)", flush=True)
        model_dir, _ = resolve_demo_paths(cfg.model.path, None)  # builds the warm start once, with a progress bar
        examples = load_dataset(cfg.data.eval_datasets[0])[:args.problems]
        warm = args.out / "runs" / WARM_START
        warm.mkdir(parents=True, exist_ok=True)
        timing = json.loads((warm / TIME_FILE).read_text()) if (warm / TIME_FILE).is_file() else {}
        timing["build"] = build_time(Path(model_dir))
        if args.reevaluate or not (warm / EVAL_FILE).is_file():
            print(f"warm start {model_dir}: evaluating {len(examples)} held-out problems x {args.samples}", flush=True)
            clock = Clock()
            result = evaluate_dir(args.out, Path(model_dir), is_run=False, examples=examples, args=args)
            timing["eval"] = clock.read()
            _write_json(warm / EVAL_FILE, {"run": {"variant": WARM_START, "seed": 0, "overrides": []}, **result})
        _write_json(warm / TIME_FILE, timing)
        runs = grid(args.variants, args.seeds)
        lam_count = len(args.lambdas) * args.lambda_seeds if set(G2RL_VARIANTS) & set(args.variants) else 0
        total = len(runs) + lam_count
        for i, run in enumerate(runs, start=1):
            do_run(run, i, total, args.out, examples, args, started)
        if lam_count:
            better = better_g2rl(_finished_pass1(args.out, runs))
            print(f"lambda points for {better} (the g2rl variant with the higher mean held-out pass@1)", flush=True)
            for i, run in enumerate(lambda_runs(better, args.lambdas, args.lambda_seeds), start=len(runs) + 1):
                do_run(run, i, total, args.out, examples, args, started)
        print(f"study: {(time.perf_counter() - started) / 60:.1f} min wall for this invocation", flush=True)
    paths = write_report(args.out, args.earlier_report)
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
