"""g2rl_jax.plan: the analytic memory plan against hand counts, XLA's compiled memory analysis of the real
`train.update.update` on CPU (within 25%), the mesh errors, and the CLI."""
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax import memory as M
from g2rl_jax import parallel
from g2rl_jax import plan as P
from g2rl_jax.config import load_config
from g2rl_jax.model import lora
from g2rl_jax.model.config import PRESETS, Qwen3Config
from g2rl_jax.model.qwen3 import Qwen3
from g2rl_jax.train import optim as train_optim
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update
from g2rl_jax.train.setup import runtime_config

from _helpers import create_sharded

PAPER_1P7B = "configs/qwen3_1p7b_g2rl.yaml"


def _config(tmp_path, model: Qwen3Config, overrides=(), path=PAPER_1P7B):
    (tmp_path / "config.json").write_text(json.dumps(model.to_hf_dict()))
    return load_config(path, [f"model.path={tmp_path}", f"run.output_dir={tmp_path / 'run'}", *overrides])


def test_params_and_kv_cache_match_hand_counts(tmp_path):
    model = PRESETS["qwen3-1.7b"]
    cfg = _config(tmp_path, model)
    one = P.plan(cfg, model, 1)
    assert one.params == model.num_params() * 4 and one.optimizer == 2 * one.params
    assert one.reference == one.params and one.gradients == one.params * 2  # f32 accumulator + f32 micro grads
    # 8-way fsdp: everything with an embed axis splits 8 ways; q_norm/k_norm [layers, head_dim] stay replicated.
    eight = P.plan(cfg, model, 8)
    replicated = 2 * model.num_hidden_layers * model.head_dim
    assert eight.params == ((model.num_params() - replicated) // 8 + replicated) * 4
    # KV cache: 28 layers x (16 prompts x 1024 + 256 samples x 8192) x 8 kv heads x 128 x (k, v) x bf16, over 8
    rows = 16 * 1024 + 16 * 16 * 8192
    assert eight.kv_cache == 28 * rows * 8 * 128 * 2 * 2 // 8
    no_kl = P.plan(_config(tmp_path, model, ["algorithm.kl_coef=0"]), model, 8)
    assert no_kl.reference == 0 and no_kl.peak == eight.peak - eight.reference


def test_4b_plan_buckets_the_12k_budget_and_has_no_reference_without_kl(tmp_path):
    model = PRESETS["qwen3-4b"]
    cfg = _config(tmp_path, model, path="configs/qwen3_4b_g2rl.yaml")
    p = P.plan(cfg, model, 8)
    assert any("T=12288" in n for n in p.notes)  # 12288 new tokens: a multiple of 1,024 keeps its own size
    assert p.kv_cache == 36 * (16 * 1024 + 256 * 12288) * 8 * 128 * 2 * 2 // 8


@pytest.mark.parametrize("devices,overrides,message", [
    (8, ["mesh.data=3"], "the fixed axes multiply to 3, which does not divide the 8 devices"),
    (8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=3"], "needs 12 devices, but there are 8"),
    (6, ["mesh.tensor=3", "mesh.fsdp=-1"], "heads = 16 is not divisible by mesh axes ('tensor',) of size 3"),
    (16, ["mesh.tensor=16", "mesh.fsdp=-1"], "kv_heads = 8 is not divisible by mesh axes ('tensor',) of size 16"),
])
def test_bad_mesh_names_both_numbers(tmp_path, devices, overrides, message):
    model = PRESETS["qwen3-1.7b"]
    with pytest.raises(P.PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        P.plan(_config(tmp_path, model, overrides), model, devices)


def test_fits_picks_the_smallest_slice(tmp_path):
    model = PRESETS["qwen3-1.7b"]
    cfg = _config(tmp_path, model, ["model.attention=splash"])
    verdicts = P.fits(cfg, model)
    assert sum(chips is not None for _, chips, _ in verdicts) >= 3, "the paper's 1.7B setup should fit somewhere"
    for acc, chips, p in verdicts:
        limit = P.USABLE_FRACTION * acc.hbm_gib * P.GiB
        assert chips is None or p.peak <= limit, acc.name
        smaller = [c for c in acc.chips if chips is None or c < chips]
        for c in smaller:  # on every smaller slice (every slice, when none fits) no mesh tried holds the peak
            for candidate in P.slice_meshes(cfg, c):
                try:
                    assert P.plan(candidate, model, c, acc.platform).peak > limit, (acc.name, c, candidate.mesh)
                except P.PlanError:
                    pass


def test_cli_prints_table_and_verdicts(tmp_path, capsys):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"base: {(pathlib.Path(PAPER_1P7B)).resolve()}\nrun:\n  output_dir: {tmp_path / 'run'}\n")
    assert P.main(["--config", str(cfg_path), "--preset", "qwen3-1.7b", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    for needle in ("params", "rollout KV cache", "activations", "PEAK", "v5e", "v5p", "v6e", "H100", "H200"):
        assert needle in out
    assert P.main(["--config", str(cfg_path), "--preset", "qwen3-1.7b", "mesh.tensor=3", "mesh.fsdp=-1",
                   "--devices", "6"]) == 2
    assert "heads = 16 is not divisible" in capsys.readouterr().err
    assert P.main(["--config", str(cfg_path), "--preset", "nope"]) == 2


def test_cli_plans_the_demo_policy_without_building_it(tmp_path, capsys):
    from g2rl_jax.demo.build import PolicySpec
    from g2rl_jax.demo.tokenizer import make_tokenizer

    target = tmp_path / "model"
    assert P.main(["--config", "configs/demo.yaml", f"run.output_dir={tmp_path / 'run'}",
                   f"model.path=demo:{target}", "--devices", "1"]) == 0
    out = capsys.readouterr().out
    want = PolicySpec().qwen3_config(len(make_tokenizer()))
    assert f"model: demo policy (demo:{target})" in out and f"D={want.hidden_size}" in out
    assert not target.exists(), "planning must not build the demo model"


# ------------------------------------------------------------------------------------------ against XLA
_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32)
_STEP = ["algorithm.mini_batch_size=16", "algorithm.micro_batch_size=8", "data.prompts_per_step=2",
         "rollout.num_samples=8", "model.compute_dtype=float32", "model.kv_cache_dtype=float32",
         "model.attention=xla"]
XLA_CASES = {
    # params/optimizer and the chunked logits matter: short sequences, one device
    "short-1dev": (1, dict(_TINY, num_hidden_layers=2, tie_word_embeddings=True),
                   ["data.max_prompt_tokens=16", "rollout.max_new_tokens=48", *_STEP]),
    # attention scores dominate (xla backend, L = 576), one device
    "long-1dev": (1, dict(_TINY, vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16,
                          num_hidden_layers=2, tie_word_embeddings=True),
                  ["data.max_prompt_tokens=64", "rollout.max_new_tokens=448", *_STEP]),
    # 8 devices, data 4 x tensor 2 (heads, mlp, vocab split), untied head, 3 layers
    "data4-tensor2": (8, dict(_TINY, num_hidden_layers=3, tie_word_embeddings=False),
                      ["data.max_prompt_tokens=32", "rollout.max_new_tokens=224", *_STEP,
                       "algorithm.mini_batch_size=32", "algorithm.micro_batch_size=16", "data.prompts_per_step=4",
                       "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2"]),
    # LoRA: adapters with the only gradients and AdamW moments, no reference copy; the base in the compute dtype
    # (float32 here, as XLA:CPU computes; a bfloat16 base would add a float32 copy of the head per decode step)
    "lora-data4-tensor2": (8, dict(_TINY, num_hidden_layers=3, tie_word_embeddings=False),
                           ["data.max_prompt_tokens=32", "rollout.max_new_tokens=224", *_STEP,
                            "algorithm.mini_batch_size=32", "algorithm.micro_batch_size=16", "data.prompts_per_step=4",
                            "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2", "model.lora.rank=8",
                            "model.lora.base_dtype=float32"]),
}


def _sharded_model(cfg, model: Qwen3Config, devices: int):
    """(mesh sizes, mesh, graphdef, params) of a randomly initialised model placed as the plan assumes."""
    sizes = M.resolve_mesh(cfg, devices)
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:devices])
    runtime = runtime_config(cfg.model)  # with LoRA, param_dtype is the base's (model.lora.base_dtype)
    module = create_sharded(lambda: Qwen3(model, runtime, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    spec = lora.LoraSpec.from_config(cfg.model.lora)
    if spec is not None:
        lora.attach(module, spec, dtype=cfg.model.param_dtype, seed=0, mesh=mesh)
    return (sizes, mesh, *nnx.split(module))


def _xla_update_bytes(cfg, model: Qwen3Config, devices: int) -> int:
    """Per-device bytes XLA assigns to the compiled update: arguments + outputs − donated aliases + temporaries."""
    sizes, mesh, graphdef, params = _sharded_model(cfg, model, devices)
    optimizer = train_optim.make_optimizer(cfg.optim, 10)
    opt_state = train_optim.init_optimizer(optimizer, lora.trainable(params))
    _, _, s, t = M.kv_cache_bytes(cfg, model, sizes)
    rows = cfg.algorithm.mini_batch_size

    def put(shape, dtype):
        return jax.device_put(jnp.zeros(shape, dtype), parallel.batch_sharding(mesh, ndim=len(shape)))

    batch = train_step.Batch(input_ids=put((rows, s + t), jnp.int32), attention_mask=put((rows, s + t), jnp.int32),
                             response_mask=put((rows, t), jnp.float32), rewards=put((rows,), jnp.float32),
                             correct=put((rows,), jnp.bool_), group_size=cfg.rollout.num_samples)
    mini = train_step.MiniBatch(batch, old_logp_BxT=put((rows, t), jnp.float32),
                                ref_logp_BxT=put((rows, t), jnp.float32), advantages_B=put((rows,), jnp.float32))
    settings = train_update.LossSettings.from_config(cfg.algorithm, cfg.rollout.temperature)
    micro = cfg.algorithm.micro_batch_size
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding),
                         lora.trainable(params))
    # of the widest micro-batch (the whole response width T), sliced abstractly: no slicing program compiled
    diag = jax.eval_shape(lambda: train_update.policy_loss(params, graphdef, jax.tree.map(lambda x: x[:micro], mini),
                                                           settings)[1])
    loss = jax.ShapeDtypeStruct((), jnp.float32)
    accumulate = train_update.accumulate.lower(graphdef, params, (grads, loss, diag), mini,  # rows taken inside
                                               np.arange(micro, dtype=np.int32), settings=settings, total_rows=rows,
                                               width=t).compile()
    apply = train_update.apply_gradients.lower(params, opt_state, grads, loss, diag, optimizer=optimizer).compile()

    def used(compiled) -> int:
        st = compiled.memory_analysis()
        return st.argument_size_in_bytes + st.output_size_in_bytes - st.alias_size_in_bytes + st.temp_size_in_bytes

    opt_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(opt_state))
    return max(used(accumulate) + opt_bytes, used(apply))  # the optimizer state stays live while gradients add up


