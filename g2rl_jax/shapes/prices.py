"""What the choice of a run's shapes prices: the devices a run trains on, seconds to compile a program of each kind,
seconds of compute per micro_cost unit.

    device = Device.of(mesh)                                         # the training mesh's chips, by jax's kind
    prices = model_prices(model, device, micro=16, seq_len=9216, kinds=("score", "gradient"), remat=True)
    prices = Prices.from_score(compile_s, run_s, units, remat)       # measured (`bench tune-shapes`)

The prices come from a model, never from a clock, so two runs of one config on one kind of device choose the same
shapes whatever else the machine is doing: a pass's compute is its FLOPs (`train_flops`) at the device's effective
FLOP/s (`Device.flops`: the chips' bf16 peak at ESTIMATE_MFU on TPU and GPU, CPU_FLOPS for a CPU host); the largest
score program compiles in SCORE_COMPILE_S[platform] seconds (the layers are scanned, so that barely moves with
depth), a reference program alike, a gradient program GRADIENT_COMPILE times it (measured: 4.68 / 1.33 s at the
demo size on the 2-core CPU, 65.8 / 19.5 s for Qwen3-1.7B compiled for v5p-8), a packed pass's program
PACKED_COMPILE times the grouped one of its kind, a rollout's segments, prefill and first token alike and its moves
MOVE_COMPILE of it; the compile threads are run.compile_threads, or
MODEL_THREADS[platform] when that is 0 (the host's core count is not the config's). The gradient runs 3 times a
forward (4 with model.remat). Only the training mesh's chips count: with mesh.rollout_devices the rollout's devices
run no pass.
"""
from __future__ import annotations

import dataclasses

from g2rl_jax.shapes.layouts import micro_cost

ESTIMATE_MFU = 0.4  # model FLOP utilisation the step-time estimates assume for the score, reference and update
GRADIENT_COMPILE = 3.5  # a gradient program's compile seconds / its score program's (see the module docstring)
# seconds to compile the largest score program, by platform: the demo-size model's 64 x 528 on the 2-core CPU (3.0 s,
# docs/performance.md), Qwen3-1.7B's on v5p-8 (19.5 s), on an H100 the 1.7B update's 43.9 s / GRADIENT_COMPILE
SCORE_COMPILE_S = {"cpu": 3.0, "gpu": 12.5, "tpu": 19.5}
MOVE_COMPILE = 0.1  # a rollout's cache or row move: this share of a score program's compile seconds
# a packed pass's program against a grouped one of the same kind and positions (the segment masks, the blocked
# attention's bands, Φ's per-slot scan): measured 2.05x (score) and 2.1x (gradient) of the compiler's CPU seconds at
# the demo size, 64 rows x 544 positions, interleaved on the 2-core CPU (1.35x and 1.2x at 48 positions);
# docs/performance.md. Not measured for TPU or GPU, where it is assumed alike.
PACKED_COMPILE = 2.0
MODEL_THREADS = {"cpu": 4, "gpu": 32, "tpu": 32}  # compile threads assumed when run.compile_threads is 0
# effective FLOP/s of a CPU host: the demo-size score program of 64 x 528 positions (35.8 GFLOP) in 1.394 s on the
# project's 2-core CPU (docs/performance.md)
CPU_FLOPS = 25.6e9
# dense bf16 peak TFLOP/s per chip by jax's device_kind (the longest match wins; Cloud TPU docs, NVIDIA data sheets);
# a kind not listed is priced at DEFAULT_TFLOPS
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v5 lite": 197.0, "TPU v5": 459.0,
                    "TPU v6 lite": 918.0, "TPU v4": 275.0}
DEFAULT_TFLOPS = 275.0


def train_flops(cfg, rows: int, length: int, tokens: int | None = None) -> float:
    """Forward + backward FLOPs of Qwen3 `cfg` over `tokens` tokens (default all rows x length) in rows of `length`
    positions: 2 x the matmul parameters (the embedding table left out unless it is the untied head's twin) per
    token and 4 x length x heads x head_dim per token and layer for the attention, forward; the backward twice that."""
    tokens = rows * length if tokens is None else tokens
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attention = 4 * tokens * length * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 3 * (2.0 * matmul_params * tokens + attention)


