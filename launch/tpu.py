#!/usr/bin/env python3
"""Cloud TPU VM launcher for g2rl_jax: a thin, printable layer over `gcloud compute tpus`.

    launch/tpu.sh create --name g2rl --zone us-east5-a --accelerator-type v5p-32 --config FILE --bucket gs://B/DIR
                         [--spot] [--force] [--no-wait]
    launch/tpu.sh setup  --name g2rl --zone us-east5-a --repo https://github.com/ORG/g2rl_jax.git [--branch main]
    launch/tpu.sh train  --name g2rl --zone us-east5-a --config configs/qwen3_1p7b_g2rl.yaml [key=value ...]
    launch/tpu.sh python --name g2rl --zone us-east5-a -- -m g2rl_jax.eval --checkpoint ...   (the VM's env)
    launch/tpu.sh status --name g2rl --zone us-east5-a [--bucket gs://B/DIR]
    launch/tpu.sh watch  --name g2rl --zone us-east5-a --accelerator-type v5p-32 --bucket gs://B/DIR --spot
                         --repo URL --config FILE [key=value ...]   (brings the run up from any state, keeps it going)
    launch/tpu.sh logs   --name g2rl --zone us-east5-a [--follow | --collect DIR]
    launch/tpu.sh ssh    --name g2rl --zone us-east5-a [--worker 0] [--command CMD]
    launch/tpu.sh delete --name g2rl --zone us-east5-a

`create` first runs the fit check (launch/tpu_fit.py: `python -m g2rl_jax.plan --target TYPE --compile` in the
project's environment; --force skips it), then waits until the queued resource is ACTIVE (--no-wait: it does not).
`setup` makes a Python >= 3.11 environment (<dir>/.venv, uv's managed CPython: the images' python3 is 3.10) on every
worker, installs .[tpu,gcs] into it and marks the worker set up. `train` starts the run on every worker (`--worker=all`;
JAX finds its peers itself on TPU VMs) in the background, immune to hang-ups: its output in <dir>/logs/worker-ID.log,
its shell's pid in worker-ID.pid, its exit status in worker-ID.exit (ID: the worker number from the TPU VM metadata
server). With `create --bucket gs://BUCKET/DIR` (kept in the VM's metadata) or `train --bucket`, the run goes to
gs://BUCKET/DIR/runs/NAME and JAX's compilation cache to gs://BUCKET/DIR/jax_cache, shared by the slice's hosts and
outliving the VM; `--spot` needs a bucket. `watch` (launch/tpu_watch.py) supervises a run from any state: the table
of docs/tpu_vm.md. Every subcommand takes --dry-run (print the exact commands, run nothing, here or on a worker) and
--project; `v5e-N` is taken as gcloud's `v5litepod-N`. Standard library only: this runs on your laptop.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

import tpu_fit
import tpu_watch

DEFAULT_DIR = "~/g2rl_jax"  # checkout location on every worker
DEFAULT_PYTHON = "3.11"  # the oldest CPython that jax, flax, orbax-checkpoint and grain accept
VENV = ".venv"  # the worker's environment, inside the checkout
DEFAULT_CACHE = "~/.cache/g2rl_jax/jax"  # JAX's compilation cache on each worker's persistent (boot) disk
SETUP_MARK = ".g2rl-setup-done"  # in <dir>/.venv: setup ran to its end on this worker
TAIL_LINES = 20  # of each worker's log, copied into watch's log when the trainer stopped
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


def accelerator_type(value: str) -> str:
    """gcloud's name of a TPU type: `v5e-N`, as the product is called, is `v5litepod-N`."""
    value = value.strip().lower()
    return "v5litepod-" + value.removeprefix("v5e-") if value.startswith("v5e-") else value


def runtime_version(accelerator_type: str) -> str:
    """The default runtime for an accelerator type such as v5p-32 (its family is the part before '-')."""
    family = accelerator_type.split("-", 1)[0]
    if family not in RUNTIME_VERSIONS:
        raise SystemExit(f"tpu.py create: no default --runtime-version for accelerator type {accelerator_type!r} "
                         f"(known families: {', '.join(RUNTIME_VERSIONS)}); pass --runtime-version explicitly")
    return RUNTIME_VERSIONS[family]


