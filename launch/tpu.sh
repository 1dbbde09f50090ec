#!/usr/bin/env bash
# Cloud TPU VM launcher: create | setup | train | logs | ssh | delete (see launch/tpu.py or --help).
# Needs python3 (standard library only) and gcloud on PATH; every subcommand takes --dry-run.
exec python3 "$(dirname "${BASH_SOURCE[0]}")/tpu.py" "$@"
