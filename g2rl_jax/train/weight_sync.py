"""Weight sync from the training mesh to the rollout mesh (mesh.rollout_devices > 0), by JAX alone.

    sync = WeightSync(graphdef, params, rollout_mesh)   # the rollout side's graphdef and full copy, once
    rollout_params = sync.push(params)                  # after each update: only the trainable part moves
    model = nnx.merge(sync.graphdef, rollout_params)    # the sampler, its activations on the rollout mesh

The rollout side keeps its own shardings (parallel.state_shardings of its mesh: weights replicated over its data
axis, split over its tensor axis). With LoRA only the adapters move at each push; the rollout side holds its own
copy of the frozen base, made once at construction.

How the arrays move. Within one process (every device addressable) `jax.device_put` onto the rollout side's
NamedShardings copies each shard device to device. Across processes, parallel.split_meshes gives every process
training devices and a rollout mesh of its own, so the move stays inside each process: the training mesh first
all-gathers each array (a collective over the training devices only, in the trainer's thread), then every
process copies its local whole array onto its own rollout mesh (`jax.make_array_from_callback`). No Pathways,
no server, no host round trip. JAX's cross-host device_put (different process sets, equal HLO shardings; TPU
runtime, or CPU with jax_cross_host_transfer_socket_address) would serve a layout with one process per side,
which split_meshes does not build (docs/async.md).
"""
from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from g2rl_jax import parallel
from g2rl_jax.model import lora


def rollout_graphdef(graphdef, params, mesh):
    """The policy's graphdef with its activations pinned to `mesh` (Qwen3.mesh is static, part of the graphdef)."""
    model = nnx.merge(graphdef, params)
    model.mesh = mesh
    return nnx.split(model)[0]


def shardings_on(params, mesh) -> list[NamedSharding]:
    """NamedSharding of every array of the nnx State `params` under the default rules on `mesh`, in the order of
    jax.tree.leaves(params)."""
    placed = parallel.state_shardings(params, mesh)
    return [v.get_value() for v in jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def _replicated(x: jax.Array) -> jax.Array:
    """x all-gathered over its own mesh: every device of it holds the whole array (a collective of that mesh)."""
    sharding = x.sharding
    if x.is_fully_replicated:
        return x
    return jax.jit(lambda a: a, out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))(x)


def move(x: jax.Array, target: NamedSharding) -> jax.Array:
    """x placed as `target`, a sharding on other devices of the same processes (see the module docstring)."""
    if x.is_fully_addressable and target.is_fully_addressable:
        return jax.device_put(x, target)
    whole = _replicated(x)
    local = whole.addressable_shards[0].data  # the whole array, on one of this process's training devices
    return jax.make_array_from_callback(x.shape, target, lambda index: local[index])


def move_tree(tree, shardings: list[NamedSharding]):
    """`move` of every array of `tree` onto its sharding (shardings in the order of jax.tree.leaves(tree))."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [move(x, s) for x, s in zip(leaves, shardings, strict=True)])


def nbytes(tree) -> int:
    """Bytes of every array of `tree` (the payload of one push, counted once, not per replica)."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class WeightSync:
    """The rollout side's graphdef, frozen base (LoRA) and shardings; `push` moves the trainable params over."""

    def __init__(self, graphdef, params, mesh):
        self.mesh = mesh
        self.graphdef = rollout_graphdef(graphdef, params, mesh)
        trainable, frozen = lora.split_trainable(params)
        self._trainable_shardings = shardings_on(trainable, mesh)
        self._frozen = move_tree(frozen, shardings_on(frozen, mesh))  # the base, copied once (all of it w/o LoRA)
        self.bytes = nbytes(trainable)  # what each push moves
        self.seconds = 0.0  # the last push's wall time (dispatch to arrival)

    def push(self, params) -> nnx.State:
        """The rollout side's params of `params` (the trainable part moved now, the frozen part the copy held)."""
        t0 = time.perf_counter()
        moved = move_tree(lora.trainable(params), self._trainable_shardings)
        jax.block_until_ready(moved)
        self.seconds = time.perf_counter() - t0
        return nnx.merge_state(moved, self._frozen)
