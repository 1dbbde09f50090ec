"""One process per side (mesh.rollout_processes): the rollout process's loop, and the trainer's sampler that reads it.

    process 0 (training devices):   Trainer(cfg).run()   with   trainer.ahead = RemoteSampler(...)
    process 1 (rollout devices):    RolloutSide(cfg).run()      (train/command.py main picks it by process)

The schedule is train/ahead.py's: step s is drawn with policy version max(first, s − k) (k = rollout.max_staleness),
the launch's first step alone, later ones once the trainer has finished that first step; the lag is exactly
min(s, k) whatever the timing, so the run equals the one-process split run. What moves, and how:

- the weights, training → rollout: train/weight_sync.SideSync, cross-host `jax.device_put` (JAX alone: the DCN
  socket transfer on CPU, the TPU runtime's transfer on TPU). Each version the trainer publishes is announced
  under `g2rl_sides/version/V` in jax.distributed's key-value store (with the prompt buckets the trainer's warm-up
  chose, which the rollout then pads to), and moved if the rollout still needs it (V + k < total steps).
- the samples, rollout → training: each step's (prompts, Rollout, texts, rewards, ...) as pickled host values
  under `g2rl_sides/sample/S`, with the data-iterator position before and after its draw. They are Python
  objects (texts, reward records), not arrays.
- the start: the trainer's first step, data-iterator position and samples restored from its checkpoint, under
  `g2rl_sides/start`: the rollout process holds no state of its own, and a resumed run redraws from there.

Each side's host collectives (checkpoint barriers, the stop flag, gathers) then involve its own process only
(parallel.side_processes), and neither runs a program of the other's devices: the device_put of each version is
the one operation both call.
"""
from __future__ import annotations

import pickle
import time

import jax
import numpy as np
from flax import nnx
from jax._src import distributed

from g2rl_jax import parallel
from g2rl_jax.model import lora
from g2rl_jax.train.ahead import Drawn, _decode, _encode
from g2rl_jax.train.sampling_rounds import SamplingRounds
from g2rl_jax.train.weight_sync import SideSync, shardings_on

PREFIX = "g2rl_sides"
WAIT_MS = 3_600_000  # a hang guard only


def _set(key: str, value) -> None:
    distributed.global_state.client.key_value_set_bytes(f"{PREFIX}/{key}", pickle.dumps(value))


def _get(key: str):
    raw = distributed.global_state.client.blocking_key_value_get_bytes(f"{PREFIX}/{key}", WAIT_MS)
    return pickle.loads(raw)  # noqa: S301 - this run's own processes


def _needed(version: int, first: int, k: int, total: int) -> bool:
    """Whether the rollout draws with `version` (as AheadSampler.publish decides): a later step uses it."""
    return version + k < total or version == first


