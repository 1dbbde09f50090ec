"""Compile every program of a run's micro-batch shape set at its first step, concurrently, before the step runs any.

    warm = RunWarmup(threads=8, choice_file=run_dir / CHOICE_FILE, budget=512, mini_rows=64, epochs=1, remat=False)
    shapes = warm.score(graphdef, params, reference, batch, temperature=T, micro=16, steps_left=200)  # the set
    warm.update(graphdef, params, minis, settings=s, micro=16, opt_state=o, optimizer=opt)
    timings = compile_all([lambda: fn.lower(*args, **static), ...], threads=8)   # the pool both use

The score and reference passes and the gradient run each micro-batch at one (rows, response width) shape of the
run's set (train/shapes.py, train/micro.py). On the run's first step, once the rollout has given a real batch,
`score` measures what the largest score (and reference) program costs to compile and to run, chooses the set by
the whole run's time (shapes.choose; the choice is kept in `choice_file`, so a resumed run uses the same set), and
compiles, for every shape of it, the score and reference programs and the small ones that move a micro-batch's
rows in (take_micro) and its results out (put_micro); `update` does the same for the gradient programs and the
optimizer step. After that first step the run meets no program it has not compiled: every shape a later step's
plan can take is in the set, and every other array of a step keeps its shape (the trainer pads responses to the
budget). Programs are lowered one at a time (Python, holding the GIL) and compiled on `threads` threads (XLA
releases it), each lowered over arguments with the shapes, dtypes and shardings the step's own call passes: real
arrays, or abstract ones copied from the compiled outputs that feed them. A jitted function keeps what
`fn.lower(args).compile()` compiled, so the step's later call runs that executable without lowering or compiling
again (jax's lowering cache; tests/test_warmup.py counts the compiles). Each job enters the caller's mesh context
(`jax.set_mesh` is per thread). It changes when programs compile, nothing they compute.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import shapes as shapes_lib
from g2rl_jax.train import step as train_step

CHOICE_FILE = "micro_shapes.json"  # in the run directory: the set a run chose, for its resumes


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


def _template(x) -> jax.ShapeDtypeStruct:
    """An abstract copy of an array (or of a compiled output's ShapeDtypeStruct): shape, dtype, weak type and
    sharding, no layout (a call with a real array of the default layout must find what this lowered)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None),
                                weak_type=bool(getattr(getattr(x, "aval", x), "weak_type", False)))


