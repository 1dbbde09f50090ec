"""The micro-batch shapes a run may meet: a small set, chosen by the whole run's time (compile + compute).

    sets = candidates(micro=16, min_rows=4, prompt_len=512, resp_len=8192)   # {name: micro.ShapeSet}
    load = step_load(sets, step_rows=256, mini_rows=32, epochs=1, prompt_len=512, resp_len=8192, budget=8192)
    pick = choose(sets, load, Prices(...), steps=1000, threads=32)           # Choice: the set and the table

The score and reference passes and the update run each micro-batch at one (rows, response width) shape, and each
shape is a program of each of the three kinds to compile. More shapes fit the response lengths more tightly (less
padding computed, train/micro.py), fewer compile faster. The candidates cross
    widths: micro.width_ladder with 4, 2 or 1 steps per octave
    rows:   "all" every halving of micro (micro.row_counts); "sparse" every other one (micro, micro/4, ...);
            "tokens" per width w one row count r(w), the most rows with r(w) x (S + w) <= micro x (S + T/8), and
            r(w)/4 (long rows come few at a time, so they get fewer rows per micro-batch); "single" r(w) alone
and `choose` takes the one of least estimated run time: the compile seconds of its programs spread over the
warm-up's threads, plus the steps left times the seconds a step computes. A step's compute is each kind's cost
units (micro.micro_cost summed over the plans train/micro.py cuts) over response lengths drawn long-tailed
(exponential with mean budget / 4, capped at the budget, the longest at it: `bench update --long-tail`'s),
priced at the measured seconds of one run of the kind's largest program per unit. The trainer measures those
prices on its first step (train/warmup.py); `plan --compile` takes them from the TPU compiler and the FLOP model.
A gradient program is priced from the score program's: GRADIENT_COMPILE times its compile seconds (measured:
4.68 / 1.33 s at the demo size on the 2-core CPU, 65.8 / 19.5 s for Qwen3-1.7B compiled for v5p-8) and 3
times its run (forward and backward; 4 with model.remat, which runs the forward again).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from g2rl_jax.train import micro as micro_lib

STEPS_PER_OCTAVE = (4, 2, 1)
ROWS = ("all", "sparse", "tokens", "single")
TOKENS_SHARE = 8  # "tokens": a micro-batch holds at most micro x (S + T / TOKENS_SHARE) positions at its r(w)
GRADIENT_COMPILE = 3.5  # a gradient program's compile seconds / its score program's (see the module docstring)
DRAWS = 4  # long-tailed steps the compute estimate averages over


def candidate(micro: int, min_rows: int, prompt_len: int, resp_len: int, steps: int, rows: str) -> micro_lib.ShapeSet:
    """One candidate set: widths at `steps` per octave, row counts by the `rows` rule (module docstring)."""
    counts = micro_lib.row_counts(micro, min_rows)
    widths = micro_lib.width_ladder(resp_len, steps)
    name = f"{steps}/octave x {rows}"
    if rows == "all":
        return micro_lib.ShapeSet.of([(r, w) for r in counts for w in widths], name)
    if rows == "sparse":
        return micro_lib.ShapeSet.of([(r, w) for r in counts[::2] for w in widths], name)
    budget = micro * (prompt_len + resp_len / TOKENS_SHARE)
    shapes = []
    for w in widths:
        i = next((i for i, r in enumerate(counts) if r * (prompt_len + w) <= budget), len(counts) - 1)
        shapes.append((counts[i], w))
        if rows == "tokens":
            shapes.append((counts[min(i + 2, len(counts) - 1)], w))
    return micro_lib.ShapeSet.of(shapes, name)


def candidates(micro: int, min_rows: int, prompt_len: int, resp_len: int) -> dict[str, micro_lib.ShapeSet]:
    """Every candidate (STEPS_PER_OCTAVE x ROWS), by name; sets that come out equal are listed once, under the
    first name (the finest)."""
    out: dict[str, micro_lib.ShapeSet] = {}
    for steps in STEPS_PER_OCTAVE:
        for rows in ROWS:
            s = candidate(micro, min_rows, prompt_len, resp_len, steps, rows)
            if all(s.widths != t.widths for t in out.values()):
                out[s.name] = s
    return out


def long_tailed_lengths(rows: int, budget: int, seed: int) -> np.ndarray:
    """Response lengths [rows]: exponential with mean budget / 4, in [1, budget], the longest at the budget."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.exponential(budget / 4, rows)), 1, budget).astype(int)
    lengths[np.argmax(lengths)] = budget
    return lengths


