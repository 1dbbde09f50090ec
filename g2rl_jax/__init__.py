"""g2rl_jax: G2RL (gradient-guided RL for LLM reasoning) in JAX/Flax.

Where things live, in the order one RL step uses them:

  data/      dataset registry over vendored files, prompt templates, grain pipelines
  rollout/   jitted group sampler: prefill each prompt once, share its KV cache, while_loop decode
  rewards/   answer extraction and safe, time-bounded sympy equivalence (the ±1 reward)
  g2rl.py    the paper's equations: token_stats (log-probs, entropy, Φ), novelty, shaping, advantages
  losses.py  PPO-clip policy loss, KL estimators, aggregation, entropy bonus
  train/     state, update step, the training loop, Orbax checkpoints, the concurrent warm-up of a step's programs
  shapes/    shape planning: the layouts and prompt buckets a run compiles, their prices and the run's choice
  model/     Qwen3 in Flax NNX, attention backends, Hugging Face import/export, LoRA adapters and PEFT adapter I/O
  parallel.py  device mesh and the logical-axis → mesh-axis table
  eval.py    pass@k, maj@k, the evaluation CLI
  plan.py    per-device memory of a config (memory.py) and the smallest slice that fits
  aot/       ahead-of-time compile of every program of a step for a TPU slice or GPUs without them (plan --compile)
  registry.py  datasets and model-path schemes (demo:DIR, ...) other packages provide, imported by name on use
  demo/      the embedded demos (tiny Qwen3, addition, Countdown) and the exploration study (demo.study)
  bench/     python -m g2rl_jax.bench NAME: the measured figures docs/performance.md quotes

Shape letters. An array's name ends in its shape, e.g. `logp_BxT` is [B, T]; einsum strings use the same letters
in lower case. This is the one legend; every module uses it.

  B  rows of a batch: responses / samples (B = P·m, group-major: prompt p's samples are rows p·m … p·m+m−1)
  P  prompts; a group is one prompt's m responses, so group arrays are [P, m]
  m  group size, the samples per prompt (rollout.num_samples)
  S  prompt positions (left-padded)          T  response positions (right-padded)
  L  positions of a whole sequence (S + T for a joined prompt and response)
  C  entries of one chunk: positions of a sequence, or a block of the sampler's candidates
  Q  chunks: of a sequence (L / C), or blocks of the sampler's candidates (I / C)
  I  candidate tokens of one sampling draw (the vocabulary, or its top k)
  D  model width (hidden size)               V  vocabulary
  E  embedding width (EVOL-RL's encoder)     F  MLP width
  H  query heads     G  key/value heads     R  query heads per key/value head (H / G)     K  head dim
  N  decoder layers                          A  processes (hosts)
  U  micro-batches of an update
  X  rows of a part of the batch: one micro-batch, or the rollout's decode batch bucket (compaction shrinks it)
  Y  pairs of one group's responses, m(m−1)/2
  W  another width, named where it is used: a KV cache's capacity, the response positions
     one micro-batch keeps
  Z  stop token ids                          J  variants of one demo SFT example
"""

import importlib.util
import os

__version__ = "0.1.0"

if importlib.util.find_spec("torch") is None:
    # The project uses transformers only for tokenizers, which need no PyTorch; without torch (a plain
    # `pip install -e .`) transformers would print "PyTorch was not found..." on import, an advisory a new user
    # reads as a broken install. Set before any transformers import; a value the user set wins.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


QUIET_TPU_DEFAULTS = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost",
                      "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
QUIET_TPU_MARK = "G2RL_JAX_QUIET_TPU"  # names the variables set below, for this process and its children, so that
#                                      parallel.on_tpu_vm does not read them as a TPU VM's


def _no_tpu_chips() -> bool:
    """libtpu is installed (the `tpu` and `test` extras) but this machine has no TPU chip nor a TPU worker list."""
    if importlib.util.find_spec("libtpu") is None or QUIET_TPU_MARK in os.environ \
            or os.environ.get("TPU_WORKER_HOSTNAMES"):
        return False  # no libtpu; set already (by the parent process); or a TPU worker list (GKE)
    from pathlib import Path

    return not (list(Path("/dev").glob("accel[0-9]*")) or list(Path("/dev/vfio").glob("[0-9]*")))


