"""Shared test helpers (tiny HF checkpoints themselves are in hf_tiny.py).

    from _helpers import create_sharded, tiny_qwen3_fixtures
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), mesh=mesh), mesh)   # random init, in place
    model_dir, model = tiny_qwen3_fixtures()   # module-scoped fixtures of one tiny random Qwen3 per test module
    kill_when(proc, ready, log)                # SIGKILL a trainer subprocess the moment a condition holds
    with lock_held_elsewhere(out, env) as holder: ...   # another process holds the run lock of `out`
    run_processes(lambda i, port: [*train_cmd, *trainer_args(i, port)], timeout=1800)   # 2 processes, one job

Multi-host on localhost: `run_processes` starts several processes at once, joined by jax.distributed (CPU, gloo
collectives) through a coordinator on a free port, each with `devices` fake CPU devices (the suite's XLA flags,
`xla_flags`) and tests/ on its PYTHONPATH; it waits for all of them (killing what still runs `timeout` seconds after
the start, a hang guard) and fails the test, with the end of its log, when one hung or exited non-zero.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import pytest
from flax import nnx

from g2rl_jax.model import load_pretrained
from g2rl_jax.parallel import DEFAULT_RULES, state_shardings

from hf_tiny import make_tiny_qwen3_dir


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess with `devices` fake CPU devices: the suite's flags (conftest.py) with that
    device count. (g2rl_jax, imported first there, sizes XLA:CPU's pool for that count.)"""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+ ?", "", os.environ.get("XLA_FLAGS", ""))
    return f"--xla_force_host_platform_device_count={devices} {flags}".strip()


# The demo command's overrides in the suite (tests/conftest.py `demo_run`): four steps, a checkpoint and an evaluation
# every two, check what the command leaves behind in under a minute; the full 200 steps and the README's promise on
# them run with G2RL_FULL_DEMO=1 (tests/test_demo_run.py, docs/testing.md).
DEMO_SHORT = ("run.total_steps=4", "run.checkpoint_every=2", "run.eval_every=2")
HANG_S = 3600  # only a run that neither ends nor reaches the awaited state in an hour is reported as hung


def tail(log) -> str:
    """The end of a subprocess's stderr file (`log`, open for writing)."""
    log.flush()
    return pathlib.Path(log.name).read_text(errors="replace")[-3000:]


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], log) -> bool:
    """SIGKILL proc the moment ready() holds; False if the run ended first. It waits on the condition (or the run's
    end), not on a fixed time, so a slow, loaded machine only makes it wait longer; HANG_S only guards a hang."""
    t0 = time.monotonic()
    while proc.poll() is None:
        if ready():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if time.monotonic() - t0 > HANG_S:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the run neither ended nor got there in {HANG_S}s: {tail(log)}")
        time.sleep(0.005)
    return False


@contextlib.contextmanager
def lock_held_elsewhere(out: str, env: dict):
    """Another process holds the run lock of `out` (a directory or a gs:// URL) inside the block; it is killed
    without releasing the lock at the end, so the lock it leaves is stale. Yields the Popen (its pid is the lock's)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from g2rl_jax.train.lifecycle import RunLock\n"
                               f"RunLock({out!r}).acquire(); print('held', flush=True); time.sleep(120)"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def create_sharded(make_module: Callable[[], nnx.Module], mesh, rules=DEFAULT_RULES):
    """Build `make_module()` with every parameter created directly in the sharding the library gives it
    (`parallel.state_shardings`); runs load their weights with `load_pretrained(..., mesh=mesh)` instead."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    shardings = state_shardings(abstract_state, mesh, rules)
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make_module()), out_shardings=shardings)())


def tiny_qwen3_fixtures(**config_overrides):
    """(model_dir, model): module-scoped fixtures of a tiny random Qwen3 checkpoint (hf_tiny) and the model
    `load_pretrained` reads from it. Assign them at module level under these names."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory):
        return make_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny_qwen3"), **config_overrides)

    @pytest.fixture(scope="module")
    def model(model_dir):
        return load_pretrained(model_dir)

    return model_dir, model


def placed_on_mesh_and_one_device(trainer, batch):
    """The trainer's params, optimizer state and `batch` placed twice: on the trainer's mesh (as sharded there) and
    on one device, each with the graphdef that says where activations live; yields (graphdef, params, opt_state,
    batch) for the mesh, then for the one device (the "sharded step equals unsharded" tests)."""
    import numpy as np

    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    for mesh in (trainer.mesh, one):
        def put(tree, mesh=mesh):
            named = lambda x: jax.sharding.NamedSharding(mesh, x.sharding.spec)  # noqa: E731
            return jax.tree.map(lambda x: jax.device_put(np.asarray(x), named(x)), tree)

        placed = jax.tree.map(lambda x, mesh=mesh: jax.device_put(np.asarray(x), jax.devices()[0] if mesh is one
                                                                  else x.sharding), batch)
        params = put(trainer.params)
        model = nnx.merge(trainer.graphdef, params)
        model.mesh = None if mesh is one else trainer.mesh  # the graphdef carries where activations live
        yield nnx.graphdef(model), params, put(trainer.opt_state), placed


# ------------------------------------------------------------------------------------------- multi-host
TESTS = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int) -> dict[str, str]:
    """The environment of one process: JAX on CPU with `devices` fake devices, tests/ importable."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def trainer_args(process_id: int, port: int, num_processes: int = 2) -> list[str]:
    """The `distributed.*` overrides that make a trainer process `process_id` of `num_processes`."""
    return [f"distributed.coordinator_address=127.0.0.1:{port}", f"distributed.num_processes={num_processes}",
            f"distributed.process_id={process_id}"]


def run_processes(command: Callable[[int, int], list[str]], *, timeout: float, processes: int = 2,
                  devices: int = 4) -> list[str]:
    """Start `command(process_id, port)` for every process id at once, wait for all; their logs (stdout and stderr),
    after asserting that each exited 0."""
    port, deadline = free_port(), time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(processes)]
        procs = []  # each writes to a file, not a pipe: a full pipe would stall its process while the other waits
        try:
            for i, log in enumerate(files):
                procs.append(subprocess.Popen(command(i, port), env=process_env(devices), stdout=log,
                                              stderr=subprocess.STDOUT))
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):  # reported below, with its log
                    p.wait(timeout=max(deadline - time.monotonic(), 0))
            hung = [i for i, p in enumerate(procs) if p.poll() is None]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        logs = []
        for log in files:
            log.seek(0)
            logs.append(log.read().decode(errors="replace"))
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert i not in hung, f"process {i} was still running after {timeout} s (a hang?), killed:\n{log[-4000:]}"
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-4000:]}"
    return logs
