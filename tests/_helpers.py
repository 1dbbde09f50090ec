"""Shared test helpers (tiny HF checkpoints themselves are in hf_tiny.py).

    from _helpers import create_sharded, tiny_qwen3_fixtures
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), mesh=mesh), mesh)   # random init, in place
    model_dir, model = tiny_qwen3_fixtures()   # module-scoped fixtures of one tiny random Qwen3 per test module
    kill_when(proc, ready, log)                # SIGKILL a trainer subprocess the moment a condition holds
    seen = BucketWrites(gcs, out); seen.saving(); seen.committed()   # a run's checkpoints in a bucket, requests free
    with lock_held_elsewhere(out, env) as holder: ...   # another process holds the run lock of `out`
    run_processes(lambda i, port: [*train_cmd, *trainer_args(i, port)], timeout=1800)   # 2 processes, one job

Multi-host on localhost: `run_processes` starts several processes at once, joined by jax.distributed (CPU, gloo
collectives) through a coordinator on a free port, each with `devices` fake CPU devices (the suite's XLA flags,
`xla_flags`) and tests/ on its PYTHONPATH; it waits for all of them (killing what still runs `timeout` seconds after
the start, a hang guard) and fails the test, with the end of its log, when one hung or exited non-zero. It is
g2rl_jax/localhost.py's launcher (the benches' too), with these checks; tests that signal one of the processes use
`localhost.Processes` directly.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import pytest
from flax import nnx

from g2rl_jax import localhost
from g2rl_jax.model import load_pretrained
from g2rl_jax.parallel import DEFAULT_RULES, state_shardings

from hf_tiny import make_tiny_qwen3_dir


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess with `devices` fake CPU devices: the suite's flags (conftest.py) with that
    device count. (g2rl_jax, imported first there, sizes XLA:CPU's pool for that count.)"""
    return localhost.cpu_env(devices)["XLA_FLAGS"]


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


class BucketWrites:
    """What the bucket's server stored under the run `out` (a gs:// URL), read from the strict proxy's log
    (tests/conftest.py's `gcs`) as it grows: a condition that `kill_when` looks at every few milliseconds costs no
    request (listing the bucket that often would take a core from the trainer under test). A write counts once the
    server answered it 2xx (the proxy logs it before the client has its answer)."""

    WRITES = ("upload", "compose", "copy")

    def __init__(self, gcs, out: str):
        self.gcs, self.prefix, self.at, self.names = gcs, out.removeprefix("gs://") + "/", 0, set()

    def written(self) -> set[str]:
        log = self.gcs.proxy.log  # only appended to (the proxy's threads); a proxy restarted on the port shares it
        end = len(log)
        self.names |= {r.obj[len(self.prefix):] for r in log[self.at:end] if r.kind in self.WRITES and r.obj
                       and r.obj.startswith(self.prefix) and 200 <= r.status < 300}
        self.at = end
        return self.names

    def _steps(self) -> tuple[set[int], set[int]]:
        """(steps with anything written under checkpoints/STEP/ or a launch's checkpoints/STEP.orbax-checkpoint-tmp-*/
        (control/commits.py), steps whose checkpoints/STEP/commit_success.txt was written)."""
        parts = [n.split("/") for n in self.written() if n.startswith("checkpoints/")]
        started = {int(p[1].split(".")[0]) for p in parts if len(p) > 2 and p[1].split(".")[0].isdigit()}
        return started, {int(p[1]) for p in parts if len(p) == 3 and p[1].isdigit() and p[2] == "commit_success.txt"}

    def saving(self) -> bool:
        """A checkpoint save under way: a step's directory written to, its commit_success.txt not (yet)."""
        started, committed = self._steps()
        return bool(started - committed)

    def committed(self) -> set[int]:
        """The steps whose checkpoint was committed (Orbax on GCS: commit_success.txt written last)."""
        return self._steps()[1]


@contextlib.contextmanager
def lock_held_elsewhere(out: str, env: dict):
    """Another process holds the run lock of `out` (a directory or a gs:// URL) inside the block; it is killed
    without releasing the lock at the end, so the lock it leaves is stale. Yields the Popen (its pid is the lock's)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from g2rl_jax.control.runlock import RunLock\n"
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
free_port = localhost.free_port


def process_env(devices: int) -> dict[str, str]:
    """The environment of one process: JAX on CPU with `devices` fake devices, tests/ importable."""
    env = localhost.cpu_env(devices)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def trainer_args(process_id: int, port: int, num_processes: int = 2, *, transfers: bool = False) -> list[str]:
    """The `distributed.*` overrides that make a trainer process `process_id` of `num_processes` (with
    `transfers`, JAX's socket transfers too: one process per side)."""
    return localhost.distributed_args(process_id, port, num_processes, transfers=transfers)


def run_processes(command: Callable[[int, int], list[str]], *, timeout: float, processes: int = 2,
                  devices: int = 4) -> list[str]:
    """Start `command(process_id, port)` for every process id at once, wait for all; their logs (stdout and stderr),
    after asserting that each exited 0 (g2rl_jax/localhost.py runs them)."""
    ran = localhost.run(command, timeout=timeout, processes=processes, devices=devices, env=process_env(devices))
    for i, (code, log) in enumerate(ran):
        assert code is not None, f"process {i} was still running after {timeout} s (a hang?), killed:\n{log[-4000:]}"
        assert code == 0, f"process {i} exited {code}:\n{log[-4000:]}"
    return [log for _, log in ran]
