"""Test set-up: JAX on CPU with 8 fake devices, so sharded code runs on a (data, fsdp, tensor) mesh; fixtures
more than one module shares.

XLA:CPU runs each fake device's share of a program on its own thread and ends the process (SIGABRT, "Fatal Python
error: Aborted") when a collective's 8 threads do not all arrive within
--xla_cpu_collective_call_terminate_timeout_seconds (40 s by default). On a 2-core machine shared with other jobs a
thread can be starved that long: one CI run aborted so in test_train.py. The tests allow 10 minutes.
"""
import atexit
import os
import shutil
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


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The demo policy configs/demo.yaml builds (`demo:DIR` reuses a build of the same recipe), built once for the
    session: the demo run and the Colab notebook start from it."""
    from g2rl_jax.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "model")
