"""Training with LoRA end to end on the tiny random Qwen3 of test_train.py (CPU, 8 fake devices, a 2x2x2 mesh).

Covers: every exploration mode and every algorithm option trains the adapters and leaves the base bit for bit
unchanged; gradients and AdamW moments exist for the adapters only; the KL reference is the base with no second
parameter tree alive; the checkpoint holds the adapters (not the base) and a resume reproduces the uninterrupted run;
the 8-device mesh equals one device; resuming onto a different base, without LoRA, or a full fine-tune with LoRA is
refused in one line; export writes merged weights that transformers loads with equal logits and a PEFT adapter that
real `peft` loads onto the transformers base with equal logits; model.lora.init_from starts from that adapter.
"""
import gc
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from test_algorithm_options import EVEN_LENGTH_REWARD, OPTIONS
from test_train import _assert_same_metrics, _check_records, assets, overrides  # noqa: F401 - the module fixture

from g2rl_jax.config import ConfigError
from g2rl_jax.export import export
from g2rl_jax.model import lora, peft_io
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update
from g2rl_jax.train.checkpoint import load_policy
from g2rl_jax.train.command import main
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics

from _helpers import placed_on_mesh_and_one_device
from hf_tiny import make_tiny_qwen3_dir

STEPS = 3
LORA = {"model.lora.rank": 4, "model.lora.alpha": 8.0, "model.lora.base_dtype": "float32"}


def lora_config(assets, out, **kw):  # noqa: F811
    from test_train import config

    return config(assets, out, **{**LORA, **kw})


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_base_unchanged_and_adapters_trained(before, after):
    b_train, b_frozen = lora.split_trainable(before)
    a_train, a_frozen = lora.split_trainable(after)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(y), x), b_frozen, a_frozen)
    changes = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - np.asarray(y)).max()), b_train, a_train))
    assert max(changes) > 0, "the adapters did not move"


@pytest.fixture(scope="module")
def lora_run(assets, tmp_path_factory):  # noqa: F811
    """One uninterrupted G2RL run with LoRA (rank 4, KL on): the reference for resume, export and the checks."""
    out = tmp_path_factory.mktemp("lora") / "run"
    trainer = Trainer(lora_config(assets, out, steps=STEPS))
    trainer.resume()
    before = _host(trainer.params)
    trainer.run()
    return {"out": out, "records": read_metrics(out), "before": before, "trainer": trainer}


def test_lora_trains_the_adapters_only(lora_run):
    trainer = lora_run["trainer"]
    _check_records(lora_run["records"], "g2rl", STEPS)
    assert lora_run["records"][-1]["kl"] > 0, "the policy never left the reference (the base)"
    _assert_base_unchanged_and_adapters_trained(lora_run["before"], trainer.params)
    adapters = lora.trainable(trainer.params)
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(adapters))
    moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim]
    assert sorted(x.shape for x in moments) == sorted(adapter_shapes * 2)  # AdamW mu and nu of each adapter
    # the checkpoint holds the adapters, not the base
    step_dir = lora_run["out"] / "checkpoints" / str(STEPS)
    saved = json.loads((step_dir / "model" / "model.json").read_text())
    assert saved["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(lora.TARGETS.values())}
    assert saved["base"]["sha256"] == trainer.base_sha256 and len(trainer.base_sha256) == 64
    meta = json.loads((step_dir / "state" / "_METADATA").read_text())
    keys = {k for k in meta["tree_metadata"] if k.startswith("('params'")}
    assert keys and all("'adapters'" in k for k in keys), sorted(keys)[:3]


FULL = {"model.lora.rank": 0, "model.lora.alpha": None, "model.lora.base_dtype": "bfloat16"}


def _fresh_step(trainer, step):
    """step_stages(step) of a trainer without moving its params and optimizer state (the update gets copies)."""
    kept = trainer.params, trainer.opt_state
    trainer.params, trainer.opt_state = jax.tree.map(jnp.copy, kept)
    try:
        return trainer.step_stages(step)
    finally:
        trainer.params, trainer.opt_state = kept


def test_reference_is_the_base_with_no_second_copy(assets, lora_run, tmp_path):  # noqa: F811
    trainer = lora_run["trainer"]
    # the reference log-probs equal a plain forward of the base weights (a model without adapters)
    plain = Trainer(lora_config(assets, tmp_path / "plain", **FULL))
    plain.close()
    batch = _fresh_step(trainer, STEPS).batch
    ref = train_step.ref_logprobs(*trainer._reference(), batch, temperature=1.0, micro=2)
    base = train_step.score(plain.graphdef, plain.params, batch, temperature=1.0, micro=2).logp_BxT
    np.testing.assert_allclose(np.asarray(ref), np.asarray(base), rtol=1e-6, atol=1e-6)
    # parameter bytes alive: a LoRA trainer adds the base once (plus adapters and their moments), a full one twice
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(plain.params))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.trainable(trainer.params)))
    del plain
    added = {}
    for name, extra in (("lora", {}), ("full", FULL)):
        gc.collect()
        alive = sum(x.nbytes for x in jax.live_arrays())
        other = Trainer(lora_config(assets, tmp_path / name, **extra))
        gc.collect()
        added[name] = sum(x.nbytes for x in jax.live_arrays()) - alive
        other.close()
        del other
    assert added["lora"] <= base_bytes + 3 * adapter_bytes + 1024, (added, base_bytes, adapter_bytes)
    assert added["full"] >= 4 * base_bytes, added  # params, reference copy, AdamW mu and nu: the test can fail


