"""Rollouts on their own mesh, ahead of the update (mesh.rollout_devices > 0; rollout.max_staleness = k).

A driver thread draws step s's samples (SamplingRounds._sample: prompts, rollout, rewards) on the rollout mesh
with the policy of version max(0, s − k), version v being the params after v updates; meanwhile the training
mesh scores and updates the earlier steps. The trainer takes step s's samples with `take(s)` and hands each new
version over with `publish(v, params)` (train/weight_sync.py moves it). k = 0 is the serial order of the
colocated run on two meshes; k = 1 is one-step-off (step s+1 is drawn while step s updates). The lag is exactly
min(s, k) whatever the timing, so a run is reproducible and a resumed run equals an uninterrupted one.

The update corrects for the lag with the sampler's own log-probs (Rollout.logprobs_BxT) as the behaviour policy:
the truncated importance weight min(π_old/π_sampler, algorithm.rollout_is_cap) of losses.ppo_loss, π_old being
the training side's score pass of the current params (the proximal policy of decoupled PPO, Hilton et al. 2022;
AReaL, Fu et al. 2025, uses the same split). Φ and novelty come from that score pass, as in the colocated run.

Checkpoints. The sampler stands in for the data iterator the Checkpointer saves (`get_state` / `set_state`).
After step t the checkpoint holds the params of version t+1; the samples of steps t+1 … t+k were drawn from
older versions, which the checkpoint does not hold, so they are saved with it (waiting for them if still in
flight), beside the iterator position before step t+k+1's draw, as JSON plus arrays (control/wire.py): read back,
every field is checked and nothing is unpickled (a pickle planted in the file is refused in one line). A resumed
run takes those samples, and redraws everything later from the checkpointed params, RNG key and iterator
position.

Several processes. Each process's rollout mesh is its own devices (parallel.split_meshes) and samples its block
of the step's prompts: the driver thread runs no device collective across processes, whose order against the
trainer's collectives could differ between processes and hang them. What the processes must agree on before a
rollout (the prompt bucket, dynamic sampling's correctness) goes host to host through the run's key-value channel
(`exchange`, control/channel.py).

A step's samples in blocks (also train/sides.py's, whose rollout and training meshes split the rows in blocks of
their own): `joined` puts the rollout blocks together, `block_of` cuts a training process's block out, and
`whole_step` does the first for dynamic sampling's rounds too (`Rounds`), picking the groups over the whole batch.

The first step of a launch runs alone (it compiles and chooses the run's shapes, train/warmup.py); overlap starts
with the next one.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from g2rl_jax.control import channel, stop, wire
from g2rl_jax.data.datasets import Example
from g2rl_jax.rewards.scoring import RewardResult
from g2rl_jax.rollout.generate import Rollout
from g2rl_jax.train.sampling_rounds import picked
from g2rl_jax.train.weight_sync import WeightSync

SAMPLE_KINDS = (Example, Rollout, RewardResult)
# a step's samples as SamplingRounds._sample returns them: examples, rollout, texts, rewards, rollout seconds, and
# each round's correctness (dynamic sampling)
Sample = tuple[list[Example], Rollout, list[str], RewardResult, float, list[np.ndarray]]
# what get_state saves beside the position: the samples drawn ahead by step, with the version and seconds of each
PENDING = dict[int, tuple[Sample, int, float]]


class _Closed(Exception):
    """The trainer closed the sampler while the driver waited for another process."""


@dataclasses.dataclass
class Drawn:
    """One step's samples (what SamplingRounds._sample returns), the policy version that drew every one of them,
    and the draw's wall time."""

    sample: tuple
    version: int
    seconds: float


def _rows(parts: list):
    """The rows of every block's `parts` (lists, or dataclasses of per-row arrays and lists) in block order; a
    dataclass's fields that are not per row (num_samples, decode_steps, segments) are the same in every block."""
    first = parts[0]
    if isinstance(first, list):
        return [x for part in parts for x in part]
    fields = {}
    for f in dataclasses.fields(first):
        values = [getattr(part, f.name) for part in parts]
        if isinstance(values[0], list):
            fields[f.name] = [x for v in values for x in v]
        elif isinstance(values[0], np.ndarray) and values[0].ndim:
            fields[f.name] = np.concatenate(values, axis=0)
    return dataclasses.replace(first, **fields)