def _host(sample: tuple) -> tuple:
    """A step's samples with every array on the host (they cross to the other process pickled)."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, sample)


class RemoteSampler:
    """The trainer's side: its data iterator (checkpointed with the samples drawn ahead), `take` and `publish`, as
    AheadSampler, the draws made by the rollout process."""

    def __init__(self, trainer, loader, max_staleness: int):
        self.trainer, self.loader, self.k = trainer, loader, max_staleness
        self.total = trainer.cfg.run.total_steps
        trainable = lora.trainable(trainer.params)
        self.sync = SideSync(trainer.mesh, shardings_on(trainable, trainer.rollout_mesh))
        self._drawn: dict[int, Drawn] = {}  # samples restored from the checkpoint, or fetched, not yet taken
        self._before: dict[int, object] = {}  # step -> data-iterator position before its draw
        self._idle: dict[int, float] = {}  # step -> seconds the rollout process waited for a version before it
        self._first = self._taken = None

    def model(self):
        raise RuntimeError("one process per side: the trainer holds no copy of the sampler")

    def _start(self, step: int) -> None:
        self._first = self._taken = step
        _set("start", (step, self.loader.get_state(), sorted(self._drawn)))
        self.publish(step, self.trainer.params)

    def publish(self, version: int, params) -> None:
        """Announce version `version` and move it to the rollout process if it still draws with it."""
        needed = _needed(version, self._first, self.k, self.total)
        _set(f"version/{version}", (needed, self.trainer.warmup.prompts))
        if needed:
            self.sync.push(lora.trainable(params))

    def _fetch(self, step: int) -> Drawn:
        if step not in self._drawn:
            sample, version, seconds, before, after, idle = _get(f"sample/{step}")
            self._drawn[step] = Drawn(sample, version, seconds)
            self._before[step], self._before[step + 1], self._idle[step] = before, after, idle
        return self._drawn[step]

    def take(self, step: int) -> tuple[tuple, dict[str, float]]:
        """Step `step`'s samples and its lag and wait figures (as AheadSampler.take)."""
        if self._first is None:
            self._start(step)
        t0 = time.perf_counter()
        drawn = self._fetch(step)
        del self._drawn[step]
        self._taken = step + 1
        waited = time.perf_counter() - t0
        examples, rollout, texts, scored, _, sampled_correct = drawn.sample
        figures = {"staleness_mean": float(step - drawn.version), "staleness_max": float(step - drawn.version),
                   "policy_version": float(drawn.version), "update_idle_seconds": waited,
                   "rollout_idle_seconds": self._idle.pop(step, 0.0), "rollout_draw_seconds": drawn.seconds}
        return (examples, rollout, texts, scored, waited, sampled_correct), figures

    def sync_figures(self) -> dict[str, float]:
        """The last push's seconds on the trainer (dispatch; the transfer itself overlaps) and bytes."""
        return {"weight_sync_seconds": self.sync.seconds, "weight_sync_bytes": float(self.sync.bytes)}

    def close(self) -> None:
        """Wait until the rollout process has every version pushed (the trainer holds their buffers until then)."""
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
            return {"ahead": _encode((self.loader.get_state(), {}))}
        stop = min(self._taken + self.k, self.total)
        pending = {s: (d.sample, d.version, d.seconds) for s in range(self._taken, stop)
                   for d in [self._fetch(s)]}
        position = self._before.get(stop, self.loader.get_state())
        return {"ahead": _encode((position, pending))}

    def set_state(self, state) -> None:
        if isinstance(state, dict) and set(state) == {"ahead"}:
            position, pending = _decode(state["ahead"])
            self._drawn = {s: Drawn(*v) for s, v in pending.items()}
        else:
            position, self._drawn = state, {}
        self.loader.set_state(position)


class RolloutSide(SamplingRounds):
    """The rollout process: draws every step's samples on its mesh with the versions the trainer sends."""

    def __init__(self, cfg):
        from transformers import AutoTokenizer

        from g2rl_jax.data import make_prompt_loader
        from g2rl_jax.rewards.custom import resolve_spec
        from g2rl_jax.train import warmup
        from g2rl_jax.train.setup import load_model, on_mesh, prompt_lengths, stop_token_ids, usable_examples

        self.cfg = cfg
        train_mesh, self.mesh = parallel.split_meshes(cfg.mesh)
        self.rollout_mesh, self.ahead, self.eval_sets = self.mesh, None, {}
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.reward_cfg = cfg.reward
        if cfg.reward.function:
            import dataclasses

            self.reward_cfg = dataclasses.replace(cfg.reward, function=resolve_spec(cfg.reward.function))
        examples, _ = usable_examples(cfg, self.tokenizer)
        self.loader = make_prompt_loader(examples, batch_size=cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed,
                                         shard_index=0, shard_count=1)
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

    def run(self) -> None:
        """Draw every step from the trainer's start to run.total_steps, then return."""
        k, total = self.cfg.rollout.max_staleness, self.cfg.run.total_steps
        first, position, pending = _get("start")
        self.loader.set_state(position)
        floor = first if not pending else 0
        versions: dict[int, nnx.State] = {}
        arrived = first - 1  # the newest version announced so far

        def announce_through(version: int) -> None:
            nonlocal arrived
            while arrived < version:
                arrived += 1
                needed, prompts = _get(f"version/{arrived}")
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
            sample = _host(self._sample(step))
            _set(f"sample/{step}", (sample, version, time.perf_counter() - t0, before, self.loader.get_state(), idle))
            for v in [v for v in versions if v < max(floor, step + 1 - k)]:
                del versions[v]
        self.sync.wait()


def run_rollout_process(cfg) -> int:
    """train/command.py main's branch for a rollout process (mesh.rollout_processes)."""
    from g2rl_jax.train.setup import resolve_model_paths

    RolloutSide(resolve_model_paths(cfg)).run()
    return 0
