"""The planner and the TPU compiler on a split run (mesh.rollout_devices > 0, g2rl_jax/aot/sides.py): each side's
config, the step-time model (serial sum for k = 0, the slower side for k >= 1, naming it), a bad split in one
line, and both sides of a tiny config compiled for v5litepod-4 (2 + 2 chips) with the real TPU compiler."""
import dataclasses
import types

import pytest

from g2rl_jax.aot import parse_target, sides
from g2rl_jax.aot.report import step_time_estimate
from g2rl_jax.config import load_config
from g2rl_jax.memory import PlanError
from g2rl_jax.model.config import Qwen3Config
from g2rl_jax.rollout import batching

TINY = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                   tie_word_embeddings=True)
BASE = ["data.prompts_per_step=4", "rollout.num_samples=4", "rollout.max_new_tokens=16", "data.max_prompt_tokens=128",
        "algorithm.mini_batch_size=16", "algorithm.micro_batch_size=8", "model.compute_dtype=bfloat16",
        "model.attention=auto", "mesh.rollout_devices=2", "algorithm.rollout_is_cap=2.0"]


def _cfg(tmp_path, *overrides):
    return load_config("configs/qwen3_1p7b_g2rl.yaml", [f"model.path={tmp_path}", f"run.output_dir={tmp_path}/run",
                                                        *BASE, *overrides])


def test_side_configs(tmp_path):
    cfg = _cfg(tmp_path, "rollout.max_staleness=1")
    train, train_chips, roll, roll_chips = sides.side_configs(cfg, chips=16, hosts=4)
    assert (train_chips, roll_chips) == (8, 2)
    assert train.mesh.rollout_devices == 0 and train.data.prompts_per_step == 4
    assert (roll.mesh.data, roll.mesh.fsdp, roll.mesh.tensor) == (2, 1, 1) and roll.data.prompts_per_step == 1
    with pytest.raises(PlanError, match="mesh.rollout_devices=4 leaves no training chip") as err:
        sides.side_configs(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rollout_devices=4)), 16, 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("k", [0, 1])
def test_step_time_model(tmp_path, k):
    cfg = _cfg(tmp_path, f"rollout.max_staleness={k}")
    target = parse_target("v5litepod-4")
    t = sides.step_seconds(cfg, TINY, target)
    train, tc, roll, rc = sides.side_configs(cfg, target.chips, target.hosts)
    shapes = types.SimpleNamespace(step_rows=4 * 4, prompt_len=batching.bucket(128, batching.MIN_PROMPT_BUCKET),
                                   new_tokens=batching.new_tokens_bucket(16))
    passes, decode = step_time_estimate(train, TINY, shapes, target)
    assert t["colocated"] == pytest.approx(passes + decode)
    assert t["training"] == pytest.approx(passes * target.chips / tc)  # the same passes on fewer chips
    want = t["rollout"] + t["training"] if k == 0 else max(t["rollout"], t["training"])
    assert t["split"] == pytest.approx(want)
    limiting = "rollout" if t["rollout"] >= t["training"] else "training"
    assert f"the {limiting} side limits it" in sides.step_lines(cfg, TINY, target)[0]


def test_both_sides_compile_for_v5litepod_4(tmp_path):
    pytest.importorskip("libtpu", reason="the test extra pins libtpu; install it: pip install -e '.[test]'")
    from g2rl_jax.aot.check import check

    cfg = _cfg(tmp_path, "rollout.max_staleness=1")
    # one program per side (the whole step of each: docs/async.md has the LoRA config's on the same slice)
    fits, text = check(cfg, TINY, parse_target("v5litepod-4"), "largest", progress=lambda line: None,
                       only=("decode segment", "score"))
    assert fits, text
    assert "rollout side, 2 chips, mesh {'data': 2, 'fsdp': 1, 'tensor': 1}:" in text
    assert "training side, 2 chips, mesh {'data': 1, 'fsdp': 2, 'tensor': 1}:" in text
    assert "rollout side FITS" in text and "training side FITS" in text and "side limits it" in text
    assert "decode segment" in text and "score" in text and "gradient" not in text