def joined(blocks: list[tuple]) -> tuple:
    """One step's samples (SamplingRounds._sample's tuple) from those of each batch block of the rollout mesh, in
    block order: what one process holding the whole rollout mesh would have drawn. The rollout seconds are the
    slowest block's; each round's correctness flags are already the whole batch's on every block."""
    if len(blocks) == 1:
        return blocks[0]
    examples, rollout, texts, scored, seconds, correct = zip(*blocks, strict=True)
    return _rows(examples), _rows(rollout), _rows(texts), _rows(scored), max(seconds), correct[0]


def _block_rows(part, i: int, n: int):
    """Block i of n of `part`'s rows (a list, or a dataclass of per-row arrays and lists): the inverse of `_rows`."""
    def cut(rows):
        size = len(rows) // n
        return rows[i * size:(i + 1) * size]

    if isinstance(part, list):
        return cut(part)
    fields = {f.name: getattr(part, f.name) for f in dataclasses.fields(part)}
    return dataclasses.replace(part, **{name: cut(v) for name, v in fields.items()
                                        if isinstance(v, list) or (isinstance(v, np.ndarray) and v.ndim)})


def block_of(sample: tuple, i: int, n: int) -> tuple:
    """Block i of the n equal blocks of a whole step's samples (`joined`'s tuple): the rows a process holding block
    i of a training mesh keeps (parallel.batch_block). Each round's correctness flags stay the whole batch's."""
    if n == 1:
        return sample
    examples, rollout, texts, scored, seconds, correct = sample
    return (_block_rows(examples, i, n), _block_rows(rollout, i, n), _block_rows(texts, i, n),
            _block_rows(scored, i, n), seconds, correct)


@dataclasses.dataclass
class Rounds:
    """What a rollout process sends for a step of dynamic sampling when the rollout mesh spans several processes:
    every round's (examples, rollout, texts, rewards) of its block's rows, the rollout seconds, and each round's
    global correctness. The rounds went on as the whole batch decides (one block), and the trainer picks the
    groups from the joined rounds (sampling_rounds.picked): the choice of one process holding the whole mesh."""

    rounds: list[tuple[list[Example], Rollout, list[str], RewardResult]]
    seconds: float
    correct: list[np.ndarray]


def whole_step(blocks: list, m: int) -> tuple:
    """A step's samples (SamplingRounds._sample's tuple) from what each block of the rollout mesh sent, in block
    order: `joined`, or for Rounds each round joined and the groups then picked over the whole batch."""
    if not isinstance(blocks[0], Rounds):
        return joined(blocks)
    first = blocks[0]
    rounds = [joined([(*b.rounds[r], b.seconds, b.correct) for b in blocks])[:4] for r in range(len(first.rounds))]
    return (*picked(rounds, first.correct, m, 1, 0), max(b.seconds for b in blocks), first.correct)


def lag_figures(step: int, drawn: Drawn, waited: float, rollout_idle: float) -> tuple[tuple, dict[str, float]]:
    """What `take(step)` returns (this sampler's and train/sides.py's): the step's samples, with the seconds the
    trainer waited in place of the rollout's own, and the step's lag and wait figures."""
    examples, rollout, texts, scored, _, sampled_correct = drawn.sample
    lag = float(step - drawn.version)
    figures = {"staleness_mean": lag, "staleness_max": lag, "policy_version": float(drawn.version),
               "update_idle_seconds": waited, "rollout_idle_seconds": rollout_idle,
               "rollout_draw_seconds": drawn.seconds}
    return (examples, rollout, texts, scored, waited, sampled_correct), figures


