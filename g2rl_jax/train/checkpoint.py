"""Orbax checkpoints of the training state plus the data-iterator position, safe against `kill -9`.

A checkpoint at step s is the directory `<run_dir>/checkpoints/<s>/` holding two items:

  state/  a pytree of arrays (params, optimizer state, step, RNG key *data*: store `jax.random.key_data(key)`,
          typed key arrays are rejected), written asynchronously by Orbax's PyTreeCheckpointHandler as one
          tensorstore transaction per process (`_state_handler`), read by its StandardCheckpointHandler;
  data/   the state of the data iterator, one JSON file per process (`process_<i>-of-<n>.json`), taken from
          `iterator.get_state()` at the moment `save` is called. Any object with get_state()/set_state() works:
          grain's DatasetIterator (a JSON-able dict) and DataLoaderIterator (bytes) included.
  model/  model.json: full fine-tune or LoRA, and then the base model by path and weights hash
          (train/identity.py), when the Checkpointer is given that record.

Orbax writes each step into a temporary directory and renames it into place only once every item is complete (on GCS
a directory of the launch's own, copied into place, commit_success.txt last: control/commits.py), so a process
killed at any moment, mid-save included, leaves the previous checkpoints intact and `latest_step` never sees a
half-written one; leftover temporary directories are removed when the next `Checkpointer` opens the run, before
anything lists its steps (on GCS a directory is only the prefix of its objects: see `_remove_unfinished`).
All processes call every method (Orbax synchronises hosts itself; nothing here runs on process 0 only).

    ckpt = Checkpointer(run_dir, every=cfg.run.checkpoint_every, keep=cfg.run.keep_checkpoints)
    start = ckpt.latest_step()                        # None on a fresh run
    if start is not None:
        state = ckpt.restore(start, abstract_state, data_iter)   # abstract: ShapeDtypeStructs with shardings
    ...
    ckpt.save(step, state, data_iter)                 # every `every` steps; force=True for the final one
    ckpt.close()                                      # waits for the last asynchronous save

A newest checkpoint that cannot be read (corrupted files) is reported and moved to `<run_dir>/corrupt_checkpoints/`
by `restore_newest`, which falls back to the previous complete one.

Failures and the run lock (g2rl_jax/control): on a bucket, what Orbax's asynchronous save raises (at `wait`, or at
the next `save`) is the storage's, StorageUnavailable naming the URL; a restore that fails while the store does not
answer a look is too (nothing is set aside), one that fails while it answers is a corrupt checkpoint. Orbax's commit
of a step (the rename of its temporary directory; on GCS the copies and commit_success.txt) and its deletes pass
the fence (control/fence.py): a trainer that lost the run's lease commits and deletes nothing. Orbax's own log
records of a failure carry no traceback: the failure reaches the Checkpointer, which reports it.

Reading a finished run, for every command that takes `--checkpoint` (eval, analyze, export, the demo's
explore_eval): `resolve_checkpoint(run_or_step_dir)` finds the step, `run_config` reads the run's config.yaml,
`run_defaults` fills a command's unset flags from it, and `load_policy(run_or_step_dir)` gives the trained policy as
a model: only the params are read, through Orbax's PyTreeCheckpointHandler (the same on-disk format; it can skip
the optimizer state).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from g2rl_jax import parallel, storage
from g2rl_jax.control import commits as control
from g2rl_jax.control import wire
from g2rl_jax.control.errors import BadInput, RunFailure, StorageUnavailable
from g2rl_jax.train import identity
from g2rl_jax.train.iterator_state import (
    IteratorStateHandler,
    IteratorStateRestore,
    IteratorStateSave,
    encode_state,
    process_file,
)

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
STATE_ITEM, DATA_ITEM = "state", "data"


RESTORE_CONCURRENT_BYTES = 96 * 10**9  # Orbax's default bound on the bytes a restore reads at once


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """The state item's handler: Orbax's PyTree handler with no bound on the bytes a save writes at once. Without a
    bound Orbax writes all of a process's arrays in one tensorstore transaction, so its OCDBT database commits once
    and its manifest.ocdbt is written once per save; under a bound (StandardCheckpointHandler's 96 GB, whatever the
    state's size) every array's write commits on its own and tensorstore batches those commits as they come, which
    on GCS wrote the manifest 3-4 times within a second (429s at GCS's one update per object per second, each
    retried after a second or more: 8.8 s a demo-size save instead of 2.8 s; docs/running.md). The transaction's
    writes reference the host copy Orbax makes anyway: a 400 MB state's save peaked at the same host memory either
    way (measured on CPU)."""
    return ocp.PyTreeCheckpointHandler(handler_impl=ocp.BasePyTreeCheckpointHandler(
        save_concurrent_bytes=None, restore_concurrent_bytes=RESTORE_CONCURRENT_BYTES))


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Each item's handler by the args it is given: the state saved by `_state_handler` and restored by
    StandardCheckpointHandler (the same format; its restore checks the saved tree's metadata)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.PyTreeSave, _state_handler())
    registry.add(STATE_ITEM, ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
    for args in (IteratorStateSave, IteratorStateRestore):
        registry.add(DATA_ITEM, args, IteratorStateHandler())
    model = ocp.JsonCheckpointHandler(identity.MODEL_FILE)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add(identity.MODEL_ITEM, args, model)
    return registry


class CheckpointError(BadInput, RuntimeError):
    """No checkpoint of the run can be read, or one was trained on another model; the message names the directory
    and what to do (bad input: exit 2)."""

    kind = "checkpoint"


class IteratorWithState(Protocol):
    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def checkpoint_dir(run_dir: str | os.PathLike) -> epath.Path:
    return storage.path(run_dir) / CHECKPOINT_DIR


def _absolute(path: str | os.PathLike) -> epath.Path:
    """What Orbax is given: a local path made absolute, a URL (gs://...) as it is."""
    where = storage.path(path)
    return where if storage.is_url(where) else where.absolute()


def _finished_steps(run_dir: str | os.PathLike) -> list[int]:
    """The complete checkpoint steps under run_dir; [] when checkpoints/ is not there, or is gone by the time it is
    listed (on GCS it vanishes with its last object: `_remove_unfinished`)."""
    try:
        return ocp.utils.checkpoint_steps(checkpoint_dir(run_dir))
    except FileNotFoundError:
        return []


def latest_step(run_dir: str | os.PathLike) -> int | None:
    """Newest complete checkpoint step under run_dir, or None; unfinished (temporary) saves are never counted."""
    return max(_finished_steps(run_dir), default=None)


def check_model(run_dir: str | os.PathLike, want: dict) -> None:
    """CheckpointError when a checkpoint of the run was trained on another model than record `want` describes
    (LoRA or not, the adapters' shape, the base's weights: train/identity.py)."""
    for step in _finished_steps(run_dir):
        step_dir = checkpoint_dir(run_dir) / str(step)
        try:
            identity.check(identity.saved(step_dir), want, f"the checkpoint {step_dir}")
        except ValueError as err:
            raise CheckpointError(str(err)) from None


def _remove_unfinished(directory: epath.Path) -> None:
    """Delete the step directories of saves a kill interrupted (`<step>.orbax-checkpoint-tmp*`, and on GCS a
    `<step>/` without commit_success.txt), on process 0 while the others wait, before Orbax lists the steps.

    Not Orbax's own `cleanup_tmp_directories`: it deletes from a background thread while the CheckpointManager's
    constructor lists the same directory. On GCS a directory is only the prefix of the objects under it, so after a
    kill mid-save of a run's first checkpoint (the unfinished step is all there is under checkpoints/) the delete can
    land between the constructor's exists() and its listing, and gcsfs answers that listing with FileNotFoundError:
    the relaunch failed at once."""
    if jax.process_index() == 0:
        for unfinished in ocp.path.step.all_temporary_paths(directory):
            storage.rmtree(unfinished.get())
    if parallel.host_count() > 1:
        parallel.sync("g2rl_jax: unfinished checkpoints removed")  # the processes of the training side


def _launch_name() -> str:
    """A name of this launch's saves, the same on every process of its side: its first process's random draw."""
    draw = np.frombuffer(os.urandom(8), np.uint32)
    if parallel.host_count() > 1:
        draw = np.asarray(parallel.broadcast_one_to_all(draw))
    return "".join(f"{int(v):08x}" for v in draw)


def _reject_typed_keys(state: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(f"checkpoint state leaf {jax.tree_util.keystr(path)} is a typed PRNG key; store "
                            "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data after restore")


class Checkpointer:
    """Save every `every` steps, keep the newest `keep`, restore onto target shardings (see module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, *, every: int, keep: int, model: dict | None = None):
        if every <= 0 or keep <= 0:
            raise ValueError(f"Checkpointer needs every > 0 and keep > 0, got every={every}, keep={keep}")
        self._every, self._model = every, model
        directory = _absolute(checkpoint_dir(run_dir))
        _remove_unfinished(directory)  # first, not in Orbax's background thread while it lists the steps
        side = parallel.side_processes()  # one process per side: only the training process saves
        processes = ocp.options.MultiprocessingOptions(primary_host=0 if side is None else min(side),
                                                       active_processes=side)
        if side is not None:  # Orbax creates the root itself only when every process runs the manager
            directory.mkdir(parents=True, exist_ok=True)
        commits = control.fenced_commits(directory, _launch_name())
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, cleanup_tmp_directories=False, create=side is None,
                                               enable_async_checkpointing=True, multiprocessing_options=processes,
                                               temporary_path_class=commits)
        control.quiet_orbax_failures()
        self._url = directory if storage.is_url(directory) else None
        self._manager = ocp.CheckpointManager(directory, options=options, handler_registry=_handlers())
        control.fence_deletes(self._manager, directory)

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
        if parallel.side_processes() is not None and parallel.host_count() == 1:
            # one training process beside rollout processes: Orbax refuses a process's own arrays when there are
            # several processes; it saves host copies. Several training processes save their global arrays.
            state = jax.tree.map(np.asarray, state)
        items = {STATE_ITEM: ocp.args.PyTreeSave(state),
                 DATA_ITEM: IteratorStateSave(encode_state(data_iter.get_state()))}
        if self._model is not None:
            items[identity.MODEL_ITEM] = ocp.args.JsonSave(self._model)
        args = ocp.args.Composite(**items)
        self.wait()  # the previous save's failure, if any, surfaces here, classified
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
        try:
            data_iter.set_state(restored[DATA_ITEM])
        except wire.Refused as err:  # a value that is not ours (control/wire.py): the line names the file
            raise wire.Refused(f"{process_file(self._manager.directory / str(step) / DATA_ITEM)}: "
                               f"{err}") from None
        return restored[STATE_ITEM]

    def restore_newest(self, abstract_state: Any, data_iter: IteratorWithState) -> tuple[int | None, Any]:
        """(step, state) of the newest checkpoint that restores, or (None, None) when there is none. An unreadable
        newer one is warned about and moved to <run_dir>/corrupt_checkpoints/; if none is readable, the error
        names the directory and what to delete."""
        steps = sorted(self.all_steps(), reverse=True)
        failed = []
        for step in steps:
            try:
                state = self.restore(step, abstract_state, data_iter)
            except Exception as err:  # noqa: BLE001 - reported, and re-raised below when nothing restores
                if isinstance(err, RunFailure) and not isinstance(err, BadInput):
                    raise  # the store did not serve a read (a typed client failure): nothing is set aside
                reason = f"{type(err).__name__}: {str(err)[:500]}"
                control.probe(self._manager.directory / str(step), err)  # the store failed, not the checkpoint?
                failed.append((step, reason))
                if step != steps[-1]:  # the last one's reason is in the error below: one line says it
                    print(f"warning: checkpoint {self._manager.directory / str(step)} cannot be restored ({reason}); "
                          "trying the previous one", file=sys.stderr, flush=True)
                continue
            self._set_aside([s for s, _ in failed])
            return step, state
        if failed:
            raise CheckpointError(f"no checkpoint in {self._manager.directory} can be restored ("
                                  + "; ".join(f"step {s}: {r}" for s, r in failed) + f"); delete "
                                  f"{self._manager.directory} to start the run over, or restore it from a backup")
        return None, None

    def _set_aside(self, steps: list[int]) -> None:
        """Move unreadable step directories out of checkpoints/ (Orbax would count them as complete and refuse
        to save those steps again)."""
        if not steps:
            return
        if parallel.host_count() > 1:
            parallel.sync("g2rl_jax: checkpoint fallback")
        if jax.process_index() == 0:
            aside = storage.path(self._manager.directory).parent / CORRUPT_DIR
            storage.makedirs(aside)
            for step in steps:  # on GCS a copy then a delete: a kill midway leaves it to be found corrupt again
                target = aside / str(step)
                storage.move(storage.path(self._manager.directory) / str(step), target)
                print(f"warning: moved the unreadable checkpoint of step {step} to {target}", file=sys.stderr)
        if parallel.host_count() > 1:
            parallel.sync("g2rl_jax: checkpoint fallback done")
        self._manager.reload()

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is fully written. On a bucket, what the save raised
        is the storage's failure (StorageUnavailable naming the URL); a failure classified where it was raised (a
        write the fence refused, a gcsfs request the store did not serve) comes as it is."""
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except RunFailure:
            raise
        except Exception as err:
            if self._url is None:
                raise
            raise StorageUnavailable(self._url, err, client="tensorstore") from err

    def close(self) -> None:
        self.wait()
        self._manager.close()


# ------------------------------------------------------------------------------------------------ reading a policy
def resolve_checkpoint(path: str | os.PathLike) -> tuple[epath.Path, epath.Path]:
    """(run_dir, step_dir) of a run directory (its newest checkpoint) or of one `<run>/checkpoints/<step>` dir,
    local or a URL."""
    path = storage.path(path, "--checkpoint")
    if (path / STATE_ITEM).is_dir() and path.parent.name == CHECKPOINT_DIR:
        return path.parent.parent, path
    step = latest_step(path)
    if step is None:
        raise FileNotFoundError(f"--checkpoint {str(path)!r}: neither a run directory with checkpoints/<step>/ "
                                f"nor a <run>/checkpoints/<step>/ directory holding {STATE_ITEM}/")
    return path, checkpoint_dir(path) / str(step)


def run_config(run_dir: str | os.PathLike):
    """The resolved training Config a run wrote to `<run>/config.yaml`."""
    from g2rl_jax.config import RESOLVED_NAME, load_config

    path = storage.path(run_dir) / RESOLVED_NAME
    if not storage.is_file(path):
        raise FileNotFoundError(f"{path} not found: a g2rl_jax run directory holds the config.yaml the trainer "
                                "wrote; pass the run directory or one of its checkpoints/<step> directories")
    return load_config(path)


def run_defaults(checkpoints: Sequence[str | os.PathLike], pick: Callable[[Any], dict], args: Any) -> dict:
    """A command's defaults for the flags left unset (None) in `args` (an argparse Namespace), from the runs'
    config.yaml: `pick(cfg)` -> {flag: value}. Runs that disagree on an unset flag raise ValueError naming it."""
    values: dict = {}
    for path in checkpoints:
        picked = pick(run_config(resolve_checkpoint(path)[0]))
        for flag, value in ((f, v) for f, v in picked.items() if getattr(args, f) is None):
            if values.setdefault(flag, value) != value:
                raise ValueError(f"the runs disagree on --{flag.replace('_', '-')} ({values[flag]} vs {value} in "
                                 f"{path}); pass --{flag.replace('_', '-')} explicitly")
    return values


def read_params(step_dir: str | os.PathLike, abstract_params: Any) -> Any:
    """The `params` of a checkpoint's state item laid out as `abstract_params`; the rest is not read."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
        restored = reader.restore(_absolute(step_dir) / STATE_ITEM, args=ocp.args.PyTreeRestore(
            item={"params": abstract}, restore_args={"params": ocp.checkpoint_utils.construct_restore_args(abstract)},
            partial_restore=True))
    return restored["params"]


def base_model_dir(run_or_checkpoint_dir: str | os.PathLike) -> epath.Path:
    """The base model dir (config and tokenizer) of a run, from its config.yaml's model.path (a bucket's copied to
    the local cache, a Hugging Face id from its cache: model/sources.py); FileNotFoundError naming it when it is not
    a Hugging Face model dir."""
    from g2rl_jax import registry
    from g2rl_jax.model.sources import local_model_dir

    run_dir = resolve_checkpoint(run_or_checkpoint_dir)[0]
    model = run_config(run_dir).model  # a Hugging Face id at the commit the run recorded (model.revision)
    path = model.path
    built = registry.resolve_model_paths(path, None)[0]  # a demo scheme's directory, built by its provider
    base_dir = storage.path(local_model_dir(built, "model.path", model.revision))
    if not (base_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir / 'config.yaml'}: model.path {path!r} is not a Hugging Face "
                                "model directory here; the checkpoint holds only the trained params, so the base "
                                "model dir (for its config and tokenizer) must exist at that path")
    return base_dir


def load_policy(run_or_checkpoint_dir: str | os.PathLike, *, mesh=None):
    """(model, base_dir): the policy of a training checkpoint, its params restored onto the structure (and `mesh`
    shardings) of `setup.load_model` (config.yaml's model.path, and its LoRA adapters) in the run's model dtypes,
    without remat; base_dir holds the base model's config and tokenizer. A LoRA checkpoint's base must be the
    weights it was trained on (ValueError naming both otherwise)."""

    from flax import nnx

    from g2rl_jax.model import lora
    from g2rl_jax.train.setup import load_model

    run_dir, step_dir = resolve_checkpoint(run_or_checkpoint_dir)
    base_dir = base_model_dir(run_or_checkpoint_dir)
    model_cfg = run_config(run_dir).model
    have = identity.saved(step_dir)
    sha = identity.base_sha256(base_dir) if have["lora"] is not None else None
    identity.check(have, identity.record(model_cfg, sha), f"the checkpoint {step_dir}")
    model_cfg = dataclasses.replace(model_cfg, path=str(base_dir))
    graphdef, params = nnx.split(load_model(model_cfg, mesh, seed=0, remat="none"))
    trainable, frozen = lora.split_trainable(params)
    return nnx.merge(graphdef, frozen, read_params(step_dir, trainable)), base_dir
