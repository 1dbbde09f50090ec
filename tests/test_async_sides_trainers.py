"""Several processes on each side, the longer scenarios (opt-in: G2RL_SIDES_SLOW=1; the default suite runs the short
two-training-process run of tests/test_async_sides_train.py). Processes on localhost joined by jax.distributed (CPU,
gloo, JAX's socket transfers), one fake device each.

- Two training processes (the training mesh, data 2, over both) and one rollout process, stopped and resumed:
  SIGTERM to the first training process once step 1's checkpoint is committed stops all three (the training side
  agrees on the stop and checkpoints with Orbax on both of its processes, the samples drawn ahead with it), and a
  relaunch finishes the run: the metrics of the same run on one process with its three devices split 2 + 1
  (mesh.data=2, mesh.rollout_devices=1).
- One training process and two rollout processes with DAPO dynamic sampling (a reward with mixed groups): the
  rollout mesh spans both rollout processes, the rounds go on as the whole batch decides, and the trainer picks the
  groups from the joined rounds: the metrics of the one-process split run with dynamic sampling.

Costs: three three-process launches and two one-process runs of the tiny model (each mostly its first step's
compiles); about 4 minutes on the 2-core machine under load. Run with
`G2RL_SIDES_SLOW=1 python -m pytest -q -n 0 tests/test_async_sides_trainers.py`.
"""
import os
import signal
import time

import pytest
from test_async import DETERMINISTIC, LAG, _same
from test_async_sides_train import HANG_S, K1, ONE, _committed
from test_multihost import _cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import localhost
from g2rl_jax.train.lifecycle import PREEMPTED_EXIT
from g2rl_jax.train.metrics import read_metrics

from _helpers import process_env, run_processes, trainer_args

pytestmark = pytest.mark.skipif(os.environ.get("G2RL_SIDES_SLOW") != "1",
                                reason="opt-in (about 4 minutes): G2RL_SIDES_SLOW=1 runs it")
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
    assert codes[:2] == [PREEMPTED_EXIT] * 2, [log[-3000:] for log in logs]
    assert "stopped by SIGTERM after step" in logs[0] and "stopped by SIGTERM after step" in logs[1], logs[1][-3000:]
    # the rollout process ends with the trainer, or has drawn every step (k = 1: the last with version 2) before
    assert codes[2] == PREEMPTED_EXIT and "the trainer ended after step" in logs[2] or codes[2] == 0, logs[2][-3000:]
    assert 1 <= len(resumed["stopped"]) < STEPS, resumed["stopped"]  # the relaunch resumed midway


def test_two_training_processes_resumed_equal_the_one_process_split(resumed, split):
    """Each training process keeps its block of every step's rows; the run, stopped and resumed, gives the
    metrics of the one-process split run."""
    got = resumed["records"]
    assert [r["policy_version"] for r in got] == [0.0, *range(STEPS - 1)]
    assert all(r["weight_sync_bytes"] > 0 for r in got)
    _same(got, split)


EVEN_LENGTH_REWARD = """
def reward(response, example):
    # correct iff the response has even length: mixed outcomes on a random policy, deterministic
    return 1.0 if len(response) % 2 == 0 else -1.0
"""
DYNAMIC = ("algorithm.filter_equal_groups=true", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3",
           "reward.truncated=keep")


@pytest.fixture(scope="module")
def dynamic(assets, tmp_path_factory):  # noqa: F811
    """One training process and two rollout processes with dynamic sampling, and the same run on one process."""
    root = tmp_path_factory.mktemp("sides_dynamic")
    (root / "even_length.py").write_text(EVEN_LENGTH_REWARD)
    extra = (*ONE, *K1, *DYNAMIC, f"reward.function={root / 'even_length.py'}:reward")
    run_processes(lambda i, port: _cmd(assets, root / "sides", STEPS, [*extra, "mesh.rollout_processes=2",
                                                                       *trainer_args(i, port, 3, transfers=True)]),
                  timeout=HANG_S, processes=3, devices=1)
    run_processes(lambda i, port: _cmd(assets, root / "split", STEPS, [*extra, "mesh.rollout_devices=1"]),
                  timeout=HANG_S, processes=1, devices=2)
    return read_metrics(root / "sides"), read_metrics(root / "split")


def test_two_rollout_processes_with_dynamic_sampling_equal_the_one_process_split(dynamic):
    got, want = dynamic
    assert any(r["sampling_rounds"] > 1 for r in want) and any(r["single_class_fraction"] < 1 for r in want), (
        "every step took one round, or no mixed group: a weak test")
    assert [r["sampling_rounds"] for r in got] == [r["sampling_rounds"] for r in want]
    _same(got, want, keys=(*DETERMINISTIC, *LAG, "sampled_accuracy", "single_class_fraction"))