@dataclasses.dataclass(frozen=True)
class Prices:
    """Seconds to compile one program of each kind (score, reference, gradient; reference absent without the KL
    term) and seconds of compute per micro_cost unit of each kind."""

    compile_s: dict[str, float]
    unit_s: dict[str, float]

    @classmethod
    def from_score(cls, compile_s: dict[str, float], run_s: dict[str, float], units: float,
                   remat: bool) -> "Prices":
        """From the compile and run seconds of the largest score (and reference) program, `units` its micro_cost;
        the gradient priced from the score program (module docstring)."""
        unit_s = {k: s / units for k, s in run_s.items()}
        unit_s["gradient"] = (3 + remat) * unit_s["score"]
        return cls({**compile_s, "gradient": GRADIENT_COMPILE * compile_s["score"]}, unit_s)


def peak_tflops(device_kind: str) -> float:
    """A chip's dense bf16 peak by jax's device_kind (PEAK_BF16_TFLOPS, the longest match; else DEFAULT_TFLOPS)."""
    matches = [k for k in PEAK_BF16_TFLOPS if k in device_kind]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else DEFAULT_TFLOPS


@dataclasses.dataclass(frozen=True)
class Device:
    """What the price model knows of the devices a run trains on: the platform, the chips' bf16 peak and how many."""

    platform: str  # "cpu", "gpu" or "tpu"
    peak_tflops: float  # per chip (0 on CPU: CPU_FLOPS prices the host)
    chips: int

    @classmethod
    def of(cls, mesh) -> "Device":
        """The devices of a training mesh (a jax Mesh), by jax's platform and device_kind: its chips only, not the
        rollout's (mesh.rollout_devices) nor any other device of the process."""
        devices = list(mesh.devices.flat)
        first = devices[0]
        return cls(first.platform, 0.0 if first.platform == "cpu" else peak_tflops(first.device_kind), len(devices))

    @property
    def flops(self) -> float:
        """Effective FLOP/s of a pass over all the chips (module docstring)."""
        return CPU_FLOPS if self.platform == "cpu" else self.chips * self.peak_tflops * 1e12 * ESTIMATE_MFU

    def describe(self) -> str:
        if self.platform == "cpu":
            return f"cpu at {CPU_FLOPS / 1e9:.1f} GFLOP/s"
        return f"{self.chips} x {self.platform} at {self.peak_tflops:.0f} TFLOP/s peak"


def model_prices(model, device: Device, *, micro: int, seq_len: int, kinds: tuple[str, ...],
                 remat: bool) -> Prices:
    """The model's prices (module docstring) of a run of Qwen3 `model` on `device`, micro-batches of up to `micro`
    rows x seq_len positions; kinds: ("score", "gradient"), with "reference" under the KL term."""
    forward_s = train_flops(model, micro, seq_len) / 3 / device.flops
    unit_s = forward_s / micro_cost(micro, seq_len)
    score = SCORE_COMPILE_S.get(device.platform, SCORE_COMPILE_S["tpu"])
    compile_s = {k: score * (GRADIENT_COMPILE if k == "gradient" else 1.0) for k in kinds}
    return Prices(compile_s, {k: unit_s * ((3 + remat) if k == "gradient" else 1) for k in kinds})


def rollout_price(counts: dict[str, int], prices: Prices) -> tuple[int, float]:
    """(programs, compile seconds) of one prompt bucket's rollout, its programs by kind (step.rollout_counts): each
    priced as a score program, its moves ("regroup") at MOVE_COMPILE of one."""
    score = prices.compile_s["score"]
    return sum(counts.values()), sum(n * score * (MOVE_COMPILE if k == "regroup" else 1.0) for k, n in counts.items())


def model_seconds(platform: str) -> dict[str, float]:
    """Compile seconds of one program of each kind by the price model, for a bill without compiling (`bench
    ladder`): a score program's SCORE_COMPILE_S[platform], a gradient GRADIENT_COMPILE of it, every move and small
    program MOVE_COMPILE of it, the rest (decode segments, prefill, ...) one."""
    score = SCORE_COMPILE_S.get(platform, SCORE_COMPILE_S["tpu"])
    out = {k: score for k in ("prefill", "start", "decode_layers", "segment", "score", "reference", "init",
                              "advantages", "apply", "embed", "token_terms")}
    out.update(gradient=GRADIENT_COMPILE * score, regroup=MOVE_COMPILE * score, small=MOVE_COMPILE * score)
    return out
