#!/usr/bin/env python3
"""Cloud TPU VM launcher for g2rl_jax: a thin, printable layer over `gcloud compute tpus`.

    launch/tpu.sh create --name g2rl --zone us-east5-a --accelerator-type v5p-32 --config FILE [--spot] [--force]
    launch/tpu.sh setup  --name g2rl --zone us-east5-a --repo https://github.com/ORG/g2rl_jax.git [--branch main]
    launch/tpu.sh train  --name g2rl --zone us-east5-a --config configs/qwen3_1p7b_g2rl.yaml [key=value ...]
    launch/tpu.sh logs   --name g2rl --zone us-east5-a [--follow | --collect DIR]
    launch/tpu.sh ssh    --name g2rl --zone us-east5-a [--worker 0] [--command CMD]
    launch/tpu.sh delete --name g2rl --zone us-east5-a

`create` first checks, on this machine, that the config fits the slice: `python -m g2rl_jax.plan --config FILE
--target TYPE --compile --programs largest` compiles the step's largest programs for that slice (needs jax and
libtpu here: pip install -e ".[tpu]") and prints its verdict; a config that does not fit is refused unless --force
(which also skips the check). `create --bucket gs://BUCKET/DIR` keeps the bucket in the VM's metadata; `train` then
writes the run to gs://BUCKET/DIR/runs/NAME and JAX's persistent compilation cache to gs://BUCKET/DIR/jax_cache,
which every host of the slice shares and which outlive the VM (`train --bucket` names one directly). Without a bucket
the cache is --compile-cache on each worker's disk, so a run resumed there does not compile everything again.

Every subcommand takes --dry-run (print the exact gcloud command lines, run nothing) and --project. A TPU slice
of several hosts runs the same command on every worker (`--worker=all`); JAX then finds its peers itself on TPU
VMs. `train` starts the run under nohup on each worker with its output in <dir>/logs/worker-<ID>.log, ID being the
worker number from the TPU VM metadata server. Standard library only: this runs on your laptop, not on the TPU.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

DEFAULT_DIR = "~/g2rl_jax"  # checkout location on every worker
DEFAULT_CACHE = "~/.cache/g2rl_jax/jax"  # JAX's compilation cache on each worker's persistent (boot) disk
REPO = Path(__file__).resolve().parents[1]
# Runtime (software) version per TPU generation, from the Cloud TPU docs; --runtime-version overrides.
RUNTIME_VERSIONS = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                    "v6e": "v2-alpha-tpuv6e"}
# The worker's index inside its slice, from the TPU VM metadata server (TPU_WORKER_ID wins where the image sets it).
WORKER_ID = ("${TPU_WORKER_ID:-$(curl -s -H 'Metadata-Flavor: Google' "
             "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)}")
# The bucket `create --bucket` stored in the VM's metadata (G2RL_JAX_BUCKET, even empty, wins where it is set).
BUCKET_KEY = "g2rl-jax-bucket"
BUCKET_SOURCE = ("${G2RL_JAX_BUCKET-$(curl -s -f -H 'Metadata-Flavor: Google' "
                 f"http://metadata.google.internal/computeMetadata/v1/instance/attributes/{BUCKET_KEY} || true)}}")


def _target(args) -> list[str]:
    """The flags naming the TPU: --zone, and --project when given."""
    return ["--zone", args.zone] + (["--project", args.project] if args.project else [])


def _ssh(args, command: str | None, worker: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_target(args), f"--worker={worker}"]
    return cmd + ([f"--command={command}"] if command is not None else [])


def runtime_version(accelerator_type: str) -> str:
    """The default runtime for an accelerator type such as v5p-32 (its family is the part before '-')."""
    family = accelerator_type.split("-", 1)[0]
    if family not in RUNTIME_VERSIONS:
        raise SystemExit(f"tpu.py create: no default --runtime-version for accelerator type {accelerator_type!r} "
                         f"(known families: {', '.join(RUNTIME_VERSIONS)}); pass --runtime-version explicitly")
    return RUNTIME_VERSIONS[family]


def check_command(args) -> list[str]:
    """The local fit check `create` runs first (the largest program of each kind bounds the others' memory)."""
    return [sys.executable, "-m", "g2rl_jax.plan", "--config", args.config, "--target", args.accelerator_type,
            "--compile", "--programs", "largest", *args.overrides]


def check_fit(args) -> int:
    """Run the fit check; 0 when the config fits the slice, else the status to exit with (after saying why)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    print(f"checking that {args.config} fits {args.accelerator_type}: {shlex.join(check_command(args))}", flush=True)
    done = subprocess.run(check_command(args), env=env, stdout=subprocess.PIPE, text=True)
    verdict = [line for line in done.stdout.splitlines() if line.startswith("VERDICT:")]
    print(verdict[-1] if verdict else done.stdout.strip()[-2000:], flush=True)
    if done.returncode == 0:
        return 0
    what = "does not fit" if done.returncode == 1 else "could not be checked"
    print(f"tpu.py create: {args.config} {what} on {args.accelerator_type}; no VM was created. Change the config or "
          "the accelerator type, or pass --force to create it anyway", file=sys.stderr, flush=True)
    return done.returncode or 1


def create(args) -> list[list[str]]:
    version = args.runtime_version or runtime_version(args.accelerator_type)
    cmd = ["gcloud", "compute", "tpus", "queued-resources", "create", args.name, "--node-id", args.name,
           *_target(args), "--accelerator-type", args.accelerator_type, "--runtime-version", version]
    if args.bucket:  # `train` reads it back on every worker: run.output_dir and the compile cache go there
        cmd += ["--metadata", f"{BUCKET_KEY}={args.bucket.rstrip('/')}"]
    return [cmd + (["--spot"] if args.spot else [])]


def setup(args) -> list[list[str]]:
    """Clone (or fast-forward) the repository on every worker and install it with the TPU extra."""
    d, branch, repo = args.dir, shlex.quote(args.branch), shlex.quote(args.repo)
    script = (f"set -e; if [ -d {d}/.git ]; then git -C {d} fetch origin {branch} && git -C {d} checkout {branch} "
              f"&& git -C {d} pull --ff-only origin {branch}; else git clone --branch {branch} {repo} {d}; fi; "
              f"cd {d} && python3 -m pip install -e '.[tpu,gcs]'")
    return [_ssh(args, script, "all")]


def train_script(args) -> str:
    """The shell line each worker runs: nohup python -m g2rl_jax.train, one log file per worker."""
    train = shlex.join(["python3", "-m", "g2rl_jax.train", "--config", args.config, *args.overrides])
    env = shlex.join(["PYTHONUNBUFFERED=1", *args.env])
    bucket = shlex.quote(args.bucket.rstrip("/")) if args.bucket else BUCKET_SOURCE
    if not any(o.startswith("run.output_dir=") for o in args.overrides):  # in the bucket, when there is one
        train += f' ${{BUCKET:+"run.output_dir=$BUCKET/runs/{args.name}"}}'
    if args.compile_cache is not None:
        train += f" {shlex.quote('run.compilation_cache_dir=' + args.compile_cache)}"
    elif not any(o.startswith("run.compilation_cache_dir=") for o in args.overrides):  # the bucket's, else the disk's
        train += f' "run.compilation_cache_dir=${{CACHE:-{DEFAULT_CACHE}}}"'
    log = f"{args.log_dir}/worker-$WORKER.log"
    # JAX_PLATFORMS is unset so JAX picks the TPU; TPU_* variables set by the VM image are left alone.
    return (f"set -e; cd {args.dir}; mkdir -p {args.log_dir}; WORKER={WORKER_ID}; BUCKET={bucket}; "
            "CACHE=${BUCKET:+$BUCKET/jax_cache}; "
            f"nohup env -u JAX_PLATFORMS {env} {train} > {log} 2>&1 < /dev/null & "
            f"echo \"worker $WORKER: started, log $PWD/{log}\"")


def train(args) -> list[list[str]]:
    return [_ssh(args, train_script(args), "all")]


def logs(args) -> list[list[str]]:
    pattern = f"{args.dir}/{args.log_dir}/worker-*.log"
    if args.collect:  # file names carry the worker id, so every worker's log lands side by side
        src = f"{args.name}:{pattern}"
        return [["mkdir", "-p", args.collect],
                ["gcloud", "compute", "tpus", "tpu-vm", "scp", src, args.collect, *_target(args),
                 f"--worker={args.worker}"]]
    tail = f"tail -n {args.lines}" + (" -f" if args.follow else "")
    return [_ssh(args, f"{tail} {pattern}", args.worker)]


def ssh(args) -> list[list[str]]:
    return [_ssh(args, args.command, args.worker)]


def delete(args) -> list[list[str]]:
    """Delete the queued resource and (--force) the TPU VMs it holds."""
    return [["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, *_target(args), "--force",
             "--quiet"]]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="launch/tpu.sh", description=__doc__.split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = top.add_subparsers(dest="subcommand", metavar="{create,setup,train,logs,ssh,delete}", required=True)

    def sub(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = subs.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        p.add_argument("--name", required=True, help="queued resource and TPU VM name")
        p.add_argument("--zone", required=True, help="Cloud zone, e.g. us-east5-a")
        p.add_argument("--project", help="Cloud project (default: gcloud's configured project)")
        p.add_argument("--dry-run", action="store_true", help="print the exact commands, run nothing")
        return p

    p = sub("create", create, "request a TPU slice as a queued resource")
    p.add_argument("--accelerator-type", required=True, help="e.g. v5p-32, v5litepod-16, v6e-8")
    p.add_argument("--runtime-version", help=f"TPU software version (default per family: {RUNTIME_VERSIONS})")
    p.add_argument("--spot", action="store_true", help="spot (preemptible) capacity")
    p.add_argument("--config", help="training config YAML, checked here to fit the slice before the VM is created")
    p.add_argument("--force", action="store_true", help="create the VM without (or despite) the fit check")
    p.add_argument("--bucket", metavar="gs://BUCKET/DIR", help="kept in the VM's metadata: `train` then writes "
                   "run.output_dir to gs://BUCKET/DIR/runs/NAME and the compile cache to gs://BUCKET/DIR/jax_cache, "
                   "storage every host of the slice shares")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the check, as for train")

    p = sub("setup", setup, "clone the repository and pip install -e '.[tpu,gcs]' on every worker")
    p.add_argument("--repo", required=True, help="git URL of the g2rl_jax repository")
    p.add_argument("--branch", default="main", help="branch or tag to check out (default: main)")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"checkout directory on the workers (default: {DEFAULT_DIR})")

    p = sub("train", train, "start python -m g2rl_jax.train on every worker under nohup")
    p.add_argument("--config", required=True, help="config YAML, relative to --dir on the workers")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"checkout directory on the workers (default: {DEFAULT_DIR})")
    p.add_argument("--log-dir", default="logs", help="log directory relative to --dir (default: logs)")
    p.add_argument("--bucket", metavar="gs://BUCKET/DIR", help="run.output_dir gs://BUCKET/DIR/runs/NAME and the "
                   "compile cache gs://BUCKET/DIR/jax_cache (default: the bucket `create --bucket` kept, if any)")
    p.add_argument("--compile-cache", metavar="DIR",
                   help=f"JAX compilation cache on the workers (run.compilation_cache_dir; default: the bucket's "
                   f"jax_cache, else {DEFAULT_CACHE} on the VM's persistent disk)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the run, e.g. --env HF_HOME=/mnt/hf (repeatable)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.total_steps=10")

    p = sub("logs", logs, "show (tail) or --collect the per-worker training logs")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"checkout directory on the workers (default: {DEFAULT_DIR})")
    p.add_argument("--log-dir", default="logs", help="log directory relative to --dir (default: logs)")
    p.add_argument("--worker", default="all", help="worker index or 'all' (default: all)")
    p.add_argument("--lines", type=int, default=50, help="lines per log to show (default: 50)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="keep following the logs (tail -f)")
    mode.add_argument("--collect", metavar="LOCAL_DIR", help="copy every worker's log into LOCAL_DIR")

    p = sub("ssh", ssh, "open a shell on a worker, or run --command there")
    p.add_argument("--worker", default="0", help="worker index or 'all' (default: 0)")
    p.add_argument("--command", help="command to run instead of an interactive shell")

    sub("delete", delete, "delete the queued resource and its TPU VMs")
    return top


def _check(args, top: argparse.ArgumentParser) -> None:
    """Checks argparse cannot express; a failure is a usage error (exit 2) naming the flag."""
    for item in getattr(args, "env", []):
        key, sep, _ = item.partition("=")
        if not sep or not key:
            top.error(f"--env {item!r}: expected KEY=VALUE")
    for item in getattr(args, "overrides", []):
        if "=" not in item or item.startswith("-"):
            top.error(f"train: {item!r} is not a config override; expected group.key=value, e.g. run.total_steps=10")
    bucket = getattr(args, "bucket", None)
    if bucket is not None and not bucket.startswith("gs://"):
        top.error(f"--bucket {bucket!r}: expected gs://BUCKET/DIR, the storage the slice's hosts share")
    for flag in ("dir", "log_dir"):  # pasted into remote shell lines unquoted, so that ~ expands there
        value = getattr(args, flag, "")
        if any(c.isspace() or c in "'\"$`;&|<>" for c in value):
            top.error(f"--{flag.replace('_', '-')} {value!r}: use a path without spaces or shell characters")
    if getattr(args, "lines", 1) < 1:
        top.error(f"logs --lines must be >= 1, got {args.lines}")
    if args.subcommand == "create" and not args.config and not args.force:
        top.error("create: --config FILE is required, to check that it fits the slice before a VM is created "
                  "(or pass --force to skip the check)")


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    _check(args, top)
    if args.subcommand == "create" and not args.force:
        if args.dry_run:
            print(shlex.join(check_command(args)))
        elif (status := check_fit(args)) != 0:
            return status
    for cmd in args.fn(args):
        print(("" if args.dry_run else "+ ") + shlex.join(cmd), flush=True)
        if not args.dry_run:
            rc = subprocess.call(cmd)
            if rc:
                print(f"tpu.py {args.subcommand}: {cmd[0]} exited with status {rc}", file=sys.stderr)
                return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
