"""One process set per side (mesh.rollout_processes): the rollout processes' loop, and the trainer's sampler that
reads it.

    processes 0..N-1 (training devices):   Trainer(cfg).run()   with   trainer.ahead = RemoteSampler(...)
    processes N..N+M-1 (rollout devices):  RolloutSide(cfg).run()      (train/command.py main picks it by process)

With M > 1 rollout processes their rollout mesh samples each step together, one sharded `generate` over the
whole batch (rollout/generate.py's multi-host path): each process keeps its block of the batch. With N > 1
training processes the training mesh spans them as the colocated multi-host trainer's does: every training process
reads each step's whole samples and keeps its block of the rows (ahead.block_of; parallel.batch_block of the training
mesh). Each side's host collectives run over its own processes (parallel.allgather, sync, broadcast_one_to_all).

The schedule is train/ahead.py's: step s is drawn with policy version max(first, s − k) (k = rollout.max_staleness),
the launch's first step alone, later ones once the trainer has finished that first step; the lag is exactly
min(s, k) whatever the timing, so the run equals the one-process split run. What moves, and how:

- the weights, training → rollout: train/weight_sync.SideSync, cross-host `jax.device_put` (JAX alone: the DCN
  socket transfer on CPU, the TPU runtime's transfer on TPU), every process of both sides taking part; the
  training mesh first all-gathers each array when it is sharded over several processes. Each version the training
  side's first process publishes is announced
  under `sides/version/V` of the key-value channel (with the prompt buckets the trainer's warm-up chose, which the
  rollout then pads to), and moved if the rollout still needs it (V + k < total steps).
- the samples, rollout → training: each step's (prompts, Rollout, texts, rewards, ...) as JSON plus arrays
  (control/wire.py, checked against their schema when read) under `sides/sample/S/B` of the run's key-value channel
  (control/channel.py: large values in chunks), one per batch block B of the rollout mesh (`joined` in block order
  by the trainer), with the data-iterator position before and after its draw. Every training process reads each;
  the last to read it deletes it.
- the start: the trainer's first step, data-iterator position and the steps of the samples restored from its
  checkpoint, under `sides/start`: the rollout process holds no state of its own, and a resumed run redraws from
  there.

Each side's host collectives (checkpoint barriers, the stop flag, the warm-up's choice, the shared-directory check,
gathers) then involve its own processes only (parallel.side_processes, parallel.allgather), and neither runs a
program of the other's devices: the device_put of each version is the one operation both call. The training side
checkpoints with Orbax on its processes only (`active_processes`): host copies of the arrays with one training
process, the global arrays with several; each training process writes its own data-iterator file.

When one side ends or dies: train/sides_store.py (the messages, the trainer's end, the rollout processes' leases,
and the exit codes) and control/stop.py.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

import jax
import numpy as np
from flax import nnx

from g2rl_jax import parallel
from g2rl_jax.control import channel, errors, stop
from g2rl_jax.control.errors import UNAVAILABLE, RunFailure, device_failure
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.lease import KeyLease
from g2rl_jax.model import lora
from g2rl_jax.train import sides_store as store
from g2rl_jax.train.ahead import Drawn, Rounds, block_of, lag_figures, restored, saved, whole_step
from g2rl_jax.train.sampling_rounds import SamplingRounds
from g2rl_jax.train.weight_sync import SideSync, shardings_on


def _needed(version: int, first: int, k: int, total: int) -> bool:
    """Whether the rollout draws with `version` (as AheadSampler.publish decides): a later step uses it."""
    return version + k < total or version == first


def _host(sample: tuple) -> tuple:
    """A step's samples with every array on the host (they cross to the other process as JSON plus arrays)."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, sample)


