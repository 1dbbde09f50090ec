"""The ahead-of-time check (g2rl_jax.aot) with the real TPU compiler (libtpu, pinned in the test extra), no TPU:
a tiny config's whole step compiled for v5e:4x4 (four hosts, from this one process), splash in the score program,
every program's memory below the planner's bound; with LoRA, the step's largest programs for v5e:2x2 (one host;
tests/test_launch.py compiles them for v5e:2x2 without LoRA too); the accelerator-type table; the CLI."""
import pytest

from g2rl_jax import plan as P
from g2rl_jax.aot import TargetError, parse_target
from g2rl_jax.aot import check as check_lib
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.aot import report as report_lib
from g2rl_jax.aot.targets import GiB, tpu_shape
from g2rl_jax.config import load_config
from g2rl_jax.model.config import Qwen3Config
from g2rl_jax.shapes.step import step_shapes

pytest.importorskip("libtpu", reason="the test extra pins libtpu; install it: pip install -e '.[test]'")
# small enough to compile in seconds, large enough that its arrays, not the compiler's fixed scratch, fill the chip
TINY = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                   tie_word_embeddings=True)
# 16 prompt tokens (the prompt bucket's floor): the packed passes' width ladder has 4 rungs (32 had 6, 128 had 9:
# 36 programs -> 27 -> 21, the same kinds; the packed gradient, the costliest to compile, 9 -> 6 -> 4)
BASE = ["data.prompts_per_step=4", "rollout.num_samples=4", "rollout.max_new_tokens=16", "data.max_prompt_tokens=16",
        "algorithm.mini_batch_size=16", "model.compute_dtype=bfloat16", "model.attention=auto"]
# micro-batches of at least the row shards: v5e:4x4 splits rows 16 ways (v5e:2x2 4 ways)
SLICE, MICRO = "v5litepod-16", ["algorithm.micro_batch_size=16"]


def _cfg(tmp_path, overrides):
    return load_config("configs/qwen3_1p7b_g2rl.yaml", [f"model.path={tmp_path}", f"run.output_dir={tmp_path}/run",
                                                        *BASE, *overrides])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(config, target, mesh, results) of the tiny config's every program compiled for the slice."""
    from g2rl_jax import parallel

    target = parse_target(SLICE)
    cfg = _cfg(tmp_path_factory.mktemp("aot"), MICRO)
    mesh = parallel.make_mesh(cfg.mesh, target.devices())
    progs = programs_lib.step_programs(cfg, TINY, mesh, scope="all")
    return cfg, target, mesh, report_lib.compile_programs(progs)


def test_every_program_of_the_step_compiles(compiled):
    cfg, target, mesh, results = compiled
    kinds = {r.program.kind for r in results}
    assert kinds == {"init", "prefill", "start", "decode_layers", "segment", "regroup", "score", "reference",
                     "advantages", "gradient", "apply"}
    assert [r.program.name for r in results if r.error] == []
    shapes = step_shapes(cfg, mesh)
    assert sum(r.program.kind == "segment" for r in results) == len(shapes.buckets)
    fits, line = check_lib.verdict(cfg, TINY, target, results)
    assert fits and line.startswith(f"VERDICT: FITS on {target.name}")


def test_read_rungs_copy_no_cache_on_tpu(tmp_path):
    """A decode segment of 256 rows at a 512-token budget, its steps reading rungs of 128, 256 and 512 slots (a
    while loop per rung, rollout/engine.py), compiled for v5e:2x2: the rungs' slices of the cache fuse into their
    reads (XLA on CPU copies them), so its temporaries stay far below a copy of the part of a layer's cache that
    the 256-slot rung reads."""
    from g2rl_jax import parallel

    target = parse_target("v5litepod-4")
    cfg = _cfg(tmp_path, [*MICRO, "rollout.max_new_tokens=512", "rollout.first_capacity=128",
                          "data.prompts_per_step=16", "rollout.num_samples=16", "algorithm.mini_batch_size=256"])
    mesh = parallel.make_mesh(cfg.mesh, target.devices())
    segment = next(p for p in programs_lib.step_programs(cfg, TINY, mesh, scope="largest") if p.kind == "segment")
    temp = segment.lower().compile().memory_analysis().temp_size_in_bytes
    shapes = step_shapes(cfg, mesh)
    assert shapes.reads == (128, 256, 512) and shapes.rows == 256
    rung_kv = 2 * shapes.rows // shapes.shards * TINY.num_key_value_heads * 256 * TINY.head_dim * 2  # bf16 K, V
    assert temp < rung_kv / 4, (temp, rung_kv)


def test_multi_host_topology_compiles_from_one_process(compiled):
    _, target, mesh, _ = compiled
    hosts = {d.process_index for d in mesh.devices.flat}
    assert len(hosts) == target.hosts == 4


def test_splash_is_in_the_score_program(compiled):
    _, _, _, results = compiled
    for kind in ("score", "reference", "gradient", "prefill"):
        assert all(r.kernels > 0 for r in results if r.program.kind == kind), kind
    assert all(r.kernels == 0 for r in results if r.program.kind in ("segment", "apply", "init"))


