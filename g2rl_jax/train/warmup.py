"""Compile every program of a run's layout at its first step, concurrently, before the step runs any.

    warm = RunWarmup.for_run(cfg, model_config, mesh, run_dir, prompt_lengths)
    layout = warm.score(graphdef, params, reference, batch, temperature=T, micro=16, batch_like=...)  # the layout
    warm.update(graphdef, params, minis, settings=s, opt_state=o, optimizer=opt, mini_like=...)

The score and reference passes and the gradient run each micro-batch at one shape of the run's layout: a
length-grouped (rows, response width) shape or a packed (rows, row width) one (g2rl_jax/shapes: the one home of the
shapes a run compiles). On the run's first step, once the rollout has given a real batch, `score` takes the run's
layout and prompt buckets: those this run recorded in `CHOICE_FILE` on an earlier launch (a resume keeps its
layout), else those run.shapes_file pins (`python -m g2rl_jax.bench tune-shapes` writes one), else
shapes.choice.choose_for's, a function of the config, the training mesh's devices and the training prompts'
lengths, never of a clock; it records them in CHOICE_FILE and compiles, for every shape of the layout, the score
and reference programs (each takes its micro-batch's rows from the whole batch and puts its results into the step's
arrays); `update` does the same for the gradient programs and the optimizer step. After that first step the run
meets no program it has not compiled: every shape a later step's plan can take is in the layout, and every other
array of a step keeps its shape (the trainer pads responses to the budget). Programs are lowered one at a time
(Python, holding the GIL) and compiled on `threads` threads (g2rl_jax/compile_pool.py), each lowered over arguments
with the shapes, dtypes and shardings the step's own call passes: real arrays, or abstract ones copied from the
compiled outputs that feed them. A jitted function keeps what `fn.lower(args).compile()` compiled, so the step's
later call runs that executable without lowering or compiling again (jax's lowering cache; tests/test_warmup.py
counts the compiles). It changes when programs compile, nothing they compute. The packed passes' lowerings
(packed_score_lowers, packed_update_lowers) take abstract batches too: `plan --compile` lowers the same programs
(aot/packed.py).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from g2rl_jax import methods, parallel, storage
from g2rl_jax.compile_pool import MAX_AUTO_THREADS, Timing, compile_all, resolve_threads
from g2rl_jax.shapes import choice as choice_lib
from g2rl_jax.shapes import record
from g2rl_jax.shapes.layouts import Layout, PackShape
from g2rl_jax.shapes.prices import Device
from g2rl_jax.shapes.step import step_shapes
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import passes
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update

__all__ = ["MAX_AUTO_THREADS", "Lowers", "RunWarmup", "Timing", "compile_all", "packed_accumulators",
           "packed_score_lowers", "packed_update_lowers", "resolve_threads"]


def _template(x) -> jax.ShapeDtypeStruct:
    """An abstract copy of an array (or of a compiled output's ShapeDtypeStruct): shape, dtype, weak type and
    sharding, no layout (a call with a real array of the default layout must find what this lowered)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None),
                                weak_type=bool(getattr(getattr(x, "aval", x), "weak_type", False)))


