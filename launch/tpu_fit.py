"""`create`'s fit check (launch/tpu.py): `python -m g2rl_jax.plan --config FILE --target TYPE --compile --programs
largest` compiles the step's largest program of each kind for the slice (they bound the others' memory) and ends in
one VERDICT line.

It runs in the project's environment: the first of this python and the checkout's .venv/bin/python that has jax,
flax and libtpu (the TPU compiler; Linux x86-64 wheels only), with the checkout first on PYTHONPATH. Where neither
has them it says so in one line and how to check (install the project, or --force to skip the check): it never
reports "does not fit" for a check that did not run. Only a VERDICT: DOES NOT FIT line refuses the config; a check
that ended without a verdict (a bad config, a traceback) says so. The plan's output is shown as it comes (its
progress lines are on stderr, its report on stdout). Standard library only, like tpu.py.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tpu_states import exits

REPO = Path(__file__).resolve().parents[1]
FIT_MODULES = ("jax", "flax", "libtpu")  # what the check needs beyond the checkout's code, the compiler included
MISSING = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"


def candidates() -> list[str]:
    """The interpreters tried, in order: this one, then the checkout's environment."""
    return list(dict.fromkeys([sys.executable, str(REPO / ".venv" / "bin" / "python")]))


def missing(python: str) -> list[str] | None:
    """The FIT_MODULES `python` cannot import (found by importlib, nothing imported); None if it does not run."""
    try:
        done = subprocess.run([python, "-c", MISSING, *FIT_MODULES], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.split() if done.returncode == 0 else None


def project_python() -> tuple[str | None, str]:
    """(an interpreter that can run the check, "") or (None, why none can)."""
    why = []
    for python in candidates():
        if not os.path.exists(python):
            why.append(f"{python} does not exist")
            continue
        lacks = missing(python)
        if lacks == []:
            return python, ""
        why.append(f"{python} does not run" if lacks is None else f"{python} has no {', '.join(lacks)}")
    return None, "; ".join(why)


def check_command(args, python: str) -> list[str]:
    return [python, "-m", "g2rl_jax.plan", "--config", args.config, "--target", args.accelerator_type, "--compile",
            "--programs", "largest", *args.overrides]


def dry_run(args) -> None:
    print(f"# the fit check, run by the first of {', '.join(candidates())} that has {', '.join(FIT_MODULES)}:")
    print(shlex.join(check_command(args, candidates()[0])))


def check_fit(args) -> int:
    """0 when the config fits the slice; else, after one line saying why, the status `create` exits with."""
    what = f"{args.config} fits {args.accelerator_type}"
    python, why = project_python()
    if python is None:
        print(f"tpu.py create: cannot check here that {what}: {why} (libtpu installs on Linux x86-64 only). "
              f"Install the project with the TPU compiler (pip install -e '.[tpu]' in {REPO}) and run create again, "
              "or pass --force to create the VM without the check", file=sys.stderr, flush=True)
        return exits.Exit.BAD_INPUT
    cmd = check_command(args, python)
    print(f"checking that {what}: {shlex.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    verdict = ""
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        for line in proc.stdout:  # shown as it comes: a long compile is not silence
            print(line, end="", flush=True)
            verdict = line.strip() if line.startswith("VERDICT:") else verdict
    if proc.returncode == 0 and verdict.startswith("VERDICT: FITS"):
        return 0
    if verdict.startswith("VERDICT: DOES NOT FIT"):
        print(f"tpu.py create: {args.config} does not fit {args.accelerator_type} (the verdict above); no VM was "
              "created. Change the config or the accelerator type, or pass --force to create it anyway",
              file=sys.stderr, flush=True)
    else:
        print(f"tpu.py create: the fit check ended with status {proc.returncode} before a verdict that {what} "
              f"({verdict or 'its output above says why'}); no VM was created. Fix what it says, or pass --force to "
              "create the VM without the check", file=sys.stderr, flush=True)
    return exits.Exit.BAD_INPUT
