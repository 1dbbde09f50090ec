"""`plan --compile` with algorithm.packing (aot/packed.py): the step's score, reference and gradient programs are the
packed ones the warm-up compiles (passes.score_micro, ref_micro, accumulate at each (rows, width) of the run's
PackShape, as many of each kind as aot/bill.packed_counts, which tests/test_program_count.py checks against a real
run), none of the length-grouped ones, and the largest of each kind lowers and compiles on CPU (8 fake devices)."""
import json

import jax
import pytest

from g2rl_jax import parallel
from g2rl_jax.aot import bill
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.config import load_config
from g2rl_jax.model.config import Qwen3Config
from g2rl_jax.shapes.layouts import PackShape
from g2rl_jax.shapes.step import step_shapes

TINY = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
# the shipped 1.7B config (algorithm.packing: true) at a tiny size: 8 rows a step, 2 batch shards (mesh data=2)
SMALL = ["data.prompts_per_step=2", "rollout.num_samples=4", "rollout.max_new_tokens=32", "data.max_prompt_tokens=32",
         "algorithm.micro_batch_size=4", "model.compute_dtype=float32", "model.attention=xla", "mesh.data=2",
         "mesh.fsdp=1", "mesh.tensor=1"]
PASSES = ("score", "reference", "gradient")
FUNCTIONS = {"score": "score_micro", "reference": "ref_micro", "gradient": "accumulate"}  # train/passes.py's


def _setup(tmp_path, overrides=()):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", [f"model.path={tmp_path}", f"run.output_dir={tmp_path / 'run'}",
                                                        *SMALL, *overrides])
    assert cfg.algorithm.packing, "the shipped config packs"
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:2])
    return cfg, mesh, step_shapes(cfg, mesh)


def _warmup_layout(cfg, s) -> PackShape:
    """The finest packed layout of these shapes (micro-batch rows, the batch's row shards, the largest prompt bucket +
    the response budget): what `plan --compile` lists, every packed shape a run's choice can take."""
    return PackShape.of(cfg.algorithm.micro_batch_size, s.shards, prompt_len=s.prompt_len, resp_len=s.new_tokens)


@pytest.mark.parametrize("method,overrides", [
    ("g2rl", ["algorithm.mini_batch_size=4"]),  # KL on: the reference pass too; two updates a step
    ("clip_cov", ["algorithm.exploration=clip_cov", "algorithm.kl_coef=0", "algorithm.mini_batch_size=4"]),
])
def test_the_listed_passes_are_the_packed_programs_the_warmup_compiles(tmp_path, method, overrides):
    cfg, mesh, s = _setup(tmp_path, overrides)
    progs = programs_lib.step_programs(cfg, TINY, mesh, scope="all")
    passes = [p for p in progs if p.kind in PASSES]
    counts = {k: sum(p.kind == k for p in passes) for k in PASSES}
    assert counts == bill.packed_counts(cfg, _warmup_layout(cfg, s), s.step_rows), [p.name for p in passes]
    micros = _warmup_layout(cfg, s).micros
    for kind in (k for k in PASSES if counts[k]):  # no reference pass without the KL term
        shapes = [p.shape for p in passes if p.kind == kind]
        assert set(shapes) == set(micros) and len(shapes) % len(micros) == 0, (kind, shapes, micros)
    assert all(p.name.startswith("packed ") for p in passes)
    assert counts["reference"] == (cfg.algorithm.kl_coef > 0) * len(micros)
    if method == "clip_cov":  # the current policy's pass over a mini-batch's rows, beside the step's
        assert sum(p.kind == "score" and p.phase == "update" for p in passes) == len(micros)


def test_the_largest_packed_programs_lower_and_compile(tmp_path):
    cfg, mesh, s = _setup(tmp_path, ["algorithm.mini_batch_size=4"])
    progs = programs_lib.step_programs(cfg, TINY, mesh, scope="largest")
    passes = [p for p in progs if p.kind in PASSES]
    widest = _warmup_layout(cfg, s).micros[0]
    assert [(p.kind, p.shape) for p in passes] == [("score", widest), ("reference", widest), ("gradient", widest)]
    for p in passes:
        lowered = p.lower()
        assert f"@jit_{FUNCTIONS[p.kind]} " in lowered.as_text()[:2000], p.name  # the packed pass's own program
        args = {jax.tree_util.keystr(k): a.shape for k, a in jax.tree_util.tree_leaves_with_path(lowered.args_info)}
        segments = [shape for k, shape in args.items() if k.endswith(".segments_RxW")]  # a passes.PackedMicro's
        assert segments == [widest], (p.name, args)
        lowered.compile()
