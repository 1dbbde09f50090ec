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
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from g2rl_jax import storage
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
    """The run's micro-batch shape set and prompt buckets, and their compiled programs (module docstring).
    `timings` keeps the Timing of every program it compiled (executables dropped), `choice` the shapes.Choice when
    it measured one. prompt_lengths: the training prompts' lengths (their buckets and how often a step's longest
    falls in each, shapes.prompt_shares)."""

    def __init__(self, threads: int, *, choice_file: storage.PathLike | None, budget: int, mini_rows: int, epochs: int,
                 remat: bool, prompt_lengths, prompts_per_step: int):
        self.threads = threads
        self.choice_file = choice_file
        self.budget, self.mini_rows, self.epochs, self.remat = budget, mini_rows, epochs, remat
        self.shares = shapes_lib.prompt_shares(prompt_lengths, prompts_per_step)
        self.shapes: micro_lib.ShapeSet | None = None
        self.prompts: tuple[int, ...] | None = None
        self.choice: shapes_lib.Choice | None = None
        self.timings: list[Timing] = []
        self._done: set[tuple] = set()

    def prompt_len(self, longest: int) -> int:
        """The prompt length a step whose longest prompt has `longest` tokens pads to: the largest bucket until the
        first step has chosen the run's buckets, then the smallest of them that holds it."""
        from g2rl_jax.rollout.batching import MIN_PROMPT_BUCKET, bucket

        if self.prompts is None:
            return max(self.shares)
        return shapes_lib.pad_prompt(bucket(longest, MIN_PROMPT_BUCKET), self.prompts)

    def _compile(self, lowers: list[Callable[[], Any]]) -> list[Timing]:
        """Lower and compile on the pool; the Timings with their executables (the record keeps them without)."""
        if not lowers:
            return []
        timings = compile_all(lowers, max(self.threads, 1))
        self.timings += [dataclasses.replace(t, compiled=None) for t in timings]
        return timings

    # ------------------------------------------------------------------------------------------- the choice
    def _saved(self, key: dict, sets: dict) -> tuple[str, tuple[int, ...]] | None:
        """(set name, prompt buckets) a previous launch of this run chose for the same sizes, if it left them."""
        if self.choice_file is None or not storage.is_file(self.choice_file):
            return None
        try:
            saved = json.loads(storage.read_text(self.choice_file))
        except (OSError, ValueError):
            return None
        name, prompts = saved.get("name"), tuple(saved.get("prompts", ()))
        if saved.get("key") != key or name not in sets or not prompts or not set(prompts) <= set(self.shares):
            return None
        return name, prompts

    def _choose(self, graphdef, params, reference, batch: train_step.Batch, *, temperature: float, micro: int,
                chunk: int, steps_left: int) -> None:
        """Measure the largest score (and reference) program and choose the shapes and prompt buckets of least
        estimated run time (or take those a previous launch chose); every process takes process 0's."""
        from g2rl_jax.rollout import prewarm

        seq_len, resp_len = batch.input_ids.shape[1], batch.response_mask.shape[1]
        prompt_len, min_rows = seq_len - resp_len, micro_lib.row_shards(batch.rewards)
        key = {"micro": micro, "min_rows": min_rows, "resp_len": resp_len, "prompts": sorted(self.shares)}
        sets = shapes_lib.candidates(micro, min_rows, prompt_len, resp_len)
        names = list(sets)
        saved = self._saved(key, sets) if jax.process_index() == 0 else None
        index = -1 if saved is None else names.index(saved[0])
        prompts = (0,) if saved is None else saved[1]
        if jax.process_count() > 1:  # process 0 decides, so every process runs the same programs
            from jax.experimental import multihost_utils

            index = int(multihost_utils.broadcast_one_to_all(np.int32(index)))
            buckets = sorted(self.shares)
            mask = multihost_utils.broadcast_one_to_all(np.array([b in prompts for b in buckets]))
            prompts = tuple(b for b, m in zip(buckets, np.asarray(mask)) if m)
        if index >= 0:
            self.shapes, self.prompts = sets[names[index]], prompts
            return
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
            start = time.perf_counter()
            jax.block_until_ready(fn(gd, p, mb, **static))
            run_s[kind] = time.perf_counter() - start
        prices = shapes_lib.Prices.from_score(compile_s, run_s, micro_lib.micro_cost(micro, seq_len), self.remat)
        loads = {s: shapes_lib.step_load(sets, step_rows=batch.rewards.shape[0], mini_rows=self.mini_rows,
                                         epochs=self.epochs, prompt_len=s, budget=self.budget) for s in self.shares}
        rollout = prewarm.COMPILED[-1] if prewarm.COMPILED else (0, 0.0)  # this step's rollout, the largest bucket
        choice = shapes_lib.choose(sets, loads, self.shares, prices, rollout=rollout, steps=steps_left,
                                   threads=max(self.threads, 1))
        index, buckets = names.index(choice.shapes.name), sorted(self.shares)
        mask = np.array([b in choice.prompts for b in buckets])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            index = int(multihost_utils.broadcast_one_to_all(np.int32(index)))
            mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
        self.shapes, self.prompts = sets[names[index]], tuple(b for b, m in zip(buckets, mask) if m)
        self.choice = dataclasses.replace(choice, shapes=self.shapes, prompts=self.prompts)
        if jax.process_index() == 0:
            print(f"micro-batch shapes {self.shapes.name} ({len(self.shapes.shapes)} shapes), prompt buckets "
                  f"{list(self.prompts)}: chosen by the estimated time of the {steps_left} steps left (measured: the "
                  f"score program of {micro} x {seq_len} compiles in {compile_s['score']:.1f} s and runs in "
                  f"{run_s['score']:.3f} s; a rollout compiles {rollout[0]} programs in {rollout[1]:.1f} s; "
                  f"{max(self.threads, 1)} compile threads)", file=sys.stderr, flush=True)
            for line in self.choice.lines(steps_left):
                print("  " + line, file=sys.stderr, flush=True)
            if self.choice_file is not None:
                storage.write_text(self.choice_file, json.dumps({"key": key, "name": self.shapes.name,
                                                                     "prompts": list(self.prompts)}) + "\n")

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
              steps_left: int, batch_like: Callable[[int], train_step.Batch],
              chunk: int = train_step.g2rl.DEFAULT_CHUNK) -> micro_lib.ShapeSet:
        """The run's set (chosen on the first call), with its score and reference programs compiled at every prompt
        bucket (reference: (graphdef, params) of the KL reference, or None without the KL term; batch_like(S): a
        batch placed like `batch` with prompts of S tokens)."""
        if self.shapes is None:
            self._choose(graphdef, params, reference, batch, temperature=temperature, micro=micro, chunk=chunk,
                         steps_left=steps_left)
        static = dict(temperature=temperature, chunk=chunk)
        passes = [(train_step._score_micro, graphdef, params)]
        if reference is not None:
            passes.append((train_step._ref_micro, *reference))
        own = batch.prompt_len
        for prompt_len in self.prompts:
            if ("score", prompt_len) in self._done:
                continue
            self._done.add(("score", prompt_len))
            like = batch if prompt_len == own else batch_like(prompt_len)
            mbs = self._take(like, like, self.shapes)
            jobs = [(key, functools.partial(fn.lower, gd, p, mb, **static)) for key, mb in mbs.items()
                    for fn, gd, p in passes]
            outs = [(key, t.compiled.out_info) for (key, _), t in zip(jobs, self._compile([j[1] for j in jobs]))
                    if t.error is None]
            self._put(like, outs)
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

    def update(self, graphdef, params, mini: train_step.MiniBatch, *, settings: train_step.LossSettings,
               mini_like: Callable[[int], train_step.MiniBatch], opt_state=None, optimizer=None) -> None:
        """The gradient program at every shape of the set and every prompt bucket (over mini-batches like `mini`;
        mini_like(S): one with prompts of S tokens) and, with `optimizer`, the optimizer step
        (train_step.apply_gradients) of `opt_state`; after `score` chose the set."""
        if self.shapes is None:
            return
        lowers, acc = [], None
        for prompt_len in self.prompts:
            if ("update", prompt_len) in self._done:
                continue
            self._done.add(("update", prompt_len))
            like = mini if prompt_len == mini.batch.prompt_len else mini_like(prompt_len)
            total_tokens = jnp.sum(like.batch.response_mask)  # as `accumulate_plan` computes it
            rows = like.batch.response_mask.shape[0]
            for mb in self._take(like, like.batch, self.shapes).values():
                acc = acc or train_step.accumulator_spec(train_step.policy_loss, graphdef, params, (mb,), settings,
                                                         like.batch.rewards)  # the same for every shape
                lowers.append(functools.partial(train_step.accumulate.lower, graphdef, params, acc, mb, total_tokens,
                                                settings=settings, total_rows=rows))
        if optimizer is not None and acc is not None and ("apply",) not in self._done:
            self._done.add(("apply",))
            lowers.append(functools.partial(train_step.apply_gradients.lower, params, opt_state, *acc,
                                            optimizer=optimizer))
        self._compile(lowers)