def test_the_weight_syncs_gathered_copy_is_what_the_compiler_allocates(tmp_path):
    """memory.trainable_bytes, the whole version the planner counts on every training chip while it is pushed,
    against XLA's memory analysis of the sync's own all-gather (weight_sync._gather_to) over the trainable params
    as the trainer shards them (fsdp over 4 CPU devices): the compiled outputs per device sum to it, and to the
    hand count of the parameters in float32."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from g2rl_jax import parallel
    from g2rl_jax.aot.programs import abstract_policy
    from g2rl_jax.config import MeshConfig
    from g2rl_jax.memory import trainable_bytes
    from g2rl_jax.model import lora
    from g2rl_jax.train.setup import runtime_config
    from g2rl_jax.train.weight_sync import _gather_to

    cfg = _cfg(tmp_path)
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    _, params = abstract_policy(TINY, runtime_config(cfg.model), mesh)
    whole = NamedSharding(mesh, PartitionSpec())
    leaves = jax.tree.leaves(lora.trainable(params))
    assert sum(not leaf.sharding.is_fully_replicated for leaf in leaves) >= 4  # the matrices are split: it gathers
    gathered = sum(_gather_to(whole).lower(leaf).compile().memory_analysis().output_size_in_bytes for leaf in leaves)
    assert gathered == trainable_bytes(cfg, TINY) == 4 * TINY.num_params()


@pytest.mark.parametrize("k", [0, 2])
def test_the_planner_counts_the_weight_sync(tmp_path, k):
    """The training side's peak per chip holds the weight sync's bytes (a hand count, W the whole float32 params):
    one process set per side (SideSync) keeps the k versions the rollout has not acknowledged while it updates and
    gathers one more whole copy on every training chip while it pushes; the rollout side takes a version whole on
    its first chip. With mesh.rollout_devices the copy is gathered only when the training mesh spans hosts."""
    from g2rl_jax.plan import plan

    W = 4 * TINY.num_params()
    cfg = _cfg(tmp_path, "mesh.rollout_devices=0", "mesh.rollout_processes=1", f"rollout.max_staleness={k}",
               "data.prompts_per_step=8")
    train, tc, roll, rc = sides.side_configs(cfg, chips=8, hosts=2)  # v5p-16: 2 hosts of 4 chips
    assert (tc, rc, roll.data.prompts_per_step, roll.mesh.data) == (4, 4, 8, 4)
    tp, rp = plan(train, TINY, tc, "tpu"), plan(roll, TINY, rc, "tpu")
    b = sides.side_bytes(cfg, TINY, 8, 2, "tpu")
    assert b["training"] == tp.persistent + k * W + max(tp.update_phase, W)
    assert b["sync"] == b["training"] - tp.persistent - tp.update_phase >= k * W
    in_flight = rp.optimizer // 2 if k else 0
    assert b["rollout"] == rp.params + in_flight + max(rp.rollout_phase, W)
    assert ("the weight sync's" in "\n".join(sides.plan_lines(cfg, TINY, 8, 2, "tpu"))) == (b["sync"] > 0) == (k > 0)
    devices = _cfg(tmp_path, "rollout.max_staleness=1", "mesh.rollout_devices=4")  # 4 per host
    one_host, two_hosts = sides.side_bytes(devices, TINY, 8, 1, "tpu"), sides.side_bytes(devices, TINY, 16, 2, "tpu")
    train1 = plan(sides.side_configs(devices, 8, 1)[0], TINY, 4, "tpu")
    assert one_host["training"] == train1.persistent + train1.update_phase and one_host["sync"] == 0
    train2 = plan(sides.side_configs(devices, 16, 2)[0], TINY, 8, "tpu")
    assert two_hosts["training"] == train2.persistent + max(train2.update_phase, W)
