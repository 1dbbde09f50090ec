"""The trainer's exit codes on a gs:// run (a real GCS server on loopback behind the strict proxy), where a failure's
text once decided them: each failure is classified where it is raised (g2rl_jax/control/errors.py), ends with one
line, no traceback, and the code of control/exits.py's table. A user's reward function that raises a
ConnectionRefusedError whose text says RESOURCE_EXHAUSTED exits 5 naming the function and the row (it exited 75,
"the storage failed", and a ConnectionRefusedError printed a 30-line traceback); a device out of memory at a jitted
program's call (a real allocation XLA refuses, raised in the update stage) exits 4 with the planner's hint (it
exited 75 on a bucket: a supervisor relaunched it forever). (75 for a real storage outage: test_storage_midrun.py;
3: test_preemption.py, test_multihost_lease.py; 76: test_async_sides_train.py; 143: test_lifecycle.py.)"""
import subprocess
import sys

from test_gcs import _gs_cmd, bucket  # noqa: F401 - bucket is a fixture
from test_train import _env, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import storage
from g2rl_jax.control.exits import Exit

from _helpers import xla_flags

FAILS = ("def fails(response, example):\n"
         "    raise ConnectionRefusedError(111, 'RESOURCE_EXHAUSTED: Out of memory (as the user\\'s code says)')\n")
OUT_OF_MEMORY = ("import sys\n"
                 "import jax.numpy as jnp\n"
                 "from g2rl_jax.train import loop\n"
                 "def update(self, *args, **kwargs):  # a program whose buffers XLA's allocator cannot give\n"
                 "    return jnp.ones((1 << 44,), jnp.float32)  # 64 TiB\n"
                 "loop.Trainer._update = update\n"
                 "from g2rl_jax.train.command import main\n"
                 "sys.exit(main(sys.argv[1:]))\n")


def _run(cmd, tmp_path, devices=8) -> tuple[int, list[str], str]:
    env = dict(_env(), XLA_FLAGS=xla_flags(devices), **{storage.CACHE_ENV: str(tmp_path / "cache")})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("I1", "W1", "E1"))]
    return done.returncode, lines, done.stderr


def test_a_reward_function_that_raises_exits_5_naming_the_function_and_the_row(gcs, assets, bucket, tmp_path):  # noqa: F811
    user = tmp_path / "user_reward.py"
    user.write_text(FAILS)
    out = gcs.url("exit_codes/reward")
    code, lines, stderr = _run([*_gs_cmd(assets, bucket, out, 2), f"reward.function={user}:fails"], tmp_path)
    assert code == Exit.REWARD_FAILED, stderr[-3000:]
    assert lines[-1].startswith(f"train error: reward function '{user}:fails' raised ConnectionRefusedError: "
                                "[Errno 111] RESOURCE_EXHAUSTED") and " on row '" in lines[-1], lines[-3:]
    assert "reward.on_error=fail" in lines[-1] and "Traceback" not in stderr, stderr[-3000:]
    assert not storage.exists(f"{out}/run.lock")  # released: the next start need not wait for it to lapse


def test_a_device_out_of_memory_exits_4_with_the_planners_hint(gcs, assets, bucket, tmp_path):  # noqa: F811
    out = gcs.url("exit_codes/oom")
    cmd = [*_gs_cmd(assets, bucket, out, 2), "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]  # one device: a smaller
    # micro-batch is fewer rows on it, which the planner counts
    code, lines, stderr = _run([sys.executable, "-c", OUT_OF_MEMORY, *cmd[cmd.index("--config"):]], tmp_path, 1)
    assert code == Exit.DEVICE_OOM, stderr[-3000:]
    line = lines[-1]
    assert line.startswith("train error: the device ran out of memory in stage 'update' (RESOURCE_EXHAUSTED: "), line
    assert "the planner puts this run's peak at " in line and "per device on 1 device (rollout phase " in line, line
    assert "try algorithm.micro_batch_size=1 (update phase " in line and "the smallest slices that hold it: " in line
    assert line.endswith(f"(python -m g2rl_jax.plan --config {out}/config.yaml)") and "Traceback" not in stderr, line
    assert not storage.exists(f"{out}/run.lock")
