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
# Several hosts: see launch/slurm_example.sbatch. The Python interpreter is $PYTHON (default: python).
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

gpus="" mem_fraction="0.90" log="" dry_run=0 config="" overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) [[ $# -ge 2 ]] || { echo "gpu.sh: --gpus needs a value, e.g. --gpus 0,1" >&2; usage; }
            gpus="$2"; shift 2 ;;
    --mem-fraction) [[ $# -ge 2 ]] || { echo "gpu.sh: --mem-fraction needs a value in (0, 1]" >&2; usage; }
            mem_fraction="$2"; shift 2 ;;
    --log) [[ $# -ge 2 ]] || { echo "gpu.sh: --log needs a file name" >&2; usage; }
           log="$2"; shift 2 ;;
    --config) [[ $# -ge 2 ]] || { echo "gpu.sh: --config needs a YAML file" >&2; usage; }
              config="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage ;;
    -*) echo "gpu.sh: unknown option '$1'" >&2; usage ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "gpu.sh: '$1' is not a config override; expected group.key=value, e.g. run.total_steps=10" >&2; usage ;;
  esac
done
[[ -n "$config" ]] || { echo "gpu.sh: --config FILE is required" >&2; usage; }
[[ "$gpus" =~ ^([0-9]+(,[0-9]+)*)?$ ]] || { echo "gpu.sh: --gpus '$gpus': expected indices like 0,1,2,3" >&2; usage; }
[[ "$mem_fraction" =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] && [[ ! "$mem_fraction" =~ ^0?\.0*$ ]] \
  || { echo "gpu.sh: --mem-fraction '$mem_fraction': expected a number in (0, 1], e.g. 0.9" >&2; usage; }

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
if [[ -n "$log" ]]; then
  mkdir -p "$(dirname "$log")"
  env -u JAX_PLATFORMS "${env_vars[@]}" "${cmd[@]}" 2>&1 | tee "$log"
  exit "${PIPESTATUS[0]}"
fi
exec env -u JAX_PLATFORMS "${env_vars[@]}" "${cmd[@]}"
