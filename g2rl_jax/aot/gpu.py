"""GPU targets for the ahead-of-time compile: NVIDIA H100, H200 and A100 (80 GB) hosts, compiled without a GPU.

    target = parse_target("h100-8")       # one host of 8 x H100 SXM 80 GB
    target = parse_target("h100-2x8")     # 2 hosts of 8 (16 GPUs), each host its own NVLink domain
    target.devices()                      # compile-only CUDA devices, no GPU needed

Names: CARD-N is one host of N GPUs (1 <= N <= 8), CARD-HxN is H hosts of N GPUs; CARD is h100 (SXM, 80 GB HBM3),
h200 (SXM, 141 GB HBM3e), a100 (SXM4, 80 GB), or the
PCIe cards of Colab's GPU runtimes, l4 (24 GB) and t4 (16 GB). A bare card name is one GPU (h100 = h100-1).

How: JAX's CUDA plugin (`jax-cuda12-plugin` of the pinned jax, with `nvidia-cudnn-cu12` for cuDNN's fused
attention; the `gpu-compile` extra) builds compile-only devices from an XLA `GpuTargetConfigProto` describing the
card, vendored in gpu_targets/ (figures and their sources in gpu_targets/README.md), and a topology
"PARTITIONS x HOSTS-PER-PARTITION x GPUS-PER-HOST": an 8-GPU HGX host is one NVLink partition, so H hosts are
"Hx1xN". What the compiler cannot know without a GPU (`WORKSPACE_CAVEAT`): cuDNN's workspace counts 0 bytes,
nothing is autotuned and cost_analysis() is None, so a program's compiled bytes are a floor.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import re

from g2rl_jax.aot.targets import Target, TargetError, register

MAX_PER_HOST = 8  # GPUs on one HGX / DGX host
MAX_HOSTS = 128
INSTALL = 'pip install "g2rl_jax[gpu-compile]" (jax-cuda12-plugin of the pinned jax and nvidia-cudnn-cu12)'
CUDNN_MARK = "__cudnn$fmha"  # cuDNN's fused attention (forward and backward) in compiled HLO
WORKSPACE_CAVEAT = ("GPU figures are a floor: cuDNN's workspace counts 0 bytes, nothing is autotuned, and XLA gives "
                    "no cost analysis without a GPU; keep the margin the verdict asks for")


@dataclasses.dataclass(frozen=True)
class Card:
    key: str  # as typed in a target name
    spec_file: str  # GpuTargetConfigProto text in gpu_targets/
    peak_tflops: float  # dense bfloat16, NVIDIA's data sheets (time estimates only)
    hbm_gbps: float  # memory bandwidth, as in the spec file (time estimates only)
    compute_capability: tuple[int, int]  # as in the spec file; below sm_80 no cuDNN fused attention


CARDS = {
    "h100": Card("h100", "h100_sxm_80gb.txtpb", 989, 3352, (9, 0)),
    "h200": Card("h200", "h200_sxm_141gb.txtpb", 989, 4800, (9, 0)),
    "a100": Card("a100", "a100_sxm_80gb.txtpb", 312, 2039, (8, 0)),
    "l4": Card("l4", "l4_pcie.txtpb", 121, 300, (8, 9)),  # Colab's L4 runtime (24 GB)
    "t4": Card("t4", "t4_pcie.txtpb", 65, 320, (7, 5)),  # Colab's T4 runtime (16 GB: no cuDNN fused attention)
}


def target_config(card: Card) -> str:
    """The card's GpuTargetConfigProto in text form (what get_topology_desc's target_config takes)."""
    return importlib.resources.files("g2rl_jax.aot").joinpath("gpu_targets", card.spec_file).read_text()


def device_memory_bytes(card: Card) -> int:
    """The card's memory as CUDA reports it (the spec's device_memory_size)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(card))[1])


def topology(hosts: int, per_host: int) -> str:
    """XLA's GPU topology string: partitions x hosts per partition x GPUs per host, one NVLink partition per host."""
    return f"{hosts}x1x{per_host}"


def missing_plugin() -> str | None:
    """None when this host can compile for GPUs; else which wheel is missing and how to install it (one line)."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return f"compiling for GPU needs JAX's CUDA plugin: {INSTALL}"
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.cudnn") is None:
        return f"compiling for GPU needs cuDNN (fused attention): {INSTALL}"
    return None


def gpu_devices(card: Card, hosts: int, per_host: int) -> list:
    """hosts x per_host compile-only devices of `card`, device i on host i // per_host."""
    problem = missing_plugin()
    if problem:
        raise TargetError(problem)
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=topology(hosts, per_host),
                                            target_config=target_config(card))
    except NotImplementedError as err:  # the plugin did not register: it found no CUDA and was asked to check it
        raise TargetError("JAX's CUDA plugin is installed but did not start; on a machine without a GPU set "
                          f"JAX_PLATFORMS=cpu or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 ({err})") from None
    return list(topo.devices)


def gpu_target(card_key: str, hosts: int, per_host: int, name: str | None = None) -> Target:
    """The Target of `hosts` hosts of `per_host` GPUs of one card (CARDS)."""
    card = CARDS[card_key]
    label = name or gpu_name(card_key, hosts, per_host)
    return Target(name=label, platform="gpu", chips=hosts * per_host, hosts=hosts,
                  hbm_bytes=device_memory_bytes(card), topology=f"{card.key}:{topology(hosts, per_host)}",
                  kind=card.key, compute_capability=card.compute_capability,
                  peak_tflops=card.peak_tflops, hbm_gbps=card.hbm_gbps,
                  make_devices=lambda: gpu_devices(card, hosts, per_host), kernel_name="cudnn",
                  kernel_mark=CUDNN_MARK, caveat=WORKSPACE_CAVEAT, resize=lambda n: gpu_name(card_key, *hosts_of(n)))


def hosts_of(gpus: int) -> tuple[int, int]:
    """(hosts, GPUs per host) of a run of `gpus` GPUs: one host up to MAX_PER_HOST, full hosts above."""
    return (1, gpus) if gpus <= MAX_PER_HOST else (-(-gpus // MAX_PER_HOST), MAX_PER_HOST)


def gpu_name(card_key: str, hosts: int, per_host: int) -> str:
    return f"{card_key}-{per_host}" if hosts == 1 else f"{card_key}-{hosts}x{per_host}"


def _parse_gpu(name: str) -> Target | None:
    match = re.fullmatch(r"(h100|h200|a100|l4|t4)(?:-(?:(\d+)x)?(\d+))?", name.lower())
    if match is None:
        return None
    card, hosts, per_host = match[1], int(match[2] or 1), int(match[3] or 1)
    if not 1 <= per_host <= MAX_PER_HOST or not 1 <= hosts <= MAX_HOSTS:
        raise TargetError(f"{name}: a host holds 1 to {MAX_PER_HOST} GPUs and a run 1 to {MAX_HOSTS} hosts; "
                          f"e.g. {card}-8 (one host of 8) or {card}-2x8 (two hosts of 8)")
    return gpu_target(card, hosts, per_host, name)


register("gpu", _parse_gpu, "h100-N, h200-N, a100-N (one host of N <= 8 GPUs; a100 is the 80 GB SXM4), "
         "h100-HxN (H hosts of N), e.g. h100-8, h200-2x8; t4, l4 (one Colab GPU)")