class RunWarmup:
    """The run's layout and prompt buckets, and their compiled programs (module docstring). `timings` keeps the
    Timing of every program it compiled (executables dropped), `choice` the shapes.choice.Choice when it chose one
    (None when a file gave the layout). prompt_lengths: the training prompts' lengths (their buckets and how often a
    step's longest falls in each, choice.prompt_shares); step: the step's sizes on the training mesh
    (shapes.step.step_shapes); device: its chips (shapes.prices.Device.of), which the choice prices."""

    def __init__(self, cfg, model, *, threads: int, choice_file: storage.PathLike | None, prompt_lengths,
                 step, device: Device):
        self.cfg, self.model, self.threads, self.choice_file = cfg, model, threads, choice_file
        self.step, self.device = step, device
        self.lengths = np.asarray(prompt_lengths)
        self.shares = choice_lib.prompt_shares(self.lengths, cfg.data.prompts_per_step)
        self.layout: Layout | None = None  # what the passes run at: a ShapeSet, or packed rows (PackShape)
        self.prompts: tuple[int, ...] | None = None
        self.choice: choice_lib.Choice | None = None
        self.source: str | None = None  # where the layout came from: "recorded", "pinned", "model"
        self.timings: list[Timing] = []
        self._done: set[tuple] = set()
        self._step_rows: int | None = None  # the step's batch rows, which the score programs were compiled for

    @classmethod
    def for_run(cls, cfg, model, mesh, run_dir, prompt_lengths) -> "RunWarmup":
        """The trainer's: Qwen3 config `model`, on the training `mesh` (its chips price the choice, the rollout's
        devices not), recording its layout in run_dir / CHOICE_FILE."""
        return cls(cfg, model, threads=resolve_threads(cfg.run.compile_threads),
                   choice_file=run_dir / record.CHOICE_FILE, prompt_lengths=prompt_lengths,
                   step=step_shapes(cfg, mesh), device=Device.of(mesh))

    def prompt_len(self, longest: int) -> int:
        """The prompt length a step whose longest prompt has `longest` tokens pads to: the largest bucket until the
        first step has chosen the run's buckets, then the smallest of them that holds it."""
        from g2rl_jax.rollout.batching import MIN_PROMPT_BUCKET, bucket

        if self.prompts is None:
            return max(self.shares)
        return choice_lib.pad_prompt(bucket(longest, MIN_PROMPT_BUCKET), self.prompts)

    def _compile(self, lowers: list[Callable[[], Any]]) -> list[Timing]:
        """Lower and compile on the pool; the Timings with their executables (the record keeps them without)."""
        if not lowers:
            return []
        timings = compile_all(lowers, max(self.threads, 1))
        self.timings += [dataclasses.replace(t, compiled=None) for t in timings]
        return timings

    # ------------------------------------------------------------------------------------------- the choice
    def layouts(self) -> dict[str, Layout]:
        """The run's candidate layouts by name (choice.candidates, and choice.packed_candidates unless
        algorithm.packing is false; only those with it true)."""
        s, packing = self.step, self.cfg.algorithm.packing
        args = (self.cfg.algorithm.micro_batch_size, s.shards, max(self.shares), s.new_tokens)
        grouped = choice_lib.candidates(*args) if packing is not True else {}
        return {**grouped, **(choice_lib.packed_candidates(*args) if packing is not False else {})}

    def _choose(self, batch: train_step.Batch, *, micro: int) -> None:
        """The run's layout and prompt buckets (module docstring): the recorded ones, the pinned ones or the model's,
        recorded in choice_file; process 0 reads the files and every process takes its pick."""
        resp_len, min_rows = batch.response_mask.shape[1], micro_lib.row_shards(batch.rewards)
        if (batch.prompt_len, resp_len, min_rows) != (max(self.shares), self.step.new_tokens, self.step.shards):
            raise ValueError(f"the first step's batch has {batch.prompt_len} prompt and {resp_len} response "
                             f"positions on {min_rows} row shards; the run's shapes were planned for "
                             f"{max(self.shares)}, {self.step.new_tokens} and {self.step.shards}")
        key = record.choice_key(micro, min_rows, resp_len, self.shares)
        layouts = self.layouts()
        names, buckets = list(layouts), sorted(self.shares)
        picked, source = None, None
        if jax.process_index() == 0:
            if self.choice_file is not None:
                picked, source = record.read_record(self.choice_file, key, names, buckets, pinned=False), "recorded"
            if picked is None and self.cfg.run.shapes_file:
                picked = record.read_record(self.cfg.run.shapes_file, key, names, buckets, pinned=True)
                source = "pinned"
        if picked is None:
            choice = choice_lib.choose_for(self.cfg, self.model, self.device, self.lengths, step=self.step)
            picked, source, self.choice = (choice.layout.name, choice.prompts), "model", choice
        index, mask = names.index(picked[0]), np.array([b in picked[1] for b in buckets])
        if parallel.host_count() > 1:  # process 0 decides, so every process runs the same programs
            index = int(parallel.broadcast_one_to_all(np.int32(index)))  # over this side's processes
            mask = np.asarray(parallel.broadcast_one_to_all(mask))
        self.layout, self.prompts = layouts[names[index]], tuple(b for b, m in zip(buckets, mask) if m)
        self.source = source
        if self.choice is not None and (self.choice.layout, self.choice.prompts) != (self.layout, self.prompts):
            self.choice = None  # process 0 read a file: this process's own choice is not the run's
        if jax.process_index() == 0:
            said = {"recorded": f"as {record.CHOICE_FILE} recorded them (a resume keeps its layout)",
                    "pinned": f"as run.shapes_file={self.cfg.run.shapes_file} pins them",
                    "model": f"chosen by the estimated time of {self.cfg.run.total_steps} steps on "
                             f"{self.device.describe()} (g2rl_jax/shapes/choice.py)"}[source]
            what = ("the score, reference and gradient passes pack whole sequences into these rows"
                    if isinstance(self.layout, PackShape) else "length-grouped micro-batches")
            print(f"{self.layout.name} ({len(self.layout.shapes)} shapes; {what}), prompt buckets "
                  f"{list(self.prompts)}: {said}", file=sys.stderr, flush=True)
            if self.choice is not None:
                for line in self.choice.lines(self.cfg.run.total_steps):
                    print("  " + line, file=sys.stderr, flush=True)
            if self.choice_file is not None and source != "recorded":
                storage.write_text(self.choice_file, record.choice_record(key, self.layout, self.prompts, source))

    # ------------------------------------------------------------------------------------------- the programs
    def score(self, graphdef, params, reference, batch: train_step.Batch, *, temperature: float, micro: int,
              batch_like: Callable[[int], train_step.Batch], chunk: int = train_step.g2rl.DEFAULT_CHUNK) -> Layout:
        """The run's layout (chosen on the first call), with its score and reference programs compiled at every
        prompt bucket (reference: (graphdef, params) of the KL reference, or None without the KL term;
        batch_like(S): a batch placed like `batch` with prompts of S tokens)."""
        if self.layout is None:
            self._choose(batch, micro=micro)
        if isinstance(self.layout, PackShape):
            self._packed_score(graphdef, params, reference, batch, temperature=temperature, chunk=chunk)
            return self.layout
        static = dict(temperature=temperature, chunk=chunk)
        hidden = train_step.hidden_size(graphdef, params)
        own = batch.prompt_len
        for prompt_len in self.prompts:
            if ("score", prompt_len) in self._done:
                continue
            self._done.add(("score", prompt_len))
            like = batch if prompt_len == own else batch_like(prompt_len)
            self._step_rows = like.response_mask.shape[0]
            passes = [(train_step.score_micro, graphdef, params, packed_accumulators(like, hidden))]
            if reference is not None:
                passes.append((train_step.ref_micro, *reference, packed_accumulators(like, hidden)[0]))
            self._compile_outs([(functools.partial(fn.lower, gd, p, like, np.arange(r, dtype=np.int32), width=w,
                                                   **static), outs)
                                for fn, gd, p, outs in passes for r, w in self.layout.shapes])
        return self.layout

    def _compile_outs(self, jobs: list) -> None:
        """Compile each job (lower(outs) -> Lowered, the outputs it puts into) for its outputs as the run's first
        call passes them (host zeros), then again for any whose compiled outputs are placed otherwise (the next
        call passes those)."""
        seen = set()
        while jobs:
            key = lambda job: (job[0], jax.tree.map(lambda x: (x.shape, str(x.dtype), x.sharding), job[1]))  # noqa: E731
            jobs = [j for j in jobs if repr(key(j)) not in seen]
            seen.update(repr(key(j)) for j in jobs)
            timings = self._compile([functools.partial(lower, outs) for lower, outs in jobs])
            jobs = [(lower, jax.tree.map(_template, t.compiled.out_info)) for (lower, _), t in zip(jobs, timings)
                    if t.error is None]

    def _packed_score(self, graphdef, params, reference, batch: train_step.Batch, *, temperature: float, chunk: int,
                      key: str = "packed score") -> None:
        """The packed score (and reference) programs at every (rows, width) of the layout, for batches like `batch`."""
        if (key, batch.response_mask.shape) in self._done:
            return
        self._done.add((key, batch.response_mask.shape))
        acc = packed_accumulators(batch, passes.graphdef_hidden(graphdef, params))
        self._compile([lower for _, _, lower in packed_score_lowers(self.layout, graphdef, params, reference, acc,
                                                                    batch, temperature=temperature, chunk=chunk)])

    def _packed_update(self, graphdef, params, mini: train_step.MiniBatch, *, settings: train_update.LossSettings):
        """The packed gradient programs at every (rows, width) (and, for a method with a token rule, the packed score
        programs over a mini-batch's rows, its current policy's pass); the accumulator spec of the first."""
        acc, lowers = packed_update_lowers(self.layout, graphdef, params, mini, settings=settings)
        self._compile([lower for _, _, lower in lowers])
        if methods.get(self.cfg.algorithm.exploration).tokens is not None:
            self._packed_score(graphdef, params, None, mini.batch, temperature=settings.temperature,
                               chunk=settings.chunk)
        return acc

    def _current_scores(self, graphdef, params, batch: train_step.Batch, settings: train_update.LossSettings):
        """The score programs over a mini-batch's rows at every shape (a token rule's current-policy pass,
        update.current_scores), for mini-batches smaller than the step."""
        outs = packed_accumulators(batch, train_step.hidden_size(graphdef, params))
        self._compile_outs([(functools.partial(train_step.score_micro.lower, graphdef, params, batch,
                                               np.arange(r, dtype=np.int32), width=w, temperature=settings.temperature,
                                               chunk=settings.chunk), outs) for r, w in self.layout.shapes])

    def update(self, graphdef, params, mini: train_step.MiniBatch, *, settings: train_update.LossSettings,
               mini_like: Callable[[int], train_step.MiniBatch], opt_state=None, optimizer=None) -> None:
        """The gradient program at every shape of the set and every prompt bucket (over mini-batches like `mini`;
        mini_like(S): one with prompts of S tokens) and, with `optimizer`, the optimizer step
        (train_update.apply_gradients) of `opt_state`; after `score` chose the set."""
        if self.layout is None:
            return
        lowers, acc = [], None
        if isinstance(self.layout, PackShape):
            if ("update",) not in self._done:
                self._done.add(("update",))
                acc = self._packed_update(graphdef, params, mini, settings=settings)
            if optimizer is not None and acc is not None and ("apply",) not in self._done:
                self._done.add(("apply",))
                self._compile([functools.partial(train_update.apply_gradients.lower, params, opt_state, *acc,
                                                 optimizer=optimizer)])
            return
        for prompt_len in self.prompts:
            if ("update", prompt_len) in self._done:
                continue
            self._done.add(("update", prompt_len))
            like = mini if prompt_len == mini.batch.prompt_len else mini_like(prompt_len)
            rows = like.batch.response_mask.shape[0]
            if methods.get(self.cfg.algorithm.exploration).tokens is not None and rows != self._step_rows:
                self._current_scores(graphdef, params, like.batch, settings)
            for r, w in self.layout.shapes:
                rows_X = np.arange(r, dtype=np.int32)
                if acc is None:  # the same for every shape
                    mb = jax.eval_shape(lambda m, x, w=w: train_step.take_rows(m, x, w), like, rows_X)
                    acc = train_update.accumulator_spec(train_update.policy_loss, graphdef, params, (mb,), settings,
                                                        like.batch.rewards)
                lowers.append(functools.partial(train_update.accumulate.lower, graphdef, params, acc, like, rows_X,
                                                settings=settings, total_rows=rows, width=w))
        if optimizer is not None and acc is not None and ("apply",) not in self._done:
            self._done.add(("apply",))
            lowers.append(functools.partial(train_update.apply_gradients.lower, params, opt_state, *acc,
                                            optimizer=optimizer))
        self._compile(lowers)


