"""Compile a step's programs concurrently before it runs them, so that the step's own calls find them compiled.

    warm = StepWarmup(threads=8)
    warm.score(graphdef, params, ref_params, batch, temperature=T, micro=16)   # before the score pass
    warm.update(graphdef, params, minis, settings=s, micro=16)                # before the optimizer updates
    timings = compile_all([lambda: fn.lower(*args, **static), ...], threads=8) # the pool both use

A run compiles each program the first time it meets its shape, and a step meets dozens at once: the score and
reference passes and the gradient at every (rows, response width) of its length-grouped micro-batches
(train/micro.py). Once the rollout has ended these shapes are known, so the warm-up lowers each new one (Python,
one at a time: it holds the GIL) and compiles them on `threads` threads (XLA releases the GIL), before the step's
own calls reach them. A jitted function keeps what `fn.lower(args).compile()` compiled: the later `fn(args)` call
with the same shapes, dtypes, shardings and static arguments runs that executable without lowering or compiling
again (jax's lowering cache holds it; tests/test_warmup.py counts the compiles per function and thread). So the
warm-up lowers with the very arrays the step passes (each micro-batch shape's first `take_micro`, the parameters)
and the accumulator's zeros as `zero_accumulator` places them. It changes when programs compile, nothing they
compute. Each job enters the caller's mesh context (`jax.set_mesh` is per thread).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import step as train_step


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


class StepWarmup:
    """Compiles the score, reference and gradient programs of each micro-batch shape a step meets for the first
    time, `threads` at a time, before the step runs them (threads <= 1: off, each compiles when first called).
    `timings` keeps the Timing of every program it compiled."""

    def __init__(self, threads: int):
        self.threads = threads
        self.seen: set = set()
        self.timings: list[Timing] = []

    def _run(self, lowers: list[Callable[[], Any]]) -> None:
        if lowers:
            self.timings += compile_all(lowers, self.threads, lambda _, t: dataclasses.replace(t, compiled=None))

    def _micro_batches(self, kind: str, tree, batch: train_step.Batch, micro: int):
        """(key, the first micro-batch) of each shape of batch's plan that `kind` has not met yet."""
        plan = micro_lib.plan_for(batch, micro)
        seq_len, resp_len = batch.input_ids.shape[1], batch.response_mask.shape[1]
        for rows_X, width in zip(plan.rows, plan.widths):
            key = (kind, len(rows_X), seq_len - resp_len + width, width)
            if key not in self.seen:
                self.seen.add(key)
                yield key, micro_lib.take_micro(tree, rows_X, width=width, seq_len=seq_len, resp_len=resp_len)

    def score(self, graphdef, params, ref_params, batch: train_step.Batch, *, temperature: float, micro: int,
              chunk: int = train_step.g2rl.DEFAULT_CHUNK) -> None:
        """The programs of train_step.score (and ref_logprobs when ref_params is not None) over `batch`."""
        if self.threads <= 1:
            return
        lowers = []
        for _, mb in self._micro_batches("score", batch, batch, micro):
            static = dict(temperature=temperature, chunk=chunk)
            lowers.append(functools.partial(train_step._score_micro.lower, graphdef, params, mb, **static))
            if ref_params is not None:
                lowers.append(functools.partial(train_step._ref_micro.lower, graphdef, ref_params, mb, **static))
        self._run(lowers)

    def update(self, graphdef, params, minis: Sequence[train_step.MiniBatch], *, settings: train_step.LossSettings,
               micro: int, opt_state=None, optimizer=None) -> None:
        """The gradient programs of train_step.gradients over each mini-batch of `minis`, and with `optimizer` the
        optimizer step (train_step.apply_gradients) of `opt_state`."""
        if self.threads <= 1:
            return
        lowers = []
        for mini in minis:
            total_tokens = jnp.sum(mini.batch.response_mask)  # as `gradients` computes it
            rows = mini.batch.response_mask.shape[0]
            for _, mb in self._micro_batches(("gradient", rows), mini, mini.batch, micro):
                acc = train_step.accumulator_spec(train_step.policy_loss, graphdef, params, (mb,), settings,
                                                   mini.batch.rewards)
                lowers.append(functools.partial(train_step.accumulate.lower, graphdef, params, acc, mb, total_tokens,
                                                settings=settings, total_rows=rows))
                if optimizer is not None and ("apply",) not in self.seen:  # the step after the gradients
                    self.seen.add(("apply",))
                    lowers.append(functools.partial(train_step.apply_gradients.lower, params, opt_state, *acc,
                                                    optimizer=optimizer))
        self._run(lowers)