def test_resume_equals_uninterrupted(assets, lora_run, tmp_path):  # noqa: F811
    part = Trainer(lora_config(assets, tmp_path / "part", steps=STEPS))
    part.resume()
    part.run(stop_after=2)
    again = Trainer(lora_config(assets, tmp_path / "part", steps=STEPS))
    assert again.resume() == 2
    again.run()
    _assert_same_metrics(read_metrics(tmp_path / "part"), lora_run["records"])
    np.testing.assert_array_equal(np.asarray(again.params["adapters"]["q_proj_b"][...]),
                                  np.asarray(lora_run["trainer"].params["adapters"]["q_proj_b"][...]))


@pytest.mark.parametrize("mode", ["grpo", "entropy_bonus", "evol"])
def test_every_mode_and_option_trains_with_lora(assets, tmp_path, mode):  # noqa: F811
    """grpo and evol as configured; entropy_bonus with every algorithm option on (test_algorithm_options.py)."""
    extra = {}
    if mode == "entropy_bonus":
        (tmp_path / "even_length.py").write_text(EVEN_LENGTH_REWARD)
        extra = dict(OPTIONS, **{"reward.function": f"{tmp_path / 'even_length.py'}:reward",
                                 "reward.truncated": "keep"})
    trainer = Trainer(lora_config(assets, tmp_path / mode, mode=mode, steps=1, **extra))
    trainer.resume()
    before = _host(trainer.params)
    trainer.run()
    records = read_metrics(tmp_path / mode)
    assert np.isfinite(records[-1]["loss"]) and records[-1]["skipped_updates"] == 0
    _assert_base_unchanged_and_adapters_trained(before, trainer.params)


def test_eight_devices_equal_one_device(lora_run):
    trainer = lora_run["trainer"]
    result = _fresh_step(trainer, STEPS)
    outs = []
    for graphdef, params, opt_state, batch in placed_on_mesh_and_one_device(trainer, result.batch):
        scores = train_step.score(graphdef, params, batch, temperature=1.0, micro=2)
        ref = train_step.ref_logprobs(lora.reference_graphdef(graphdef, params), params, batch, temperature=1.0,
                                      micro=2)
        mini = train_step.MiniBatch(batch, old_logp_BxT=scores.logp_BxT, ref_logp_BxT=ref,
                                    advantages_B=jnp.asarray(np.asarray(result.signal["advantages"])))
        new_params, _, info = train_update.update(graphdef, params, opt_state, mini, optimizer=trainer.optimizer,
                                                settings=trainer.settings, micro=2)
        outs.append((scores, ref, new_params, info))
    (s8, r8, p8, i8), (s1, r1, p1, i1) = outs
    for a, b in zip(jax.tree.leaves((s8, r8)), jax.tree.leaves((s1, r1))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(i8["loss"]), float(i1["loss"]), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), p8, p1)


# ------------------------------------------------------------------------------------------ refused resumes
@pytest.fixture
def run_copy(lora_run, tmp_path):
    """A copy of the LoRA run directory to resume in other ways."""
    shutil.copytree(lora_run["out"], tmp_path / "copy")
    return tmp_path / "copy"


def _refused(assets, run_dir, capsys, **kw):  # noqa: F811
    """main() on run_dir with overrides kw: exit status 2 and the one-line checkpoint error."""
    argv = ["--config", "configs/qwen3_1p7b_g2rl.yaml",
            *overrides(assets, run_dir, steps=STEPS + 1, **{**LORA, "run.allow_config_change": True, **kw})]
    capsys.readouterr()  # what came before main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("checkpoint error: ") and "\n" not in err, err
    return err


