"""Several training processes beside a rollout process (mesh.rollout_processes=1 of 3, train/sides.py): three
`python -m g2rl_jax.train` processes on localhost joined by jax.distributed (CPU, gloo, JAX's socket transfers), one
fake device each; processes 0 and 1 hold the training mesh (data 2: each keeps its block of every step's rows),
process 2 the rollout mesh. The weights cross by cross-host jax.device_put from the training mesh's arrays, the
samples by jax.distributed's key-value store (every training process reads each step's).

Checks: one-step-off (k = 1) gives the metrics of the same run on one process with its three devices split 2 + 1
(mesh.data=2, mesh.rollout_devices=1), resumed midway: SIGTERM to the first training process once step 1's checkpoint
is committed stops all three (the training side agrees on the stop and checkpoints with Orbax on both of its
processes, the samples drawn ahead with it), and a relaunch finishes the run.

Costs: two three-process launches and one one-process run of the tiny model (each mostly its first step's compiles).
"""
import signal
import time

import pytest
from test_async import _same
from test_async_sides_train import HANG_S, K1, ONE, _committed
from test_multihost import _cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import localhost
from g2rl_jax.train.lifecycle import PREEMPTED_EXIT
from g2rl_jax.train.metrics import read_metrics

from _helpers import process_env, run_processes, trainer_args

STEPS = 4
TRAINING = ("mesh.data=2",)  # after ONE's mesh.data=1: the training mesh spans two devices


def _sides_cmd(assets, out):  # noqa: F811
    return lambda i, port: _cmd(assets, out, STEPS, [*ONE, *TRAINING, *K1, "mesh.rollout_processes=1",
                                                     *trainer_args(i, port, 3, transfers=True)])


@pytest.fixture(scope="module")
def split(assets, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sides_trainers_split") / "run"
    run_processes(lambda i, port: _cmd(assets, out, STEPS, [*ONE, *TRAINING, *K1, "mesh.rollout_devices=1"]),
                  timeout=HANG_S, processes=1, devices=3)
    return read_metrics(out)


@pytest.fixture(scope="module")
def resumed(assets, tmp_path_factory):  # noqa: F811
    """SIGTERM to training process 0 once step 1's checkpoint is committed, then a relaunch of all three."""
    out = tmp_path_factory.mktemp("sides_trainers") / "run"
    with localhost.Processes(_sides_cmd(assets, out), processes=3, devices=1, env=process_env(1)) as procs:
        t0 = time.monotonic()
        while not _committed(out, 1):
            codes = [p.poll() for p in procs.procs]
            assert codes == [None] * 3 and time.monotonic() - t0 < HANG_S, (codes, procs.log(0)[-3000:])
            time.sleep(0.005)
        procs.procs[0].send_signal(signal.SIGTERM)
        codes = procs.wait(HANG_S)
        logs = [procs.log(i) for i in range(3)]
    stopped = [r["step"] for r in read_metrics(out)]
    run_processes(_sides_cmd(assets, out), timeout=HANG_S, processes=3, devices=1)
    return {"codes": codes, "logs": logs, "stopped": stopped, "records": read_metrics(out)}


def test_two_training_processes_stop_together_with_a_checkpoint(resumed):
    codes, logs = resumed["codes"], resumed["logs"]
    assert codes == [PREEMPTED_EXIT] * 3, [log[-3000:] for log in logs]
    assert "stopped by SIGTERM after step" in logs[0] and "stopped by SIGTERM after step" in logs[1], logs[1][-3000:]
    assert "the trainer ended after step" in logs[2], logs[2][-3000:]
    assert 1 <= len(resumed["stopped"]) < STEPS, resumed["stopped"]  # the relaunch resumed midway


def test_two_training_processes_resumed_equal_the_one_process_split(resumed, split):
    """Each training process keeps its block of every step's rows; the run, stopped and resumed, gives the
    metrics of the one-process split run."""
    got = resumed["records"]
    assert [r["policy_version"] for r in got] == [0.0, *range(STEPS - 1)]
    assert all(r["weight_sync_bytes"] > 0 for r in got)
    _same(got, split)
