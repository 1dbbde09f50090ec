"""Compiled for NVIDIA GPUs without one (g2rl_jax.aot.gpu): the GPU targets, and the cuDNN attention path.

On a GPU the model's `attention=auto` runs cuDNN's fused attention; these tests compile that path from this CPU host
for compile-only H100s (JAX's CUDA plugin, the gpu-compile extra), so CI checks it on every change:
* the target names, devices and hosts (one host of 8, two hosts of 8);
* the model's attention at the GQA layouts of Qwen3-1.7B and 4B (16 and 32 query heads on 8 KV heads, head_dim
  128) lowers to cuDNN's fused kernels, forward and backward, and holds no [rows, heads, L, L] scores: its bytes are
  those the planner counts (the inputs and outputs, and the [rows, 1, L, L] mask cuDNN takes as a bias), far below
  XLA attention's at the same shapes;
* `auto` picks cuDNN from the mesh's devices, not the CPU host.
What only a GPU shows (cuDNN's numerics against XLA attention, speed) stays in tests/test_model.py's GPU-only tests
and `python -m g2rl_jax.bench`.
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from g2rl_jax import parallel
from g2rl_jax import plan as P
from g2rl_jax.aot import TargetError, gpu, parse_target
from g2rl_jax.aot import check as check_lib
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.aot import report as report_lib
from g2rl_jax.config import MeshConfig, load_config
from g2rl_jax.model import attention as attn
from g2rl_jax.model.config import PRESETS, Qwen3Config

if gpu.missing_plugin():  # the test extra installs it (g2rl_jax[gpu-compile]); an older venv may not have it
    pytest.skip(gpu.missing_plugin(), allow_module_level=True)
FWD, BWD = "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"  # with the padding mask as a bias


def _kernels(compiled) -> set[str]:
    return set(re.findall(r'custom_call_target="(__cudnn\$[^"]+)"', compiled.as_text()))


def test_gpu_target_names_hosts_and_memory():
    one = parse_target("h100-8")
    assert (one.platform, one.chips, one.hosts, one.kind, one.topology) == ("gpu", 8, 1, "h100", "h100:1x1x8")
    assert one.hbm_bytes == gpu.device_memory_bytes(gpu.CARDS["h100"]) == 84_942_979_072
    two = parse_target("H100-2x8")
    assert (two.chips, two.hosts, two.topology) == (16, 2, "h100:2x1x8")
    assert [d.process_index for d in two.devices()] == [0] * 8 + [1] * 8
    assert {d.device_kind for d in two.devices()} == {"NVIDIA H100 80GB HBM3"}
    assert parse_target("h200-4").hbm_gib > 140 and parse_target("a100").chips == 1
    assert one.devices()[0].device_kind == "NVIDIA H100 80GB HBM3"  # each card its own devices, same topology
    assert parse_target("a100-8").devices()[0].device_kind == "NVIDIA A100-SXM4-80GB"
    for bad in ("h100-9", "h100-0", "h200-2x16"):
        with pytest.raises(TargetError, match="a host holds 1 to 8 GPUs"):
            parse_target(bad)
    with pytest.raises(TargetError, match="h100-N"):
        parse_target("rtx4090-1")


def _gpu_mesh(target: str, mesh_cfg: MeshConfig):
    return parallel.make_mesh(mesh_cfg, parse_target(target).devices())


def test_a_mesh_of_two_hosts_compiles_sharded():
    """2 x 8 H100s: a row-sharded matmul holds 1/16 of the rows per device."""
    mesh = _gpu_mesh("h100-2x8", MeshConfig(data=2, fsdp=8, tensor=1))
    rows = NamedSharding(mesh, jax.P(("data", "fsdp")))
    w = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=rows)
    compiled = jax.jit(lambda w: jnp.sum(w.astype(jnp.float32) ** 2)).lower(w).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == 4096 * 1024 * 2 // 16


GQA = {"qwen3-1.7b": MeshConfig(data=1, fsdp=4, tensor=2), "qwen3-4b": MeshConfig(data=1, fsdp=2, tensor=4)}
ROWS, L = 8, 512


@pytest.fixture(scope="module", params=list(GQA))
def compiled_attention(request):
    """The model's attention (`attention(..., "auto", mesh)`) and its gradient at a preset's head layout, and XLA
    attention's gradient at the same shapes, compiled for 8 x H100 (rows over fsdp, heads over tensor)."""
    model, mesh_cfg = PRESETS[request.param], GQA[request.param]
    mesh = _gpu_mesh("h100-8", mesh_cfg)
    H, G, K = model.num_attention_heads, model.num_key_value_heads, model.head_dim
    heads = NamedSharding(mesh, jax.P(("data", "fsdp"), None, "tensor"))
    q = jax.ShapeDtypeStruct((ROWS, L, H, K), jnp.bfloat16, sharding=heads)
    kv = jax.ShapeDtypeStruct((ROWS, L, G, K), jnp.bfloat16, sharding=heads)
    mask = jax.ShapeDtypeStruct((ROWS, L), jnp.int32, sharding=parallel.batch_sharding(mesh))

    def grad(backend):
        loss = lambda q, k, v, m: jnp.sum(attn.attention(q, k, v, m, backend, mesh).astype(jnp.float32))  # noqa
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, mask).compile()

    forward = jax.jit(lambda q, k, v, m: attn.attention(q, k, v, m, "auto", mesh)).lower(q, kv, kv, mask).compile()
    tp, rows = mesh.shape["tensor"], ROWS // (mesh.shape["data"] * mesh.shape["fsdp"])
    return dict(forward=forward, grad=grad("auto"), xla=grad("xla"), rows=rows, heads=H // tp, kv_heads=G // tp, K=K)


def test_cudnn_attention_lowers_forward_and_backward(compiled_attention):
    assert attn.mesh_platform(compiled_attention["forward"].input_shardings[0][0].mesh) == "gpu"
    assert _kernels(compiled_attention["forward"]) == {FWD}
    assert _kernels(compiled_attention["grad"]) == {FWD, BWD}  # auto picked cuDNN for GPU devices on a CPU host
    assert not _kernels(compiled_attention["xla"])


def test_cudnn_attention_holds_no_scores(compiled_attention):
    """Per device: the gradient's temporaries are the mask bias [rows, 1, L, L] (bf16) plus O(L) arrays (q, k, v,
    output, their cotangents, the softmax statistics), as the planner counts them; XLA attention holds the
    [rows, heads, L, L] scores, their softmax and cotangent on top."""
    c = compiled_attention
    b, h, g, K = c["rows"], c["heads"], c["kv_heads"], c["K"]
    bias = b * L * L * 2
    linear = b * L * (2 * h + 2 * g) * K * 4  # q, k, v, out and cotangents at float32 width: a generous bound
    temp = c["grad"].memory_analysis().temp_size_in_bytes
    assert bias <= temp <= bias + linear, (temp, bias, linear)
    scores = b * h * L * L * 4  # one float32 [rows, heads, L, L] buffer
    assert c["xla"].memory_analysis().temp_size_in_bytes > temp + scores


# ------------------------------------------------------------------------------------------ a whole step
# Qwen3's head_dim (128, what cuDNN runs for the real models) and GQA; small enough to compile in seconds
TINY = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=512,
                   tie_word_embeddings=True)
