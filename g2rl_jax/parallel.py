"""Device mesh and sharding: one mesh shape (data, fsdp, tensor) and one table from logical to mesh axes.

Every `nnx.Param` carries the logical names of its axes (metadata `out_sharding`, e.g. ("layers", "embed",
"heads", "head_dim")); `ShardingRules` maps each logical name to mesh axes, so all parameter shardings follow
from that one table:

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))   # config.MeshConfig; an axis of -1 takes the rest
    model = load_pretrained(path, mesh=mesh)   # each parameter read straight into its shard (g2rl_jax.model);
    # the model's mesh pins activations to rows over (data, fsdp), so fsdp all-gathers weights per layer
    ids = jax.device_put(ids_BxL, batch_sharding(mesh))
    state = place(state, state_shardings(state, mesh))   # moves only what sits elsewhere (no reshard program)

Checks, each with both numbers in the message: the mesh must use exactly the available devices (ConfigError);
a sharded parameter dimension (heads, kv_heads, vocab, mlp, embed, ...) must be divisible by its mesh axes' size;
two dimensions of one array must not map to the same mesh axis.

Multi-host: `initialize_distributed(cfg.distributed)` starts `jax.distributed` (explicit coordinator/num_processes/
process_id, or auto-detected on a Cloud TPU VM) before anything touches the devices. A batch is then a global
array whose rows are split over the processes in contiguous blocks:

    rows = process_rows(mesh, 64)                      # slice of the 64 global rows this process holds
    x = global_rows(mesh, x_local, 64)                 # jax.Array [64, ...] from this process's rows
    x_all = gather(x)                                  # host numpy of the whole array, on every process
    y_all = gather_blocks(mesh, y_local)               # every process's host rows, in order, on every process
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from g2rl_jax.config import ConfigError, MeshConfig
from g2rl_jax.control.errors import host_collective

MESH_AXES = ("data", "fsdp", "tensor")


def mesh_sizes(config: MeshConfig, num_devices: int) -> dict[str, int]:
    """{data, fsdp, tensor} sizes of config `mesh` on `num_devices` devices, an axis of -1 taking all the rest;
    a ConfigError names both numbers when they do not fit."""
    sizes = {axis: getattr(config, axis) for axis in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if num_devices % fixed:
            raise ConfigError(f"mesh {sizes}: the fixed axes multiply to {fixed}, which does not divide the "
                              f"{num_devices} devices; choose axis sizes whose product divides {num_devices}")
        sizes = {k: num_devices // fixed if v == -1 else v for k, v in sizes.items()}
    elif fixed != num_devices:
        raise ConfigError(f"mesh {sizes} needs {fixed} devices, but there are {num_devices}; "
                          f"choose data*fsdp*tensor = {num_devices} or set one axis to -1")
    return sizes


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all) of config `mesh` (-1 = all remaining devices)."""
    devices = jax.devices() if devices is None else list(devices)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagates shardings from params/inputs
    shape = tuple(mesh_sizes(config, len(devices)).values())
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    except NotImplementedError:
        # a TPU torus whose sides no mesh axis is a product of (fsdp 16 x tensor 2 on v6e's 4x8): split a side
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=auto)


_SIDE: frozenset[int] | None = None  # one process per side: the processes of this process's side (else None)


def side_processes() -> frozenset[int] | None:
    """The processes of this process's side when each side has processes of its own (mesh.rollout_processes; set
    by split_meshes), else None: every process runs the same programs."""
    return _SIDE


def host_count() -> int:
    """How many processes run this process's programs and host collectives: all, or those of its side."""
    return jax.process_count() if _SIDE is None else len(_SIDE)


def is_rollout_process(config: MeshConfig) -> bool:
    """Whether this process holds only rollout devices (mesh.rollout_processes: the last N processes)."""
    return config.rollout_processes > 0 and jax.process_index() >= jax.process_count() - config.rollout_processes


def set_sides(config: MeshConfig) -> None:
    """With mesh.rollout_processes = M, record this process's side (side_processes) before any host collective: the
    first N = process count − M processes train, the last M draw the rollouts; each side's host collectives
    (`allgather`, `sync`, `broadcast_one_to_all`) then span its own processes only."""
    global _SIDE
    if config.rollout_processes == 0:
        return
    total, m = jax.process_count(), config.rollout_processes
    if not 0 < m < total:
        raise ConfigError(f"mesh.rollout_processes={m} of {total} processes leaves {total - m} training processes: "
                          f"each side needs at least one process; launch more than {m} processes (the last "
                          f"{m} draw the rollouts, the others train), or lower mesh.rollout_processes")
    rollout = frozenset(range(total - m, total))
    _SIDE = rollout if jax.process_index() in rollout else frozenset(range(total - m))


