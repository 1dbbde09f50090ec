"""LoRA on the model (g2rl_jax/model/lora.py, peft_io.py), its config group and the planner; training, resume and
export with LoRA are in test_lora_train.py.

Covers: step 0's LoRA policy has the base model's logits bit for bit; x·W + x·A·(alpha/r)·B against a float64
NumPy transcription for every projection's einsum; adapters switched off are the base; merged weights and the
sampler's merged decode weights equal the adapters applied on the fly; adapters shard like their projection's in /
out dims; gradients exist for the adapters only; model.lora config errors; PEFT adapter errors; the plan's LoRA
parts against hand counts.
"""
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax import parallel
from g2rl_jax import plan as P
from g2rl_jax.config import ConfigError, MeshConfig, load_config
from g2rl_jax.model import PRESETS, load_pretrained, lora, peft_io
from g2rl_jax.model.qwen3 import LORA_A, LORA_B, project
from g2rl_jax.train import update as train_update

from hf_tiny import make_tiny_qwen3_dir

SPEC = lora.LoraSpec(rank=4, alpha=8.0, targets=tuple(lora.TARGETS.values()))
IDS = np.random.RandomState(0).randint(0, 128, (2, 11))
_logits = jax.jit(lambda graphdef, state, ids: nnx.merge(graphdef, state)(ids), static_argnums=0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_qwen3_dir(tmp_path_factory.mktemp("lora") / "base", num_key_value_heads=1, head_dim=16,
                               tie_word_embeddings=False)


def _random_b(model, seed=1):
    """Non-zero B factors, so the adapters change the policy."""
    for i, name in enumerate(model.adapters.spec.targets):
        b = getattr(model.adapters, f"{name}_b")
        b[...] = 0.05 * jax.random.normal(jax.random.key(seed + i), b.shape, b[...].dtype)
    return model


@pytest.fixture(scope="module")
def adapted(base_dir):
    """(base logits, a LoRA model with random A and B on every projection)."""
    base = load_pretrained(base_dir)
    base_logits = np.asarray(_logits(*nnx.split(base), IDS))
    return base_logits, _random_b(lora.attach(load_pretrained(base_dir), SPEC, dtype="float32", seed=0))


def test_step_0_policy_is_the_base_model_bit_for_bit(base_dir, adapted):
    base_logits, _ = adapted
    fresh = lora.attach(load_pretrained(base_dir), SPEC, dtype="float32", seed=0)  # A random, B = 0
    assert float(jnp.abs(fresh.adapters.q_proj_a[...]).max()) > 0
    np.testing.assert_array_equal(np.asarray(_logits(*nnx.split(fresh), IDS)), base_logits)


# the einsum of every projection, as qwen3.py calls `project`: (equation, x shape, W shape, number of W's in dims)
EINSUMS = {"q_proj": ("bld,dhk->blhk", (2, 3, 6), (6, 4, 5), 1),
           "o_proj": ("blhk,hkd->bld", (2, 3, 4, 5), (4, 5, 6), 2),
           "gate_proj": ("bld,df->blf", (2, 3, 6), (6, 7), 1), "down_proj": ("blf,fd->bld", (2, 3, 7), (7, 6), 1)}


@pytest.mark.parametrize("name", list(EINSUMS))
def test_project_is_x_w_plus_x_a_b_in_float64(name):
    eq, x_shape, w_shape, n_in = EINSUMS[name]
    rs, r = np.random.RandomState(3), 3
    x, w = rs.randn(*x_shape), rs.randn(*w_shape)
    a, b = rs.randn(*w_shape[:n_in], r), rs.randn(r, *w_shape[n_in:])
    got = project(eq, jnp.asarray(x, jnp.float32), {name: w, name + LORA_A: a, name + LORA_B: b}, name)
    # float64 transcription: flatten x's contracted dims and W / A / B to matrices
    k, o = math.prod(w_shape[:n_in]), math.prod(w_shape[n_in:])
    x2 = x.reshape(-1, k)
    want = (x2 @ w.reshape(k, o) + (x2 @ a.reshape(k, r)) @ b.reshape(r, o)).reshape(*x_shape[:2], *w_shape[n_in:])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    plain = project(eq, jnp.asarray(x, jnp.float32), {name: w}, name)  # no factors: the base projection alone
    np.testing.assert_allclose(np.asarray(plain), (x2 @ w.reshape(k, o)).reshape(want.shape), rtol=1e-5, atol=1e-5)


def test_adapters_off_is_the_base_and_merged_weights_are_the_adapted_policy(adapted):
    base_logits, model = adapted
    graphdef, state = nnx.split(model)
    lora_logits = np.asarray(_logits(graphdef, state, IDS))
    assert np.abs(lora_logits - base_logits).max() > 1e-3, "the random adapters should change the policy"
    np.testing.assert_array_equal(np.asarray(_logits(lora.reference_graphdef(graphdef, state), state, IDS)),
                                  base_logits)
    assert model.adapters.enabled, "the reference graphdef must not switch the live model's adapters off"
    merged = lora.merged(model, "float32")
    assert merged.adapters is None and model.adapters is not None
    np.testing.assert_allclose(np.asarray(_logits(*nnx.split(merged), IDS)), lora_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge", [True, False])
def test_decode_with_adapters_equals_the_forward(adapted, merge):
    """The sampler's path: prefill, then decode steps with the per-layer weights (adapters merged in, or applied
    per step) give the logits of the full forward at those positions."""
    _, model = adapted
    model.adapters.merge_for_decode = merge
    try:
        full = np.asarray(_logits(*nnx.split(model), IDS))
        logits, prefix = model.prefill(jnp.asarray(IDS[:, :8]), jnp.ones((2, 8), jnp.int32))
        suffix = model.init_suffix(prefix, num_samples=1, max_new_tokens=4)
        layers = model.decode_layers()
        assert (f"q_proj{LORA_A}" in layers[0]) != merge
        np.testing.assert_allclose(np.asarray(logits), full[:, 7], rtol=1e-5, atol=1e-5)
        for t in range(3):
            logits, suffix = model.decode_step(jnp.asarray(IDS[:, 8 + t]), prefix, suffix, t, layers=layers)
            np.testing.assert_allclose(np.asarray(logits), full[:, 8 + t], rtol=1e-5, atol=1e-5)
    finally:
        model.adapters.merge_for_decode = True


def test_adapters_shard_like_their_projection(tmp_path):
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = lora.attach(load_pretrained(make_tiny_qwen3_dir(tmp_path / "m"), mesh=mesh), SPEC, dtype="float32", seed=0,
                        mesh=mesh)
    spec = lambda name: tuple(getattr(model.adapters, name)[...].sharding.spec)  # noqa: E731
    assert spec("q_proj_a") == (None, "fsdp", None) and spec("q_proj_b") == (None, None, "tensor", None)
    assert spec("o_proj_a") == (None, "tensor", None, None) and spec("o_proj_b") == (None, None, "fsdp")
    assert spec("down_proj_a") == (None, "tensor", None) and spec("down_proj_b") == (None, None, "fsdp")


def test_gradients_and_split_cover_the_adapters_only(base_dir, adapted):
    _, model = adapted
    graphdef, state = nnx.split(model)
    trainable, frozen = lora.split_trainable(state)
    assert set(trainable.keys()) == {"adapters"} and "adapters" not in frozen
    assert len(jax.tree.leaves(trainable)) == 2 * len(SPEC.targets)
    loss = lambda params, ids: (jnp.mean(nnx.merge(graphdef, params)(ids) ** 2), {})  # noqa: E731
    (_, _), grads = train_update.trainable_grad(loss, state, jnp.asarray(IDS))
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    # full fine-tuning: every parameter is trainable, nothing is frozen
    full, none = lora.split_trainable(nnx.state(load_pretrained(base_dir)))
    assert len(jax.tree.leaves(full)) == len(jax.tree.leaves(frozen)) and not jax.tree.leaves(none)


# ------------------------------------------------------------------------------------------ config and PEFT errors
@pytest.mark.parametrize("overrides, message", [
    (["model.lora.alpha=16"], "model.lora.alpha: is set but model.lora.rank is 0 (LoRA off)"),
    (["model.lora.targets=q,v"], "model.lora.targets: is set but model.lora.rank is 0"),
    (["model.lora.rank=-2"], "model.lora.rank: must be >= 0 (0 = LoRA off), got -2"),
    (["model.lora.rank=8", "model.lora.targets=q,qkv"], "unknown target(s) ['qkv']; choose from q, k, v, o, gate"),
    (["model.lora.rank=8", "model.lora.targets=q,q"], "names a projection twice"),
    (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha: must be a finite number > 0"),
    (["model.lora.rnak=8"], "unknown key 'model.lora.rnak'; did you mean 'model.lora.rank'?"),
])
def test_lora_config_errors_are_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lora_yaml_group_round_trips(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: " + str(Path("configs/demo.yaml").resolve()) + "\nmodel:\n  lora:\n    rank: 8\n"
                    "    targets: [q, v]\n")
    cfg = load_config(path)
    assert (cfg.model.lora.rank, cfg.model.lora.targets, cfg.model.lora.alpha) == (8, ("q", "v"), None)
    assert lora.LoraSpec.from_config(cfg.model.lora) == lora.LoraSpec(8, 8.0, ("q_proj", "v_proj"))


def test_peft_adapter_round_trip_and_errors(base_dir, adapted, tmp_path):
    _, model = adapted
    out = peft_io.save_adapter(model, tmp_path / "adapter", base_model=str(base_dir), base_sha256="a" * 64)
    config = json.loads((out / peft_io.ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    fresh = lora.attach(load_pretrained(base_dir), SPEC, dtype="float32", seed=7)
    peft_io.load_adapter(fresh, out, base_sha256="a" * 64)
    for name in SPEC.targets:
        for x, y in zip(fresh.adapters.factors(name), model.adapters.factors(name)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="was trained on another base model .* point model.path at its base"):
        peft_io.load_adapter(fresh, out, base_sha256="b" * 64)
    other_rank = lora.attach(load_pretrained(base_dir), lora.LoraSpec(8, 8.0, SPEC.targets), dtype="float32", seed=0)
    with pytest.raises(ValueError, match="has r=4, lora_alpha=8.0, but model.lora asks for rank 8, alpha 8: set "
                                         "model.lora.rank=4 model.lora.alpha=8.0"):
        peft_io.load_adapter(other_rank, out)
    fewer = lora.attach(load_pretrained(base_dir), lora.LoraSpec(4, 8.0, ("q_proj", "v_proj")), dtype="float32",
                        seed=0)
    with pytest.raises(ValueError, match="set model.lora.targets=q,k,v,o,gate,up,down"):
        peft_io.load_adapter(fewer, out)
    with pytest.raises(ValueError, match="is not a PEFT adapter directory"):
        peft_io.load_adapter(fresh, tmp_path)
    wider = make_tiny_qwen3_dir(tmp_path / "wider", hidden_size=32, num_key_value_heads=1, head_dim=16,
                                tie_word_embeddings=False)
    on_wider = lora.attach(load_pretrained(wider), SPEC, dtype="float32", seed=0)
    with pytest.raises(ValueError, match="needs \\[4, 32\\]: the adapter was trained on another base model"):
        peft_io.load_adapter(on_wider, out)


# ------------------------------------------------------------------------------------------ the planner
def test_plan_knows_lora(tmp_path):
    model = PRESETS["qwen3-1.7b"]
    (tmp_path / "config.json").write_text(json.dumps(model.to_hf_dict()))
    base = ["model.path=" + str(tmp_path), "run.output_dir=" + str(tmp_path / "run")]
    full = P.plan(load_config("configs/qwen3_1p7b_g2rl.yaml", base), model, 1)
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", [*base, "model.lora.rank=64"])
    low = P.plan(cfg, model, 1)
    d, f, h, g, k, n = 2048, 6144, 16, 8, 128, 28  # A [in, r] + B [r, out] per projection and layer
    adapter = n * 64 * sum(i + o for i, o in ((d, h * k), (d, g * k), (d, g * k), (h * k, d), (d, f), (d, f), (f, d)))
    assert low.params == model.num_params() * 2 + adapter * 4  # base in bfloat16, adapters in float32
    assert low.optimizer == 2 * adapter * 4 and low.gradients == adapter * 8 and low.reference == 0
    assert full.reference == full.params > 0 and low.kv_cache == full.kv_cache
    assert any("no reference copy" in note for note in low.notes)
