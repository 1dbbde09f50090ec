"""Test set-up: JAX on CPU with 8 fake devices, so sharded code runs on a (data, fsdp, tensor) mesh; the XLA flags
and compilation cache every test process shares; the order, and the grouping that `-n 3` runs the modules
in; fixtures more than one module shares; the demo run.

XLA flags: LLVM at -O0 compiles the CPU programs about a third faster (tests/test_micro.py: 114 -> 76 s of CPU),
and XLA:CPU's elemental loop emitters instead of its MLIR fusion emitters (--xla_cpu_use_fusion_emitters=false) cut
another third (a two-step trainer run on an empty cache: 19 -> 13 s of CPU, docs/testing.md). The demo run, a
newcomer's command, runs without these flags; the same tests pass with and without them. XLA:CPU runs each fake
device's share of a program on its own thread of one pool; with one thread per device a run could hang in a
collective (or abort after --xla_cpu_collective_call_terminate_timeout_seconds, 40 s by default: one CI run aborted
so in test_train.py), which importing g2rl_jax now prevents (PJRT_NPROC, tests/test_cpu_pool.py). The tests allow
10 minutes. Tests that start processes with another device count take these flags from
`_helpers.xla_flags(devices)`.
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
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
              "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_collective_call_terminate_timeout_seconds=600"):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # A fresh persistent compilation cache for this session (empty at the start, deleted at the end), inherited by
    # the trainer subprocesses and the `-n` workers: a relaunched or resumed run (kill -9, SIGTERM, multi-host resume)
    # loads the programs the first launch compiled instead of compiling them again, and a worker loads what the
    # other compiled. Every program, however quick to compile (JAX's default keeps those of >= 1 s).
    _cache = tempfile.mkdtemp(prefix="g2rl_jax_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
import g2rl_jax  # noqa: E402,F401 -- sizes XLA:CPU's pool for the 8 fake devices (PJRT_NPROC) before a backend starts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = pathlib.Path(__file__).resolve().parents[1]

# `-n 3` (the default, pyproject.toml) runs one module (one group) per worker at a time, so a module's fixtures and
# compiled programs serve all its tests. Modules that share a session fixture share a group. A worker takes the next
# module of SLOW_FIRST when it is nearly done with its own, so the costliest go first (longest first: the
# workers end together), and those that mostly wait (timeouts, a GCS server's slow answers, a fake cloud's queue)
# alternate with those that keep a core busy, so that the workers seldom all wait at once; the rest follow in file
# order. Costs: `--durations=0` summed by module (worker seconds, 2026-11-27, docs/testing.md).
GROUPS = {"test_colab.py": "test_demo_run.py"}  # the notebook starts from the policy the demo run built
SLOW_FIRST = ("test_async_sides_train.py", "test_gcs.py", "test_multihost.py", "test_storage_midrun.py",
              "test_bench.py", "test_preemption.py", "test_program_count.py", "test_storage.py", "test_micro.py",
              "test_demo_run.py", "test_rollout_segments.py", "test_tensorstore_timeouts.py", "test_warmup.py",
              "test_tpu_watch.py",
              "test_train.py", "test_async.py", "test_preempt.py", "test_lora_train.py", "test_lifecycle.py",
              "test_aot.py", "test_micro_multihost.py", "test_launch.py", "test_async_multihost.py",
              "test_method_updates.py", "test_gpu_compile.py", "test_plan.py",
              "test_study.py", "test_model.py", "test_strict.py", "test_verify_bounds.py", "test_lora.py",
              "test_g2rl.py", "test_rollout.py", "test_demo_assets.py", "test_algorithm_options.py")


def _group(name: str) -> str:
    return GROUPS.get(name, name)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by scope, the scope a module's group (the `@group` suffix of `--dist loadgroup` does not
    reach pytest 9.2's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    # stable: a group's own file first, then file order
    items.sort(key=lambda item: (rank.get(_group(item.path.name), len(rank)), item.path.name != _group(item.path.name)))


@pytest.fixture(scope="session")
def gcs():
    """A real GCS server on loopback (g2rl_jax/bench/gcs_emulator.py), one per test process: tensorstore reads its
    address once per process and etils keeps its gcsfs client, so every module a worker runs shares this one (each
    under its own prefix of the bucket). The clients reach it through the strict proxy (gcs_proxy.py): a 429 for a
    second update of an object within a second, and seeded 503s, slow answers and dropped connections."""
    from g2rl_jax.bench.gcs_emulator import STRICT, GcsEmulator

    with GcsEmulator(proxy=STRICT) as emulator:
        yield emulator


def demo_command(run: pathlib.Path, model: pathlib.Path, *overrides: str) -> list[str]:
    """`python -m g2rl_jax.train --config configs/demo.yaml` into run, the demo policy built in model (or reused)."""
    return [sys.executable, "-m", "g2rl_jax.train", "--config", str(ROOT / "configs" / "demo.yaml"),
            f"run.output_dir={run}", f"model.path=demo:{model}", *overrides]


def run_demo(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a demo command as a newcomer does: one CPU device, XLA's default flags."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # a guard against a hang only: the run shares the machine with the other worker
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """(finished process, run dir) of `python -m g2rl_jax.train --config configs/demo.yaml` as a newcomer's first
    command runs it (one CPU device, XLA's default flags, the demo policy built first: `model.path=demo:DIR`),
    shortened to four steps (DEMO_SHORT)."""
    from _helpers import DEMO_SHORT

    root = tmp_path_factory.mktemp("demo_run")
    return run_demo(demo_command(root / "run", root / "model", *DEMO_SHORT)), root / "run"


@pytest.fixture(scope="session")
def demo_model_dir(demo_run):
    """The demo policy the demo run built (`demo:DIR` reuses a build of the same recipe): the Colab notebook and the
    full demo run start from it. (The build itself is tested in test_demo_assets.py.)"""
    done, out = demo_run
    assert done.returncode == 0, done.stderr[-4000:]
    return out.parent / "model"


@pytest.fixture(scope="session")
def demo_full_run(demo_model_dir):
    """(finished process, run dir) of the full demo, all 200 steps of configs/demo.yaml, from the policy the short
    run built: only with G2RL_FULL_DEMO=1 (over 200 s of CPU; the README's first command is the same run)."""
    if os.environ.get("G2RL_FULL_DEMO") != "1":
        pytest.skip("the full 200-step demo runs with G2RL_FULL_DEMO=1 (docs/testing.md)")
    run = demo_model_dir.parent / "full_run"
    return run_demo(demo_command(run, demo_model_dir)), run
