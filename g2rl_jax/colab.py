"""Which Colab runtime this is, what to install on it and which config fits it (launch/colab.ipynb).

    runtime = detect()              # Runtime(kind='gpu', name='Tesla T4', memory_gib=15.0, compute_capability=(7, 5))
    install_args(runtime)           # pip arguments: the project with this runtime's jax extra
    run_shown([sys.executable, "-m", "pip", *install_args(runtime)])   # pip's lines shown as they come
    choice = choose(runtime)        # the config that fits, its overrides, the model and why
    backend_problem(runtime, jax.default_backend())   # None, or what to do when jax did not get the hardware

Nothing here imports jax: the notebook runs it before jax of the right kind is installed. A TPU is found by its
chips (/dev/accel*, /dev/vfio/N) or the variables a TPU VM sets (TPU_ACCELERATOR_TYPE, TPU_NAME); a GPU by
`nvidia-smi`. `G2RL_COLAB_RUNTIME=cpu` runs the CPU demo on any runtime.

What fits (docs/lora.md): Qwen3-1.7B-Base with LoRA (configs/qwen3_1p7b_g2rl_lora.yaml) peaks at 10.3 GiB per chip,
compiled without the hardware for one v5e chip, a T4 and an L4. Below compute capability 8.0 (T4, V100) cuDNN has
no fused attention, so the config runs with `model.attention=xla`. The demo's config is a float32 full fine-tune
of a tiny model: with a real Qwen3 it would need about 32 GiB (the planner's estimate) before any KV cache, so it
only ever runs the demo model.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

DEMO_CONFIG = "configs/demo.yaml"
DEMO_MODEL = "demo:runs/colab/model"
LORA_CONFIG = "configs/qwen3_1p7b_g2rl_lora.yaml"
LORA_MODEL = "Qwen/Qwen3-1.7B-Base"  # a Hugging Face id; downloaded on first use (about 3.4 GB)
LORA_PEAK_GIB = 10.33  # the planner's per-chip peak of LORA_CONFIG (compiled: 10.28 on v5e, T4 and L4)
USABLE_FRACTION = 0.90  # share of a chip's memory a run may use, as g2rl_jax.plan.USABLE_FRACTION
FUSED_ATTENTION_CC = (8, 0)  # model.config.FUSED_ATTENTION_CC (which a run's `auto` follows); this module loads no jax
# a small step for the notebook's stage-by-stage cells on the demo model (one CPU core runs it in seconds)
DEMO_STEP = ("data.prompts_per_step=4", "rollout.num_samples=8", "algorithm.mini_batch_size=32",
             "algorithm.micro_batch_size=32")
TPU_GIB = {"v2": 8, "v3": 16, "v4": 32, "v5litepod": 16, "v5e": 16, "v5p": 95, "v6e": 32}  # HBM per chip
CC_BY_NAME = {"T4": (7, 5), "V100": (7, 0), "P100": (6, 0), "L4": (8, 9), "A100": (8, 0), "H100": (9, 0)}


@dataclasses.dataclass(frozen=True)
class Runtime:
    kind: str  # "cpu", "gpu" or "tpu"
    name: str = ""  # "Tesla T4", "v5litepod-1", ...
    memory_gib: float = 0.0  # per chip; 0 on CPU or where unknown
    compute_capability: tuple[int, int] | None = None  # GPUs only
    chips: int = 1


@dataclasses.dataclass(frozen=True)
class Choice:
    config: str
    model_path: str
    overrides: tuple[str, ...]  # on top of the config, for the notebook and for a full run alike
    reason: str
    sample_dataset: str  # where the notebook takes its one example prompt from

    def command(self, output_dir: str) -> str:
        """The full training run of this choice, as a shell command."""
        return " ".join(["python -m g2rl_jax.train --config", self.config, f"model.path={self.model_path}",
                         f"run.output_dir={output_dir}", *self.overrides])


def detect(environ=None, run=subprocess.run, dev: Path = Path("/dev")) -> Runtime:
    """This machine's accelerator, read without jax (see the module docstring)."""
    environ = os.environ if environ is None else environ
    if environ.get("G2RL_COLAB_RUNTIME", "").lower() == "cpu":
        return Runtime("cpu")
    tpu = _tpu(environ, dev)
    return tpu or _gpu(run) or Runtime("cpu")


def _tpu(environ, dev: Path) -> Runtime | None:
    # `import g2rl_jax` sets TPU_ACCELERATOR_TYPE on a machine with libtpu and no chips (its names are in this mark)
    quiet = environ.get("G2RL_JAX_QUIET_TPU", "").split(",")
    kind = "" if "TPU_ACCELERATOR_TYPE" in quiet else environ.get("TPU_ACCELERATOR_TYPE", "")
    chips = sorted(dev.glob("accel[0-9]*")) + sorted((dev / "vfio").glob("[0-9]*"))
    if not (kind or chips or environ.get("TPU_NAME")):
        return None
    generation = re.match(r"(v\d+[a-z]*)", kind)
    count = re.search(r"-(\d+)$", kind)
    return Runtime("tpu", kind or "TPU", TPU_GIB.get(generation[1] if generation else "", 0.0),
                   chips=len(chips) or (int(count[1]) if count else 1))


