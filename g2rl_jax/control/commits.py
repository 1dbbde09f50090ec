"""Orbax (the checkpoints, train/checkpoint.py) under run control: its commit of a step and its deletes of old steps
pass the fence (control/fence.py); on GCS each launch writes a step where no other launch reads or writes, so what
tensorstore sends itself (which the fence does not see) cannot reach another launch's step (`fenced_commits`); its
log records of a failure carry no traceback (the Checkpointer reports the failure), and a failed restore from a
bucket is told apart from a corrupt checkpoint by whether the store answers.
"""
from __future__ import annotations

import asyncio
import os
import time

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import checkpoint as ocp_metadata

from g2rl_jax import storage
from g2rl_jax.control import errors, fence
from g2rl_jax.control.errors import StorageUnavailable

ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"  # in the path of Orbax's modules
SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp": a step directory not committed yet
COMMIT_FILE = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # "commit_success.txt": on GCS, what makes a step count


def fenced_commits(directory: epath.Path, launch: str) -> type:
    """Orbax's temporary-path class for `directory` whose commit passes the fence (control/fence.py) first. Locally
    a rename (under the run lock's mutex for its duration). On GCS each launch writes a step into a directory of its
    own, `<step>.orbax-checkpoint-tmp-<launch>` (`launch`: the same on every process of the launch), and its commit
    copies that into `<step>/` and writes commit_success.txt there last (`LaunchCommit`)."""
    if not storage.is_url(directory):
        class FencedCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
            async def finalize(self, *args, **kwargs):
                with fence.guard(self.get_final()):
                    await super().finalize(*args, **kwargs)

        return FencedCommit

    class LaunchCommit(ocp.path.atomicity.CommitFileTemporaryPath):
        """A step written where only this launch writes: what tensorstore (Orbax's array writer) sends itself does
        not pass the fence, and a request of a launch frozen mid-save may land after its thaw, after a takeover;
        it lands in this launch's own directory, which nobody reads (the next start deletes it), never in the step
        another launch is writing. An item of the step (state/, data/) is written in place inside it."""

        @classmethod
        def from_final(cls, final_path, *, checkpoint_metadata_store=None, file_options=None, snapshot_type=None):
            final = epath.Path(final_path)
            inside = SUFFIX in final.parent.name  # an item of a step being written
            tmp = final if inside else final.parent / f"{final.name}{SUFFIX}-{launch}"
            return cls(tmp, final_path, checkpoint_metadata_store=checkpoint_metadata_store,
                       file_options=file_options or ocp.options.FileOptions())

        @classmethod
        def from_temporary(cls, temporary_path, *, file_options=None, snapshot_type=None):
            name = epath.Path(temporary_path).name
            final = epath.Path(temporary_path).parent / name[:name.index(SUFFIX)] if SUFFIX in name else temporary_path
            return cls(temporary_path, final, file_options=file_options or ocp.options.FileOptions())

        async def finalize(self, *args, **kwargs):
            with fence.guard(self.get_final()):
                if self._tmp_path == self._final_path:  # an item: commit_success.txt in place
                    await super().finalize(*args, **kwargs)
                    return
                store = self._checkpoint_metadata_store
                if store:  # as Orbax's own finalize: the commit's time in the step's metadata
                    await asyncio.to_thread(store.wait_until_finished)
                    await asyncio.to_thread(store.update, commit_timestamp_nsecs=time.time_ns(),
                                            file_path=ocp_metadata.step_metadata_file_path(self._tmp_path))
                    await asyncio.to_thread(store.wait_until_finished)
                await asyncio.to_thread(publish, self._tmp_path, self._final_path)

    return LaunchCommit


def publish(tmp: epath.Path, final: epath.Path) -> None:
    """A step written under `tmp` made the step `final` (GCS): whatever is at `final` deleted (a save of an earlier
    launch that did not commit), every object copied (server side), commit_success.txt written last, `tmp`
    deleted, no sooner than a second after the call (tensorstore wrote them before it: GCS allows one update of an
    object a second). Each request passes the fence; a kill on the way leaves `final` without its commit file: not a
    step."""
    written_by = time.monotonic()
    fs, tmp_key = storage._fs(tmp)
    final_key = storage._fs(final)[1]
    storage.rmtree(final)
    sources = [key for key in fs.find(tmp_key) if key != f"{tmp_key}/{COMMIT_FILE}"]
    if sources:
        fs.copy(sources, [final_key + key[len(tmp_key):] for key in sources])
    storage.write_text(final / COMMIT_FILE, f"Checkpoint commit was successful to {final}")
    time.sleep(max(written_by + storage.UPDATE_INTERVAL_S + 0.05 - time.monotonic(), 0))
    storage.rmtree(tmp)


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
