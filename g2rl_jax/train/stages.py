"""`stage`: the context every step of the training loop runs its stages in, so that a failure names the stage and
the shapes of its inputs (a `train.step.StageError`). It is also where the trainer's jitted programs are called:
a program that runs out of device memory or loses a peer process becomes DeviceOutOfMemory or PeerLost there
(control/errors.py's `device_failure`), and a failure already classified (control/errors.py) passes as it is."""
from __future__ import annotations

import contextlib

import jax
import numpy as np

from g2rl_jax.control.errors import RunFailure, device_failure
from g2rl_jax.train.step import StageError


@contextlib.contextmanager
def stage(name: str, **arrays):
    """Re-raise any failure inside a stage as StageError naming the stage and its input arrays' shapes."""
    try:
        yield
    except (StageError, RunFailure):
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with context, never swallowed
        typed = device_failure(err, f"stage {name!r}")
        if typed is not None:
            raise typed from err
        shapes = ", ".join(f"{k}={_shape_of(v)}" for k, v in arrays.items())
        message = f"stage {name!r} failed on inputs [{shapes}]: {type(err).__name__}: {err}"
        raise StageError(message) from err


def _shape_of(x) -> str:
    leaves = jax.tree.leaves(x)
    if len(leaves) == 1 and hasattr(leaves[0], "shape"):
        return f"{tuple(leaves[0].shape)}"
    if isinstance(x, (list, tuple)):
        return f"list[{len(x)}]"
    return "{" + ", ".join(f"{tuple(np.shape(leaf))}" for leaf in leaves[:6]) + ("…}" if len(leaves) > 6 else "}")