def test_memory_is_below_the_planners_bound(compiled):
    """Each program's bytes per chip, without its machine code, are below the planner's peak for the slice (the
    compiled state is the planner's persistent part, the rest is bounded by its larger phase)."""
    cfg, target, _, results = compiled
    p = P.plan(cfg, TINY, target.chips)
    for r in results:
        assert r.total - r.code <= p.peak * 1.25, (r.program.name, r.total - r.code, p.peak)
    assert max(r.total for r in results) < 0.01 * target.hbm_bytes


# ------------------------------------------------------------------------------------------ targets
@pytest.mark.parametrize("name,topology,chips,hosts,hbm", [
    ("v4-8", "v4:2x2x1", 4, 1, 32), ("v4-16", "v4:2x2x2", 8, 2, 32), ("v5p-8", "v5p:2x2x1", 4, 1, 95),
    ("v5p-128", "v5p:4x4x4", 64, 16, 95), ("v5litepod-1", "v5e:1x1", 1, 1, 16), ("v5litepod-8", "v5e:2x4", 8, 1, 16),
    ("v5e-16", "v5e:4x4", 16, 4, 16), ("v5litepod-256", "v5e:16x16", 256, 64, 16), ("v6e-8", "v6e:2x4", 8, 1, 32),
    ("v6e-32", "v6e:4x8", 32, 8, 32),
])
def test_accelerator_types_map_to_topologies(name, topology, chips, hosts, hbm):
    t = parse_target(name)
    assert (t.topology, t.chips, t.hosts, t.hbm_bytes) == (topology, chips, hosts, hbm * GiB)


def test_topology_grows_like_the_cloud_tpu_shapes():
    assert [tpu_shape(c, 3) for c in (4, 8, 16, 32, 64, 128, 256)] == [
        (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8)]
    assert [tpu_shape(c, 2) for c in (1, 4, 8, 16, 32, 64, 128)] == [
        (1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)]


def test_multi_host_devices_carry_their_host():
    devices = parse_target("v5p-16").devices()
    assert len(devices) == 8 and {d.process_index for d in devices} == {0, 1}
    assert {d.platform for d in devices} == {"tpu"}


@pytest.mark.parametrize("name,message", [("v9-8", "unknown target 'v9-8'; accepted: tpu: v4-N"),
                                          ("v5p-7", "power-of-two slices"), ("v5litepod-24", "power-of-two")])
def test_bad_target_names_say_what_is_accepted(name, message):
    with pytest.raises(TargetError, match=message):
        parse_target(name)


def test_cli_errors_are_one_line(tmp_path, capsys):
    args = ["--config", "configs/demo.yaml", f"run.output_dir={tmp_path}/run"]
    assert P.main([*args, "--target", "v9-8", "--compile"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    with pytest.raises(SystemExit):
        P.main([*args, "--compile"])
    assert "--compile needs --target" in capsys.readouterr().err


def test_without_libtpu_one_line_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_libtpu(name, *a, **kw):
        if name == "libtpu":
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_libtpu)
    target = parse_target("v6e-4")
    with pytest.raises(TargetError, match=r'pip install "g2rl_jax\[tpu\]"'):
        target.make_devices()


def test_a_mesh_axis_may_split_a_torus_side():
    """fsdp 16 x tensor 2 on v6e-32's 4x8 chips: no side is 16, so the mesh splits one (jax.make_mesh alone fails)."""
    from g2rl_jax import parallel
    from g2rl_jax.config import MeshConfig

    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=16, tensor=2), parse_target("v6e-32").devices())
    assert dict(mesh.shape) == {"data": 1, "fsdp": 16, "tensor": 2}
    assert len({d.id for d in mesh.devices.flat}) == 32


def test_lora_step_compiles_with_adapter_only_optimizer_state(tmp_path):
    """model.lora: the step's programs compile for v5e:2x2 with the adapters; the optimizer state the compiler
    lays out is the adapters' (two moments each), and the step fits."""
    from g2rl_jax import parallel
    from g2rl_jax.model import lora

    target = parse_target("v5litepod-4")
    cfg = _cfg(tmp_path, ["algorithm.micro_batch_size=4", "model.lora.rank=8"])
    mesh = parallel.make_mesh(cfg.mesh, target.devices())
    progs = programs_lib.step_programs(cfg, TINY, mesh, scope="largest")
    results = report_lib.compile_programs(progs)
    assert [r.program.name for r in results if r.error] == []
    _, params = programs_lib.abstract_policy(TINY, None, mesh, programs_lib.lora_policy(
        TINY, programs_lib.setup.runtime_config(cfg.model), mesh, cfg.model))
    adapters, base = lora.split_trainable(params)
    full_moments = 2 * programs_lib.per_chip_bytes(programs_lib.Abstract(mesh).like(base, "float32"))
    init = next(r for r in results if r.program.kind == "init")
    # two moments per adapter, laid out in the chip's tiles (a rank of 8 pads up), far below a full fine-tune's
    assert 2 * programs_lib.per_chip_bytes(adapters) <= init.output <= 0.1 * full_moments, (init.output, full_moments)
    assert check_lib.verdict(cfg, TINY, target, results)[0]