# ------------------------------------------------------------------------------------------- packed programs
# What the warm-up compiles for packed passes, over real or abstract (jax.ShapeDtypeStruct) batches alike, so that
# `python -m g2rl_jax.plan --compile` (aot/programs.py) lowers the very programs a run compiles.
Lowers = list[tuple[str, tuple[int, int], Callable[[], Any]]]  # (kind, packed (rows, width), () -> Lowered)


def _rows_spec(like_B, shape) -> jax.ShapeDtypeStruct:
    """What train_step.zeros_rows(like_B, shape) places, without allocating it: rows split like like_B's."""
    sharding = like_B.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        rows = sharding.spec[0] if len(sharding.spec) else None
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(rows))
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def packed_accumulators(batch: train_step.Batch, hidden: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The packed score pass's accumulators (log-probs [B, T], entropies [B, T], Φ [B, D]) for batches like `batch`."""
    b, t = batch.response_mask.shape
    return tuple(_rows_spec(batch.rewards, s) for s in ((b, t), (b, t), (b, hidden)))


def packed_score_lowers(shape: PackShape, graphdef, params, reference, acc, batch: train_step.Batch, *,
                        temperature: float, chunk: int) -> Lowers:
    """The packed score programs (passes.score_micro) and, with `reference` ((graphdef, params) of the KL
    reference), the reference ones (passes.ref_micro) at each of shape.micros, for batches like `batch`."""
    b, t = batch.response_mask.shape
    out: Lowers = []
    for micro in shape.micros:
        m = passes.template(shape, micro, b, t, batch.rewards)
        out.append(("score", micro, functools.partial(
            passes.score_micro.lower, graphdef, params, acc, m, _template(batch.response_mask),
            temperature=temperature, chunk=chunk, slots=shape.slots, block=shape.block)))
        if reference is not None:
            out.append(("reference", micro, functools.partial(
                passes.ref_micro.lower, *reference, acc[0], m, temperature=temperature, chunk=chunk,
                block=shape.block)))
    return out


def packed_update_lowers(shape: PackShape, graphdef, params, mini: train_step.MiniBatch, *,
                         settings: train_update.LossSettings) -> tuple[Any, Lowers]:
    """(the gradient accumulator's spec, the packed gradient programs (passes.accumulate) at each of shape.micros)
    for mini-batches like `mini`."""
    rows, t = mini.batch.response_mask.shape
    acc, out = None, []
    for micro in shape.micros:
        pm = passes.PackedMini.of(passes.template(shape, micro, rows, t, mini.batch.rewards), mini)
        acc = acc or train_update.accumulator_spec(passes.policy_loss, graphdef, params, (pm,), settings,
                                                 mini.batch.rewards)
        out.append(("gradient", micro, functools.partial(
            passes.accumulate.lower, graphdef, params, acc, pm, settings=settings, total_rows=rows,
            block=shape.block)))
    return acc, out
