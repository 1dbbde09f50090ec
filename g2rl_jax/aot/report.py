"""Compile a step's programs for a Target, read the compiler's memory per chip, and give one verdict.

    results = compile_programs(programs, progress=print)   # one line per program as it finishes
    text = report(cfg, model, target, mesh, results)       # the table, planner vs compiler, time, the verdict

A program's bytes per chip are the compiler's: arguments + outputs − donated aliases + temporaries + code. Its
total adds `Program.resident`, the run state alive beside it (see programs.py); the verdict compares the largest
total with `plan.USABLE_FRACTION` of the chip's HBM, as the planner does. A compile error that mentions
resource_exhausted or hbm counts as out of memory (the TPU compiler's way of saying so), any other as a failure.
The compiler's own cost analysis is not used for time (on TPU its optimal_seconds can be negative, and it counts a
loop body once): the step-time line is an estimate from the FLOP model (shapes.prices.train_flops) at a stated MFU.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from g2rl_jax.aot.programs import PHASES, Program
from g2rl_jax.aot.targets import GiB, Target
from g2rl_jax.compile_pool import Timing, compile_all
from g2rl_jax.shapes.prices import ESTIMATE_MFU, train_flops
from g2rl_jax.shapes.step import StepShapes

__all__ = ["ESTIMATE_MFU", "Result", "compile_programs", "phase_peaks", "planner_rows", "step_time_estimate", "table"]

KERNEL_MARK = "tpu_custom_call"  # a Mosaic (Pallas TPU) kernel in compiled HLO
OOM_MARKS = ("resource_exhausted", "hbm")


@dataclasses.dataclass(frozen=True)
class Result:
    program: Program
    seconds: float  # wall clock, lowering and compiling
    cpu_seconds: float  # this process's CPU time (threads summed) meanwhile: its own when compiled one at a time
    error: str | None = None  # the compiler's first error line
    argument: int = 0
    output: int = 0
    alias: int = 0
    temp: int = 0
    code: int = 0
    kernels: int = 0  # Pallas kernel calls in the compiled program
    lower_seconds: float = 0.0  # of `seconds`, the lowering (Python: holds the GIL)

    @property
    def oom(self) -> bool:
        return self.error is not None and any(m in self.error.lower() for m in OOM_MARKS)

    @property
    def bytes(self) -> int:
        """The program's own bytes per chip."""
        return self.argument + self.output - self.alias + self.temp + self.code

    @property
    def total(self) -> int:
        """The chip's use while it runs: its bytes and the run state resident beside it."""
        return self.bytes + self.program.resident


def _result(program: Program, t: Timing, mark: str) -> Result:
    seconds = t.lower_s + t.compile_s
    if t.error is not None:
        lines = [line.strip() for line in str(t.error).splitlines() if line.strip()] or [type(t.error).__name__]
        return Result(program, seconds, t.cpu_s, error=lines[0][:300], lower_seconds=t.lower_s)
    stats = t.compiled.memory_analysis()
    return Result(program, seconds, t.cpu_s, argument=stats.argument_size_in_bytes, output=stats.output_size_in_bytes,
                  alias=stats.alias_size_in_bytes, temp=stats.temp_size_in_bytes,
                  code=stats.generated_code_size_in_bytes, kernels=t.compiled.as_text().count(mark),
                  lower_seconds=t.lower_s)


def compile_programs(programs: list[Program], progress: Callable[[str], None] | None = None,
                     threads: int = 1, mark: str = KERNEL_MARK) -> list[Result]:
    """Compile the programs on `threads` threads (train.compile_all); `progress` gets one line per program
    as it finishes. With more than one thread a program's CPU seconds overlap the others'. `mark` is how the
    target's fused kernel appears in compiled HLO (Target.kernel_mark)."""
    count = [0]

    def done(i: int, t: Timing) -> Result:
        r = _result(programs[i], t, mark)  # the executable is dropped here: a run's hundreds would not fit in memory
        count[0] += 1
        if progress is not None:
            state = f"{r.total / GiB:7.2f} GiB/chip" if r.error is None else ("OUT OF MEMORY" if r.oom else "FAILED")
            progress(f"[{count[0]:>{len(str(len(programs)))}}/{len(programs)}] {programs[i].name:48s} "
                     f"{r.seconds:6.1f} s ({r.cpu_seconds:.1f} s CPU)  {state}")
        return r

    return compile_all([p.lower for p in programs], threads, done)


