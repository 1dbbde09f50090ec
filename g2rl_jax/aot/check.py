"""`python -m g2rl_jax.plan --config FILE --target v5p-8 --compile`: will this config run on that slice?

`check(cfg, model, target, scope)` builds the mesh of the config on the target's devices, compiles every program
of a step (programs.py) and returns the report (report.py) ending in one verdict line, and whether it fits. The
verdict names the largest program and its margin, or what to change: a mesh, the micro-batch size, the response
budget or rows per step, or the smallest slice of the same generation that fits. Those suggestions come from the
memory planner (`g2rl_jax.plan`, calibrated against these compiles), so run the check again on the one you pick.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time

from g2rl_jax import parallel
from g2rl_jax.aot import bill as bill_lib
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.aot import report as report_lib
from g2rl_jax.aot.targets import GiB, Target, tpu_name, tpu_target
from g2rl_jax.config import Config, ConfigError, MeshConfig
from g2rl_jax.memory import PlanError, check_divisible, resolve_mesh
from g2rl_jax.shapes import choice as choice_lib
from g2rl_jax.shapes.step import step_shapes


def _plan_fits(cfg: Config, model, chips: int, limit: float, phase: str | None = None, *,
               platform: str = "tpu", compute_capability: tuple[int, int] | None = None) -> bool:
    from g2rl_jax.plan import plan

    try:
        p = plan(cfg, model, chips, platform, compute_capability)
    except (PlanError, ConfigError):
        return False
    peak = {"rollout": p.persistent + p.rollout_phase, "update": p.persistent + p.update_phase}.get(phase, p.peak)
    return peak <= limit


def _replace(cfg: Config, group: str, **values) -> Config:
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **values)})


def suggestions(cfg: Config, model, target: Target, phase: str, limit: float) -> list[str]:
    """Changes the planner says would fit this phase on this slice, then the smallest slice that fits as is."""
    fits = functools.partial(_plan_fits, platform=target.platform, compute_capability=target.compute_capability)
    out = []
    if phase in ("update", "score"):
        micro = cfg.algorithm.micro_batch_size
        while micro > 1 and not fits(_replace(cfg, "algorithm", micro_batch_size=micro), model, target.chips,
                                     limit, "update"):
            micro //= 2
        if micro != cfg.algorithm.micro_batch_size and fits(_replace(cfg, "algorithm", micro_batch_size=micro),
                                                            model, target.chips, limit, "update"):
            out.append(f"algorithm.micro_batch_size={micro}")
    if phase == "rollout":
        for tensor in (2, 4, 8):
            mesh = MeshConfig(data=1, fsdp=-1, tensor=tensor)
            if tensor != cfg.mesh.tensor and target.chips % tensor == 0 and \
                    fits(dataclasses.replace(cfg, mesh=mesh), model, target.chips, limit):
                out.append(f"mesh.tensor={tensor} mesh.fsdp=-1")
                break
        budget = cfg.rollout.max_new_tokens
        while budget > 1024 and not fits(_replace(cfg, "rollout", max_new_tokens=budget), model, target.chips,
                                         limit):
            budget -= 1024
        if budget != cfg.rollout.max_new_tokens and fits(_replace(cfg, "rollout", max_new_tokens=budget), model,
                                                         target.chips, limit):
            out.append(f"rollout.max_new_tokens={budget}")
        prompts = cfg.data.prompts_per_step
        while prompts > 1 and not fits(_replace(cfg, "data", prompts_per_step=prompts), model, target.chips,
                                       limit):
            prompts //= 2
        if prompts != cfg.data.prompts_per_step and prompts >= 1:
            out.append(f"data.prompts_per_step={prompts} (rows per step)")
    chips = target.chips * 2
    while chips <= 4096:
        if any(fits(c, model, chips, limit) for c in _slice_configs(cfg, chips)):
            name = target.resize(chips) if target.resize else tpu_name(target.kind, chips)
            out.append(f"the smallest {target.kind} slice the planner fits it on: {name}")
            break
        chips *= 2
    return out


def _slice_configs(cfg: Config, chips: int) -> list[Config]:
    from g2rl_jax.plan import slice_meshes

    return slice_meshes(cfg, chips)


def verdict(cfg: Config, model, target: Target, results: list[report_lib.Result]) -> tuple[bool, str]:
    from g2rl_jax.plan import USABLE_FRACTION

    limit = USABLE_FRACTION * target.hbm_bytes
    usable = f"{limit / GiB:.1f} GiB usable of {target.hbm_gib:.0f} GiB per chip"
    over = [r for r in results if r.oom or (r.error is None and r.total > limit)]
    failed = [r for r in results if r.error is not None and not r.oom]
    if not over and failed:
        first = failed[0]
        return False, (f"VERDICT: cannot tell, {len(failed)} program(s) did not compile; first: "
                       f"{first.program.name}: {first.error}")
    if not over:
        top = max(results, key=lambda r: r.total)
        return True, (f"VERDICT: FITS on {target.name}: the largest program, {top.program.name}, holds "
                      f"{top.total / GiB:.2f} GiB per chip ({usable}), a margin of {(limit - top.total) / GiB:.2f} GiB")
    worst = max(over, key=lambda r: (r.oom, r.total))
    need = "the compiler ran out of memory" if worst.oom else f"it needs {worst.total / GiB:.2f} GiB per chip"
    hints = suggestions(cfg, model, target, worst.program.phase, limit)
    change = "; or ".join(hints) if hints else "a larger slice"
    return False, (f"VERDICT: DOES NOT FIT on {target.name}: {worst.program.name}: {need} ({usable}). "
                   f"Change: {change}")


def check(cfg: Config, model, target: Target, scope: str = "all", progress=None, threads: int = 1,
          only: tuple[str, ...] = ()) -> tuple[bool, str]:
    """(fits, report text) of every program of a step of `cfg` compiled for `target` (see the module docstring);
    `only`: just the programs whose name contains one of these strings (the verdict then covers those)."""
    from g2rl_jax.plan import plan

    sizes = resolve_mesh(cfg, target.chips)
    check_divisible(model, sizes)
    mesh = parallel.make_mesh(cfg.mesh, target.devices())
    shapes = step_shapes(cfg, mesh)
    lengths = choice_lib.training_prompt_lengths(cfg)
    choice = choice_lib.run_choice(cfg, model, shapes, bill_lib.target_device(target), lengths)
    progs = programs_lib.step_programs(cfg, model, mesh, scope=scope, packed=choice.packed)
    if only:
        progs = [p for p in progs if any(text in p.name for text in only)]
        if not progs:
            raise ConfigError(f"--only {list(only)}: no program of this step is named so; see the names that "
                              "--programs largest prints")
    picked = f"{scope}, only {list(only)}" if only else scope
    header = (f"compiling {len(progs)} programs ({picked}) for {target.name}: {target.chips} chips of "
              f"{target.hbm_gib:.0f} GiB, {target.hosts} host(s), topology {target.topology}, mesh {sizes}")
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    if cfg.mesh.rollout_devices or cfg.mesh.rollout_processes:  # a split run: each side on its own mesh
        from g2rl_jax.aot.sides import check_sides

        fits, lines = check_sides(cfg, model, target, scope, say, threads, only)
        return fits, "\n".join([f"split run on {target.name}, {target.hosts} host(s), {scope}", "", *lines])
    say(header)
    start, cpu = time.perf_counter(), time.process_time()
    results = report_lib.compile_programs(progs, say, threads, target.kernel_mark)
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    fits, line = verdict(cfg, model, target, results)
    passes_s, decode_s = report_lib.step_time_estimate(cfg, model, shapes, target)
    lines = [header, "", *report_lib.table(results, target), "",
             "planner vs compiler, peak per chip by phase (program + state resident beside it):",
             *report_lib.planner_rows(plan(cfg, model, target.chips, target.platform, target.compute_capability),
                                      results), "",
             f"total compile time: {total:.1f} s for {len(progs)} programs on {threads} thread(s), {cpu:.1f} s of CPU "
             f"(rollout {sum(r.seconds for r in results if r.program.phase == 'rollout'):.1f} s)",
             *bill_lib.bill(cfg, model, shapes, results, target, lengths).lines(),
             f"step time, an ESTIMATE from the FLOP model (every response at the budget): score, reference and "
             f"update {passes_s:.1f} s at {report_lib.ESTIMATE_MFU:.0%} MFU of {target.peak_tflops:.0f} TFLOP/s per "
             f"chip; decode at least {decode_s:.1f} s at {target.hbm_gbps:.0f} GB/s HBM bandwidth",
             line]
    return fits, "\n".join(lines)


__all__ = ["check", "suggestions", "tpu_target", "verdict"]
