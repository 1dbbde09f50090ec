"""Test set-up: JAX on CPU with 8 fake devices, so sharded code runs on a (data, fsdp, tensor) mesh; fixtures
more than one module shares; the full demo run, started in the background when a test needs it.

XLA:CPU runs each fake device's share of a program on its own thread and ends the process (SIGABRT, "Fatal Python
error: Aborted") when a collective's 8 threads do not all arrive within
--xla_cpu_collective_call_terminate_timeout_seconds (40 s by default). On a 2-core machine shared with other jobs a
thread can be starved that long: one CI run aborted so in test_train.py. The tests allow 10 minutes.
"""
import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_cpu_collective_call_terminate_timeout_seconds=600"):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # A fresh persistent compilation cache for this session (empty at the start, deleted at the end), inherited by
    # the trainer subprocesses: a relaunched or resumed run (kill -9, SIGTERM, multi-host resume) loads the programs
    # the first launch compiled instead of compiling them again. JAX caches programs that took >= 1 s to compile.
    _cache = tempfile.mkdtemp(prefix="g2rl_jax_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The demo policy configs/demo.yaml builds (`demo:DIR` reuses a build of the same recipe), built once for the
    session: the demo run and the Colab notebook start from it."""
    from g2rl_jax.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="session", autouse=True)
def _demo_run_in_background(request, tmp_path_factory):
    """When a selected test uses `demo_run`: start `python -m g2rl_jax.train --config configs/demo.yaml` (one CPU
    device, as on a laptop) at the session's first test, so its minutes of mostly one core overlap the other tests
    instead of following them. Yields a function that waits for it: (finished process, its run dir)."""
    if not any("demo_run" in item.fixturenames for item in request.session.items):
        yield None
        return
    model = request.getfixturevalue("demo_model_dir")
    out = tmp_path_factory.mktemp("demo_run") / "run"
    stdout, stderr = out.parent / "stdout.txt", out.parent / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "g2rl_jax.train", "--config", str(ROOT / "configs" / "demo.yaml"),
           f"run.output_dir={out}", f"model.path=demo:{model}"]
    with open(stdout, "w") as out_file, open(stderr, "w") as err_file:
        proc = subprocess.Popen(cmd, env=env, stdout=out_file, stderr=err_file, cwd=ROOT)

    def finished(timeout: float = 3600):  # a guard against a hang only: the run shares the machine with the suite
        proc.wait(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout.read_text(), stderr.read_text()), out

    try:
        yield finished
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def demo_run(_demo_run_in_background):
    """(finished process, run dir) of the full demo run started in the background."""
    return _demo_run_in_background()
