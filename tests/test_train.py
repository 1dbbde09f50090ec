"""The training loop end to end on a tiny random Qwen3 with the demo's small tokenizer (CPU, 8 fake devices).

Covers: every exploration mode runs and writes its metrics; resume gives exactly the uninterrupted run's metrics;
kill -9 mid-run and mid-save, then rerun the same command; a non-finite step is skipped with params unchanged;
micro-batch accumulation equals one full batch; sharded equals unsharded; bad input fails before any compile.
"""
import dataclasses
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax.config import ConfigError, load_config
from g2rl_jax.demo.tokenizer import make_tokenizer
from g2rl_jax.train import optim as train_optim
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update
from g2rl_jax.train.command import main
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics

from _helpers import HANG_S, kill_when, placed_on_mesh_and_one_device, tail, xla_flags
from hf_tiny import make_tiny_qwen3_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATASET = "demo"
VOCAB = 0  # set by the assets fixture
DETERMINISTIC = ("accuracy", "reward", "loss", "kl", "entropy", "response_length", "novelty", "clip_fraction",
                 "grad_norm", "learning_rate")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_assets")
    tok = make_tokenizer()
    global VOCAB
    VOCAB = -(-len(tok) // 64) * 64  # padded like real checkpoints, so the vocab axis splits over the mesh
    policy = make_tiny_qwen3_dir(root / "policy", vocab_size=VOCAB, max_position_embeddings=128,
                                 num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=16,
                                 num_attention_heads=2, num_key_value_heads=2)
    tok.save_pretrained(policy)
    import torch
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128)
    embedder = root / "embedder"
    transformers.Qwen3Model(cfg).save_pretrained(embedder)
    tok.save_pretrained(embedder)
    return {"policy": policy, "embedder": embedder, "root": root}


def overrides(assets, out, mode="g2rl", steps=2, **extra):
    ov = {"run.output_dir": str(out), "run.total_steps": steps, "run.checkpoint_every": 1, "run.eval_every": 0,
          "run.keep_checkpoints": 2, "model.path": str(assets["policy"]), "model.compute_dtype": "float32",
          "model.kv_cache_dtype": "float32", "model.remat": "none", "data.train_dataset": DATASET,
          "data.prompt_template": "plain", "data.prompts_per_step": 2, "rollout.num_samples": 4,
          "rollout.max_new_tokens": 8, "algorithm.mini_batch_size": 4, "algorithm.micro_batch_size": 2,
          "algorithm.exploration": mode, "optim.learning_rate": 1e-3, "mesh.data": 2, "mesh.fsdp": 2,
          "mesh.tensor": 2, "algorithm.packing": False}  # the config packs; these tests cover the grouped passes
    if mode == "entropy_bonus":
        ov["algorithm.entropy_coef"] = 0.01
    if mode == "evol":
        ov["algorithm.embedding_model"] = str(assets["embedder"])
    ov.update(extra)
    return [f"{k}={v}" for k, v in ov.items()]