def _side_mesh() -> Mesh:
    """A 1-d mesh ("processes") of the first device of each process of this process's side."""
    first: dict[int, object] = {}
    for d in jax.devices():
        if d.process_index in _SIDE:
            first.setdefault(d.process_index, d)
    return Mesh(np.array([first[p] for p in sorted(first)]), ("processes",))


@functools.cache
def _replicate_on(mesh: Mesh):
    """One jitted copy onto every device of `mesh` (cached: one program per shape, not per call)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


@host_collective
def allgather(x) -> np.ndarray:
    """`multihost_utils.process_allgather(x)` of a host value (every process's x stacked on a new axis 0, in process
    order) over the processes of this process's side: all of them without sides (mesh.rollout_processes = 0)."""
    if _SIDE is None:
        return np.asarray(multihost_utils.process_allgather(x))
    x = np.asarray(x)
    if len(_SIDE) == 1:
        return x[None]
    mesh = _side_mesh()
    stacked = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("processes")), x[None],
                                                     (len(_SIDE), *x.shape))
    whole = _replicate_on(mesh)(stacked)
    return np.asarray(whole.addressable_data(0))


@host_collective
def sync(name: str) -> None:
    """`multihost_utils.sync_global_devices(name)` over the processes of this process's side: every one of them
    waits here until all have come (and they must all name the same barrier)."""
    if _SIDE is None:
        multihost_utils.sync_global_devices(name)
        return
    names_A = allgather(np.frombuffer(name.encode().ljust(64)[:64], np.uint8))
    if any(bytes(row).rstrip() != name.encode()[:64].rstrip() for row in names_A):
        raise AssertionError(f"the processes of this side reached different barriers: {name!r} and others")


@host_collective
def broadcast_one_to_all(x):
    """`multihost_utils.broadcast_one_to_all(x)` (a tree of host arrays of one shape on every process) over this
    process's side: every process gets its side's first process's values."""
    if _SIDE is None:
        return multihost_utils.broadcast_one_to_all(x)
    return jax.tree.map(lambda v: allgather(v)[0], x)