def saved(position, pending: dict[int, Drawn]) -> dict[str, Any]:
    """What `get_state` saves in each process's data-iterator file (a JSON file of the checkpoint): the
    data-iterator position and the samples drawn ahead by step, as JSON plus arrays (control/wire.py)."""
    return {"ahead": wire.to_json((position, {s: (d.sample, d.version, d.seconds) for s, d in pending.items()}))}


def restored(state, where: str = "the samples drawn ahead") -> tuple[Any, dict[int, Drawn]]:
    """(data-iterator position, samples drawn ahead by step) of what `get_state` saved, every field checked
    (wire.Refused, naming `where`, for anything else: a pickle planted in the file, or the pickled state older
    versions wrote); a plain iterator state, from a run without a sampler ahead, is taken as the position."""
    if isinstance(state, dict) and set(state) == {"ahead"}:
        if isinstance(state["ahead"], str):
            raise wire.Refused(f"{where}: pickled (what versions before 2026-11-29 wrote, or a payload planted in "
                               "the file); refused, nothing in it was run: resume this run with the "
                               "version that wrote it, or start it anew in another run.output_dir")
        position, pending = wire.from_json(state["ahead"], SAMPLE_KINDS, tuple[Any, PENDING], where)
        return position, {s: Drawn(*v) for s, v in pending.items()}
    return state, {}