def config(assets, out, **kw):
    return load_config(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml", overrides(assets, out, **kw))


STEPS = 3


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """One uninterrupted g2rl run of STEPS steps: what resumed and killed runs must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    trainer = Trainer(config(assets, out, steps=STEPS))
    trainer.resume()
    before = jax.tree.map(np.asarray, trainer.params)
    trainer.run()
    return {"out": out, "records": read_metrics(out), "before": before, "after": trainer.params}


def _check_records(records, mode, steps):
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        for key in ("accuracy", "reward", "loss", "kl", "entropy", "response_length", "clip_fraction", "grad_norm",
                    "learning_rate", "rollout_seconds", "update_seconds", "tokens_per_second",
                    "update_tokens_per_second"):
            assert np.isfinite(r[key]), (mode, key, r[key])
        assert 0.0 <= r["padding_fraction"] < 1.0
        assert r["skipped_updates"] == 0
        assert 0.0 <= r["truncated_fraction"] <= 1.0  # share of responses that hit rollout.max_new_tokens
        # sampler and scorer compute the same float32 log-probs (same params: the update comes after scoring)
        assert 0 <= r["rollout_logprob_diff_mean"] <= r["rollout_logprob_diff_max"] < 1e-3, (mode, r)
        if mode == "g2rl":
            assert 0.0 <= r["novelty"] <= 1.0
        else:
            assert "novelty" not in r


def _max_change(before, after):
    return max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - np.asarray(b)))), before, after)))


def test_g2rl_trains(reference):
    _check_records(reference["records"], "g2rl", STEPS)
    assert _max_change(reference["before"], reference["after"]) > 0, "the update did not change the params"
    assert (reference["out"] / "config.yaml").is_file()


@pytest.mark.parametrize("mode", ["grpo", "entropy_bonus", "evol"])
def test_each_baseline_mode_trains(assets, tmp_path, mode):
    trainer = Trainer(config(assets, tmp_path / mode, mode=mode, steps=1))
    trainer.resume()
    before = jax.tree.map(np.asarray, trainer.params)
    trainer.run()
    _check_records(read_metrics(tmp_path / mode), mode, 1)
    assert _max_change(before, trainer.params) > 0, "the update did not change the params"


def _deterministic(records):
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in records]


def _assert_same_metrics(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for rg, rw in zip(_deterministic(got), _deterministic(want)):
        for key in rw:
            np.testing.assert_allclose(rg[key], rw[key], rtol=1e-6, atol=1e-6, err_msg=key)


def test_resume_equals_uninterrupted(assets, tmp_path, reference):
    part = Trainer(config(assets, tmp_path / "part", steps=STEPS))
    part.resume()
    part.run(stop_after=2)  # as if the job died right after step 2's checkpoint
    again = Trainer(config(assets, tmp_path / "part", steps=STEPS))
    assert again.resume() == 2
    again.run()
    _assert_same_metrics(read_metrics(tmp_path / "part"), reference["records"])


def test_a_kill_in_a_validation_loses_no_record_and_the_resume_writes_none_twice(assets, tmp_path, reference,
                                                                                 monkeypatch):
    """Validation before the first update, every 2 steps and after the last; the first run dies in step 2's
    validation once step 2's checkpoint has committed (BaseException: nothing after it runs, as a kill). Step 2's
    training record was written before (the old order wrote it after the validation, and lost it). The rerun resumes
    from step 2, runs step 2's validation first (it never reached the run directory), and leaves each step's training
    record and each validation record once: the training records the uninterrupted run's, step 2's validation the
    one the first run had computed. The finished run's summary is written under its lease, before the lock's
    release (it used to be written after: a launch frozen there wrote it after another had taken the run over)."""
    from g2rl_jax import storage
    from g2rl_jax.bench.chaos_checks import kind, line_counts
    from g2rl_jax.control.runlock import LOCK_FILE
    from g2rl_jax.train import report
    from g2rl_jax.train.metrics import metric_lines

    finish, locked = report.finish, []

    def finish_while_locked(run_dir, **kwargs):
        locked.append(storage.exists(f"{run_dir}/{LOCK_FILE}"))
        return finish(run_dir, **kwargs)

    monkeypatch.setattr(report, "finish", finish_while_locked)

    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(f'{{"problem": "{a}+{b}", "answer": "{a + b}"}}\n' for a, b in ((12, 30), (7, 8))))
    extra = {"run.eval_every": 2, "data.eval_datasets": evalset, "data.eval_samples": 2,
             "data.eval_max_new_tokens": 8}
    out = tmp_path / "run"

    class Killed(BaseException):
        pass

    first = Trainer(config(assets, out, steps=STEPS, **extra))
    first.resume()
    validate, seen = first.validate, {}

    def dies_in_step_2():
        result = validate()
        if first.step == 2:
            first.ckpt.wait()  # the checkpoint of step 2 committed
            seen[2] = result
            raise Killed
        return result

    first.validate = dies_in_step_2
    with pytest.raises(Killed):
        first.run()
    assert [(r["step"], kind(r)) for r in metric_lines(out)] == [(0, "validation"), (1, "training"), (2, "training")]
    again = Trainer(config(assets, out, steps=STEPS, **extra))
    assert again.resume() == 2
    again.run()
    lines = metric_lines(out)
    assert line_counts(lines) == {(0, "validation"): 1, (1, "training"): 1, (2, "training"): 1,
                                  (2, "validation"): 1, (3, "training"): 1, (3, "validation"): 1}
    _assert_same_metrics([r for r in lines if kind(r) == "training"], reference["records"])
    assert {k: v for r in lines if r["step"] == 2 and kind(r) == "validation" for k, v in r.items() if k != "step"} \
        == pytest.approx(seen[2])
    assert (out / "summary.json").is_file() and locked == [True]


def _train_cmd(assets, out, steps):
    return [sys.executable, "-m", "g2rl_jax.train", "--config", str(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml"),
            *overrides(assets, out, steps=steps)]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def test_kill_9_mid_run_and_mid_save_then_resume(assets, tmp_path, reference):
    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    env = _env()
    env["XLA_FLAGS"] = xla_flags(8)
    cmd = _train_cmd(assets, out, steps=STEPS)
    # stderr goes to a file: a pipe nobody reads fills up and stalls the trainer before the awaited state
    with open(tmp_path / "trainer.err", "w") as log:
        # 1) mid-save: kill the moment a temporary (uncommitted) checkpoint directory appears
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        mid_save = lambda: ckpts.is_dir() and any("tmp" in p.name for p in ckpts.iterdir())  # noqa: E731
        assert kill_when(proc, mid_save, log), f"no checkpoint save was observed before the run ended: {tail(log)}"
        # 2) mid-run: rerun, kill once a later step's checkpoint is committed
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        def committed():
            return ckpts.is_dir() and any(p.name.isdigit() and int(p.name) >= 2 for p in ckpts.iterdir())
        kill_when(proc, committed, log)
    # 3) rerun to the end: it resumes from a committed checkpoint, and the metrics equal an uninterrupted run
    committed_steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()]
    assert committed_steps, "the mid-run kill left no committed checkpoint to resume from"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the checkpoint of step {max(committed_steps)}" in done.stdout, done.stdout[-2000:]
    _assert_same_metrics(read_metrics(out), reference["records"])


# ------------------------------------------------------------------------------------------ the update itself
@pytest.fixture(scope="module")
def step_parts(assets, tmp_path_factory):
    trainer = Trainer(config(assets, tmp_path_factory.mktemp("parts") / "run"))
    result = trainer.step_stages(0)
    return trainer, result


def _mini(result, **changes) -> train_step.MiniBatch:
    mini = train_step.MiniBatch(result.batch, old_logp_BxT=result.scores.logp_BxT, ref_logp_BxT=result.scores.logp_BxT,
                                advantages_B=result.signal["advantages"])
    return dataclasses.replace(mini, **changes)


def test_single_class_metrics_match_numpy(step_parts):
    """The step's single-class metrics recomputed in float64 from its ν, advantages and correctness."""
    _, result = step_parts
    m = result.batch.group_size
    correct = np.asarray(result.batch.correct).reshape(-1, m)
    nu, adv = (np.float64(result.signal[k]).reshape(-1, m) for k in ("nu", "advantages"))
    single, wrong = correct.all(1) | ~correct.any(1), ~correct.any(1)
    most = np.array([a[np.argmax(n)] for a, n in zip(adv, nu)])
    least = np.array([a[np.argmin(n)] for a, n in zip(adv, nu)])
    got = result.metrics
    assert got["single_class_fraction"] == pytest.approx(single.mean()) and single.any()
    assert got["all_wrong_fraction"] == pytest.approx(wrong.mean())
    for key, values, mask in (("single_class_adv_most_novel", most, single),
                              ("single_class_adv_least_novel", least, single),
                              ("all_wrong_adv_most_novel", most, wrong), ("all_wrong_adv_least_novel", least, wrong)):
        want = values[mask].mean() if mask.any() else np.nan
        np.testing.assert_allclose(got[key], want, atol=1e-6, err_msg=key)


def test_single_class_metrics_of_mixed_and_empty_steps():
    from g2rl_jax.train.metrics import single_class_metrics

    m = 3
    correct = np.array([[1, 1, 1], [0, 0, 0], [1, 0, 1], [0, 0, 0]], bool)
    most, least = np.array([0.5, -1.2, 0.9, -0.4]), np.array([-0.5, 1.1, -0.9, 0.8])
    signal = {"single_class": np.repeat(correct.all(1) | ~correct.any(1), m),
              "all_wrong": np.repeat(~correct.any(1), m), "most_novel_advantage": np.repeat(most, m),
              "least_novel_advantage": np.repeat(least, m)}
    got = single_class_metrics({k: jnp.asarray(v) for k, v in signal.items()}, novelty=True)
    assert got["single_class_fraction"] == pytest.approx(0.75) and got["all_wrong_fraction"] == pytest.approx(0.5)
    assert got["single_class_adv_most_novel"] == pytest.approx((0.5 - 1.2 - 0.4) / 3)
    assert got["single_class_adv_least_novel"] == pytest.approx((-0.5 + 1.1 + 0.8) / 3)
    assert got["all_wrong_adv_most_novel"] == pytest.approx((-1.2 - 0.4) / 2)
    assert got["all_wrong_adv_least_novel"] == pytest.approx((1.1 + 0.8) / 2)
    mixed = {k: jnp.asarray(v[6:9]) for k, v in signal.items()}  # only the mixed group: no single-class group
    got = single_class_metrics(mixed, novelty=True)
    assert got["single_class_fraction"] == 0 and np.isnan(got["single_class_adv_least_novel"])
    assert set(single_class_metrics(mixed, novelty=False)) == {"single_class_fraction", "all_wrong_fraction"}


def test_nan_step_is_skipped_and_params_unchanged(step_parts):
    trainer, result = step_parts
    mini = _mini(result, advantages_B=result.signal["advantages"].at[0].set(jnp.nan))
    params = jax.tree.map(jnp.copy, trainer.params)
    opt_state = jax.tree.map(jnp.copy, trainer.opt_state)
    before = jax.tree.map(np.asarray, params)
    opt_before = jax.tree.map(np.asarray, opt_state)
    new_params, new_opt_state, info = train_update.update(trainer.graphdef, params, opt_state, mini,
                                                        optimizer=trainer.optimizer, settings=trainer.settings, micro=2)
    assert int(info["skipped"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), a), before, new_params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), a), opt_before, new_opt_state)


