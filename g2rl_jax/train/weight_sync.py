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
no server, no host round trip.

One process per side (parallel.side_meshes: the training and the rollout devices on disjoint process sets):
`SideSync` moves the params with JAX's cross-host `jax.device_put` (multi-controller JAX, no Pathways): the
training mesh all-gathers each array (its own collective), the training process holding the mesh's first device
sends the whole array from that device to the first rollout device of each rollout process, device to device
(on CPU over the DCN socket transfer that `enable_cross_host_transfers` switches on; the TPU runtime moves it
natively), and each rollout process copies it onto its part of the rollout shardings, then acknowledges the push
under `sync/<push>/<process>` of the run's key-value channel (control/channel.py). JAX 0.10 moves an array
across process sets only between shardings of equal device count and HLO sharding, hence the one-device hop:
the wire carries each array once per rollout process, whatever the two meshes' shapes.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from g2rl_jax import parallel
from g2rl_jax.control import channel, stop, wire
from g2rl_jax.model import lora

ACK_WAIT_S = 3600.0  # the trainer's wait for a rollout process to acknowledge a push (channel.Late after it)


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
    return _gather_to(NamedSharding(sharding.mesh, PartitionSpec()))(x)


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


# ------------------------------------------------------------------------------------ one process per side
@functools.cache
def _gather_to(sharding: NamedSharding):
    """One jitted copy onto `sharding` (cached: one program per shape, not per call)."""
    return jax.jit(jnp.copy, out_shardings=sharding)


def _whole_copy(x: jax.Array) -> jax.Array:
    """A new buffer of all of x on every device of its mesh (an all-gather of x's mesh when x is sharded)."""
    return _gather_to(NamedSharding(x.sharding.mesh, PartitionSpec()))(x)


def enable_cross_host_transfers(address: str) -> None:
    """Switch on JAX's socket transfers between processes (`address` = this host's "ip:port" for them), before
    the backend starts: CPU needs it for a device_put across process sets; the TPU runtime does not."""
    jax.config.update("jax_cross_host_transfer_socket_address", address)


def _first_devices(mesh) -> list:
    """The first device of each process of `mesh`, in process order (the hops of SideSync)."""
    first: dict[int, object] = {}
    for d in mesh.devices.flat:
        first.setdefault(d.process_index, d)
    return [first[p] for p in sorted(first)]


def _placeholder(like, sharding):
    """An array of `like`'s shape and dtype on `sharding`'s devices, none of which this process holds: the
    handle a process passes to a device_put whose source (or result) lives on other processes."""
    return jax.make_array_from_single_device_arrays(like.shape, sharding, [], dtype=like.dtype)


class SideSync:
    """Moves the trainable params from the training mesh to a rollout mesh on other processes (see the module
    docstring). Every process of both sides calls `push` for each version, in the same order."""

    def __init__(self, train_mesh, rollout_shardings: list[NamedSharding]):
        self.src = SingleDeviceSharding(_first_devices(train_mesh)[0])
        self.dst = [SingleDeviceSharding(d) for d in _first_devices(rollout_shardings[0].mesh)]
        self.dst_processes = [d.process_index for d in _first_devices(rollout_shardings[0].mesh)]
        self.sender = _first_devices(train_mesh)[0].process_index
        self.train_processes = {d.process_index for d in train_mesh.devices.flat}
        self.shardings = rollout_shardings
        self.bytes = 0  # the payload of one push (once, not per rollout process)
        self.seconds = 0.0  # the last push's wall time on this process (a rollout process: until arrival)
        self.pushes = 0
        self._held: dict[int, list] = {}  # the sender's pushes in flight: buffers live until every rollout has them

    @staticmethod
    def _ack_key(push: int, process: int) -> str:
        return f"sync/{push}/{process}"

    def _arrived(self, push: int, block: bool) -> bool:
        """Whether every rollout process has acknowledged push `push` (waiting for it, ACK_WAIT_S at most, with
        `block`)."""
        ch = channel.default()
        for process in self.dst_processes:
            key = self._ack_key(push, process)
            try:
                if block:
                    ch.get(key, schema=bool, timeout_s=ACK_WAIT_S)
                elif ch.look(key, schema=bool) is None:  # not acknowledged yet
                    return False
            except wire.Refused as err:
                stop.refuse(err)
        return True

    def _release(self, block: bool) -> None:
        """Free the buffers of the pushes every rollout process has (all of them, waiting, with `block`). A rollout
        process acknowledges each push when it arrives, through the run's key-value channel."""
        for push in sorted(self._held):
            if not self._arrived(push, block):
                return
            del self._held[push]
            for process in self.dst_processes:  # read once: the store need not keep them
                channel.default().delete(self._ack_key(push, process))

    def wait(self) -> None:
        """Until every rollout process has every push so far."""
        self._release(block=True)

    def push(self, tree):
        """On a training process, `tree` holds the arrays (on the training mesh); elsewhere anything with the
        same tree structure, shapes and dtypes (jax.ShapeDtypeStruct). Returns the tree on the rollout shardings
        on a rollout process, None on a training process."""
        self._release(block=False)  # the sender does not wait for the rollout to take a version
        t0 = time.perf_counter()
        me = jax.process_index()
        leaves, treedef = jax.tree.flatten(tree)
        self.pushes += 1
        if me in self.train_processes:  # the all-gather: a collective of the training mesh only
            # fresh buffers (a replicated leaf too): the trainer may donate its params before the transfer ends
            wholes = [_whole_copy(x) for x in leaves]
            hop = self.src.device_set
            sent = [next((s.data for s in w.addressable_shards if s.device in hop), None) for w in wholes]
            sent = [x if x is not None else _placeholder(w, self.src) for x, w in zip(sent, wholes, strict=True)]
        else:
            sent = [_placeholder(x, self.src) for x in leaves]
        arrived = None
        for dst, process in zip(self.dst, self.dst_processes, strict=True):  # one batched device_put each
            moved = jax.device_put(sent, [dst] * len(sent))
            if process == me:
                arrived = moved
        self.bytes = nbytes(leaves)
        if arrived is None:
            if me == self.sender:
                self._held[self.pushes] = sent
            self.seconds = time.perf_counter() - t0
            return None
        local = [x.addressable_shards[0].data for x in arrived]
        out = [jax.device_put(x, s) if s.is_fully_addressable
               else jax.make_array_from_callback(x.shape, s, lambda index, x=x: x[index])
               for x, s in zip(local, self.shardings, strict=True)]
        jax.block_until_ready(out)
        channel.default().put(self._ack_key(self.pushes, me), True)
        self.seconds = time.perf_counter() - t0
        return jax.tree.unflatten(treedef, out)
