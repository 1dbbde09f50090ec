"""Orbax (the checkpoints, train/checkpoint.py) under run control: its commit of a step and its deletes of old steps
pass the fence (control/fence.py), its log records of a failure carry no traceback (the Checkpointer reports the
failure), and a failed restore from a bucket is told apart from a corrupt checkpoint by whether the store answers.
"""
from __future__ import annotations

import os

import orbax.checkpoint as ocp
from etils import epath

from g2rl_jax import storage
from g2rl_jax.control import errors, fence
from g2rl_jax.control.errors import StorageUnavailable

ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"  # in the path of Orbax's modules


def fenced_commits(directory: epath.Path) -> type:
    """Orbax's temporary-path class for `directory` (a commit file on GCS, a rename locally) whose commit passes
    the fence (control/fence.py) first: locally under the run lock's mutex for the rename's duration."""
    base = (ocp.path.atomicity.CommitFileTemporaryPath if storage.is_url(directory)
            else ocp.path.atomicity.AtomicRenameTemporaryPath)

    class FencedCommit(base):
        async def finalize(self, *args, **kwargs):
            with fence.guard(self.get_final()):
                await super().finalize(*args, **kwargs)

    return FencedCommit


class FencedDeleter:
    """Orbax's deleter of old steps (run.keep_checkpoints), each delete through the fence."""

    def __init__(self, deleter, directory: epath.Path):
        self._deleter, self._directory = deleter, directory

    def delete(self, step: int) -> None:
        with fence.guard(self._directory / str(step)):
            self._deleter.delete(step)

    def delete_steps(self, steps) -> None:
        for step in steps:
            self.delete(step)

    def close(self) -> None:
        self._deleter.close()


def quiet_orbax_failures() -> None:
    """Orbax's records of a failed save or finalize (absl's logger) lose their traceback: the failure reaches the
    Checkpointer's `save`/`wait`, which reports it in one line or re-raises it."""
    errors.one_line_records("absl", "a failed save", lambda record: ORBAX in record.pathname)


def probe(directory: epath.Path, err: BaseException) -> None:
    """After a failed read of checkpoints in a bucket: StorageUnavailable (with `err`) when the store does not answer
    a look at `directory` within the storage budget, else nothing (the checkpoint itself is at fault)."""
    from g2rl_jax import storage_clients

    if not storage.is_url(directory):
        return
    try:
        storage_clients._within(storage_clients.timeout_seconds(), "gcsfs", lambda: storage.exists(directory))
    except (StorageUnavailable, TimeoutError):
        raise StorageUnavailable(directory, err, client="tensorstore", verb="read") from err


def fence_deletes(manager, directory: epath.Path) -> None:
    """Put `manager`'s deleter of old steps behind the fence (Orbax 0.12.8 keeps it as _checkpoint_deleter and takes
    none through its options; another release fails here, at the Checkpointer's start, in one line)."""
    from g2rl_jax.errors import ConfigError

    if not hasattr(manager, "_checkpoint_deleter"):
        raise ConfigError("this orbax-checkpoint keeps no _checkpoint_deleter on its CheckpointManager; install "
                          "orbax-checkpoint 0.12.8, or update g2rl_jax/control/commits.py's fence_deletes")
    manager._checkpoint_deleter = FencedDeleter(manager._checkpoint_deleter, directory)