def test_resume_without_lora_is_refused(assets, run_copy, capsys):  # noqa: F811
    err = _refused(assets, run_copy, capsys, **FULL)
    assert "holds LoRA adapters (rank 4, alpha 8, targets q_proj," in err and "has model.lora.rank=0" in err
    err = _refused(assets, run_copy, capsys, **{"model.lora.rank": 8})
    assert "asks for rank 8, alpha 8" in err


def test_full_fine_tune_resumed_with_lora_is_refused(assets, run_copy, capsys):  # noqa: F811
    for record in run_copy.glob("checkpoints/*/model/model.json"):  # what a full fine-tune's checkpoints record
        record.write_text(json.dumps({"lora": None}))
    err = _refused(assets, run_copy, capsys)
    assert "holds a full fine-tune (every weight trained), but this run sets model.lora.rank=4" in err


def _other_base(assets, root):  # noqa: F811
    """A copy of the policy directory with other weights of the same shapes."""
    other = shutil.copytree(assets["policy"], root / "other_base")
    cfg = json.loads((assets["policy"] / "config.json").read_text())
    keys = ("vocab_size", "max_position_embeddings", "num_hidden_layers", "hidden_size", "intermediate_size",
            "head_dim", "num_attention_heads", "num_key_value_heads")
    make_tiny_qwen3_dir(root / "weights", seed=5, **{k: cfg[k] for k in keys})
    shutil.copy(root / "weights" / "model.safetensors", other / "model.safetensors")
    return other


def test_resume_onto_another_base_is_refused(assets, lora_run, run_copy, tmp_path, capsys):  # noqa: F811
    err = _refused(assets, run_copy, capsys, **{"model.path": _other_base(assets, tmp_path)})
    assert "holds other weights (sha256" in err and "point model.path at the base model" in err
    assert (run_copy / "config.yaml").read_text() == (lora_run["out"] / "config.yaml").read_text()


# ------------------------------------------------------------------------------------------ export
def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def policy_logits(lora_run):
    """The trained LoRA policy (load_policy of the run's newest checkpoint) and its float32 logits of IDS."""
    model, base_dir = load_policy(lora_run["out"])
    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, (2, 9))
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
    return model, base_dir, ids, logits


def _assert_close(ours, ref, rel=1e-4):
    assert np.abs(ours - ref).max() <= rel * np.abs(ref).max(), (np.abs(ours - ref).max(), np.abs(ref).max())


def test_export_merged_loads_in_transformers(lora_run, policy_logits, tmp_path):
    model, _, ids, logits = policy_logits
    assert model.adapters is not None and float(jnp.abs(model.adapters.q_proj_b[...]).max()) > 0
    out = export(lora_run["out"], tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    _assert_close(_torch_logits(hf, ids), logits)


def test_export_adapter_loads_in_peft_and_starts_a_run(assets, lora_run, policy_logits, tmp_path):  # noqa: F811
    import peft

    model, base_dir, ids, logits = policy_logits
    out = export(lora_run["out"], tmp_path / "adapter", adapter=True)
    assert sorted(p.name for p in out.iterdir()) == [peft_io.ADAPTER_CONFIG, peft_io.ADAPTER_WEIGHTS]
    with safe_open(str(out / peft_io.ADAPTER_WEIGHTS), framework="numpy") as f:
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in f.keys()
        assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in f.keys()
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, out).eval()
    _assert_close(_torch_logits(with_adapter, ids), logits)
    # the adapter starts a new run: its adapters are the checkpoint's
    trainer = Trainer(lora_config(assets, tmp_path / "init", **{"model.lora.init_from": out}))
    for name in lora.TARGETS.values():
        for x, y in zip(trainer.model.adapters.factors(name), model.adapters.factors(name)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    trainer.close()
    # ... but not on another base model
    other = _other_base(assets, tmp_path)
    with pytest.raises(ConfigError, match="model.lora.init_from: .* was trained on another base model"):
        Trainer(lora_config(assets, tmp_path / "init_other", **{"model.lora.init_from": out, "model.path": other}))


def test_export_adapter_of_a_full_fine_tune_is_refused(run_copy, tmp_path):
    for record in run_copy.glob("checkpoints/*/model/model.json"):
        record.write_text(json.dumps({"lora": None}))
    with pytest.raises(ValueError, match="is a full fine-tune .* export it without --adapter"):
        export(run_copy, tmp_path / "adapter", adapter=True)


def test_load_policy_refuses_another_base(run_copy):
    record = json.loads(next(run_copy.glob("checkpoints/*/model/model.json")).read_text())
    for path in run_copy.glob("checkpoints/*/model/model.json"):  # as if trained on other weights
        path.write_text(json.dumps({**record, "base": {**record["base"], "sha256": "0" * 64}}))
    with pytest.raises(ValueError, match="holds other weights"):
        load_policy(run_copy)