@pytest.mark.parametrize("case", list(XLA_CASES))
def test_update_estimate_within_25_percent_of_xla(tmp_path, case):
    """compute_dtype float32: XLA:CPU upcasts bfloat16 matmuls to float32, which TPUs and GPUs do not."""
    devices, model_kwargs, overrides = XLA_CASES[case]
    model = Qwen3Config(rope_theta=10000.0, max_position_embeddings=1024, **model_kwargs)
    cfg = _config(tmp_path, model, overrides)
    p = P.plan(cfg, model, devices)
    estimate = p.params + p.optimizer + p.update_phase  # what the compiled update holds (no reference model)
    measured = _xla_update_bytes(cfg, model, devices)
    assert abs(estimate / measured - 1) <= 0.25, (case, estimate, measured, estimate / measured)


def _xla_rollout_bytes(cfg, model: Qwen3Config, devices: int) -> int:
    """Per-device bytes of the sampler's compiled prefill, of a decode segment at the full batch (arguments +
    outputs − donated aliases + temporaries) and of the first compaction (its first layer's move, with the other
    layers' caches, the parameters, the decode weights and the decode state beside it), the largest: the rollout
    phase's peak with the parameters."""
    from g2rl_jax.aot import programs
    from g2rl_jax.rollout import engine
    from g2rl_jax.rollout.sampling import spec_for

    sizes, mesh, graphdef, state = _sharded_model(cfg, model, devices)
    _, p, s, t = M.kv_cache_bytes(cfg, model, sizes)
    m, G, L = cfg.rollout.num_samples, model.num_key_value_heads, model.num_hidden_layers
    ids = jax.device_put(jnp.ones((p, s), jnp.int32), engine.batch_sharding(mesh, 2))
    mask = jax.device_put(jnp.ones((p, s), bool), engine.batch_sharding(mesh, 2))
    spec, stops = spec_for(1.0, 1.0, 0, model.vocab_size), jnp.full((1,), -1, jnp.int32)
    key, one = jax.random.key(0), jnp.float32(1.0)

    def used(compiled) -> int:
        st = compiled.memory_analysis()
        return st.argument_size_in_bytes + st.output_size_in_bytes - st.alias_size_in_bytes + st.temp_size_in_bytes

    with jax.set_mesh(mesh):
        prefill = engine.prefill_fn(mesh, G, L).lower(graphdef, state, ids, mask, num_samples=m, capacity=t)
        # the segment's inputs abstract, placed as the programs that make them return them (their outputs pinned,
        # the decode weights as aot.programs.decode_layers places them): two programs compiled, not five
        logits, prefix, suffix = engine.prefill_fn(mesh, G, L).lower(graphdef, state, ids, mask, num_samples=m,
                                                                     capacity=t).out_info
        ds = engine.start_fn(mesh).lower(logits, key, one, one, stops, jnp.int32(p * m), num_samples=m,
                                         new_tokens=t, spec=spec).out_info
        layers = programs.decode_layers(graphdef, state, mesh)
        segment = engine.segment_fn(mesh, G, L).lower(graphdef, state, layers, prefix, suffix, ds, jnp.int32(1),
                                                      jnp.int32(t), jnp.int32(-1), key, one, one, stops, spec=spec,
                                                      reads=engine.read_ladder(t))
        half = engine.batch_buckets(p * m, engine.batch_shards(mesh), cfg.rollout.max_new_tokens)[1]
        rows_X = jax.ShapeDtypeStruct((half,), jnp.int32, sharding=engine.batch_sharding(mesh, 1))
        move = engine.regroup_fn(mesh, G).lower(prefix.k[0], prefix.v[0], suffix.k[0], suffix.v[0], rows_X, rows_X,
                                                jnp.int32(t))
        local = lambda tree: sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # noqa: E731
                                 for x in jax.tree.leaves(tree))
        beside = local((prefix.k[1:], prefix.v[1:], suffix.k[1:], suffix.v[1:], state, layers, ds))
        mv = move.compile()
        return max(used(prefill.compile()), used(segment.compile()), used(mv) + beside)


@pytest.mark.parametrize("case", list(XLA_CASES))
def test_rollout_estimate_within_25_percent_of_xla(tmp_path, case):
    """The rollout phase (params + KV cache + sampler temporaries), which sets the peak of the paper's setups."""
    devices, model_kwargs, overrides = XLA_CASES[case]
    model = Qwen3Config(rope_theta=10000.0, max_position_embeddings=1024, **model_kwargs)
    cfg = _config(tmp_path, model, overrides)
    p = P.plan(cfg, model, devices)
    estimate = p.params + p.rollout_phase
    measured = _xla_rollout_bytes(cfg, model, devices)
    assert abs(estimate / measured - 1) <= 0.25, (case, estimate, measured, estimate / measured)
