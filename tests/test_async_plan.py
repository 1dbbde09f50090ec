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
