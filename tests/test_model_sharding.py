"""Sharding: a (data, fsdp, tensor) = (2, 2, 2) mesh over 8 fake CPU devices gives the unsharded logits."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from g2rl_jax.config import MeshConfig
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, load_pretrained
from g2rl_jax.parallel import DEFAULT_RULES, ShardingRules, batch_sharding, make_mesh, state_shardings

from _helpers import create_sharded
from hf_tiny import make_tiny_qwen3_dir

CFG = PRESETS["tiny"]  # 4 heads, 2 KV heads: both divide tensor=2
_fwd = nnx.jit(lambda model, ids, mask: model(ids, mask))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


def _batch():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, CFG.vocab_size, (4, 10)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def test_sharded_model_matches_unsharded(mesh, tmp_path):
    ids, mask = _batch()
    path = make_tiny_qwen3_dir(tmp_path / "m")
    plain = load_pretrained(path)
    sharded = load_pretrained(path, mesh=mesh)
    q = sharded.layers.q_proj[...]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert sharded.embed_tokens[...].sharding.spec == P("tensor", "fsdp")
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 32, 2, 24)
    ref = np.asarray(_fwd(plain, jnp.asarray(ids), jnp.asarray(mask)))
    s_ids, s_mask = (jax.device_put(a, batch_sharding(mesh)) for a in (ids, mask))
    out = _fwd(sharded, s_ids, s_mask)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _collectives(model, ids):
    """{op: [result shape text, ...]} of the compiled forward + backward of a loss over the hidden states."""
    graphdef, state = nnx.split(model)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state).hidden_states(ids).astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    found = {}
    for op, shape in re.findall(r"= (\S+) (all-reduce|all-gather|reduce-scatter)(?:-start)?\(", hlo):
        found.setdefault(shape, []).append(op)
    return found


def test_fsdp_keeps_rows_sharded_and_gathers_weights():
    """fsdp=8: with the model's mesh, activations stay split by rows and only weights move (all-gathers).
    Without it GSPMD follows the weights' fsdp-sharded embed dim: every device computes all 16 rows and
    all-reduces [16, L, ...] activations."""
    mesh = make_mesh(MeshConfig(fsdp=8))
    ids = jax.device_put(jnp.asarray(np.random.RandomState(1).randint(0, CFG.vocab_size, (16, 32))),
                         batch_sharding(mesh))
    pinned = _collectives(create_sharded(lambda: Qwen3(CFG, rngs=nnx.Rngs(0), mesh=mesh), mesh), ids)
    assert "all-reduce" not in pinned and len(pinned["all-gather"]) >= CFG.num_hidden_layers, pinned
    free = _collectives(create_sharded(lambda: Qwen3(CFG, rngs=nnx.Rngs(0)), mesh), ids)
    assert any(op.startswith("f32[16,32,") for op in free.get("all-reduce", [])), free


def test_mesh_must_match_device_count():
    with pytest.raises(ValueError, match=r"needs 6 devices, but there are 8"):
        make_mesh(MeshConfig(data=3, fsdp=2, tensor=1))


def test_heads_must_divide_tensor_axis():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    cfg = Qwen3Config(**{**CFG.__dict__, "num_key_value_heads": 2})
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"layers\.k_proj: dimension 2 \(kv_heads\) has size 2, not divisible by "
                                         r"mesh axes \('tensor',\) of size 4"):
        state_shardings(abstract, mesh)


def test_rules_reject_one_mesh_axis_twice_and_unknown_axes():
    rules = ShardingRules(DEFAULT_RULES.table)
    with pytest.raises(ValueError, match=r"'batch' and 'embed' both map to mesh axis 'fsdp'"):
        rules.spec(("batch", "seq", "embed"))
    with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]"):
        ShardingRules((("heads", ("model",)),))
    with pytest.raises(ValueError, match=r"no rule for logical axis 'experts'"):
        rules.spec(("experts",))


def test_load_reads_only_each_devices_slice(tmp_path, monkeypatch):
    """load_pretrained reads each parameter slice by slice (what keeps a host of a multi-host job from ever holding
    the whole model): on an 8-way fsdp mesh no read of a tensor with an `embed` axis exceeds 1/8 of it."""
    from g2rl_jax.model import hf_io

    path = make_tiny_qwen3_dir(tmp_path / "m")
    reads = []
    real = hf_io._read_slice

    def spy(handle, name, n_in, ours, slices, dtype):
        out = real(handle, name, n_in, ours, slices, dtype)
        reads.append((name, out.size, int(np.prod(ours))))
        return out

    monkeypatch.setattr(hf_io, "_read_slice", spy)
    load_pretrained(path, mesh=make_mesh(MeshConfig(data=1, fsdp=8, tensor=1)))
    embed_sharded = [r for r in reads if not r[0].endswith("norm.weight")]  # norms stay replicated
    assert embed_sharded and {r[0] for r in reads} >= {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"}
    for name, got, full in embed_sharded:
        assert got * 8 <= full, f"{name}: read {got} of {full} elements at once on an 8-way fsdp mesh"