def create(args) -> list[list[str]]:
    version = args.runtime_version or runtime_version(args.accelerator_type)
    cmd = ["gcloud", "compute", "tpus", "queued-resources", "create", args.name, "--node-id", args.name,
           *_target(args), "--accelerator-type", args.accelerator_type, "--runtime-version", version]
    if args.bucket:  # `train` reads it back on every worker: run.output_dir and the compile cache go there
        cmd += ["--metadata", f"{BUCKET_KEY}={args.bucket.rstrip('/')}"]
    return [cmd + (["--spot"] if args.spot else [])]


def setup_script(args) -> str:
    """Clone (or fast-forward) the repository, then a Python >= 3.11 environment in <dir>/.venv with .[tpu,gcs];
    <dir>/.venv/SETUP_MARK once all of it succeeded (what `watch` reads as "set up").

    uv (one static binary from PyPI, put in ~/.local/bin by the image's pip, else by its installer) creates the
    environment with a CPython it downloads (--python-preference only-managed: never the image's 3.10, nor any other
    interpreter found on the VM); the environment's version is checked before anything is installed."""
    d, branch, repo, py = args.dir, shlex.quote(args.branch), shlex.quote(args.repo), shlex.quote(args.python)
    want = "(" + ", ".join(args.python.split(".")) + ")"
    return (f"set -e; if [ -d {d}/.git ]; then git -C {d} fetch origin {branch} && git -C {d} checkout {branch} "
            f"&& git -C {d} pull --ff-only origin {branch}; else git clone --branch {branch} {repo} {d}; fi; "
            f'cd {d}; rm -f {VENV}/{SETUP_MARK}; export PATH="$HOME/.local/bin:$PATH"; '
            "command -v uv > /dev/null || python3 -m pip install --user --quiet uv "
            "|| curl -LsSf https://astral.sh/uv/install.sh | sh; "
            f"uv venv --allow-existing --python-preference only-managed --python {py} {VENV}; "
            f"{VENV}/bin/python -c 'import sys; sys.exit(sys.version_info[:2] < {want})' "
            f"|| {{ echo \"setup: {d}/{VENV} is not Python {args.python}+\" >&2; exit 1; }}; "
            f"uv pip install --python {VENV}/bin/python -e '.[tpu,gcs]'; "
            f"{VENV}/bin/python -c 'import sys, jax; print(\"python\", sys.version.split()[0], \"jax\", "
            f"jax.__version__)'; touch {VENV}/{SETUP_MARK}")


def setup(args) -> list[list[str]]:
    return [_ssh(args, setup_script(args), "all")]


def train_script(args) -> str:
    """The shell line each worker runs: the environment's python -m g2rl_jax.train in the background, hang-ups
    ignored (as nohup), one log, one pid file and one exit-status file per worker."""
    train = shlex.join([f"{VENV}/bin/python", "-m", "g2rl_jax.train", "--config", args.config, *args.overrides])
    env = shlex.join(["PYTHONUNBUFFERED=1", *args.env])
    bucket = shlex.quote(args.bucket.rstrip("/")) if args.bucket else BUCKET_SOURCE
    if not any(o.startswith("run.output_dir=") for o in args.overrides):  # in the bucket, when there is one
        train += f' ${{BUCKET:+"run.output_dir=$BUCKET/runs/{args.name}"}}'
    if args.compile_cache is not None:
        train += f" {shlex.quote('run.compilation_cache_dir=' + args.compile_cache)}"
    elif not any(o.startswith("run.compilation_cache_dir=") for o in args.overrides):  # the bucket's, else the disk's
        train += f' "run.compilation_cache_dir=${{CACHE:-{DEFAULT_CACHE}}}"'
    log, status, pid = (f"{args.log_dir}/worker-$WORKER.{ext}" for ext in ("log", "exit", "pid"))
    # JAX_PLATFORMS is unset so JAX picks the TPU; TPU_* variables set by the VM image are left alone. The exit file
    # appears whole (renamed into place); the pid file names the subshell that writes it, before ssh returns.
    return (f"set -e; cd {args.dir}; mkdir -p {args.log_dir}; WORKER={WORKER_ID}; BUCKET={bucket}; "
            f"CACHE=${{BUCKET:+$BUCKET/jax_cache}}; rm -f {status} {pid}; "
            f"( trap '' HUP; trap true TERM; set +e; env -u JAX_PLATFORMS {env} {train}; echo $? > {status}.tmp; "
            f"mv {status}.tmp {status} ) > {log} 2>&1 < /dev/null & echo $! > {pid}; "
            f"echo \"worker $WORKER: started, log $PWD/{log}\"")


