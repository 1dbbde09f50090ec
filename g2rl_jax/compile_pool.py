"""The compile pool: lower and compile many programs on a few threads, each with the seconds it took.

    timings = compile_all([lambda: fn.lower(*args, **static), ...], threads=8)   # [Timing], in the order given
    threads = resolve_threads(cfg.run.compile_threads)                             # 0 -> one per core, up to 32

The trainer's warm-up (train/warmup.py), the rollout's (rollout/prewarm.py), `plan --compile` (aot/report.py) and
`bench compile` share it. Lowering runs Python and holds the GIL; XLA releases it while it compiles, so the threads
compile at once. Each job enters the caller's mesh context (`jax.set_mesh` is per thread). It depends on JAX alone,
so both warm-ups import it and neither imports the other.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    """One program: its compiled executable (None when it failed: `error`), and the seconds of each stage."""

    compiled: Any
    lower_s: float
    compile_s: float
    cpu_s: float  # the process's CPU seconds while it lowered and compiled (its own only when nothing else ran)
    error: BaseException | None = None


def _one(lower: Callable[[], Any]) -> Timing:
    t0, cpu = time.perf_counter(), time.process_time()
    try:
        lowered = lower()
    except Exception as err:  # noqa: BLE001 - kept in the Timing; the step's own call raises it again
        return Timing(None, time.perf_counter() - t0, 0.0, time.process_time() - cpu, err)
    t1 = time.perf_counter()
    try:
        compiled, error = lowered.compile(), None
    except Exception as err:  # noqa: BLE001
        compiled, error = None, err
    return Timing(compiled, t1 - t0, time.perf_counter() - t1, time.process_time() - cpu, error)


def compile_all(lowers: Sequence[Callable[[], Any]], threads: int, done: Callable[[int, Timing], Any] | None = None):
    """Lower (`lowers[i]()` -> jax.stages.Lowered) and compile every program on `threads` threads: their Timings in
    the order given, a failure kept in its Timing, not raised. With `done`, `done(i, timing)` is called as each one
    finishes (in the thread that compiled it) and its results are returned instead (the executables then live only
    as long as `done` keeps them)."""
    mesh = jax.sharding.get_mesh()

    def job(i: int):
        if mesh.empty:
            timing = _one(lowers[i])
        else:
            with jax.set_mesh(mesh):
                timing = _one(lowers[i])
        return timing if done is None else done(i, timing)

    if threads <= 1:
        return [job(i) for i in range(len(lowers))]
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(lowers)), thread_name_prefix="compile") as pool:
        return list(pool.map(job, range(len(lowers))))


MAX_AUTO_THREADS = 32  # run.compile_threads=0: one thread per CPU core, at most this many


def resolve_threads(threads: int) -> int:
    """run.compile_threads: 0 -> one per CPU core this process may use, at most MAX_AUTO_THREADS."""
    if threads:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_AUTO_THREADS)