class RunWarmup:
    """The run's micro-batch shape set and its compiled programs (module docstring). `timings` keeps the Timing of
    every program it compiled (executables dropped), `choice` the shapes.Choice when it measured one."""

    def __init__(self, threads: int, *, choice_file: Path | None, budget: int, mini_rows: int, epochs: int,
                 remat: bool):
        self.threads = threads
        self.choice_file = choice_file
        self.budget, self.mini_rows, self.epochs, self.remat = budget, mini_rows, epochs, remat
        self.shapes: micro_lib.ShapeSet | None = None
        self.choice: shapes_lib.Choice | None = None
        self.timings: list[Timing] = []
        self._done: set[str] = set()

    def _compile(self, lowers: list[Callable[[], Any]]) -> list[Timing]:
        """Lower and compile on the pool; the Timings with their executables (the record keeps them without)."""
        if not lowers:
            return []
        timings = compile_all(lowers, max(self.threads, 1))
        self.timings += [dataclasses.replace(t, compiled=None) for t in timings]
        return timings

    # ------------------------------------------------------------------------------------------- the set
    def _candidates(self, micro: int, min_rows: int, prompt_len: int, resp_len: int):
        return shapes_lib.candidates(micro, min_rows, prompt_len, resp_len)

    def _saved(self, key: dict) -> micro_lib.ShapeSet | None:
        """The set a previous launch of this run chose for the same sizes, if it left one."""
        if self.choice_file is None or not self.choice_file.is_file():
            return None
        try:
            saved = json.loads(self.choice_file.read_text())
        except (OSError, ValueError):
            return None
        if saved.get("key") != key:
            return None
        return micro_lib.ShapeSet(tuple((int(r), tuple(int(w) for w in ws)) for r, ws in saved["widths"]),
                                  saved["name"])

    def _choose(self, graphdef, params, reference, batch: train_step.Batch, *, temperature: float, micro: int,
                chunk: int, steps_left: int) -> micro_lib.ShapeSet:
        """Measure the largest score (and reference) program, and choose the set of least estimated run time."""
        seq_len, resp_len = batch.input_ids.shape[1], batch.response_mask.shape[1]
        prompt_len, min_rows = seq_len - resp_len, micro_lib.row_shards(batch.rewards)
        key = {"micro": micro, "min_rows": min_rows, "prompt_len": prompt_len, "resp_len": resp_len}
        sets = self._candidates(micro, min_rows, prompt_len, resp_len)
        saved = self._saved(key)
        if saved is not None:
            return saved
        rows_X = np.arange(micro, dtype=np.int32)
        mb = micro_lib.take_micro(batch, rows_X, width=resp_len, seq_len=seq_len, resp_len=resp_len)
        kinds = {"score": (train_step._score_micro, graphdef, params)}
        if reference is not None:
            kinds["reference"] = (train_step._ref_micro, *reference)
        static = dict(temperature=temperature, chunk=chunk)
        timings = self._compile([functools.partial(fn.lower, gd, p, mb, **static) for fn, gd, p in kinds.values()])
        compile_s, run_s = {}, {}
        for (kind, (fn, gd, p)), t in zip(kinds.items(), timings):
            compile_s[kind] = t.lower_s + t.compile_s
            seconds = []
            for _ in range(2):  # the second run is the one timed: the first may pay one-time costs
                start = time.perf_counter()
                jax.block_until_ready(fn(gd, p, mb, **static))
                seconds.append(time.perf_counter() - start)
            run_s[kind] = seconds[-1]
        prices = shapes_lib.Prices.from_score(compile_s, run_s, micro_lib.micro_cost(micro, seq_len), self.remat)
        load = shapes_lib.step_load(sets, step_rows=batch.rewards.shape[0], mini_rows=self.mini_rows,
                                    epochs=self.epochs, prompt_len=prompt_len, budget=self.budget)
        choice = shapes_lib.choose(sets, load, prices, steps=steps_left, threads=max(self.threads, 1))
        names = list(sets)
        index = names.index(choice.shapes.name)
        if jax.process_count() > 1:  # process 0's timings decide, so every process runs the same programs
            from jax.experimental import multihost_utils

            index = int(multihost_utils.broadcast_one_to_all(np.int32(index)))
        self.choice = dataclasses.replace(choice, shapes=sets[names[index]])
        if jax.process_index() == 0:
            chosen = self.choice.shapes
            print(f"micro-batch shapes: {chosen.name}, {len(chosen.shapes)} shapes, chosen by the estimated time of "
                  f"the {steps_left} steps left (measured: score program compiles in {compile_s['score']:.1f} s, "
                  f"runs in {run_s['score']:.3f} s at {micro} x {seq_len}; {max(self.threads, 1)} compile threads):",
                  file=sys.stderr, flush=True)
            for line in self.choice.lines(steps_left):
                print("  " + line, file=sys.stderr, flush=True)
            if self.choice_file is not None:
                self.choice_file.write_text(json.dumps({"key": key, "name": chosen.name,
                                                        "widths": [[r, list(ws)] for r, ws in chosen.widths]}) + "\n")
        return self.choice.shapes

    # ------------------------------------------------------------------------------------------- the programs
    def _take(self, tree, batch: train_step.Batch, shapes: micro_lib.ShapeSet) -> dict:
        """take_micro of `tree` at every shape, compiled; {(rows, width): the abstract micro-batch it returns}."""
        seq_len, resp_len = batch.input_ids.shape[1], batch.response_mask.shape[1]
        keys = list(shapes.shapes)
        lowers = [functools.partial(micro_lib.take_micro.lower, tree, np.arange(r, dtype=np.int32), width=w,
                                    seq_len=seq_len, resp_len=resp_len) for r, w in keys]
        out = {}
        for key, t in zip(keys, self._compile(lowers)):
            if t.error is None:
                out[key] = jax.tree.map(_template, t.compiled.out_info)
        return out

    def score(self, graphdef, params, reference, batch: train_step.Batch, *, temperature: float, micro: int,
              steps_left: int, chunk: int = train_step.g2rl.DEFAULT_CHUNK) -> micro_lib.ShapeSet:
        """The run's set (chosen on the first call), with its score and reference programs compiled (reference:
        (graphdef, params) of the KL reference, or None without the KL term)."""
        if self.shapes is None:
            self.shapes = self._choose(graphdef, params, reference, batch, temperature=temperature, micro=micro,
                                       chunk=chunk, steps_left=steps_left)
        if "score" in self._done:
            return self.shapes
        self._done.add("score")
        mbs = self._take(batch, batch, self.shapes)
        static = dict(temperature=temperature, chunk=chunk)
        passes = [(train_step._score_micro, graphdef, params)]
        if reference is not None:
            passes.append((train_step._ref_micro, *reference))
        jobs = [(key, fn, functools.partial(fn.lower, gd, p, mb, **static)) for key, mb in mbs.items()
                for fn, gd, p in passes]
        outs = [(key, t.compiled.out_info) for (key, _, _), t in zip(jobs, self._compile([j[2] for j in jobs]))
                if t.error is None]
        self._put(batch, outs)
        return self.shapes

    def _put(self, batch: train_step.Batch, outs: list) -> None:
        """put_micro of every output of the score and reference programs (outs: [((rows, width), their compiled
        out_info: (per-token parts, per-row parts))]) into its [B, ...] array: the first time into _per_micro's
        zeros, later into put_micro's own (donated) output, compiled again only where that is placed otherwise."""
        b, t = batch.response_mask.shape
        fulls: dict[tuple, Any] = {}
        jobs, seen = [], set()
        for (rows, _), (per_token, per_row) in outs:
            pairs = [(p, (b, t)) for p in per_token] + [(p, (b, *p.shape[1:])) for p in per_row]
            for part, shape in pairs:
                if shape not in fulls:
                    fulls[shape] = _template(train_step._zeros_rows(batch.rewards, shape))
                jobs.append((rows, _template(part), fulls[shape]))
        while jobs:
            jobs = [j for j in jobs if (j[0], j[1].shape, str(j[1].dtype), j[2].shape, j[2].sharding) not in seen]
            seen.update((j[0], j[1].shape, str(j[1].dtype), j[2].shape, j[2].sharding) for j in jobs)
            timings = self._compile([functools.partial(micro_lib.put_micro.lower, full, np.arange(rows, dtype=np.int32),
                                                       part) for rows, part, full in jobs])
            jobs = [(rows, part, _template(t.compiled.out_info)) for (rows, part, _), t in zip(jobs, timings)
                    if t.error is None]

    def update(self, graphdef, params, minis: Sequence[train_step.MiniBatch], *, settings: train_step.LossSettings,
               micro: int, opt_state=None, optimizer=None) -> None:
        """The gradient program at every shape of the set (over mini-batches like minis[0]) and, with `optimizer`,
        the optimizer step (train_step.apply_gradients) of `opt_state`; after `score` chose the set."""
        if "update" in self._done or self.shapes is None:
            return
        self._done.add("update")
        mini = minis[0]
        mbs = self._take(mini, mini.batch, self.shapes)
        total_tokens = jnp.sum(mini.batch.response_mask)  # as `accumulate_plan` computes it
        rows = mini.batch.response_mask.shape[0]
        lowers, acc = [], None
        for mb in mbs.values():
            acc = acc or train_step.accumulator_spec(train_step.policy_loss, graphdef, params, (mb,), settings,
                                                     mini.batch.rewards)  # the same for every shape
            lowers.append(functools.partial(train_step.accumulate.lower, graphdef, params, acc, mb, total_tokens,
                                            settings=settings, total_rows=rows))
        if optimizer is not None and acc is not None:
            lowers.append(functools.partial(train_step.apply_gradients.lower, params, opt_state, *acc,
                                            optimizer=optimizer))
        self._compile(lowers)
