"""Rollouts on their own mesh, ahead of the update (train/ahead.py, train/weight_sync.py), on 8 fake CPU devices:
4 train + 4 rollout.

Costs: one module of compiles (the colocated and the split programs); one uninterrupted one-step-off run serves
the lag, float64, weight-sync, resume and kill -9 tests; the runs compared with checkpoint at their end only.

Covers: max_staleness=0 on split meshes gives the colocated run's metrics; max_staleness=1 draws each step's samples
with the previous step's policy (and the first step's with its own), and its importance weights match a float64
NumPy transcription; a resumed one-step-off run, and one killed with -9 mid-run, equal the uninterrupted run; the
weight sync moves exactly the params (the adapters only with LoRA); bad settings fail in one line; a pickle planted
in a gs:// run's data-iterator file (the samples drawn ahead) is refused in one line naming the file, and never run.
"""
import base64
import json
import pickle
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from test_train import DETERMINISTIC, ROOT, _env, assets, overrides  # noqa: F401 - assets is a fixture

from g2rl_jax import losses, parallel, storage
from g2rl_jax.config import ConfigError, MeshConfig, load_config
from g2rl_jax.train import step as train_step
from g2rl_jax.train.checkpoint import CheckpointError
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics

from _helpers import HANG_S, kill_when, tail, xla_flags

STEPS = 3
SPLIT = {"mesh.rollout_devices": 4, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 1}
CAP = 2.0


