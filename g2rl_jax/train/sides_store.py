"""The messages between the two process sets of a split run (mesh.rollout_processes, train/sides.py), each with its key
under `sides/` of the run's key-value channel (control/channel.py: JSON plus arrays, never pickle, chunked), the
schema its reader checks (control/wire.py), and the waits on them; and how each side learns that the other ended.

Keys: `version/V` (the training side announces each policy version: whether the rollout draws with it, and the
prompt buckets its warm-up chose), `sample/S/B` (the rollout side's block B of step S's samples, with the
data-iterator position before and after the draw), `read/sample/S/B` (a counter: how many training processes read
it; the last deletes both), `start` (the trainer's first step, data-iterator position and the steps of the samples
restored from its checkpoint), `alive/P` (a counter: rollout process P's lease, control/lease.py's KeyLease). A
value that is not what its schema says (a pickle planted in the store, a process of another version) stops every
process with one line naming the key, exit code 2 (wire.Refused, a control/errors.py BadInput), and nothing in it is
run (stop.refuse).

When one side ends or dies. The trainer's end (done, SIGTERM, an error) is a control/stop.py `finish` with the
trainer's exit code (control/errors.py's `exit_code`): the rollout process, whose gets ask `stop.ended` while they
wait, takes what the trainer already sent and returns that code (0 after a finished run, 143 after SIGTERM, 2 after
a setting the trainer refused, 1 after a bug), so that every process of the run reports what a supervisor should do
(exits.py) and all leave jax.distributed cleanly. Each rollout process renews a lease (`alive/P`, every
run.lock_lease_seconds / 3); the first training process, seeing no renewal of one for a whole lease, stops with one
line and Exit.PEER_LOST (KeyLease.watch, stop.stop_everywhere). A trainer that dies takes jax.distributed's
coordinator with it, and JAX ends the rollout processes at once ("the JAX distributed service detected fatal
errors"), or the rollout process notices first (channel.StoreGone) and ends with one line and Exit.PEER_LOST. Any
other process that dies (kill -9 of training process 1 of 2, of one rollout process of 2) breaks the collectives of
the processes it ran them with: the first of them to see its gloo connection lost stops every process with one line
and Exit.PEER_LOST (a PeerLost raised where the collective is called, control/errors.py; the trainer's loop and the
rollout process stop with it), at once rather than after jax.distributed's heartbeat timeout. A rollout process that
fails otherwise stops all with its error's line (stop.stop_everywhere; the trainer's stop.Watch ends it). The
key-value store lives in the trainer process, so a relaunch starts from a store without the old keys.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

from g2rl_jax.control import channel, errors, stop, wire
from g2rl_jax.train.ahead import SAMPLE_KINDS, Rounds, Sample

PREFIX = "sides"
KINDS = (*SAMPLE_KINDS, Rounds)  # the dataclasses a message may hold
START = tuple[int, Any, list[int]]  # first step, data-iterator position, the steps of the restored samples
VERSION = tuple[bool, tuple[int, ...] | None]  # drawn with, the warm-up's prompt buckets
# a block of a step's samples, the version that drew it, its draw's seconds, the data-iterator position before and
# after it, the seconds the rollout waited for the version, and how many blocks the step has
BLOCK = tuple[Sample | Rounds, int, float, Any, Any, float, int]


def _key(name: str) -> str:
    return f"{PREFIX}/{name}"


def _put(name: str, value) -> None:
    channel.default().put(_key(name), value)


def _get(name: str, schema, ended=None):
    """The message `name` once set (no bound: the other side's death ends the wait, see the module docstring);
    channel.Ended when `ended` says the trainer ended first; a value that is not ours stops the run."""
    try:
        return channel.default().get(_key(name), kinds=KINDS, schema=schema, timeout_s=math.inf, ended=ended)
    except wire.Refused as err:
        stop.refuse(err)


def put_start(step: int, position, pending: list[int]) -> None:
    _put("start", (step, position, pending))


def get_start() -> tuple[int, Any, list[int]]:
    """The trainer's start (the rollout process); channel.Ended if the trainer ended before it."""
    return _get("start", START, stop.ended)


def put_version(version: int, needed: bool, prompts: tuple[int, ...] | None) -> None:
    _put(f"version/{version}", (needed, prompts))


def get_version(version: int) -> tuple[bool, tuple[int, ...] | None]:
    """Version `version`'s announcement (the rollout process); channel.Ended if the trainer ended before it."""
    return _get(f"version/{version}", VERSION, stop.ended)


def put_block(step: int, block: int, message: tuple) -> None:
    """Block `block` of step `step`'s samples (BLOCK), from the rollout process that holds it."""
    _put(f"sample/{step}/{block}", message)


def read_block(step: int, block: int, readers: int) -> tuple:
    """Block `block` of step `step`'s samples, which each of the `readers` training processes reads: the last of
    them to read it deletes it (the store holds each once)."""
    name = f"sample/{step}/{block}"
    value = _get(name, BLOCK)
    if channel.default().increment(_key(f"read/{name}"), 1) == readers:
        channel.default().delete(_key(name))
        channel.default().delete(_key(f"read/{name}"))
    return value


def end_rollout(step: int, code: int) -> None:
    """Tell the rollout processes that the trainer ends after step `step` with exit code `code`: they end too, with
    that code."""
    stop.finish(step, code)


@contextlib.contextmanager
def told_if_failed(mesh_cfg):
    """Around the trainer's setup: with mesh.rollout_processes, a setup that fails tells the rollout processes,
    which would otherwise wait for the trainer's start; they end with the trainer's code."""
    try:
        yield
    except BaseException as err:
        if mesh_cfg.rollout_processes:
            end_rollout(0, errors.exit_code(err))
        raise