def _gpu(run) -> Runtime | None:
    """The first GPU nvidia-smi lists: name, memory and compute capability (older drivers lack compute_cap)."""
    for fields in ("name,memory.total,compute_cap", "name,memory.total"):
        try:
            out = run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                      capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None  # no driver: no GPU
        if out.returncode == 0 and out.stdout.strip():
            lines = out.stdout.strip().splitlines()
            parts = [p.strip() for p in lines[0].split(",")]
            cc = tuple(int(x) for x in parts[2].split(".")) if len(parts) > 2 else _cc_from_name(parts[0])
            return Runtime("gpu", parts[0], round(float(parts[1]) / 1024, 1), cc, chips=len(lines))
    return None


def _cc_from_name(name: str) -> tuple[int, int] | None:
    return next((cc for key, cc in CC_BY_NAME.items() if key in name.upper()), None)


def with_device_memory(runtime: Runtime, devices) -> Runtime:
    """The runtime with its per-chip memory read from jax's devices (`jax.local_devices()`, after the install),
    where detection could not tell it (a TPU found by its chips alone, a GPU nvidia-smi did not size)."""
    stats = devices[0].memory_stats() if runtime.kind != "cpu" and devices else None
    if runtime.memory_gib or not stats or "bytes_limit" not in stats:
        return runtime
    name = runtime.name if runtime.name not in ("", "TPU") else devices[0].device_kind
    # what jax's allocator may use: a TPU's whole HBM, a GPU's XLA_PYTHON_CLIENT_MEM_FRACTION (an underestimate)
    return dataclasses.replace(runtime, name=name, memory_gib=round(stats["bytes_limit"] / 2**30, 1),
                               chips=len(devices))


def install_args(runtime: Runtime, project: str = "g2rl_jax") -> list[str]:
    """`pip install` arguments for the project with the jax that drives this runtime's hardware; pip's lines
    (collecting, downloading, installing) stay, its progress bars (terminal control codes) go."""
    extra = {"tpu": "[tpu]", "gpu": "[cuda]"}.get(runtime.kind, "")
    return ["install", "--progress-bar", "off", "-e", f"{project}{extra}"]


def run_shown(cmd: list[str], say=print) -> int:
    """Run `cmd`, passing each line of its output (stderr included) to `say` as it comes (a notebook cell shows what
    Python prints, not what a subprocess writes to the kernel's own stdout, so a long install would be silent).
    Returns its exit status."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            say(line.rstrip("\n"))
    return proc.returncode


def lora_fits(runtime: Runtime) -> bool:
    """The 1.7B LoRA config's peak, with the runtime's reserve, fits one chip of this runtime."""
    return runtime.kind != "cpu" and LORA_PEAK_GIB <= USABLE_FRACTION * runtime.memory_gib


def choose(runtime: Runtime, model_path: str | None = None) -> Choice:
    """The config this runtime runs; `model_path` (the notebook's MODEL_PATH) None for the runtime's default.
    A real model where only the demo fits raises ValueError saying which runtime to pick."""
    demo = model_path is not None and model_path.startswith("demo:")
    if demo or (model_path is None and not lora_fits(runtime)):
        where = "this CPU runtime" if runtime.kind == "cpu" else f"{runtime.name} ({runtime.memory_gib:g} GiB)"
        return Choice(DEMO_CONFIG, model_path or DEMO_MODEL, DEMO_STEP, f"the embedded demo on {where}: a tiny "
                      "Qwen3 trained on two-digit addition", "demo_test")
    if not lora_fits(runtime):
        raise ValueError(f"MODEL_PATH={model_path!r} is a real model, and {runtime.name or runtime.kind} cannot "
                         f"train it: Qwen3-1.7B with LoRA needs {LORA_PEAK_GIB} GiB on one chip (configs/demo.yaml, "
                         "a float32 full fine-tune, needs about 32 GiB before its KV cache, the planner's estimate); "
                         "pick a T4, L4, A100 or TPU v5e-1 runtime, or leave MODEL_PATH unset for the demo")
    overrides: tuple[str, ...] = ()
    why = f"Qwen3-1.7B-Base with rank-64 LoRA, peak {LORA_PEAK_GIB} GiB of {runtime.memory_gib:g} per chip"
    cc = runtime.compute_capability
    if runtime.kind == "gpu" and (cc is None or cc < FUSED_ATTENTION_CC):
        overrides = ("model.attention=xla",)
        why += (f"; compute capability {'.'.join(map(str, cc)) if cc else 'unknown'} has no cuDNN fused attention, "
                "so XLA attention, and bfloat16 math without bfloat16 units (correct, slow)")
    return Choice(LORA_CONFIG, model_path or LORA_MODEL, overrides, why, "math500")


def backend_problem(runtime: Runtime, backend: str) -> str | None:
    """None when jax's default backend drives this runtime's hardware; else one line saying what to do."""
    if runtime.kind == "cpu" or backend == runtime.kind:
        return None
    return (f"this runtime has a {runtime.kind.upper()} ({runtime.name}) but jax runs on {backend}: restart the "
            "runtime (Runtime > Restart session) and run the notebook again from the top")


def restart_needed(modules=None) -> bool:
    """jax was imported before the install: the running kernel keeps the jax (and backends) it loaded."""
    return "jax" in (sys.modules if modules is None else modules)
