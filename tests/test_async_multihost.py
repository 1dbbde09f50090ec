"""Rollouts ahead of the update across two processes: two `python -m g2rl_jax.train` processes on localhost joined by
jax.distributed (CPU, gloo collectives), 4 fake devices each: the training mesh takes 2 devices of each process
(one (data 2, fsdp 2) mesh over both), the rollout side the other 2 of each (train/ahead.py). The rollout driver
thread and the training thread then run at the same time in each process, one-step-off.

Checks: both processes finish (no hang: the driver thread runs no collective across processes, docs/async.md);
the lag metrics say version max(0, s - 1) drew step s; step 0's sampler log-probs equal the score pass's (the
weight sync moved the very params the trainer holds, and the rows line up with the training batch); later
steps differ by the lag only, and their importance weights are finite; both processes checkpoint their samples.
"""
import numpy as np
import pytest
from test_multihost import _cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import storage
from g2rl_jax.train.metrics import read_metrics

from _helpers import run_processes, trainer_args

STEPS = 3
HANG_S = 900  # a hang guard only (a hang is what this test exists to rule out)
AHEAD = ("mesh.rollout_devices=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", "rollout.max_staleness=1",
         "algorithm.rollout_is_cap=2.0", "run.eval_every=0")


@pytest.fixture(scope="module")
def one_step_off(assets, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("async_multihost") / "run"
    run_processes(lambda i, port: _cmd(assets, out, STEPS, [*AHEAD, *trainer_args(i, port)]), timeout=HANG_S)
    return out


def test_two_processes_one_step_off(one_step_off):
    records = read_metrics(one_step_off)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["policy_version"] for r in records] == [0.0, 0.0, 1.0]
    # step 0: sampler and score pass hold the same params (float32 recomputation differs by < 1e-3)
    assert records[0]["rollout_logprob_diff_max"] < 1e-3, records[0]
    # later steps: the sampler is one update behind, visibly
    assert all(r["rollout_logprob_diff_max"] > records[0]["rollout_logprob_diff_max"] for r in records[1:])
    for r in records:
        assert np.isfinite(r["loss"]) and 0 <= r["rollout_is_capped_frac"] <= 1 and r["weight_sync_bytes"] > 0


def test_both_processes_checkpoint_their_samples(one_step_off):
    data = storage.names(f"{one_step_off}/checkpoints/{STEPS}/data")
    assert [n for n in data if n.startswith("process_")] == ["process_0-of-2.json", "process_1-of-2.json"]