def train(args) -> list[list[str]]:
    return [_ssh(args, train_script(args), "all")]


def probe_script(args) -> str:
    """What `watch` and `status` read on each worker, as one line: `g2rl-worker ID setup=ok|none trainer=STATE`,
    STATE being `never` (no pid file, no exit file), `running` (the pid file's shell runs the trainer's line),
    `exited:CODE` (the exit file) or `lost` (a pid file whose process is gone, and no exit file: killed)."""
    logs = f"{args.dir}/{args.log_dir}"
    return (f"W={WORKER_ID}; S=none; [ -f {args.dir}/{VENV}/{SETUP_MARK} ] && S=ok; "
            f"P={logs}/worker-$W.pid; X={logs}/worker-$W.exit; "
            'if [ -s "$X" ]; then T="exited:$(cat "$X")"; '
            'elif [ -f "$P" ] && grep -qs g2rl_jax.train "/proc/$(cat "$P")/cmdline"; then T=running; '
            'elif [ -f "$P" ]; then T=lost; else T=never; fi; echo "g2rl-worker $W setup=$S trainer=$T"')


def probe(args) -> list[list[str]]:
    return [_ssh(args, probe_script(args), "all")]


def stop(args) -> list[list[str]]:
    """SIGTERM to each worker's trainer still running (the processes its pid file's shell started)."""
    pid = f"{args.dir}/{args.log_dir}/worker-$W.pid"
    return [_ssh(args, f'W={WORKER_ID}; [ -f {pid} ] && pkill -TERM -P "$(cat {pid})"; true', "all")]


def tail(args) -> list[list[str]]:
    """Each worker's last log lines, each line prefixed with its worker."""
    log = f"{args.dir}/{args.log_dir}/worker-$W.log"
    return [_ssh(args, f'W={WORKER_ID}; tail -n {TAIL_LINES} {log} 2>/dev/null | sed "s/^/worker $W: /"', "all")]


def logs(args) -> list[list[str]]:
    pattern = f"{args.dir}/{args.log_dir}/worker-*.log"
    if args.collect:  # file names carry the worker id, so every worker's log lands side by side
        src = f"{args.name}:{pattern}"
        return [["mkdir", "-p", args.collect],
                ["gcloud", "compute", "tpus", "tpu-vm", "scp", src, args.collect, *_target(args),
                 f"--worker={args.worker}"]]
    tail = f"tail -n {args.lines}" + (" -f" if args.follow else "")
    return [_ssh(args, f"{tail} {pattern}", args.worker)]


def python(args) -> list[list[str]]:
    """Any module or script, run with the environment setup made, in the checkout."""
    return [_ssh(args, f"cd {args.dir} && {VENV}/bin/python {shlex.join(args.args)}", args.worker)]


def ssh(args) -> list[list[str]]:
    return [_ssh(args, args.command, args.worker)]