def split_meshes(config: MeshConfig, devices=None) -> tuple[Mesh, Mesh | None]:
    """(training mesh, rollout mesh): with config.rollout_processes = N > 0, side_meshes (one process set per
    side, each side's host collectives over its own processes: `allgather`); with
    config.rollout_devices = R > 0, data/fsdp/tensor shape the training mesh on all but the last R devices of each
    process, and this process's last R devices form its rollout mesh (data =
    R / rollout_tensor, fsdp 1, tensor = rollout_tensor); with R = 0, one mesh (make_mesh) and None. With several
    processes each samples its own block of the prompts on its own rollout mesh: the rollout side then runs no
    collective across processes, which a driver thread beside the trainer's could not order safely (the trainer's
    collectives span the processes too); weight sync copies within a process (train/weight_sync.py)."""
    devices = jax.devices() if devices is None else list(devices)
    if config.rollout_processes:
        set_sides(config)
        return side_meshes(config, config.rollout_processes, devices)
    if config.rollout_devices == 0:
        return make_mesh(config, devices), None
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    local = min(len(v) for v in by_process.values())
    if config.rollout_devices >= local:
        raise ConfigError(f"mesh.rollout_devices={config.rollout_devices} leaves no training device of the {local} "
                          f"each process has; give the rollout fewer than {local} devices per process")
    r = config.rollout_devices
    train = [d for ds in by_process.values() for d in ds[:-r]]
    rollout = by_process[jax.process_index() if jax.process_index() in by_process else min(by_process)][-r:]
    shape = {"data": r // config.rollout_tensor, "fsdp": 1, "tensor": config.rollout_tensor}
    rollout_mesh = make_mesh(MeshConfig(**shape), rollout)
    return make_mesh(dataclasses.replace(config, rollout_devices=0), train), rollout_mesh


def side_meshes(config: MeshConfig, rollout_processes: int, devices=None) -> tuple[Mesh, Mesh]:
    """(training mesh, rollout mesh) with one process set per side: every device of the last `rollout_processes`
    processes forms the rollout mesh (data = its devices / rollout_tensor, fsdp 1, tensor = rollout_tensor), and
    data/fsdp/tensor shape the training mesh on every device of the other processes. A process runs only its
    side's programs; the weights cross with train/weight_sync.SideSync."""
    devices = jax.devices() if devices is None else list(devices)
    processes = sorted({d.process_index for d in devices})
    if not 0 < rollout_processes < len(processes):
        raise ConfigError(f"{rollout_processes} rollout processes of {len(processes)}: each side needs at least "
                          f"one process; give the rollout between 1 and {len(processes) - 1}")
    rollout_set = set(processes[-rollout_processes:])
    rollout = [d for d in devices if d.process_index in rollout_set]
    train = [d for d in devices if d.process_index not in rollout_set]
    if len(rollout) % config.rollout_tensor:
        raise ConfigError(f"mesh.rollout_tensor={config.rollout_tensor} must divide the {len(rollout)} devices of "
                          "the rollout processes")
    shape = {"data": len(rollout) // config.rollout_tensor, "fsdp": 1, "tensor": config.rollout_tensor}
    return make_mesh(dataclasses.replace(config, rollout_devices=0), train), make_mesh(MeshConfig(**shape), rollout)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The logical-axis -> mesh-axes table; `None` means replicated along that dimension."""

    table: tuple[tuple[str, tuple[str, ...] | None], ...]

    def __post_init__(self):
        names = [name for name, _ in self.table]
        if len(set(names)) != len(names):
            raise ValueError(f"ShardingRules: a logical axis appears twice in {names}")
        for name, axes in self.table:
            unknown = [a for a in axes or () if a not in MESH_AXES]
            if unknown:
                raise ValueError(f"ShardingRules: logical axis {name!r} maps to unknown mesh axes {unknown}; "
                                 f"mesh axes are {MESH_AXES}")

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        lookup = dict(self.table)
        if logical not in lookup:
            raise ValueError(f"ShardingRules: no rule for logical axis {logical!r}; known: {sorted(lookup)}")
        return lookup[logical] or ()

    def spec(self, logical_axes: tuple[str | None, ...], shape=None, mesh: Mesh | None = None,
             what: str = "array") -> PartitionSpec:
        """PartitionSpec for one array; with `shape` and `mesh`, also checks that every sharded dim divides."""
        used: dict[str, str] = {}
        entries = []
        for dim, logical in enumerate(logical_axes):
            axes = self.mesh_axes(logical)
            for axis in axes:
                if axis in used:
                    raise ValueError(f"{what}: logical axes {used[axis]!r} and {logical!r} both map to mesh "
                                     f"axis {axis!r}; one array may use a mesh axis once")
                used[axis] = logical
            if shape is not None and mesh is not None and axes:
                parts = math.prod(mesh.shape[a] for a in axes)
                if shape[dim] % parts:
                    raise ValueError(f"{what}: dimension {dim} ({logical}) has size {shape[dim]}, not divisible "
                                     f"by mesh axes {axes} of size {parts}")
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)


DEFAULT_RULES = ShardingRules((
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", None),
    ("mlp", ("tensor",)),
    ("layers", None),
    ("lora_rank", None),  # LoRA's r: A [*in, r] and B [r, *out] shard like their projection's in / out dims
))


def state_shardings(state, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """NamedSharding for every Variable of an nnx State (real or abstract), from its logical axes."""

    def one(path, var):
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        what = "parameter " + jax.tree_util.keystr(path, simple=True, separator=".")
        return var.replace(NamedSharding(mesh, rules.spec(tuple(logical), var.shape, mesh, what)))

    return jax.tree.map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(tree, shardings):
    """`jax.device_put(tree, shardings)` that leaves every array already on an equivalent sharding as it is. A
    compiled program may return an output in jax's canonical spec (trailing replicated dims dropped: a parameter
    placed as P(None, 'fsdp', 'tensor', None) came back from the update as P(None, 'fsdp', 'tensor')), which
    `device_put` takes for another sharding: on one process it wraps the same buffers in a new array, across
    processes it compiles a reshard program for it (a compile after the warm-up step)."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    moves = [i for i, (x, s) in enumerate(zip(leaves, targets))
             if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim))]
    for i, moved in zip(moves, jax.device_put([leaves[i] for i in moves], [targets[i] for i in moves])):
        leaves[i] = moved
    return jax.tree.unflatten(treedef, leaves)


