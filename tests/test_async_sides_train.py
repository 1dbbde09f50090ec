"""One process per side in the trainer (mesh.rollout_processes=1, train/sides.py): two `python -m g2rl_jax.train`
processes on localhost joined by jax.distributed (CPU, gloo, JAX's socket transfers), one fake device each;
process 0 holds the training mesh, process 1 the rollout mesh. The weights cross by cross-host jax.device_put,
the samples by jax.distributed's key-value store.

Checks: one-step-off (k = 1) gives the metrics of the same run on one process with its two devices split 1 + 1
(mesh.rollout_devices=1), and the lag metrics say version max(0, s - 1) drew step s; k = 0 gives the colocated
run's metrics (one process, one device).
"""
import subprocess

import pytest
from test_async import _same
from test_multihost import _cmd, _env, _free_port, assets  # noqa: F401 - assets is a fixture

from g2rl_jax.train.metrics import read_metrics

STEPS = 3
HANG_S = 300  # a hang guard only
ONE = ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "run.eval_every=0")
K1 = ("rollout.max_staleness=1", "algorithm.rollout_is_cap=2.0")


def _launch(cmds, devices):
    procs = [subprocess.Popen(c, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    try:
        logs = [p.communicate(timeout=HANG_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"process {i} exited {p.returncode}:\n{log[-3000:]}" for i, (p, log) in enumerate(zip(procs, logs))
              if p.returncode != 0]
    assert not failed, "\n".join(failed)


def _sides(assets, out, extra):  # noqa: F811
    port = _free_port()
    _launch([_cmd(assets, out, STEPS, [*ONE, *extra, "mesh.rollout_processes=1",
                                       f"distributed.coordinator_address=127.0.0.1:{port}",
                                       "distributed.num_processes=2", f"distributed.process_id={i}",
                                       f"distributed.transfer_address=127.0.0.1:{_free_port()}"])
             for i in range(2)], devices=1)
    return read_metrics(out)


def _one_process(assets, out, extra, devices):  # noqa: F811
    _launch([_cmd(assets, out, STEPS, [*ONE, *extra])], devices=devices)
    return read_metrics(out)


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("async_sides_train")
    return {"sides_k1": _sides(assets, tmp / "sides_k1", K1),
            "split_k1": _one_process(assets, tmp / "split_k1", (*K1, "mesh.rollout_devices=1"), devices=2),
            "sides_k0": _sides(assets, tmp / "sides_k0", ()),
            "colocated": _one_process(assets, tmp / "colocated", (), devices=1)}


def test_one_process_per_side_one_step_off_equals_the_one_process_split(runs):
    got = runs["sides_k1"]
    assert [r["policy_version"] for r in got] == [0.0, 0.0, 1.0]
    assert [r["staleness_max"] for r in got] == [0.0, 1.0, 1.0]
    assert all(r["weight_sync_bytes"] > 0 for r in got)
    _same(got, runs["split_k1"])


def test_one_process_per_side_serial_equals_colocated(runs):
    _same(runs["sides_k0"], runs["colocated"])