def delete(args) -> list[list[str]]:
    """Delete the queued resource and (--force) the TPU VMs it holds."""
    return [["gcloud", "compute", "tpus", "queued-resources", "delete", args.name, *_target(args), "--force",
             "--quiet"]]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="launch/tpu.sh", description=__doc__.split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = top.add_subparsers(dest="subcommand", metavar="{create,setup,train,python,status,watch,logs,ssh,delete}",
                              required=True)

    def sub(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = subs.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        p.add_argument("--name", required=True, help="queued resource and TPU VM name")
        p.add_argument("--zone", required=True, help="Cloud zone, e.g. us-east5-a")
        p.add_argument("--project", help="Cloud project (default: gcloud's configured project)")
        p.add_argument("--dry-run", action="store_true", help="print the exact commands, run nothing")
        return p

    def create_args(p, bucket_help: str) -> None:
        p.add_argument("--accelerator-type", required=True, type=accelerator_type,
                       help="e.g. v5p-32, v5litepod-16 (or v5e-16), v6e-8")
        p.add_argument("--runtime-version", help=f"TPU software version (default per family: {RUNTIME_VERSIONS})")
        p.add_argument("--spot", action="store_true", help="spot (preemptible) capacity; needs --bucket")
        p.add_argument("--bucket", metavar="gs://BUCKET/DIR", help=bucket_help)
        p.add_argument("--wait-timeout", type=float, default=7200.0, metavar="S",
                       help="wait this long for the queued resource to be ACTIVE (watch: in any one waiting state) "
                       "(default: 7200)")

    def setup_args(p) -> None:
        p.add_argument("--repo", required=True, help="git URL of the g2rl_jax repository")
        p.add_argument("--branch", default="main", help="branch or tag to check out (default: main)")
        p.add_argument("--python", default=DEFAULT_PYTHON, metavar="X.Y",
                       help=f"CPython of the workers' environment, 3.11 or newer (default: {DEFAULT_PYTHON})")

    def train_args(p) -> None:
        p.add_argument("--log-dir", default="logs", help="log directory relative to --dir (default: logs)")
        p.add_argument("--compile-cache", metavar="DIR",
                       help=f"JAX compilation cache on the workers (run.compilation_cache_dir; default: the bucket's "
                       f"jax_cache, else {DEFAULT_CACHE} on the VM's persistent disk)")
        p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                       help="extra environment for the run, e.g. --env HF_HOME=/mnt/hf (repeatable)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.total_steps=10")

    def dir_arg(p) -> None:
        p.add_argument("--dir", default=DEFAULT_DIR, help=f"checkout directory on the workers (default: {DEFAULT_DIR})")

    kept = ("kept in the VM's metadata: `train` then writes run.output_dir to gs://BUCKET/DIR/runs/NAME and the "
            "compile cache to gs://BUCKET/DIR/jax_cache, storage every host of the slice shares")
    p = sub("create", create, "request a TPU slice as a queued resource and wait until it is ACTIVE")
    create_args(p, kept)
    p.add_argument("--poll-seconds", type=float, default=30.0, metavar="S",
                   help="ask for its state this often while waiting (default: 30)")
    p.add_argument("--config", help="training config YAML, checked here to fit the slice before the VM is created")
    p.add_argument("--force", action="store_true", help="create the VM without (or despite) the fit check")
    p.add_argument("--no-wait", action="store_true", help="return once the request is made, without waiting")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the check, as for train")

    p = sub("setup", setup, "clone the repository, make a Python >= 3.11 environment and install .[tpu,gcs] in it, "
            "on every worker")
    setup_args(p)
    dir_arg(p)

    p = sub("train", train, "start the environment's python -m g2rl_jax.train on every worker, in the background")
    p.add_argument("--config", required=True, help="config YAML, relative to --dir on the workers")
    dir_arg(p)
    p.add_argument("--bucket", metavar="gs://BUCKET/DIR", help="run.output_dir gs://BUCKET/DIR/runs/NAME and the "
                   "compile cache gs://BUCKET/DIR/jax_cache (default: the bucket `create --bucket` kept, if any)")
    train_args(p)

    p = sub("python", python, "run the environment's python (e.g. -m g2rl_jax.eval ...) in the checkout")
    dir_arg(p)
    p.add_argument("--worker", default="all", help="worker index or 'all' (default: all)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="python's arguments, after --")

    p = sub("status", None, "the queued resource's state, the trainer's (while ACTIVE) and the run's last step "
            "and checkpoints (in the bucket)")
    p.add_argument("--bucket", metavar="gs://BUCKET/DIR", help="the bucket given to create, where the run is")
    dir_arg(p)
    p.add_argument("--log-dir", default="logs", help="log directory relative to --dir (default: logs)")

    p = sub("watch", None, "supervise a (spot) run from any state: create if needed, setup and train once ACTIVE, "
            "relaunch or stop by the trainer's exit code, delete and recreate on a preemption (no fit check: run "
            "create once for it); the table of docs/tpu_vm.md")
    create_args(p, kept + " (required: the run must outlive the VM)")
    setup_args(p)
    p.add_argument("--config", required=True, help="config YAML, relative to --dir on the workers")
    dir_arg(p)
    train_args(p)
    p.add_argument("--interval", type=float, default=60.0, metavar="S", help="poll every S seconds (default: 60)")
    p.add_argument("--backoff", type=float, default=60.0, metavar="S",
                   help="the first wait before a retry or a relaunch that waits; it doubles each time in a row, up "
                   "to 32 times (default: 60)")
    p.add_argument("--max-relaunches", type=int, default=5,
                   help="stop after the trainer ended this many times in a row without a new step (default: 5)")
    p.add_argument("--max-tries", type=int, default=3,
                   help="stop after create, delete, setup or train failed this many times in a row (default: 3)")
    p.add_argument("--max-recoveries", type=int, default=20,
                   help="stop after this many preemptions recovered (default: 20)")
    p.add_argument("--log", metavar="FILE", help="append every event here too (default: tpu-watch-NAME.log)")
    p.add_argument("--delete-when-done", action="store_true",
                   help="delete the queued resource when watch ends, however it ends (the workers' last log lines "
                   "are in --log)")

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
    if getattr(args, "spot", False) and not getattr(args, "bucket", None):
        top.error(f"{args.subcommand} --spot needs --bucket gs://BUCKET/DIR: a preempted VM's disk, with the "
                  "run's checkpoints and compile cache, is gone")
    if args.subcommand == "watch" and not args.bucket:
        top.error("watch needs --bucket gs://BUCKET/DIR: a recreated VM resumes the run from there")
    version = getattr(args, "python", DEFAULT_PYTHON).split(".")
    if len(version) != 2 or not all(v.isdigit() for v in version) or (int(version[0]), int(version[1])) < (3, 11):
        top.error(f"--python {args.python!r}: expected 3.11 or newer as MAJOR.MINOR (jax, flax, orbax-checkpoint "
                  "and grain require Python >= 3.11)")
    if args.subcommand == "python":
        args.args = args.args[1:] if args.args[:1] == ["--"] else args.args
        if not args.args:
            top.error("python: give python's arguments after --, e.g. -- -m g2rl_jax.eval --help")
    if args.subcommand == "create" and not args.config and not args.force:
        top.error("create: --config FILE is required, to check that it fits the slice before a VM is created "
                  "(or pass --force to skip the check)")


class Steps:
    """What `status` and `watch` run: the command lists of each step for their arguments, and how they run them."""

    BUILDERS = {"create": create, "delete": delete, "setup": setup, "train": train, "probe": probe, "stop": stop,
                "tail": tail}
    line = staticmethod(shlex.join)

    def __init__(self, args):
        self.args = args

    def build(self, name: str) -> list[list[str]]:
        return self.BUILDERS[name](self.args)

    def call(self, cmds: list[list[str]]) -> int:
        return call(cmds, self.args)

    @staticmethod
    def capture(cmd: list[str]) -> str | None:
        """A read's output (stdout), None when it failed."""
        done = subprocess.run(cmd, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None


def call(cmds: list[list[str]], args) -> int:
    """Print and run each command (only print with --dry-run); the first failing status, else 0."""
    for cmd in cmds:
        print(("" if args.dry_run else "+ ") + shlex.join(cmd), flush=True)
        if not args.dry_run:
            rc = subprocess.call(cmd)
            if rc:
                print(f"tpu.py {args.subcommand}: {cmd[0]} exited with status {rc}", file=sys.stderr, flush=True)
                return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    _check(args, top)
    if args.subcommand == "status":
        return tpu_watch.status(args, _target(args), Steps(args))
    if args.subcommand == "watch":
        args.log = args.log or f"tpu-watch-{args.name}.log"
        return tpu_watch.watch(args, _target(args), Steps(args))
    if args.subcommand == "create" and not args.force:
        if args.dry_run:
            tpu_fit.dry_run(args)
        elif (status := tpu_fit.check_fit(args)) != 0:
            return status
    rc = call(args.fn(args), args)
    if rc or args.subcommand != "create" or args.no_wait:
        return rc
    if args.dry_run:
        print(shlex.join(tpu_watch.describe_command(args, _target(args))) + "   # until ACTIVE")
        return 0
    ok = tpu_watch.wait_active(args, _target(args), tpu_watch.Log(None), args.wait_timeout, args.poll_seconds)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