def batch_sharding(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, seq, ...] input: batch over its mesh axes, the rest replicated."""
    return NamedSharding(mesh, rules.spec(("batch",) + (None,) * (ndim - 1)))


# ------------------------------------------------------------------------------------------- multi-host
def on_tpu_vm() -> bool:
    """A Cloud TPU VM (libtpu installed and TPU chips present, or GKE's TPU worker list set), where
    `jax.distributed.initialize()` finds the coordinator, process count and id by itself."""
    from g2rl_jax import QUIET_TPU_DEFAULTS, QUIET_TPU_MARK

    key = "TPU_WORKER_HOSTNAMES"
    quiet = key in os.environ.get(QUIET_TPU_MARK, "").split(",") and os.environ.get(key) == QUIET_TPU_DEFAULTS[key]
    if os.environ.get(key) and not quiet:  # not the value `import g2rl_jax` set on a host without TPU chips
        return True
    chips = list(Path("/dev").glob("accel[0-9]*")) + list(Path("/dev/vfio").glob("[0-9]*"))
    return importlib.util.find_spec("libtpu") is not None and bool(chips)


def initialize_distributed(dist) -> bool:
    """Start jax.distributed from a DistributedConfig before any device is touched; True if it was started.

    All three of coordinator_address / num_processes / process_id set: explicit (GPUs, SLURM, CPU + gloo);
    none set on a Cloud TPU VM: auto-detected; none set elsewhere: one process, nothing to do."""
    given = {"coordinator_address": dist.coordinator_address, "num_processes": dist.num_processes,
             "process_id": dist.process_id}
    missing = [f"distributed.{k}" for k, v in given.items() if v is None]
    if len(missing) == 3:
        if not on_tpu_vm():
            return False
        jax.distributed.initialize(initialization_timeout=dist.join_timeout_seconds)
        return True
    if missing:
        named = ", ".join(f"distributed.{k}" for k, v in given.items() if v is not None)
        raise ValueError(f"{named} set but {', '.join(missing)} not: give all three of distributed."
                         "coordinator_address (host:port of process 0), distributed.num_processes and "
                         "distributed.process_id, or none of them (one process, or auto-detection on a TPU VM)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-backend collectives across processes
    jax.distributed.initialize(coordinator_address=dist.coordinator_address, num_processes=dist.num_processes,
                               process_id=dist.process_id, initialization_timeout=dist.join_timeout_seconds)
    return True


def batch_block(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> tuple[int, int]:
    """(i, n): this process holds block i of the n equal contiguous blocks into which the processes split a
    batch's rows (n = 1 when the batch axes do not span processes: every process then holds all rows)."""
    axes = rules.mesh_axes("batch")
    order = [mesh.axis_names.index(a) for a in axes]
    devices = np.moveaxis(mesh.devices, order, range(len(axes)))
    replicas_by_shard = devices.reshape(math.prod(mesh.shape[a] for a in axes), -1)  # [batch shard, replica]
    owned: dict[int, set[int]] = {}
    for shard, replicas in enumerate(replicas_by_shard):
        for device in replicas:
            owned.setdefault(device.process_index, set()).add(shard)
    blocks = sorted({tuple(sorted(v)) for v in owned.values()})
    flat = [s for block in blocks for s in block]
    shards = len(replicas_by_shard)
    if flat != list(range(shards)) or any(b != tuple(range(b[0], b[0] + len(blocks[0]))) for b in blocks):
        raise ValueError(f"the processes hold batch shards {blocks} of {shards}, not equal contiguous "
                         "blocks; order the mesh devices so each process's devices are adjacent on the batch axes")
    return blocks.index(tuple(sorted(owned[jax.process_index()]))), len(blocks)


def process_rows(mesh: Mesh, num_rows: int) -> slice:
    """The contiguous block of rows of a [num_rows, ...] batch-sharded array that this process's devices hold."""
    i, n = batch_block(mesh)
    if num_rows % n:
        raise ValueError(f"a batch of {num_rows} rows does not split over the {n} process blocks of the mesh; "
                         f"make it a multiple of {n}")
    return slice(i * num_rows // n, (i + 1) * num_rows // n)


def global_rows(mesh: Mesh, local, num_rows: int, rules: ShardingRules = DEFAULT_RULES) -> jax.Array:
    """A [num_rows, ...] array, rows over the batch mesh axes, from this process's rows `local` (host numpy)."""
    local = np.asarray(local)
    rows = process_rows(mesh, num_rows)
    if local.shape[0] != rows.stop - rows.start:
        raise ValueError(f"this process holds rows [{rows.start}, {rows.stop}) of {num_rows}, i.e. "
                         f"{rows.stop - rows.start} rows, but was given an array of shape {local.shape}")
    sharding = batch_sharding(mesh, rules, ndim=local.ndim)
    return jax.make_array_from_process_local_data(sharding, local, (num_rows, *local.shape[1:]))


def gather_blocks(mesh: Mesh, local) -> np.ndarray:
    """Every process block's rows `local` concatenated in block order (each block once), on every process: the
    inverse of each process taking rows `process_rows(mesh, n)`. Every process passes an array of one shape."""
    if host_count() == 1:  # this side is one process: its rows are all of them
        return np.asarray(local)
    block, _ = batch_block(mesh)
    blocks_A = allgather(np.int32(block)).reshape(-1).tolist()
    every = allgather(np.asarray(local)).reshape(len(blocks_A), *np.shape(local))
    first = {b: k for k, b in reversed(list(enumerate(blocks_A)))}  # process k's rows stand for block b
    return np.concatenate([every[first[b]] for b in sorted(first)], axis=0)


def gather(x) -> np.ndarray:
    """Host numpy of the whole of x on every process (an all-gather when x spans several processes)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