class RemoteSampler:
    """The trainer's side: its data iterator (checkpointed with the samples drawn ahead), `take` and `publish`, as
    AheadSampler, the draws made by the rollout process."""

    def __init__(self, trainer, loader, max_staleness: int):
        self.trainer, self.loader, self.k = trainer, loader, max_staleness
        self.total = trainer.cfg.run.total_steps
        trainable = lora.trainable(trainer.params)
        self.sync = SideSync(trainer.mesh, shardings_on(trainable, trainer.rollout_mesh))
        self.trainers = parallel.host_count()  # the training processes: each reads every step's samples
        self.block = parallel.batch_block(trainer.mesh)  # (i, n): the rows of each step this process keeps
        self.lease = KeyLease(store.PREFIX, trainer.cfg.run.lock_lease_seconds)
        if jax.process_index() == 0:  # the training side's first process watches (its stop ends every process)
            self.lease.watch(list(range(self.trainers, jax.process_count())))
        self._closed = False
        self._drawn: dict[int, Drawn] = {}  # samples restored from the checkpoint, or fetched, not yet taken
        self._before: dict[int, object] = {}  # step -> data-iterator position before its draw
        self._idle: dict[int, float] = {}  # step -> seconds the rollout process waited for a version before it
        self._first = self._taken = None

    def model(self):
        raise RuntimeError("one process per side: the trainer holds no copy of the sampler")

    def _start(self, step: int) -> None:
        self._first = self._taken = step
        if jax.process_index() == 0:  # the training processes hold the same position and samples
            store.put_start(step, self.loader.get_state(), sorted(self._drawn))
        self.publish(step, self.trainer.params)

    def publish(self, version: int, params) -> None:
        """Announce version `version` (the training side's first process) and move it to the rollout processes (all
        of both sides) if the rollout still draws with it."""
        needed = _needed(version, self._first, self.k, self.total)
        if jax.process_index() == 0:
            store.put_version(version, needed, self.trainer.warmup.prompts)
        if needed:
            self.sync.push(lora.trainable(params))

    def _fetch(self, step: int) -> Drawn:
        if step not in self._drawn:
            parts, blocks = [], 1
            while len(parts) < blocks:  # block 0 says how many blocks the rollout mesh drew the step in
                sample, version, seconds, before, after, idle, blocks = store.read_block(step, len(parts),
                                                                                         self.trainers)
                parts.append((sample, seconds, idle))
            whole = whole_step([p[0] for p in parts], self.trainer.cfg.rollout.num_samples)
            self._drawn[step] = Drawn(whole, version, max(p[1] for p in parts))
            self._before[step], self._before[step + 1] = before, after  # every block's loader moves alike
            self._idle[step] = max(p[2] for p in parts)
        return self._drawn[step]

    def take(self, step: int) -> tuple[tuple, dict[str, float]]:
        """This process's block of step `step`'s samples, and the step's lag and wait figures (as
        AheadSampler.take)."""
        if self._first is None:
            self._start(step)
        t0 = time.perf_counter()
        drawn = self._fetch(step)
        del self._drawn[step]
        self._taken = step + 1
        mine = Drawn(block_of(drawn.sample, *self.block), drawn.version, drawn.seconds)
        return lag_figures(step, mine, time.perf_counter() - t0, self._idle.pop(step, 0.0))

    def sync_figures(self) -> dict[str, float]:
        """The last push's seconds on the trainer (dispatch; the transfer itself overlaps) and bytes."""
        return {"weight_sync_seconds": self.sync.seconds, "weight_sync_bytes": float(self.sync.bytes)}

    def close(self) -> None:
        """Tell the rollout processes that the trainer ends (after which step, and with the exit code the trainer's
        process ends with: done, SIGTERM, or the error on its way out), then wait until they have every version
        pushed (the trainer holds their buffers until then)."""
        if self._closed:
            return
        self._closed = True
        self.lease.stop()
        code = (Exit.DONE if self.trainer.step >= self.total else Exit.PREEMPTED if self.trainer.preempted
                else errors.exit_code(sys.exc_info()[1]))
        store.end_rollout(self.trainer.step, code)
        if self._first is not None:
            self.sync.wait()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.loader)

    def get_state(self) -> dict[str, str]:
        """As AheadSampler.get_state: the samples of steps taken … taken + k − 1 (fetched) and the position
        before the next draw."""
        if self._taken is None:
            return saved(self.loader.get_state(), {})
        stop = min(self._taken + self.k, self.total)
        pending = {s: self._fetch(s) for s in range(self._taken, stop)}
        return saved(self._before.get(stop, self.loader.get_state()), pending)

    def set_state(self, state) -> None:
        position, self._drawn = restored(state)
        self.loader.set_state(position)


