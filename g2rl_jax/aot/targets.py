"""Compile targets: a `Target` names the devices a run would use, without them, and how much memory each has.

    target = parse_target("v5p-8")      # the accelerator types of `gcloud compute tpus` / launch/tpu.sh
    target.devices()                    # 4 TPU v5 devices from libtpu's topology description, no TPU needed
    target.hbm_bytes, target.hosts      # 95 GiB per chip, 1 host

Parsers are registered per platform (`register`); `parse_target` asks each in turn, so another platform adds its
own names (e.g. GPU targets in their own module) without touching this one. TPU names follow gcloud: `v4-N` and
`v5p-N` count TensorCores (N/2 chips, one megacore device per chip), `v5litepod-N` (or `v5e-N`) and `v6e-N` count
chips. Each maps to a topology the way MaxText's accelerator table does: v4/v5p are 3-D tori grown from 2x2x1
(8 chips 2x2x2, 16 chips 2x2x4, 32 chips 2x4x4, ...) with 4 chips per host; v5e/v6e are 2-D (4 chips 2x2, 8 chips
2x4, 16 chips 4x4, ...), one host up to 8 chips and hosts of 4 chips above. A multi-host slice compiles from this
one process: its devices carry their host's process index.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Sequence

GiB = 2**30


class TargetError(ValueError):
    """A target name no registered parser knows; the message lists the forms each platform accepts."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One slice to compile for. `devices()` builds (and caches) its compile-only devices on first use."""

    name: str  # as the user typed it, e.g. "v5p-8"
    platform: str  # "tpu" (jax's platform name of the devices)
    chips: int  # devices the programs are partitioned over (one per chip)
    hosts: int  # processes a real run of this slice has
    hbm_bytes: int  # memory per chip
    topology: str  # e.g. "v5p:2x2x1"
    kind: str  # the generation, e.g. "v5p"
    peak_tflops: float  # dense bfloat16 peak per chip (for time estimates only)
    hbm_gbps: float  # HBM bandwidth per chip, GB/s (for time estimates only)
    make_devices: Callable[[], Sequence] = dataclasses.field(repr=False, compare=False)
    compute_capability: tuple[int, int] | None = None  # a GPU's; below sm_80 `auto` attention is xla
    kernel_name: str = "pallas"  # the platform's fused attention kernel, as the report's column names it
    kernel_mark: str = "tpu_custom_call"  # how that kernel appears in compiled HLO
    caveat: str = ""  # what the compiler's figures leave out on this platform, printed once under the report
    resize: Callable[[int], str] | None = dataclasses.field(default=None, repr=False, compare=False)  # the name of
    # the same kind with n chips (for "the smallest slice that fits"); None: a TPU slice (tpu_name)

    def devices(self) -> list:
        key = (self.platform, self.topology)
        if key not in _DEVICES:
            _DEVICES[key] = list(self.make_devices())
        return _DEVICES[key]

    @property
    def hbm_gib(self) -> float:
        return self.hbm_bytes / GiB


_DEVICES: dict = {}
_PARSERS: dict[str, tuple[Callable[[str], Target | None], str]] = {}


def register(platform: str, parser: Callable[[str], Target | None], forms: str) -> None:
    """Add a parser for `platform`: it returns a Target for a name it knows, None otherwise. `forms` describes the
    names it accepts, for the error message."""
    _PARSERS[platform] = (parser, forms)


def parse_target(name: str) -> Target:
    """The Target a user-facing name stands for (TargetError listing the accepted forms when none knows it)."""
    for parser, _ in _PARSERS.values():
        target = parser(name.strip())
        if target is not None:
            return target
    forms = "; ".join(f"{platform}: {forms}" for platform, (_, forms) in _PARSERS.items())
    raise TargetError(f"unknown target {name!r}; accepted: {forms}")


# ------------------------------------------------------------------------------------------------ TPU
@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    kind: str  # as in gcloud names: v4, v5p, v5e, v6e
    topology_prefix: str  # libtpu's topology name prefix
    hbm_gib: float
    chip_config: str  # "megacore": one device per chip of two TensorCores; "default": one core per chip
    cores_in_name: bool  # gcloud's N counts TensorCores (2 per chip), not chips
    dims: int  # 3-D torus or 2-D mesh
    peak_tflops: float  # bf16 per chip, Cloud TPU docs
    hbm_gbps: float  # per chip, Cloud TPU docs