def _config(assets, out, steps=STEPS, **kw):  # noqa: F811
    return load_config(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml", overrides(assets, out, steps=steps, **kw))


def _run(assets, out, steps=STEPS, **kw):  # noqa: F811
    """An uninterrupted run, checkpointed at its end only (the runs it is compared with checkpoint every step)."""
    trainer = Trainer(_config(assets, out, **{"run.checkpoint_every": steps, **kw}))
    trainer.resume()
    trainer.run()
    return read_metrics(out)


LAG = ("staleness_max", "policy_version")


def _same(got, want, keys=DETERMINISTIC + LAG, tol=1e-5):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for rg, rw in zip(got, want):
        for key in keys:
            if key in rw:
                np.testing.assert_allclose(rg[key], rw[key], rtol=tol, atol=tol, err_msg=f"step {rw['step']} {key}")


ONE_STEP_OFF = {**SPLIT, "rollout.max_staleness": 1, "algorithm.rollout_is_cap": CAP}


@pytest.fixture(scope="module")
def one_step_off(assets, tmp_path_factory):  # noqa: F811
    """An uninterrupted one-step-off run (checkpointed at its end only): what a resumed or killed one must
    reproduce; also its trainer, its initial params (version 0) and every step's intermediates."""
    out = tmp_path_factory.mktemp("one_step_off") / "run"
    trainer = Trainer(_config(assets, out, **{"run.checkpoint_every": STEPS, **ONE_STEP_OFF}))
    trainer.resume()
    v0 = jax.tree.map(np.asarray, trainer.params)
    results, stages = [], trainer.step_stages
    trainer.step_stages = lambda step: results.append(stages(step)) or results[-1]
    trainer.run()
    return {"out": out, "records": read_metrics(out), "trainer": trainer, "v0": v0, "results": results}


def test_split_meshes_on_eight_devices():
    train, rollout = parallel.split_meshes(MeshConfig(rollout_devices=4, data=2, fsdp=2, tensor=1))
    assert set(train.devices.flat).isdisjoint(rollout.devices.flat)
    assert train.devices.size == rollout.devices.size == 4 and dict(rollout.shape)["data"] == 4
    with pytest.raises(ConfigError, match="mesh.rollout_devices=8 leaves no training device"):
        parallel.split_meshes(MeshConfig(rollout_devices=8))


@pytest.mark.parametrize("overrides_, match", [
    ({"rollout.max_staleness": 1, "algorithm.rollout_is_cap": CAP},
     "set mesh.rollout_devices or mesh.rollout_processes too"),
    ({**SPLIT, "rollout.max_staleness": 1}, "set algorithm.rollout_is_cap"),
    ({"rollout.max_staleness": -1}, "rollout.max_staleness: must be >= 0"),
    ({"mesh.rollout_devices": 4, "mesh.rollout_tensor": 3}, "must divide mesh.rollout_devices=4"),
])
def test_bad_settings_fail_in_one_line(assets, tmp_path, overrides_, match):  # noqa: F811
    with pytest.raises(ConfigError, match=match) as err:
        _config(assets, tmp_path / "bad", **overrides_)
    assert "\n" not in str(err.value)


def test_weight_sync_moves_the_params_and_only_the_adapters_with_lora(assets, tmp_path, one_step_off):  # noqa: F811
    for rank in (0, 2):
        trainer = one_step_off["trainer"] if rank == 0 else \
            Trainer(_config(assets, tmp_path / f"sync{rank}", **SPLIT, **{"model.lora.rank": rank}))
        sync = trainer.ahead.sync
        moved = sync.push(trainer.params)
        for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(moved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert set(b.sharding.device_set) <= set(trainer.rollout_mesh.devices.flat)
        every = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
        adapters = sum(x.nbytes for x in jax.tree.leaves(nnx.state(trainer.model, nnx.LoRAParam)))
        assert sync.bytes == (every if rank == 0 else adapters) and (rank == 0 or adapters < every / 2)
        if rank:
            trainer.close()


def test_staleness_zero_on_split_meshes_equals_colocated(assets, tmp_path):  # noqa: F811
    colocated = _run(assets, tmp_path / "colocated", steps=2)  # step 1 samples from the params after an update
    split = _run(assets, tmp_path / "split", steps=2, **SPLIT)
    _same(split, colocated)
    assert all(r["staleness_max"] == 0 and r["weight_sync_bytes"] > 0 for r in split)


def test_one_step_off_uses_the_previous_policy_and_float64_weights(one_step_off):
    records, trainer = one_step_off["records"], one_step_off["trainer"]
    assert [r["staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["policy_version"] for r in records] == [0.0, 0.0, 1.0]
    # step 1: its samples come from version 0 (the initial params), its score pass from version 1
    result, v0 = one_step_off["results"][1], one_step_off["v0"]
    mask = np.asarray(result.batch.response_mask, np.float64)
    sampler = np.asarray(result.rollout.logprobs_BxT, np.float64)  # host rows (one process: all of them)
    old = np.asarray(result.scores.logp_BxT, np.float64)
    params_v0 = jax.tree.map(lambda a, b: jax.device_put(a, b.sharding), v0, trainer.params)
    again = train_step.score(trainer.graphdef, params_v0, result.batch, temperature=1.0, micro=2)
    logp_v0 = np.asarray(again.logp_BxT, np.float64)
    # the sampler's log-probs are version 0's, not version 1's
    assert np.max(np.abs((sampler - logp_v0) * mask)) < 1e-4
    assert np.max(np.abs((sampler - old) * mask)) > 10 * np.max(np.abs((sampler - logp_v0) * mask))
    # the truncated importance weight min(π_old/π_sampler, C) against float64 NumPy
    w_ref = np.minimum(np.exp(old - sampler), CAP)
    w, capped = losses.truncated_is_weights(result.scores.logp_BxT, result.rollout.logprobs_BxT, CAP)
    np.testing.assert_allclose(np.asarray(w, np.float64) * mask, w_ref * mask, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(capped) * mask, (np.exp(old - sampler) > CAP) * mask)
    assert "rollout_is_capped_frac" in result.metrics


def test_two_steps_ahead_lags_by_two(assets, tmp_path):  # noqa: F811
    records = _run(assets, tmp_path / "k2", **{**ONE_STEP_OFF, "rollout.max_staleness": 2})
    assert [r["staleness_max"] for r in records] == [0.0, 1.0, 2.0]
    assert [r["policy_version"] for r in records] == [0.0, 0.0, 0.0]
    assert all(np.isfinite(r["loss"]) and 0 <= r["rollout_is_capped_frac"] <= 1 for r in records)


def test_resume_of_one_step_off_equals_uninterrupted(assets, tmp_path, one_step_off):  # noqa: F811
    kw = ONE_STEP_OFF
    part = Trainer(_config(assets, tmp_path / "part", **kw))
    part.resume()
    part.run(stop_after=1)  # step 1's samples, drawn from version 0, are saved with step 1's checkpoint
    again = Trainer(_config(assets, tmp_path / "part", **kw))
    assert again.resume() == 1
    again.run()
    _same(read_metrics(tmp_path / "part"), one_step_off["records"])


def test_kill_9_during_an_overlapped_step_resumes_exactly(assets, tmp_path, one_step_off):  # noqa: F811
    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    env = _env()
    env["XLA_FLAGS"] = xla_flags(8)
    kw = ONE_STEP_OFF
    cmd = [sys.executable, "-m", "g2rl_jax.train", "--config", str(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml"),
           *overrides(assets, out, steps=STEPS, **kw)]
    with open(tmp_path / "trainer.err", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        committed = lambda: ckpts.is_dir() and any(p.name == "1" for p in ckpts.iterdir())  # noqa: E731
        assert kill_when(proc, committed, log), f"the run ended before step 1's checkpoint: {tail(log)}"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step" in done.stdout, done.stdout[-2000:]
    _same(read_metrics(out), one_step_off["records"])


class _Planted:
    """What an attacker writes: unpickling it creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_planted_in_the_iterator_file_on_a_bucket_is_refused(assets, gcs, tmp_path, capsys):  # noqa: F811
    """A one-step-off run on the bucket (GCS emulator) checkpoints step 1 with step 2's samples in its data-iterator
    file; that file replaced by a pickle (the format versions before 2026-11-29 wrote), the relaunch's resume
    refuses it in one line naming the file, and the pickle never runs (its unpickling would create `marker`)."""
    out = gcs.url("runs/planted_iterator")
    part = Trainer(_config(assets, out, **ONE_STEP_OFF))
    part.resume()
    part.run(stop_after=1)
    data_file = f"{out}/checkpoints/1/data/process_0-of-1.json"
    assert '"ahead": {"wire": 1' in storage.read_text(data_file)  # JSON plus arrays, written by this version
    marker = tmp_path / "ran"
    planted = base64.b64encode(pickle.dumps(_Planted(marker))).decode()
    storage.write_text(data_file, json.dumps({"encoding": "json", "state": {"ahead": planted}}))
    again = Trainer(_config(assets, out, **ONE_STEP_OFF))
    try:
        with pytest.raises(CheckpointError) as err:
            again.resume()
    finally:
        again.close()
    assert not marker.exists(), "the planted pickle was run"
    said = f"{data_file}: the samples drawn ahead: pickled (what versions before 2026-11-29 wrote, or a payload planted"
    assert said in str(err.value) and "refused, nothing in it was run" in str(err.value), err.value
    assert "\n" not in str(err.value)
    assert [line for line in capsys.readouterr().err.splitlines() if data_file in line] == [], \
        "the error alone names the file, in its one line (one checkpoint: no fallback, no warning)"
