#!/usr/bin/env bash
# Cloud TPU VM launcher: create | setup | train | python | status | watch | logs | ssh | delete
# (launch/tpu.py: each one's use; launch/tpu.sh SUBCOMMAND --help: its flags).
# Needs python3 (standard library only) and gcloud on PATH; every subcommand takes --dry-run.
exec python3 "$(dirname "${BASH_SOURCE[0]}")/tpu.py" "$@"