TPU_GENERATIONS = {
    "v4": TpuGeneration("v4", "v4", 32, "megacore", True, 3, 275, 1200),
    "v5p": TpuGeneration("v5p", "v5p", 95, "megacore", True, 3, 459, 2765),
    "v5e": TpuGeneration("v5e", "v5e", 16, "default", False, 2, 197, 819),
    "v6e": TpuGeneration("v6e", "v6e", 32, "default", False, 2, 918, 1640),
}
_ALIASES = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}
MAX_TPU_CHIPS = 8192


def tpu_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The slice's chip grid: 3-D grows 2x2x1 by doubling its last smallest side (2x2x2, 2x2x4, 2x4x4, 4x4x4, ...);
    2-D grows 1x1 by doubling the smaller side, the second first (1x2, 2x2, 2x4, 4x4, 4x8, ...)."""
    if dims == 3:
        shape = [2, 2, 1] if chips >= 4 else [chips, 1, 1]
        while math.prod(shape) < chips:
            low = min(shape)
            i = max(j for j, n in enumerate(shape) if n == low)
            shape[i] *= 2
        return tuple(shape)
    shape = [1, 1]
    while math.prod(shape) < chips:
        shape[0 if shape[0] < shape[1] else 1] *= 2
    return tuple(shape)


def host_bounds(gen: TpuGeneration, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Chips per host: v4/v5p hosts hold 2x2x1; v5e/v6e one host up to 8 chips (the whole 2-D grid), 2x2 above."""
    if gen.dims == 3 or math.prod(shape) > 8:
        return (min(2, shape[0]), min(2, shape[1]), 1)
    return (shape[0], shape[1], 1)


def _tpu_devices(topology: str, chip_config: str, bounds: tuple[int, int, int]):
    def make():
        from jax.experimental import topologies

        try:
            import libtpu  # noqa: F401
        except ImportError:
            raise TargetError('compiling for TPU needs libtpu: pip install "g2rl_jax[tpu]" (the jax[tpu] of the '
                              'pinned jax, e.g. pip install "jax[tpu]==0.10.2")') from None
        return topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name=chip_config,
                                            chips_per_host_bounds=bounds, num_slices=1).devices
    return make


def tpu_target(kind: str, chips: int, name: str | None = None) -> Target:
    """The Target of `chips` chips of TPU generation `kind` (v4, v5p, v5e, v6e)."""
    gen = TPU_GENERATIONS[kind]
    shape = tpu_shape(chips, gen.dims)
    topology = f"{gen.topology_prefix}:{'x'.join(map(str, shape))}"
    bounds = host_bounds(gen, shape)
    label = name or tpu_name(kind, chips)
    return Target(name=label, platform="tpu", chips=chips, hosts=max(1, chips // math.prod(bounds)),
                  hbm_bytes=int(gen.hbm_gib * GiB), topology=topology, kind=kind, peak_tflops=gen.peak_tflops,
                  hbm_gbps=gen.hbm_gbps, make_devices=_tpu_devices(topology, gen.chip_config, bounds))


def tpu_name(kind: str, chips: int) -> str:
    """gcloud's accelerator type for `chips` chips of `kind`: v5p-8 is 4 chips, v5litepod-8 is 8."""
    gen = TPU_GENERATIONS[kind]
    family = "v5litepod" if kind == "v5e" else kind
    return f"{family}-{2 * chips if gen.cores_in_name else chips}"


def _parse_tpu(name: str) -> Target | None:
    match = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", name.lower())
    if match is None:
        return None
    kind, n = _ALIASES[match[1]], int(match[2])
    gen = TPU_GENERATIONS[kind]
    chips = n // 2 if gen.cores_in_name else n
    smallest = 4 if gen.dims == 3 else 1
    if (gen.cores_in_name and n % 2) or chips < smallest or chips > MAX_TPU_CHIPS or chips & (chips - 1):
        sizes = ", ".join(tpu_name(kind, c) for c in (smallest, 2 * smallest if smallest > 1 else 4, 16))
        raise TargetError(f"{name}: this tool compiles power-of-two slices ({sizes}, ...); pick the nearest one")
    return tpu_target(kind, chips, name)


register("tpu", _parse_tpu, "v4-N, v5p-N (N TensorCores, 2 per chip), v5litepod-N or v5e-N, v6e-N (N chips), "
         "e.g. v5p-8, v5litepod-16, v6e-8")
