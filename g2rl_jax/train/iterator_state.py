"""The data item of a checkpoint (train/checkpoint.py): this process's data-iterator position, taken from
`iterator.get_state()` when the save is called, as one JSON file per process (`process_<i>-of-<n>.json`): grain's
DatasetIterator state (a JSON-able dict) as it is, DataLoaderIterator's (bytes) in base64.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


def encode_state(state: Any) -> str:
    """Iterator state (bytes or JSON-able) as JSON text that `decode_state` turns back into an equal value."""
    if isinstance(state, bytes):
        return json.dumps({"encoding": "base64", "state": base64.b64encode(state).decode("ascii")})
    return json.dumps({"encoding": "json", "state": state})


def decode_state(text: str) -> Any:
    record = json.loads(text)
    return base64.b64decode(record["state"]) if record["encoding"] == "base64" else record["state"]


def process_file(directory: epath.Path) -> epath.Path:
    return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


class IteratorStateHandler(ocp.CheckpointHandler):
    """Orbax handler writing this process's iterator state (already captured as JSON text) to its own file."""

    def save(self, directory: epath.Path, args: IteratorStateSave) -> None:
        process_file(directory).write_text(args.text)

    def restore(self, directory: epath.Path, args: IteratorStateRestore | None = None) -> Any:
        path = process_file(directory)
        if not path.exists():
            present = sorted(p.name for p in directory.iterdir())
            raise FileNotFoundError(f"no data-iterator state {path} for this process; the checkpoint has "
                                    f"{present} (was it written by a job with a different process count?)")
        return decode_state(path.read_text())

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
