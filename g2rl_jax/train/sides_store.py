"""The key-value store between the two process sets of a split run (mesh.rollout_processes, train/sides.py): its keys
under `g2rl_sides/` in jax.distributed's store, the waits on them, and how each side learns that the other ended.

Keys: `version/V` (the training side announces each policy version), `sample/S/B` (the rollout side's block B of step
S's samples), `read/sample/S/B` (how many training processes read it), `start` (the trainer's first step, position
and restored samples), `stop` (the trainer's last step and exit code), `alive/P` (rollout process P's lease,
control/lease.py's KeyLease). Values
are pickled host values of this run's own processes.

When one side ends or dies. The trainer's end (done, SIGTERM, an error) sets `g2rl_sides/stop`: the rollout
process, which polls for it while it waits, takes what the trainer already sent and returns (exit 0 after a
finished run, else ENDED_EARLY_EXIT), so all leave jax.distributed cleanly. Each rollout process renews a lease
(`g2rl_sides/alive/P`, every run.lock_lease_seconds / 3); the first training process, seeing no renewal of one for a
whole lease, stops with one line and Exit.PEER_LOST (halt.stop_everywhere). A trainer that dies takes jax.distributed's
coordinator with it, and JAX ends the rollout processes at once ("the JAX distributed service detected fatal
errors"). Any other process that dies (kill -9 of training process 1 of 2, of one rollout process of 2) breaks the
collectives of the processes it ran them with: the first of them to see its gloo connection lost stops every
process with one line and Exit.PEER_LOST (a PeerLost raised where the collective is called, control/errors.py; the
trainer's loop and the rollout process stop with it), at once rather than after jax.distributed's heartbeat timeout.
A rollout process that fails otherwise stops all with its error's line (halt.stop_everywhere; the trainer's
halt.PeerWatch ends it). The key-value store lives in the trainer process, so a relaunch starts from a store
without the old keys.
"""
from __future__ import annotations

import contextlib
import pickle

import jax
from jax._src import distributed

PREFIX = "g2rl_sides"
POLL_MS = 1000  # a wait for the other side's key, between looks at whether that side has ended
ENDED_EARLY_EXIT = 1  # the rollout process, when the trainer ended before run.total_steps


class TrainerEnded(Exception):
    """The trainer set `g2rl_sides/stop` while the rollout process waited for it: (its last step, exit code)."""


def client():
    """jax.distributed's client, whose key-value store both sides share."""
    return distributed.global_state.client


def put(key: str, value) -> None:
    """Set `key` to `value` (pickled) for the other side."""
    client().key_value_set_bytes(f"{PREFIX}/{key}", pickle.dumps(value))


def look(key: str):
    """The value of `key`, None while nobody has set it."""
    try:
        return pickle.loads(client().key_value_try_get_bytes(f"{PREFIX}/{key}"))  # noqa: S301 - this run's own
    except jax.errors.JaxRuntimeError as err:
        if "NOT_FOUND" not in str(err):
            raise
        return None


def get(key: str, ended=lambda: None):
    """The value of `key` once the other side has set it; TrainerEnded when `ended()` gives an exit code first (a
    key set before the trainer ended is still taken)."""
    while True:
        try:
            raw = client().blocking_key_value_get_bytes(f"{PREFIX}/{key}", POLL_MS)
            return pickle.loads(raw)  # noqa: S301 - this run's own processes
        except jax.errors.JaxRuntimeError as err:
            if "DEADLINE_EXCEEDED" not in str(err):
                raise
        code = ended()
        if code is not None:
            value = look(key)  # set just before the stop
            if value is None:
                raise TrainerEnded(code)
            return value


def end_rollout(step: int, code: int) -> None:
    """Tell the rollout process that the trainer ends after step `step` with exit code `code`: it ends too."""
    client().key_value_set_bytes(f"{PREFIX}/stop", pickle.dumps((step, code)), allow_overwrite=True)


@contextlib.contextmanager
def told_if_failed(mesh_cfg):
    """Around the trainer's setup: with mesh.rollout_processes, a setup that fails tells the rollout process, which
    would otherwise wait for the trainer's start."""
    try:
        yield
    except BaseException:
        if mesh_cfg.rollout_processes:
            end_rollout(0, ENDED_EARLY_EXIT)
        raise


def trainer_ended():
    """(the trainer's last step, its exit code) once it has ended (it sets `stop`), else None."""
    return look("stop")