class AheadSampler:
    """The rollout driver (see the module docstring); also the data iterator the trainer reads and checkpoints."""

    def __init__(self, trainer, loader, max_staleness: int):
        self.trainer, self.loader, self.k = trainer, loader, max_staleness
        self.total = trainer.cfg.run.total_steps
        self.sync = WeightSync(trainer.graphdef, trainer.params, trainer.rollout_mesh)
        self._cond = threading.Condition()
        self._versions: dict[int, nnx.State] = {}  # rollout-side params by version
        self._drawn: dict[int, Drawn] = {}  # samples drawn, not yet taken
        self._before: dict[int, Any] = {}  # step -> data-iterator state before that step's draw
        self._next = self._first = self._taken = None  # next step to draw; first step taken this launch; next to take
        self._floor = 0  # no version below it exists (a launch that resumed without saved samples)
        self._warm = False  # the launch's first step has finished
        self._current = None  # the rollout-side params of the draw in progress
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._rollout_idle = 0.0  # seconds the driver waited for a version since the last take
        self._held: str | None = None  # this process's key of the last exchange (see exchange)

    # ---------------------------------------------------------------------------------------- the schedule
    def version_of(self, step: int) -> int:
        """The policy version that draws step `step`: max(0, step − k)."""
        return max(self._floor, step - self.k)

    def model(self):
        """The sampler: the policy of the draw in progress (else the newest version) on the rollout mesh."""
        params = self._current if self._current is not None else self._versions[max(self._versions)]
        return nnx.merge(self.sync.graphdef, params)

    def _start(self, step: int) -> None:
        self._first = self._taken = step
        if self._drawn:  # samples restored from the checkpoint
            self._next = max(self._drawn) + 1
        else:
            self._next, self._floor = step, step
        if self.version_of(self._next) != step and self._next < self.total:
            raise RuntimeError(f"step {self._next} needs policy version {self.version_of(self._next)}, but the "
                               f"params at hand are version {step}")
        self.publish(step, self.trainer.params)
        self._thread = threading.Thread(target=self._drive, name="g2rl-rollout-ahead", daemon=True)
        self._thread.start()

    def publish(self, version: int, params) -> None:
        """Hand version `version` of the policy (params after that many updates) to the rollout side."""
        needed = version + self.k < self.total or version == self._first
        moved = self.sync.push(params) if needed else None
        with self._cond:
            if moved is not None:
                self._versions[version] = moved
            self._warm |= version > self._first
            self._cond.notify_all()

    def _ready(self, step: int) -> bool:
        return self.version_of(step) in self._versions and (self._warm or step == self._first)

    def _drive(self) -> None:
        try:
            while True:
                with self._cond:
                    t0 = time.perf_counter()
                    while not self._closing and self._next < self.total and not self._ready(self._next):
                        self._cond.wait()
                    self._rollout_idle += time.perf_counter() - t0
                    if self._closing or self._next >= self.total:
                        return
                    step, version = self._next, self.version_of(self._next)
                    self._current = self._versions[version]
                    self._before[step] = self.loader.get_state()
                t0 = time.perf_counter()
                sample = self.trainer._sample(step)
                seconds = time.perf_counter() - t0
                with self._cond:
                    self._drawn[step] = Drawn(sample, version, seconds)
                    self._next = step + 1
                    self._before[step + 1] = self.loader.get_state()
                    self._current = None
                    for v in [v for v in self._versions if v < self.version_of(step + 1)]:
                        del self._versions[v]
                    self._cond.notify_all()
        except _Closed:
            return
        except BaseException as err:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def exchange(self, name: str, value, block: int) -> list[np.ndarray]:
        """Every process block's `value` in block order (each block once), on every process, through the run's
        key-value channel: host to host. The driver thread issues no device collective across processes: its
        order against the trainer's could differ between processes and hang both."""
        ch, key = channel.default(), f"ahead/{name}"
        mine = f"{key}/{jax.process_index()}"
        ch.put(mine, (block, np.asarray(value)))
        by_block: dict[int, np.ndarray] = {}
        for process in range(jax.process_count()):
            try:  # no bound: a closed sampler (the trainer's end) or a gone process's stop ends the wait
                b, v = ch.get(f"{key}/{process}", schema=tuple[int, np.ndarray], timeout_s=math.inf,
                              ended=lambda: True if self._closing else None)
            except channel.Ended:
                raise _Closed(key) from None
            except wire.Refused as err:
                stop.refuse(err)
            by_block.setdefault(b, v)
        # every process set this key after reading all of the previous exchange's: that one can go
        if self._held is not None:
            ch.delete(self._held)
        self._held = mine
        return [by_block[b] for b in sorted(by_block)]

    def _wait(self, done) -> None:
        while not done() and self._error is None:
            self._cond.wait()
        if self._error is not None:
            raise self._error

    def take(self, step: int) -> tuple[tuple, dict[str, float]]:
        """Step `step`'s samples (as SamplingRounds._sample returns them, with the seconds the trainer waited in
        place of the rollout's own) and the step's lag, wait and weight-sync figures."""
        if self._thread is None:
            self._start(step)
        t0 = time.perf_counter()
        with self._cond:
            self._wait(lambda: step in self._drawn)
            drawn = self._drawn.pop(step)
            rollout_idle, self._rollout_idle = self._rollout_idle, 0.0
            self._taken = step + 1
        return lag_figures(step, drawn, time.perf_counter() - t0, rollout_idle)

    def sync_figures(self) -> dict[str, float]:
        """The last push's seconds and bytes (the trainable params: the adapters with LoRA)."""
        return {"weight_sync_seconds": self.sync.seconds, "weight_sync_bytes": float(self.sync.bytes)}

    def close(self) -> None:
        """Stop the driver after the draw in progress (its samples are dropped)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ---------------------------------------------------------------------------------------- data iterator
    def __iter__(self):
        return self

    def __next__(self):
        return next(self.loader)

    def get_state(self) -> dict[str, str]:
        """What the checkpoint of the steps taken so far saves: the samples of later steps drawn from versions
        older than the current params (waited for), and the iterator position before the first draw of a later
        version (see the module docstring)."""
        if self._taken is None:
            return saved(self.loader.get_state(), {})
        stop = min(self._taken + self.k, self.total)
        with self._cond:
            self._wait(lambda: all(s in self._drawn for s in range(self._taken, stop)))
            pending = {s: self._drawn[s] for s in range(self._taken, stop)}
            position = self._before.get(stop)
        if position is None:  # nothing drawn this launch yet
            position = self.loader.get_state()
        return saved(position, pending)

    def set_state(self, state) -> None:
        """Restore what get_state saved (a plain iterator state, from a run without the sampler, is taken as is)."""
        position, self._drawn = restored(state)
        self.loader.set_state(position)