def test_update_that_makes_params_non_finite_is_skipped(step_parts):
    """lr=inf: loss and gradients are finite, the updated params are not; the update must not count as made."""
    import optax

    trainer, result = step_parts
    params = jax.tree.map(jnp.copy, trainer.params)
    sgd = optax.sgd(float("inf"))
    before = jax.tree.map(np.asarray, params)
    new_params, _, info = train_update.update(trainer.graphdef, params, sgd.init(params), _mini(result), optimizer=sgd,
                                   settings=trainer.settings, micro=2)
    assert np.isfinite(float(info["loss"])) and np.isfinite(float(info["grad_norm"]))
    assert int(info["skipped"]) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), a), before, new_params)


def test_micro_batch_accumulation_equals_one_batch(step_parts):
    trainer, result = step_parts
    outs = []
    for micro in (8, 2):
        params = jax.tree.map(jnp.copy, trainer.params)
        opt_state = jax.tree.map(jnp.copy, trainer.opt_state)
        outs.append(train_update.update(trainer.graphdef, params, opt_state, _mini(result), optimizer=trainer.optimizer,
                                      settings=trainer.settings, micro=micro))
    (p8, _, i8), (p2, _, i2) = outs
    np.testing.assert_allclose(float(i2["loss"]), float(i8["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(i2["grad_norm"]), float(i8["grad_norm"]), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 p8, p2)


def test_sharded_step_equals_unsharded(step_parts):
    trainer, result = step_parts
    outs = []
    for graphdef, params, opt_state, batch in placed_on_mesh_and_one_device(trainer, result.batch):
        scores = train_step.score(graphdef, params, batch, temperature=1.0, micro=2)
        mini = train_step.MiniBatch(batch, old_logp_BxT=scores.logp_BxT, ref_logp_BxT=scores.logp_BxT,
                                    advantages_B=jnp.asarray(np.asarray(result.signal["advantages"])))
        new_params, _, info = train_update.update(graphdef, params, opt_state, mini, optimizer=trainer.optimizer,
                                                settings=trainer.settings, micro=2)
        outs.append((scores, new_params, info))
    (s8, p8, i8), (s1, p1, i1) = outs
    for a, b in zip(jax.tree.leaves(s8), jax.tree.leaves(s1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(i8["loss"]), float(i1["loss"]), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), p8, p1)


# ------------------------------------------------------------------------------------------ bad input, early
def test_config_error_exits_2_with_the_key(assets, tmp_path, capsys):
    code = main(["--config", str(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml"),
                 *overrides(assets, tmp_path / "x"), "algorithm.explorashun=g2rl"])
    assert code == 2
    err = capsys.readouterr().err
    assert "algorithm.explorashun" in err and "algorithm.exploration" in err


@pytest.mark.parametrize("case", ["missing_model", "no_usable_rows", "unwritable_output"])
def test_bad_input_fails_before_any_compile(assets, tmp_path, case):
    kw = {}
    if case == "missing_model":
        kw["model.path"] = str(tmp_path / "nowhere")
    if case == "no_usable_rows":
        kw["data.max_prompt_tokens"] = 1
    out = tmp_path / "run"
    if case == "unwritable_output":
        out = tmp_path / "a_file"
        out.write_text("not a directory")
    cfg = load_config(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml", overrides(assets, out / "run", **kw))
    t0 = time.time()
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert time.time() - t0 < 10
    message = str(err.value)
    expected = {"missing_model": "model.path", "no_usable_rows": "usable rows",
                "unwritable_output": "run.output_dir"}[case]
    assert expected in message, message


# ------------------------------------------------------------------------------------------ pieces of the step
def test_reference_is_frozen_and_sharded_like_the_policy(assets, step_parts):
    from g2rl_jax.model import load_pretrained

    trainer, _ = step_parts  # one step has updated the policy in place
    loaded = nnx.state(load_pretrained(str(assets["policy"]), "float32", mesh=trainer.mesh))
    same_sharding = jax.tree.map(lambda r, p: r.sharding.is_equivalent_to(p.sharding, r.ndim), trainer.ref_params,
                                 trainer.params)
    assert all(jax.tree.leaves(same_sharding)), "reference params are not sharded like the policy"
    jax.tree.map(lambda r, w: np.testing.assert_array_equal(np.asarray(r), np.asarray(w)), trainer.ref_params, loaded)
    assert _max_change(jax.tree.map(np.asarray, trainer.ref_params), trainer.params) > 0, "the policy did not move"


def test_filter_keeps_mixed_groups_keyed_on_correctness():
    correct = np.array([1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1], bool)  # groups of 3: all right, all wrong, mixed x2
    keep = train_step.group_keep_mask(correct, 3)
    np.testing.assert_array_equal(keep, np.repeat([False, False, True, True], 3))


def test_masked_rows_do_not_move_the_params(step_parts):
    """What filtering relies on: rows whose response mask is zeroed contribute nothing, whatever their advantage."""
    trainer, result = step_parts
    outs = []
    for adv_dropped in (0.0, 5.0):
        drop_B = jnp.arange(result.batch.rewards.shape[0]) < 4  # the first group
        kept_BxT = result.batch.response_mask * ~drop_B[:, None]
        mini = _mini(result, advantages_B=jnp.where(drop_B, adv_dropped, result.signal["advantages"]),
                     batch=dataclasses.replace(result.batch, response_mask=kept_BxT))
        params, opt_state = jax.tree.map(jnp.copy, trainer.params), jax.tree.map(jnp.copy, trainer.opt_state)
        outs.append(train_update.update(trainer.graphdef, params, opt_state, mini, optimizer=trainer.optimizer,
                                      settings=trainer.settings, micro=2)[0])
        # one CI run aborted here: XLA:CPU's collective termination timeout on a starved machine (tests/conftest.py)
        jax.block_until_ready(outs[-1])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), *outs)


def test_stage_errors_name_the_stage_and_shapes(step_parts):
    from g2rl_jax.train.stages import stage

    with pytest.raises(train_step.StageError, match=r"stage 'score' failed on inputs \[input_ids=\(8, 24\), "
                                           r"rewards=\(8,\)\]: ValueError: boom"):
        with stage("score", input_ids=np.zeros((8, 24)), rewards=np.zeros(8)):
            raise ValueError("boom")
    trainer, result = step_parts
    with pytest.raises(train_step.StageError, match="batch of 8 responses is not a multiple of micro_batch_size=3"):
        train_step.score(trainer.graphdef, trainer.params, result.batch, temperature=1.0, micro=3)
    with pytest.raises(train_step.StageError, match=r"rewards has shape \(7,\), expected 8 rows like prompt_ids"):
        b = result.batch
        train_step.build_batch(np.zeros((8, 4)), np.ones((8, 4)), np.zeros((8, 2)), np.ones((8, 2)), np.zeros(7),
                               np.zeros(8, bool), b.group_size)


def test_learning_rate_schedule_warmup_then_cosine():
    from g2rl_jax.config import OptimConfig

    lr, w, total, a = 1e-3, 4, 20, 0.1
    sched = train_optim.learning_rate_schedule(OptimConfig(learning_rate=lr, warmup_steps=w, min_lr_ratio=a), total)
    for t in range(0, 25):
        d = min(t - w, total - w) / (total - w)
        want = lr * t / w if t < w else lr * ((1 - a) * 0.5 * (1 + np.cos(np.pi * d)) + a)
        np.testing.assert_allclose(float(sched(t)), want, rtol=1e-6, atol=1e-12, err_msg=f"update {t}")


def test_gradients_are_clipped_to_max_grad_norm():
    """b1 = b2 = 0 and eps = 1 make AdamW's step g / (|g| + 1): it sees the clipped gradient's scale."""
    from g2rl_jax.config import OptimConfig

    lr = 0.1
    opt = train_optim.make_optimizer(OptimConfig(learning_rate=lr, b1=0.0, b2=0.0, eps=1.0, weight_decay=0.0,
                                                max_grad_norm=1.0), 10)
    params = {"w": jnp.zeros(2)}
    updates, _ = opt.update({"w": jnp.array([30.0, 40.0])}, opt.init(params), params)  # norm 50 -> [0.6, 0.8]
    np.testing.assert_allclose(np.asarray(updates["w"]), -lr * np.array([0.6 / 1.6, 0.8 / 1.8]), rtol=1e-6)


def test_evol_invalid_responses_get_minus_one():
    """exploration=evol: a response with no extractable answer is invalid, reward −1 whatever its embedding."""
    from g2rl_jax.config import AlgorithmConfig

    rng = np.random.default_rng(0)
    correct = np.array([1, 1, 0, 0, 1, 0, 0, 1], bool)
    batch = train_step.Batch(input_ids=jnp.zeros((8, 4), jnp.int32), attention_mask=jnp.ones((8, 4), jnp.int32),
                             response_mask=jnp.ones((8, 2)), rewards=jnp.where(correct, 1.0, -1.0),
                             correct=jnp.asarray(correct), group_size=4)
    emb = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    valid = np.array([1, 1, 1, 0, 1, 1, 0, 1], bool)
    algo = AlgorithmConfig(exploration="evol", embedding_model="unused")
    shaped = np.asarray(train_step.advantages(batch, jnp.zeros((8, 3)), algo, emb, valid)["shaped_rewards"])
    assert shaped[3] == -1.0 and shaped[6] == -1.0
    everyone = np.asarray(train_step.advantages(batch, jnp.zeros((8, 3)), algo, emb)["shaped_rewards"])
    assert not np.allclose(shaped, everyone), "the valid mask changed nothing"
