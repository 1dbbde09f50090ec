"""Time to first step: which programs the first steps of a run compile, and what that costs.

    meets = step_meets(cfg, shapes, lengths_B)       # names of the programs one step runs (programs.py's names)
    firsts = first_steps(cfg, shapes, steps=10)      # the programs each of the first steps compiles anew
    est = estimate(firsts[0], results)               # their compile seconds, from the compiled programs' seconds

A run compiles a program the first time it meets its shape. Which shapes a step meets depends on its response
lengths: the rollout's decode segments follow them (engine.decode_schedule, the decode loop's own rules), and so
do the micro-batches of the score and reference passes (over the step's responses) and of the gradient (over each
mini-batch), which train.micro.plan_micro cuts by length. `first_steps` draws each step's lengths from the
long-tailed distribution of `bench update --long-tail` (exponential with mean budget / 4, capped at the budget,
the longest of each step at the budget): a step of a long-tailed run at the budget, the worst case for the
segment ladder. Prompts are taken at the largest prompt bucket, as programs.py does; small programs (cache
moves, micro-batch gathers and scatters) are counted apart from the named ones.

The estimate prices each program met at its own compile seconds when it was compiled (`--programs all`), else at
the seconds of the compiled program of its kind (`--programs largest`: an estimate, labelled as such), and gives
both the one-at-a-time sum (what the step pays without a warm-up) and the step with the warm-ups on N threads:
rollout/prewarm.py compiles every reachable decode segment right after the prefill (when they fit in
prewarm.ROUNDS rounds of N; else the segments the step meets compile one at a time), train/warmup.py the score,
reference and update programs after the rollout; in each, the lowering (which holds the GIL) summed and the
compiles spread over the threads, never less than the longest.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from g2rl_jax.aot.programs import StepShapes
from g2rl_jax.config import Config
from g2rl_jax.rollout import engine, prewarm
from g2rl_jax.rollout.batching import new_tokens_bucket
from g2rl_jax.train import micro as micro_lib

ONCE = ("optimizer init", "decode weights", "advantages (novelty, shaping, groups)", "optimizer step")
WARMED = ("score", "reference", "gradient", "advantages", "apply")  # kinds train/warmup.py compiles concurrently


@dataclasses.dataclass(frozen=True)
class StepMeets:
    """The programs one step runs: `names` as programs.step_programs names them; `small` the shapes of the small
    programs it runs (cache moves, the micro-batches' gathers and scatters)."""

    names: frozenset[str]
    small: frozenset[tuple]


def long_tailed_lengths(rows: int, budget: int, seed: int) -> np.ndarray:
    from g2rl_jax.bench.update import long_tailed_lengths as draw

    return draw(rows, budget, seed)


def _plan_shapes(lengths_B: np.ndarray, width: int, micro: int, shards: int) -> set[tuple[int, int]]:
    mask = np.arange(width)[None] < lengths_B[:, None]
    plan = micro_lib.plan_micro(mask, micro, min_rows=shards)
    return {(len(rows), w) for rows, w in zip(plan.rows, plan.widths)}


def step_meets(cfg: Config, s: StepShapes, lengths_B: np.ndarray) -> StepMeets:
    """The programs a step whose s.step_rows responses have lengths_B tokens runs (group-major rows, as the
    trainer's batch; mini-batches are consecutive rows)."""
    algo, shards = cfg.algorithm, s.shards
    budget = cfg.rollout.max_new_tokens
    names = {*ONCE, f"prefill {s.prompts} prompts x {s.prompt_len} tokens", f"first token of {s.rows} samples"}
    segments = engine.decode_schedule(lengths_B, s.rows, budget, shards)
    names |= {f"decode segment {rows} rows x {capacity} slots" for rows, capacity in segments}
    small = {("regroup", a, b) for a, b in zip(segments, segments[1:])}
    small |= {("live_rows", a[0], b[0]) for a, b in zip(segments, segments[1:]) if b[0] < a[0]}
    width = min(new_tokens_bucket(int(lengths_B.max())), s.new_tokens)  # the step batch's response width T
    score = _plan_shapes(lengths_B, width, algo.micro_batch_size, shards)
    passes = ("score", "reference") if algo.kl_coef > 0 else ("score",)
    names |= {f"{kind} {rows} rows x {w} tokens" for kind in passes for rows, w in score}
    grads = set()
    for start in range(0, len(lengths_B), algo.mini_batch_size):
        grads |= _plan_shapes(lengths_B[start:start + algo.mini_batch_size], width, algo.micro_batch_size, shards)
    names |= {f"gradient {rows} rows x {w} tokens" for rows, w in grads}
    small |= {("take", rows, w) for rows, w in score | grads} | {("put", rows, w) for rows, w in score}
    if algo.exploration == "evol":
        width = 1 << (algo.embedding_max_tokens - 1).bit_length()
        names.add(f"EVOL embedder {s.step_rows} responses x {width} tokens")
    return StepMeets(frozenset(names), frozenset(small))


def first_steps(cfg: Config, s: StepShapes, steps: int = 10, seed: int = 0) -> list[StepMeets]:
    """What each of the first `steps` steps compiles anew (step i's responses drawn with seed + i)."""
    seen_names, seen_small, out = set(), set(), []
    for i in range(steps):
        meets = step_meets(cfg, s, long_tailed_lengths(s.step_rows, cfg.rollout.max_new_tokens, seed + i))
        out.append(StepMeets(meets.names - seen_names, meets.small - seen_small))
        seen_names |= meets.names
        seen_small |= meets.small
    return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    programs: int  # named programs met
    small: int  # small programs met
    serial_s: float  # compile seconds, one program at a time (lowering included)
    warm_s: dict[int, float]  # threads -> seconds with the warm-ups (decode segments; score, reference, update)
    unwarmed_segments_s: dict[int, float]  # the same without the decode segments' (they compile when met)
    measured: bool  # every named program's seconds were its own (else some were priced by their kind)
    by_kind: dict[str, int]  # programs met per kind


def _pool(programs, threads: int) -> float:
    """Seconds to lower `programs` (report.Results) one at a time and compile them on `threads` threads."""
    compile_s = [r.seconds - r.lower_seconds for r in programs]
    return sum(r.lower_seconds for r in programs) + max(max(compile_s, default=0.0), sum(compile_s) / threads)


def estimate(meets: StepMeets, results, threads=(8, 32), segments: int = 0) -> Estimate:
    """Compile seconds of the programs `meets` names, from `results` (report.Result of the compiled programs):
    each program's own seconds, or its kind's (the most expensive compiled program of that kind); `segments`: the
    decode segments a run can reach (rollout/prewarm.py compiles them all, with enough threads)."""
    by_name = {r.program.name: r for r in results if r.error is None}
    by_kind: dict[str, object] = {}
    for r in by_name.values():
        if r.program.kind not in by_kind or r.seconds > by_kind[r.program.kind].seconds:
            by_kind[r.program.kind] = r
    names = {n: by_name.get(n) for n in meets.names}
    kinds = {n: (r.program.kind if r else _kind(n)) for n, r in names.items()}
    measured = all(r is not None for r in names.values())
    seconds = {n: (r or by_kind.get(kinds[n])) for n, r in names.items()}
    seconds = {n: r for n, r in seconds.items() if r is not None}
    small = by_kind.get("regroup")
    small_s = len(meets.small) * (small.seconds if small else 0.0)
    serial = sum(r.seconds for r in seconds.values()) + small_s
    warmed = [r for n, r in seconds.items() if kinds[n] in WARMED]
    met_segments = [r for n, r in seconds.items() if kinds[n] == "segment"]
    rest = serial - sum(r.seconds for r in warmed) - sum(r.seconds for r in met_segments)
    reachable = [by_kind["segment"]] * segments if "segment" in by_kind else []
    met_s = sum(r.seconds for r in met_segments)
    unwarmed = {n: rest + _pool(warmed, n) + met_s for n in threads}
    warm = {n: unwarmed[n] - met_s + _pool(reachable, n) if 0 < segments <= prewarm.ROUNDS * n else unwarmed[n]
            for n in threads}
    counts: dict[str, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    return Estimate(len(meets.names), len(meets.small), serial, warm, unwarmed, measured, counts)


def _kind(name: str) -> str:
    """The kind of a program name (programs.py's names)."""
    for prefix, kind in (("decode segment", "segment"), ("score", "score"), ("reference", "reference"),
                         ("gradient", "gradient"), ("prefill", "prefill"), ("first token", "start"),
                         ("decode weights", "decode_layers"), ("advantages", "advantages"),
                         ("optimizer init", "init"), ("optimizer step", "apply"), ("EVOL", "embed")):
        if name.startswith(prefix):
            return kind
    raise ValueError(f"no program kind for {name!r}")


def reachable(cfg: Config, s: StepShapes) -> dict[str, int]:
    """Programs a run can reach, per kind (programs.step_programs(scope="all") lists them)."""
    shapes = len(s.micro_rows) * len(s.widths)
    counts = {"init": 1, "prefill": 1, "start": 1, "decode_layers": 1, "segment": len(s.buckets) * len(s.capacities),
              "regroup": int(len(s.capacities) > 1), "score": shapes, "reference": shapes * (cfg.algorithm.kl_coef > 0),
              "advantages": 1, "gradient": shapes, "apply": 1, "embed": int(cfg.algorithm.exploration == "evol")}
    return {k: n for k, n in counts.items() if n}


def report_lines(cfg: Config, s: StepShapes, results, scope: str, threads=(8, 32), steps: int = 10) -> list[str]:
    """Time to first step and the programs a run can reach, for the compile command's report."""
    by_kind: dict[str, object] = {}
    for r in results:
        if r.error is None and (r.program.kind not in by_kind or r.seconds > by_kind[r.program.kind].seconds):
            by_kind[r.program.kind] = r
    counts = reachable(cfg, s)
    if scope == "all":
        run = f"{sum(r.seconds for r in results):,.0f} s, compiled here"
    else:
        priced = sum(n * by_kind[k].seconds for k, n in counts.items() if k in by_kind)
        run = f"~{priced:,.0f} s, an ESTIMATE at the seconds of each kind's program above"
    firsts = first_steps(cfg, s, steps)
    est = estimate(firsts[0], results, threads, segments=counts.get("segment", 0))
    label = "" if est.measured else ", an ESTIMATE at the seconds of each kind's program above"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(est.by_kind.items(), key=lambda kv: -kv[1]))
    warm = " / ".join(f"~{sec:,.0f} s on {n} threads" for n, sec in est.warm_s.items())
    unwarmed = " / ".join(f"~{sec:,.0f} s" for sec in est.unwarmed_segments_s.values())
    later = ", ".join(str(len(m.names)) for m in firsts[1:])
    return [f"programs a run can reach: {sum(counts.values())} ({run})",
            f"time to first step: a step of long-tailed responses (bench update --long-tail's lengths: mean "
            f"{cfg.rollout.max_new_tokens // 4}, the longest at the budget) compiles {est.programs} programs ({kinds}) "
            f"and {est.small} small ones: ~{est.serial_s:,.0f} s one at a time{label}; with the warm-ups "
            f"(rollout/prewarm.py: all {counts.get('segment', 0)} reachable decode segments when they fit in "
            f"{prewarm.ROUNDS} rounds of the threads; train/warmup.py: the score, reference and update programs): "
            f"{warm} (without the decode segments' warm-up: {unwarmed})",
            f"the next {steps - 1} steps compile {later} more programs each (new shapes)"]
