"""Three defects that would break a real TPU run, each found by compiling for a TPU topology without a TPU:

* splash attention (a Mosaic kernel, which XLA cannot partition) runs per shard under `shard_map`: equal to XLA
  attention forward and backward on the 8-device CPU mesh (Pallas interpreter), and it compiles for v5e:2x2;
* `model.attention=auto` is decided by the mesh's devices, not by the host: a CPU host compiling for TPU devices
  gets splash;
* the optimizer state is sharded like the parameters, when created and after a checkpoint restore.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from g2rl_jax import parallel
from g2rl_jax.config import MeshConfig, load_config
from g2rl_jax.demo.tokenizer import make_tokenizer
from g2rl_jax.model import attention as attn
from g2rl_jax.model.config import PRESETS, RuntimeConfig
from g2rl_jax.model.qwen3 import Qwen3

from hf_tiny import make_tiny_qwen3_dir

pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
KERNEL = "tpu_custom_call"  # how a Mosaic (Pallas TPU) kernel appears in compiled HLO


def _tpu_mesh(mesh_cfg: MeshConfig):
    from g2rl_jax.aot.targets import parse_target

    return parallel.make_mesh(mesh_cfg, parse_target("v5litepod-4").devices())


def test_splash_under_shard_map_equals_xla_forward_and_backward():
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(3)
    B, L, H, G, K = 4, 130, 4, 2, 128
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, L, H, K), (B, L, G, K), (B, L, G, K)))
    lengths = np.array([130, 97, 64, 5])
    mask = jnp.asarray(np.arange(L)[None] >= L - lengths[:, None], jnp.int32)  # left padding, as the sampler's
    rows, heads = NamedSharding(mesh, jax.P(("data", "fsdp"))), NamedSharding(mesh, jax.P(("data", "fsdp"), None,
                                                                                          "tensor"))
    q, k, v, mask = jax.device_put((q, k, v, mask), (heads, heads, heads, rows))
    w = jnp.asarray(rng.standard_normal((B, L, H, K)), jnp.float32) * mask[:, :, None, None]  # real queries only

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, mask) * w)

    splash = lambda q, k, v, m: attn.splash(q, k, v, m, mesh=mesh, interpret=True)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        got, got_grads = jax.jit(jax.value_and_grad(lambda *a: loss(splash, *a), argnums=(0, 1, 2)))(q, k, v)
        want, want_grads = jax.jit(jax.value_and_grad(lambda *a: loss(attn.xla, *a), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tpu_compiled():
    """hidden_states + its gradient of a tiny Qwen3 with model.attention=auto, compiled for a v5e:2x2 mesh
    (fsdp 2 x tensor 2) from this CPU host."""
    mesh = _tpu_mesh(MeshConfig(data=1, fsdp=2, tensor=2))
    runtime = RuntimeConfig(compute_dtype="bfloat16", attention="auto", remat="full")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(PRESETS["tiny"], runtime, rngs=nnx.Rngs(0),
                                                                mesh=mesh)))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                          parallel.state_shardings(abstract, mesh))
    ids = jax.ShapeDtypeStruct((4, 200), jnp.int32, sharding=parallel.batch_sharding(mesh))

    def loss(params, ids):
        return jnp.sum(nnx.merge(graphdef, params).hidden_states(ids, ids > 0).astype(jnp.float32))

    return jax.jit(jax.grad(loss)).lower(params, ids).compile()


def test_splash_compiles_for_a_tpu_mesh(tpu_compiled):
    """Without shard_map the TPU compiler stops: "Mosaic kernels cannot be automatically partitioned"."""
    assert KERNEL in tpu_compiled.as_text()
    assert tpu_compiled.memory_analysis().temp_size_in_bytes > 0


def test_auto_attention_follows_the_mesh_devices_not_the_host(tpu_compiled):
    assert jax.default_backend() == "cpu"
    assert attn.mesh_platform(_tpu_mesh(MeshConfig(fsdp=-1))) == "tpu"
    assert attn.mesh_platform(parallel.make_mesh(MeshConfig(fsdp=-1))) == "cpu"
    assert attn.mesh_platform(None) is None  # no mesh: the host's backend decides
    assert KERNEL in tpu_compiled.as_text()  # auto picked splash for TPU devices, from a CPU host


# ------------------------------------------------------------------------------------------ optimizer state
def _per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _assert_moments_like_params(opt_state, params):
    """Every AdamW moment carries its parameter's sharding, and mu and nu each hold the params' per-device bytes."""
    adam = opt_state[1][0]  # chain(clip_by_global_norm, adamw): adamw's ScaleByAdamState
    for moments in (adam.mu, adam.nu):
        got = jax.tree.leaves(jax.tree.map(lambda m, p: m.sharding.is_equivalent_to(p.sharding, m.ndim),
                                           moments, params))
        assert all(got), "a moment is not sharded like its parameter"
        assert _per_device_bytes(moments) == _per_device_bytes(params)
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(opt_state))


def test_optimizer_state_is_sharded_like_params_on_creation_and_after_restore(tmp_path):
    from g2rl_jax.train.loop import Trainer

    tok = make_tokenizer()
    policy = make_tiny_qwen3_dir(tmp_path / "policy", vocab_size=-(-len(tok) // 64) * 64, hidden_size=64,
                                 intermediate_size=64, num_hidden_layers=1, head_dim=16, num_attention_heads=2,
                                 num_key_value_heads=2, max_position_embeddings=64)
    tok.save_pretrained(policy)
    overrides = [f"model.path={policy}", f"run.output_dir={tmp_path / 'run'}", "run.eval_every=0",
                 "data.train_dataset=demo", "data.prompt_template=plain", "data.prompts_per_step=2",
                 "rollout.num_samples=4", "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=8",
                 "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"]
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", overrides)
    trainer = Trainer(cfg)
    try:
        params_bytes = _per_device_bytes(trainer.params)
        assert params_bytes * 4 < sum(x.nbytes for x in jax.tree.leaves(trainer.params))  # fsdp 8 splits them
        _assert_moments_like_params(trainer.opt_state, trainer.params)
        trainer.step = 1  # as after one step: the checkpoint of step 1
        trainer.ckpt.save(1, trainer.state(), trainer.loader, force=True)
        trainer.ckpt.close()
    finally:
        trainer.close()
    resumed = Trainer(cfg)
    try:
        assert resumed.resume() == 1
        _assert_moments_like_params(resumed.opt_state, resumed.params)
    finally:
        resumed.ckpt.close()
        resumed.close()
