#!/usr/bin/env bash
# Train on the GPUs of one host: one process sees every selected GPU (JAX single-process, multi-device), and the
# mesh spreads over them (mesh.fsdp=-1 by default: fully sharded over all GPUs; override e.g. mesh.tensor=2).
#
#   launch/gpu.sh [--gpus 0,1,2,3] [--mem-fraction 0.9] [--log FILE] [--dry-run] --config FILE [key=value ...]
#
# --gpus          CUDA device indices to use (default: all visible GPUs)
# --mem-fraction  share of each GPU's memory JAX preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.90,
#                 JAX's own default 0.75 leaves a quarter unused)
# --log FILE      also write the output to FILE (tee)
# --dry-run       print the environment and the command, run nothing
# -h, --help      this text
# Needs the GPU install, pip install -e ".[cuda]" (jax with CUDA 12): before training it checks that the jax of
# $PYTHON (default: python) drives a GPU, and refuses a CPU-only jax in one line. Several hosts:
# launch/slurm_example.sbatch.
set -euo pipefail

HELP_LINES='2,15'
usage() { sed -n "${HELP_LINES}p" "$0" | sed 's/^# \{0,1\}//'; }
bad() { echo "gpu.sh: $1" >&2; usage >&2; exit 2; }
# One line on stdout: the GPUs jax sees, or (exit 1) why it cannot train on a GPU; nothing is allocated.
CUDA_CHECK='
import importlib.util as u, sys
plugins = [m for m in ("jax_cuda12_plugin", "jax_cuda13_plugin") if u.find_spec(m)]
if not plugins:
    print(f"the jax of {sys.executable} has no CUDA support (a CPU-only jax): install the GPU build with "
          "pip install -e \".[cuda]\", then run again")
    sys.exit(1)
try:
    import jax
    gpus = jax.devices("gpu")
except Exception as err:
    detail = " ".join(str(err).split())
    print(f"the jax of {sys.executable} ({plugins[0]}) cannot use a GPU here: {detail}")
    sys.exit(1)
print(f"gpu.sh: {len(gpus)} GPU(s), {gpus[0].device_kind}; jax {jax.__version__}")
'

gpus="" mem_fraction="0.90" log="" dry_run=0 config="" overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) [[ $# -ge 2 ]] || bad "--gpus needs a value, e.g. --gpus 0,1"
            gpus="$2"; shift 2 ;;
    --mem-fraction) [[ $# -ge 2 ]] || bad "--mem-fraction needs a value in (0, 1]"
            mem_fraction="$2"; shift 2 ;;
    --log) [[ $# -ge 2 ]] || bad "--log needs a file name"
           log="$2"; shift 2 ;;
    --config) [[ $# -ge 2 ]] || bad "--config needs a YAML file"
              config="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) bad "unknown option '$1'" ;;
    *=*) overrides+=("$1"); shift ;;
    *) bad "'$1' is not a config override; expected group.key=value, e.g. run.total_steps=10" ;;
  esac
done
[[ -n "$config" ]] || bad "--config FILE is required"
[[ "$gpus" =~ ^([0-9]+(,[0-9]+)*)?$ ]] || bad "--gpus '$gpus': expected indices like 0,1,2,3"
[[ "$mem_fraction" =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] && [[ ! "$mem_fraction" =~ ^0?\.0*$ ]] \
  || bad "--mem-fraction '$mem_fraction': expected a number in (0, 1], e.g. 0.9"

env_vars=(
  "XLA_PYTHON_CLIENT_MEM_FRACTION=$mem_fraction"
  "PYTHONUNBUFFERED=1"
  # overlap collectives with compute (XLA GPU latency-hiding scheduler)
  "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_latency_hiding_scheduler=true"
)
[[ -n "$gpus" ]] && env_vars+=("CUDA_VISIBLE_DEVICES=$gpus")
cmd=("${PYTHON:-python}" -m g2rl_jax.train --config "$config" ${overrides[@]+"${overrides[@]}"})

if [[ $dry_run -eq 1 ]]; then
  printf 'env -u JAX_PLATFORMS'; printf ' %q' "${env_vars[@]}" "${cmd[@]}"; printf '\n'
  exit 0
fi
# the check's stderr (jax's own log lines about CUDA) is dropped: its one line says what is wrong
if ! report=$(env -u JAX_PLATFORMS "${env_vars[@]}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
              "${PYTHON:-python}" -c "$CUDA_CHECK" 2>/dev/null); then
  echo "gpu.sh: ${gpus:+--gpus $gpus: }${report:-${PYTHON:-python} could not run the GPU check}" >&2
  exit 2
fi
echo "$report"
if [[ -n "$log" ]]; then
  mkdir -p "$(dirname "$log")"
  env -u JAX_PLATFORMS "${env_vars[@]}" "${cmd[@]}" 2>&1 | tee "$log"
  exit "${PIPESTATUS[0]}"
fi
exec env -u JAX_PLATFORMS "${env_vars[@]}" "${cmd[@]}"