def phase_peaks(results: list[Result]) -> dict[str, Result]:
    """The compiled program of largest total per phase (of those that compiled)."""
    peaks = {}
    for r in results:
        if r.error is None and (r.program.phase not in peaks or r.total > peaks[r.program.phase].total):
            peaks[r.program.phase] = r
    return peaks


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(results: list[Result], target: Target) -> list[str]:
    lines = [f"{'program':48s} {'compile s':>9s} {'cpu s':>6s} {'args':>7s} {'out':>7s} {'temp':>7s} {'program':>8s} "
             f"{'+state':>7s} {'total':>7s} {'of HBM':>6s}  {target.kernel_name:>6s}  (GiB per chip)"]
    for r in results:
        p = r.program
        if r.error is not None:
            what = "OUT OF MEMORY" if r.oom else "DID NOT COMPILE"
            lines.append(f"{p.name:48s} {r.seconds:9.1f} {r.cpu_seconds:6.1f}  {what}: {r.error}")
            continue
        lines.append(f"{p.name:48s} {r.seconds:9.1f} {r.cpu_seconds:6.1f} {_gib(r.argument):>7s} "
                     f"{_gib(r.output):>7s} {_gib(r.temp):>7s} "
                     f"{_gib(r.bytes):>8s} {_gib(p.resident):>7s} {_gib(r.total):>7s} "
                     f"{r.total / target.hbm_bytes:6.0%}  {'yes' if r.kernels else '-':>6s}")
    return lines + ([f"note: {target.caveat}"] if target.caveat else [])


def planner_rows(plan, results: list[Result]) -> list[str]:
    """Planner vs compiler, per phase: the planner's peak of the phase against the largest compiled total."""
    peaks = phase_peaks(results)
    planned = {"rollout": plan.persistent + plan.rollout_phase, "update": plan.persistent + plan.update_phase}
    lines = [f"{'phase':8s} {'planner GiB':>11s} {'compiled GiB':>12s} {'planner/compiled':>16s}  largest program"]
    for phase in PHASES:
        if phase not in peaks:
            continue
        r = peaks[phase]
        want = planned.get(phase)
        ratio = f"{want / r.total:16.2f}" if want else f"{'-':>16s}"
        lines.append(f"{phase:8s} {(_gib(want) if want else '-'):>11s} {_gib(r.total):>12s} {ratio}  {r.program.name}")
    return lines


def step_time_estimate(cfg, model, shapes: StepShapes, target: Target) -> tuple[float, float]:
    """(seconds of the score, reference and update passes at ESTIMATE_MFU, seconds of the decode at the HBM
    bandwidth: every step reads the decode weights and the cache), every response at the budget: an estimate from
    the FLOP model, not a measurement."""
    from g2rl_jax.memory import decode_weight_bytes, gathered_decode_weight_bytes, kv_cache_bytes, resolve_mesh

    rows, length = shapes.step_rows, shapes.prompt_len + shapes.new_tokens
    forward = train_flops(model, rows, length) / 3
    passes = forward * (1 + (cfg.algorithm.kl_coef > 0)) + 3 * forward * cfg.algorithm.ppo_epochs
    passes_s = passes / (target.chips * target.peak_tflops * 1e12 * ESTIMATE_MFU)
    mesh = resolve_mesh(cfg, target.chips)
    kv, _, _, _ = kv_cache_bytes(cfg, model, mesh)
    # each chip decodes its rows with the whole weights (gathered over fsdp before the loop), and on average half
    # of its final cache
    weights = max(decode_weight_bytes(cfg, model, mesh), gathered_decode_weight_bytes(cfg, model, mesh))
    per_step = weights + kv / 2
    decode_s = shapes.new_tokens * per_step / (target.hbm_gbps * 1e9)
    return passes_s, decode_s
