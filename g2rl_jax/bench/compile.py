"""`python -m g2rl_jax.bench compile`: what compiling a step's programs costs, per program and with N threads.

    python -m g2rl_jax.bench compile --config configs/demo.yaml --threads 1 --threads 2      # this machine's CPU
    python -m g2rl_jax.bench compile --config configs/qwen3_1p7b_g2rl.yaml --preset qwen3-1.7b --target v5p-8 \\
        --match "packed gradient 16 rows x 9216" --match "decode segment 256 rows x 128 slots"       # for a TPU slice

The programs are those of `python -m g2rl_jax.plan --compile --programs all` (g2rl_jax/aot/programs.py), picked
by --match (a substring of the program's name; repeatable; default: every program). Without --target they compile
for this process's devices (tests/conftest.py's 8 CPU devices when XLA_FLAGS asks for them). For each --threads N
the in-memory caches are cleared and every picked program is lowered and compiled by a pool of N threads
(g2rl_jax.train.warmup.compile_all, as the trainer warms a step up): per program the seconds of lowering (Python,
holds the GIL) and of compiling, the process's CPU seconds meanwhile (its own with one thread; the compiler runs
threads of its own, so a thread's CPU clock would miss them) and the compiler's temporary bytes per device;
then the wall clock, the process's CPU seconds and how many XLA compiles the pool ran (jax.monitoring), which
equals the programs picked when none compiled twice. Leave the persistent compilation cache off for this.

    python -m g2rl_jax.bench compile --config configs/demo.yaml --relaunch                     # a relaunch, for real

--relaunch answers what JAX's persistent compilation cache (run.compilation_cache_dir) saves a relaunch: it runs
the trainer (`python -m g2rl_jax.train`, one step, no validation, a fresh run directory each time) as separate
processes: once untimed (it builds a demo model and warms the file cache), then with the cache off, with an empty
cache directory (the first launch, which fills it) and again with that directory (the relaunch). Per launch: the
seconds from starting the process to its first step's metrics line (time to first step, watched from outside),
the step's own seconds (its rollout, reward, score and update stages, from metrics.jsonl) and the cache's files.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from g2rl_jax.bench.step import COMPILE_EVENT


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench compile", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--preset", help="architecture preset instead of model.path/config.json")
    p.add_argument("--target", help="a TPU slice as gcloud names it (v5p-8, ...); default: this process's devices")
    p.add_argument("--match", action="append", default=[], help="compile the programs whose name contains this")
    p.add_argument("--threads", action="append", type=int, default=[], help="compile threads (repeatable; default 1)")
    p.add_argument("--relaunch", action="store_true",
                   help="instead, launch the trainer for one step: cache off, empty cache, the same cache again")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    return p.parse_args(argv)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _launch(cmd: list[str], run_dir: Path, log: Path) -> tuple[float, float, dict]:
    """(seconds to the first metrics line, seconds to exit, that line) of the trainer run as `cmd`."""
    metrics = run_dir / "metrics.jsonl"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        first_s = None
        while proc.poll() is None:
            if first_s is None and metrics.exists() and metrics.read_text().endswith("\n"):
                first_s = time.perf_counter() - start
            time.sleep(0.05)  # watching from outside: the trainer has no hook for this
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not metrics.exists():
        raise SystemExit(f"bench compile error: the trainer failed (exit {proc.returncode}); see {log}")
    line = json.loads(metrics.read_text().splitlines()[0])
    return (first_s if first_s is not None else wall), wall, line


def relaunch(config: str, overrides: list[str]) -> int:
    """The --relaunch measurement (module docstring)."""
    tmp = Path(tempfile.mkdtemp(prefix="g2rl_relaunch_"))
    cache = tmp / "cache"
    base = [sys.executable, "-m", "g2rl_jax.train", "--config", config, "run.total_steps=1", "run.eval_every=0",
            "run.loggers=jsonl", *overrides]
    launches = [("untimed (builds the model)", ""), ("cache off", ""), ("first launch, empty cache", str(cache)),
                ("relaunch, same cache", str(cache))]
    print(f"trainer launches of {config} {' '.join(overrides)} (logs under {tmp}, kept if a launch fails)\n"
          f"| launch | to first step s | process s | step s (rollout + reward + score + update) | cache files |\n"
          f"|{'---|' * 5}", flush=True)
    for i, (name, directory) in enumerate(launches):
        run_dir = tmp / f"run{i}"
        first_s, wall, line = _launch([*base, f"run.output_dir={run_dir}", f"run.compilation_cache_dir={directory}"],
                                      run_dir, tmp / f"launch{i}.log")
        step_s = sum(line[k] for k in ("rollout_seconds", "reward_seconds", "score_seconds", "update_seconds"))
        files = sum(1 for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0
        if i:
            print(f"| {name} | {first_s:.1f} | {wall:.1f} | {step_s:.1f} | {files} |", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def main(argv: list[str]) -> int:
    a = _args(argv)
    if a.relaunch:
        return relaunch(a.config, a.overrides)
    import jax

    from g2rl_jax import parallel
    from g2rl_jax.aot import parse_target, programs
    from g2rl_jax.config import load_config
    from g2rl_jax.plan import model_config
    from g2rl_jax.train import warmup

    cfg = load_config(a.config, a.overrides)
    model, source = model_config(cfg, a.preset)
    devices = parse_target(a.target).devices() if a.target else jax.devices()
    mesh = parallel.make_mesh(cfg.mesh, devices)
    progs = programs.step_programs(cfg, model, mesh, scope="all")
    picked = [p for p in progs if not a.match or any(m in p.name for m in a.match)]
    if not picked:
        print(f"no program matches {a.match}; the programs are: {', '.join(p.name for p in progs)}", file=sys.stderr)
        return 2
    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.__setitem__(0, compiles[0] + (event == COMPILE_EVENT)))
    print(f"{len(picked)} of {len(progs)} programs of {a.config} ({source}) for "
          f"{a.target or f'{len(devices)} x {devices[0].device_kind}'}, mesh {dict(mesh.shape)}; jax {jax.__version__}")
    for threads in a.threads or [1]:
        jax.clear_caches()
        compiles[0] = 0
        cpu_label = "CPU s" if threads == 1 else "CPU s (overlapping)"
        print(f"\n{threads} thread(s), each program as it finishes:\n| program | lower s | compile s | {cpu_label} "
              f"| temp MiB/device |\n|{'---|' * 5}", flush=True)

        def done(i, t):
            temp = "failed" if t.error else f"{t.compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f}"
            print(f"| {picked[i].name} | {t.lower_s:.1f} | {t.compile_s:.1f} | {t.cpu_s:.1f} | {temp} |", flush=True)
            return t.error

        start, cpu = time.perf_counter(), _cpu_seconds()
        warmup.compile_all([p.lower for p in picked], threads, done)
        wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        print(f"{threads} thread(s): {wall:.1f} s wall, {cpu:.1f} s CPU (process), {compiles[0]} XLA compiles "
              f"for {len(picked)} programs", flush=True)
    return 0