if _no_tpu_chips():
    # With libtpu installed and no TPU here, libtpu prints three warnings about an unknown accelerator type and worker
    # list each time it starts: when jax probes for a TPU backend, and when g2rl_jax.aot compiles for a TPU
    # topology. It needs neither on this machine; naming them quiets it (jax then falls back to its other backends,
    # as it does anyway). libtpu also takes a lock file so that one process owns the chips; with no chips to own,
    # several compiles (two checks, a test run beside a check) may run at once. A value the user set wins.
    _quiet = {k: v for k, v in QUIET_TPU_DEFAULTS.items() if k not in os.environ}
    os.environ.update(_quiet)
    os.environ[QUIET_TPU_MARK] = ",".join(_quiet)

CPU_POOL_MARK = "G2RL_JAX_PJRT_NPROC"  # the PJRT_NPROC value set below, so that a child process with another
#                                      device count sets its own


def _cpu_pool_threads(xla_flags: str, cores: int) -> int | None:
    """The PJRT_NPROC a CPU backend of `--xla_force_host_platform_device_count` N > 1 fake devices needs (2 N), or
    None when XLA's default (one thread per core, at least N) is already enough.

    XLA:CPU runs each device's share of a multi-device program on one pool of max(cores, N) threads, and the launch
    of each device's share on the same pool. With N threads and no spare, a launch that waits for its device's
    in-flight slot, held by work queued for a pool thread, never reaches the collective the other N - 1 threads
    wait in: the process hangs (XLA's rendezvous warns "not all of them arrived") or aborts after
    --xla_cpu_collective_call_terminate_timeout_seconds. On a 2-core machine with 8 fake devices it took a busy
    machine; two threads per device never hung (tests/test_cpu_pool.py)."""
    import re

    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", xla_flags)
    devices = int(found[-1]) if found else 1
    return 2 * devices if devices > 1 and 2 * devices > cores else None


def _size_cpu_pool() -> None:
    """Set PJRT_NPROC for fake CPU devices (above), unless the user set it; a value a parent process set here is
    recomputed for this process's device count."""
    if CPU_POOL_MARK in os.environ and os.environ.get("PJRT_NPROC") == os.environ[CPU_POOL_MARK]:
        del os.environ["PJRT_NPROC"], os.environ[CPU_POOL_MARK]
    if "PJRT_NPROC" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = _cpu_pool_threads(os.environ.get("XLA_FLAGS", ""), cores)
    if threads:
        os.environ["PJRT_NPROC"] = os.environ[CPU_POOL_MARK] = str(threads)


_size_cpu_pool()

_CUDA_PLUGIN_WITHOUT_DRIVER = bool(importlib.util.find_spec("jax_plugins") and importlib.util.find_spec(
    "jax_plugins.xla_cuda12") and not os.path.exists("/proc/driver/nvidia/version"))

if _CUDA_PLUGIN_WITHOUT_DRIVER:
    # JAX's CUDA plugin installed (the gpu-compile / test extras: g2rl_jax.aot compiles for GPUs without one) on a
    # machine with no NVIDIA driver: its CUDA version check would log a traceback on every start and leave the
    # plugin unregistered, so compiling for GPU devices would fail. Skipping the check registers it; jax still runs
    # on the CPU here. A value the user set wins.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _start_jax_without_cuda_driver_log() -> None:
    """Import jax and register its plugins with stderr (fd 2) closed for the duration.

    The CUDA plugin, loaded on a machine with no NVIDIA driver, logs "Could not find cuda drivers on your machine"
    through a C++ logger on every `import jax` and again when jax registers its plugins; no environment variable
    turns that off, and it would be the first lines of every command's output (a bad-input error included). Both
    steps run here, once, before any command's work: an import error still raises (and prints) after fd 2 is back.
    """
    import sys

    if "jax" in sys.modules:
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        import jax  # noqa: F401
        from jax._src import xla_bridge  # registers plugins without starting a backend (jax.distributed comes first)

        xla_bridge._discover_and_register_pjrt_plugins()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


if _CUDA_PLUGIN_WITHOUT_DRIVER:
    _start_jax_without_cuda_driver_log()