def step_load(sets: dict[str, micro_lib.ShapeSet], *, step_rows: int, mini_rows: int, epochs: int, prompt_len: int,
              budget: int) -> dict[str, dict[str, float]]:
    """{set name: {"score": units, "gradient": units}}: micro_cost units of one step's score pass (the reference
    pass is the same) and of its update (every mini-batch, every epoch), averaged over DRAWS long-tailed steps."""
    out = {}
    for name, shapes in sets.items():
        score = grads = 0.0
        for seed in range(DRAWS):
            lengths = long_tailed_lengths(step_rows, budget, seed)
            score += micro_lib.group(lengths, prompt_len, shapes)[2]
            for start in range(0, step_rows, mini_rows):
                grads += epochs * micro_lib.group(lengths[start:start + mini_rows], prompt_len, shapes)[2]
        out[name] = {"score": score / DRAWS, "gradient": grads / DRAWS}
    return out


@dataclasses.dataclass(frozen=True)
class Prices:
    """Seconds to compile one program of each kind (score, reference, gradient; reference absent without the KL
    term) and seconds of compute per micro_cost unit of each kind."""

    compile_s: dict[str, float]
    unit_s: dict[str, float]

    @classmethod
    def from_score(cls, compile_s: dict[str, float], run_s: dict[str, float], units: float,
                   remat: bool) -> "Prices":
        """From the compile and run seconds of the largest score (and reference) program, `units` its micro_cost;
        the gradient priced from the score program (module docstring)."""
        unit_s = {k: s / units for k, s in run_s.items()}
        unit_s["gradient"] = (3 + remat) * unit_s["score"]
        return cls({**compile_s, "gradient": GRADIENT_COMPILE * compile_s["score"]}, unit_s)


@dataclasses.dataclass(frozen=True)
class Estimate:
    name: str
    shapes: int  # (rows, width) shapes in the set
    programs: int  # programs to compile: shapes x kinds
    compile_s: float  # their compile seconds spread over the threads
    step_s: float  # compute seconds of one long-tailed step's score, reference and update passes
    run_s: float  # compile_s + steps x step_s


@dataclasses.dataclass(frozen=True)
class Choice:
    shapes: micro_lib.ShapeSet
    table: tuple[Estimate, ...]  # every candidate, in candidates() order

    def lines(self, steps: int) -> list[str]:
        """The table as the trainer and `plan --compile` print it: each candidate's programs, compile seconds, the
        padding it computes (step compute against the finest set's) and the estimated run time."""
        finest = self.table[0].step_s
        out = [f"{'micro-batch shapes':22s} {'shapes':>6s} {'programs':>8s} {'compile s':>9s} {'step s':>8s} "
               f"{'compute':>8s} {f'{steps} steps s':>12s}"]
        for e in self.table:
            mark = "  <- chosen" if e.name == self.shapes.name else ""
            out.append(f"{e.name:22s} {e.shapes:6d} {e.programs:8d} {e.compile_s:9.1f} {e.step_s:8.3f} "
                       f"{e.step_s / finest:7.3f}x {e.run_s:12.1f}{mark}")
        return out


def choose(sets: dict[str, micro_lib.ShapeSet], load: dict[str, dict[str, float]], prices: Prices, *, steps: int,
           threads: int) -> Choice:
    """The set of least estimated run time (module docstring); ties go to the fewer programs."""
    kinds = prices.compile_s.keys()
    table = []
    for name, shapes in sets.items():
        n = len(shapes.shapes)
        compile_s = n * sum(prices.compile_s.values()) / max(threads, 1)
        step_s = sum(load[name]["gradient" if k == "gradient" else "score"] * prices.unit_s[k] for k in kinds)
        table.append(Estimate(name, n, n * len(kinds), compile_s, step_s, compile_s + steps * step_s))
    best = min(table, key=lambda e: (e.run_s, e.programs))
    return Choice(sets[best.name], tuple(table))
