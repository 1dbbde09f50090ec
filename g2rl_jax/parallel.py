"""Device mesh and sharding: one mesh shape (data, fsdp, tensor) and one table from logical to mesh axes.

Every `nnx.Param` carries the logical names of its axes (metadata `out_sharding`, e.g. ("layers", "embed",
"heads", "head_dim")); `ShardingRules` maps each logical name to mesh axes, so all parameter shardings follow
from that one table:

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), mesh)      # initialised in place
    ids = jax.device_put(ids_BxL, batch_sharding(mesh))

Checks, each with both numbers in the message: the mesh must use exactly the available devices; a sharded
parameter dimension (heads, kv_heads, vocab, mlp, embed, ...) must be divisible by its mesh axes' size; two
dimensions of one array must not map to the same mesh axis. Multi-host start-up (jax.distributed) belongs to the
scale-out work and is not here yet.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh shape: data parallel x fully-sharded data parallel x tensor parallel."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"MeshConfig.{axis} must be a positive int, got {size!r}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)


def make_mesh(config: MeshConfig, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all); their number must equal the mesh size."""
    devices = jax.devices() if devices is None else list(devices)
    size = math.prod(config.shape)
    if size != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, config.shape))} needs {size} devices, but there are "
                         f"{len(devices)}; choose data*fsdp*tensor = {len(devices)}")
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagates shardings from params/inputs
    return jax.make_mesh(config.shape, MESH_AXES, axis_types=auto, devices=devices)


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
))


def state_shardings(state, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """NamedSharding for every Variable of an nnx State (real or abstract), from its logical axes."""

    def one(path, var):
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        what = "parameter " + jax.tree_util.keystr(path, simple=True, separator=".")
        return var.replace(NamedSharding(mesh, rules.spec(tuple(logical), var.shape, mesh, what)))

    return jax.tree.map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(make_module: Callable[[], nnx.Module], mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
    """Build `make_module()` with every parameter created directly in its sharding (never whole on one device)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    shardings = state_shardings(abstract_state, mesh, rules)

    def init():
        return nnx.state(make_module())

    return nnx.merge(graphdef, jax.jit(init, out_shardings=shardings)())


def shard_module(module: nnx.Module, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> nnx.Module:
    """Move an existing module's parameters onto their shardings (returns the same module, updated)."""
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, state_shardings(state, mesh, rules)))
    return module


def batch_sharding(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, seq, ...] input: batch over its mesh axes, the rest replicated."""
    return NamedSharding(mesh, rules.spec(("batch",) + (None,) * (ndim - 1)))