STEP = ["data.prompts_per_step=4", "rollout.num_samples=4", "rollout.max_new_tokens=256", "data.max_prompt_tokens=128",
        "algorithm.mini_batch_size=16", "algorithm.micro_batch_size=8", "model.compute_dtype=bfloat16",
        "model.attention=auto"]


@pytest.fixture(scope="module")
def gpu_step(tmp_path_factory):
    """(config, target, results): the largest shape of every program of the tiny config's step, compiled for
    8 x H100 (fsdp 8)."""
    target = parse_target("h100-8")
    tmp = tmp_path_factory.mktemp("gpu_step")
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", [f"model.path={tmp}", f"run.output_dir={tmp}/run", *STEP])
    mesh = parallel.make_mesh(cfg.mesh, target.devices())
    progs = programs_lib.step_programs(cfg, TINY, mesh, scope="largest")
    return cfg, target, report_lib.compile_programs(progs, mark=target.kernel_mark)


def test_a_step_compiles_for_h100_with_cudnn_where_the_model_attends(gpu_step):
    cfg, target, results = gpu_step
    assert [r.program.name for r in results if r.error] == []
    for kind in ("prefill", "score", "reference", "gradient"):  # full-sequence attention: cuDNN (auto, GPU mesh)
        assert all(r.kernels > 0 for r in results if r.program.kind == kind), kind
    assert all(r.kernels == 0 for r in results if r.program.kind in ("segment", "apply", "init"))
    fits, line = check_lib.verdict(cfg, TINY, target, results)
    assert fits and line.startswith("VERDICT: FITS on h100-8")
    lines = report_lib.table(results, target)
    assert "cudnn" in lines[0] and sum(gpu.WORKSPACE_CAVEAT in x for x in lines) == 1


def test_gpu_memory_is_below_the_planners_bound(gpu_step):
    """Each program's bytes per device, without its machine code, stay below the GPU plan's peak (at this size
    fixed costs dominate; the per-phase agreement at 1.7B and 4B is measured in docs/gpu.md)."""
    cfg, target, results = gpu_step
    p = P.plan(cfg, TINY, target.chips, "gpu")
    for r in results:
        assert r.total - r.code <= p.peak * 1.25, (r.program.name, r.total - r.code, p.peak)
    assert max(r.total for r in results) < 0.01 * target.hbm_bytes
