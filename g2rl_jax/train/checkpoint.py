"""Orbax checkpoints of the training state plus the data-iterator position, safe against `kill -9`.

A checkpoint at step s is the directory `<run_dir>/checkpoints/<s>/` holding two items:

  state/  a pytree of arrays (params, optimizer state, step, RNG key *data*: store `jax.random.key_data(key)`,
          typed key arrays are rejected), written asynchronously by Orbax's StandardCheckpointHandler;
  data/   the state of the data iterator, one JSON file per process (`process_<i>-of-<n>.json`), taken from
          `iterator.get_state()` at the moment `save` is called. Any object with get_state()/set_state() works:
          grain's DatasetIterator (a JSON-able dict) and DataLoaderIterator (bytes) included.

Orbax writes each step into a temporary directory and renames it into place only once every item is complete, so a
process killed at any moment, mid-save included, leaves the previous checkpoints intact and `latest_step` never
sees a half-written one; leftover temporary directories are removed when the next `Checkpointer` opens the run.
All processes call every method (Orbax synchronises hosts itself; nothing here runs on process 0 only).

    ckpt = Checkpointer(run_dir, every=cfg.run.checkpoint_every, keep=cfg.run.keep_checkpoints)
    start = ckpt.latest_step()                        # None on a fresh run
    if start is not None:
        state = ckpt.restore(start, abstract_state, data_iter)   # abstract: ShapeDtypeStructs with shardings
    ...
    ckpt.save(step, state, data_iter)                 # every `every` steps; force=True for the final one
    ckpt.close()                                      # waits for the last asynchronous save
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Protocol

import jax
import orbax.checkpoint as ocp
from etils import epath

CHECKPOINT_DIR = "checkpoints"
STATE_ITEM, DATA_ITEM = "state", "data"


class IteratorWithState(Protocol):
    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def _encode_state(state: Any) -> str:
    """Iterator state (bytes or JSON-able) as JSON text that `_decode_state` turns back into an equal value."""
    if isinstance(state, bytes):
        return json.dumps({"encoding": "base64", "state": base64.b64encode(state).decode("ascii")})
    return json.dumps({"encoding": "json", "state": state})


def _decode_state(text: str) -> Any:
    record = json.loads(text)
    return base64.b64decode(record["state"]) if record["encoding"] == "base64" else record["state"]


def _process_file(directory: epath.Path) -> epath.Path:
    return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


class IteratorStateHandler(ocp.CheckpointHandler):
    """Orbax handler writing this process's iterator state (already captured as JSON text) to its own file."""

    def save(self, directory: epath.Path, args: IteratorStateSave) -> None:
        _process_file(directory).write_text(args.text)

    def restore(self, directory: epath.Path, args: IteratorStateRestore | None = None) -> Any:
        path = _process_file(directory)
        if not path.exists():
            present = sorted(p.name for p in directory.iterdir())
            raise FileNotFoundError(f"no data-iterator state {path} for this process; the checkpoint has "
                                    f"{present} (was it written by a job with a different process count?)")
        return _decode_state(path.read_text())

    def metadata(self, directory: epath.Path) -> None:
        return None


@ocp.args.register_with_handler(IteratorStateHandler, for_save=True)
@dataclasses.dataclass
class IteratorStateSave(ocp.args.CheckpointArgs):
    text: str


@ocp.args.register_with_handler(IteratorStateHandler, for_restore=True)
@dataclasses.dataclass
class IteratorStateRestore(ocp.args.CheckpointArgs):
    pass


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """Newest complete checkpoint step under run_dir, or None; unfinished (temporary) saves are never counted."""
    steps = ocp.utils.checkpoint_steps(checkpoint_dir(run_dir)) if checkpoint_dir(run_dir).exists() else []
    return max(steps, default=None)


def _reject_typed_keys(state: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(f"checkpoint state leaf {jax.tree_util.keystr(path)} is a typed PRNG key; store "
                            "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data after restore")


class Checkpointer:
    """Save every `every` steps, keep the newest `keep`, restore onto target shardings (see module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, *, every: int, keep: int):
        if every <= 0 or keep <= 0:
            raise ValueError(f"Checkpointer needs every > 0 and keep > 0, got every={every}, keep={keep}")
        self._every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, cleanup_tmp_directories=True,
                                               enable_async_checkpointing=True)
        self._manager = ocp.CheckpointManager(
            checkpoint_dir(run_dir).absolute(), options=options,
            item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(), DATA_ITEM: IteratorStateHandler()})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_iter: IteratorWithState, *, force: bool = False) -> bool:
        """Start an asynchronous save of (state, data_iter position) if step is due (or force); True if started.

        The iterator state is read now; the arrays must not be donated/deleted until the save has copied them
        (Orbax copies device arrays to host before returning, so the next jitted step may donate them).
        """
        if not (force or step % self._every == 0) or step in self._manager.all_steps():
            return False  # not due, or already saved (e.g. the final forced save on an interval step)
        _reject_typed_keys(state)
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                     DATA_ITEM: IteratorStateSave(_encode_state(data_iter.get_state()))})
        return self._manager.save(step, args=args, force=True)  # due-ness decided above, not by Orbax

    def restore(self, step: int, abstract_state: Any, data_iter: IteratorWithState) -> Any:
        """The state saved at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings, or arrays
        whose shardings to copy); `data_iter` is moved to the saved position in place."""
        self._manager.wait_until_finished()
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self._manager.directory}; "
                                    f"available: {self.all_steps()}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(abstract), DATA_ITEM: IteratorStateRestore()}))
        data_iter.set_state(restored[DATA_ITEM])
        return restored[STATE_ITEM]

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is fully written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