class RolloutSide(SamplingRounds):
    """The rollout process: draws every step's samples on its mesh with the versions the trainer sends."""

    def __init__(self, cfg):
        from g2rl_jax.data import make_prompt_loader
        from g2rl_jax.data.tokenizer import load_tokenizer
        from g2rl_jax.rewards.custom import resolve_spec
        from g2rl_jax.train import warmup
        from g2rl_jax.train.setup import load_model, on_mesh, prompt_lengths, stop_token_ids, usable_examples

        self.cfg = cfg
        train_mesh, self.mesh = parallel.split_meshes(cfg.mesh)
        self.rollout_mesh, self.ahead, self.eval_sets = self.mesh, None, {}
        self.block, self.blocks = parallel.batch_block(self.mesh)  # the prompts this process holds: a block of each
        blocks_A = parallel.allgather(np.int32(self.block)).reshape(-1).tolist()  # the side's processes, in order
        self.sends = blocks_A.index(self.block) == sorted(parallel.side_processes()).index(jax.process_index())
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.reward_cfg = cfg.reward
        if cfg.reward.function:
            self.reward_cfg = dataclasses.replace(cfg.reward, function=resolve_spec(cfg.reward.function))
        examples, _ = usable_examples(cfg, self.tokenizer)
        self.loader = make_prompt_loader(examples, batch_size=cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed,
                                         shard_index=self.block, shard_count=self.blocks)
        model = load_model(cfg.model, self.mesh, seed=cfg.run.seed)  # the frozen base (LoRA) stays as loaded
        self.graphdef, self.params = nnx.split(model)
        self.trainable_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                               lora.trainable(self.params))
        self.sync = SideSync(train_mesh, shardings_on(lora.trainable(self.params), self.mesh))
        from g2rl_jax import storage

        run_dir = storage.path(cfg.run.output_dir, "run.output_dir")
        self.warmup = warmup.RunWarmup.for_run(cfg, model.config, self.mesh, run_dir,
                                               prompt_lengths([examples], self.tokenizer, cfg.data))
        self.rng_key_data = on_mesh(jax.random.key_data(jax.random.key(cfg.run.seed)), self.mesh)
        self._warmed_prompts: set[int] = set()
        self._current = None

    def rollout_model(self):
        return nnx.merge(self.graphdef, self._current)

    def _sample(self, step: int):
        """This block's samples of step `step`; with dynamic sampling on a rollout mesh of several processes, the
        rounds as the whole batch decides them (Rounds: the trainer picks the groups)."""
        if not (self.cfg.algorithm.dynamic_sampling and self.blocks > 1):
            return _host(super()._sample(step))
        rounds, correct, seconds = self._rounds(step, 1)
        return Rounds(_host(rounds), seconds, _host(correct))

    def run(self) -> int:
        """Draw every step from the trainer's start to run.total_steps; the exit code (train/sides_store.py says
        which)."""
        try:
            self._draw_all()
        except channel.Ended as ended:
            end = ended.reason
            print(f"the trainer ended after step {end.step} of {self.cfg.run.total_steps} (its log says why): this "
                  f"rollout process ends too, with its exit code {end.code}; relaunch both processes together",
                  file=sys.stderr, flush=True)
            return end.code
        return Exit.DONE

    def _draw_all(self) -> None:
        k, total = self.cfg.rollout.max_staleness, self.cfg.run.total_steps
        first, position, pending = store.get_start()
        self.loader.set_state(position)
        floor = first if not pending else 0
        versions: dict[int, nnx.State] = {}
        arrived = first - 1  # the newest version announced so far

        def announce_through(version: int) -> None:
            nonlocal arrived
            while arrived < version:
                arrived += 1
                needed, prompts = store.get_version(arrived)
                if prompts is not None:
                    self.warmup.prompts = prompts
                if needed:
                    moved = self.sync.push(self.trainable_abstract)
                    versions[arrived] = nnx.merge_state(lora.split_trainable(self.params)[1], moved)

        for step in range(max(pending, default=first - 1) + 1, total):
            version = max(floor, step - k)
            t0 = time.perf_counter()
            announce_through(max(version, first + 1) if step > first else version)  # later steps: after the first
            idle = time.perf_counter() - t0  # waiting for the trainer's version (and its transfer)
            self._current = versions[version]
            before = self.loader.get_state()
            t0 = time.perf_counter()
            sample = self._sample(step)  # this block's rows (the rollout mesh samples the batch together)
            if self.sends:  # the first process of each block sends it
                store.put_block(step, self.block, (sample, version, time.perf_counter() - t0, before,
                                                   self.loader.get_state(), idle, self.blocks))
            for v in [v for v in versions if v < max(floor, step + 1 - k)]:
                del versions[v]
        self.sync.wait()


def run_rollout_process(cfg) -> int:
    """train/command.py main's branch for a rollout process (mesh.rollout_processes): its exit code. SIGTERM does not
    end it: the trainer, told too, finishes its step and checkpoints, and its stop then ends this process."""
    import traceback

    from g2rl_jax.train.setup import resolve_model_paths

    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM: the rollout process goes on until the trainer ends",
                                                  file=sys.stderr, flush=True))
    KeyLease(store.PREFIX, cfg.run.lock_lease_seconds).renew()  # until the process ends (see below)
    try:
        with stop.Watch():  # the trainer's stop (its end, a lost run lock, a storage failure) ends it too
            return RolloutSide(resolve_model_paths(cfg)).run()
    except Exception as err:  # noqa: BLE001 - its traceback, then one line that ends the trainer too
        if isinstance(err, channel.StoreGone) or (isinstance(err, jax.errors.JaxRuntimeError)
                                                  and err.error_code == UNAVAILABLE):
            # the trainer held jax.distributed's coordinator: it is gone (JAX's own client may end us first)
            print("the trainer process is gone (jax.distributed's coordinator does not answer): this rollout "
                  "process ends; relaunch both processes together", file=sys.stderr, flush=True)
            os._exit(Exit.PEER_LOST)
        typed = err if isinstance(err, RunFailure) else device_failure(err, "the rollout process")
        if typed is not None:  # classified where raised (control/errors.py): its line and code, all stop
            errors.end_run(typed)
        traceback.print_exc()
        stop.stop_everywhere(f"rollout process error: {type(err).__name__}: {err}", Exit.BUG)
    # the lease is never stopped: after its last draw this process waits in jax.distributed's shutdown for the trainer,
    # which still trains up to rollout.max_staleness steps and may take longer than a lease (its watch stops first)
