"""analyze: pairwise cosines and geometry stats against float64 transcriptions and hand-computed values; the
trainer-checkpoint restore (load_policy, real Orbax via the training Checkpointer); the CLI end to end on tiny
models (a HF dir and a run dir compared; greedy duplicates give gradient and semantic cosine 1)."""
import json
import math
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax import analyze
from g2rl_jax.analyze import geometry_stats, histogram, pairwise_cosines
from g2rl_jax.train.checkpoint import load_policy

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import make_tiny_qwen3_dir  # noqa: E402

TINY = dict(vocab_size=176, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ pure functions
def test_pairwise_cosines_match_a_float64_loop():
    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float32)
    got = pairwise_cosines(x)
    assert got.shape == (3, 10) and got.dtype == np.float64
    for g in range(3):
        want = [sum(float(a) * float(b) for a, b in zip(x[g, i], x[g, j]))
                / (math.sqrt(sum(float(a) ** 2 for a in x[g, i])) * math.sqrt(sum(float(b) ** 2 for b in x[g, j])))
                for i in range(5) for j in range(i + 1, 5)]  # row-major upper triangle
        np.testing.assert_allclose(got[g], want, rtol=0, atol=1e-12)
    assert np.all(got >= -1.0) and np.all(got <= 1.0)


def test_identical_responses_give_cosine_one_and_opposite_minus_one():
    v = np.random.default_rng(1).standard_normal(64)
    x = np.stack([v, v, 3.5 * v, -v])[None]
    # pairs (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
    np.testing.assert_allclose(pairwise_cosines(x)[0], [1, 1, -1, 1, -1, -1], rtol=0, atol=1e-14)


def test_cosines_stay_in_range_for_nearly_parallel_vectors():
    v = np.full(4096, 1e3, np.float32)
    x = np.stack([v, v * (1 + 1e-7), -v])[None]
    c = pairwise_cosines(x)
    assert np.all(np.abs(c) <= 1.0)
    np.testing.assert_allclose(c[0], [1, -1, -1], atol=1e-12)


@pytest.mark.parametrize("bad", [0.0, np.nan])
def test_directionless_feature_is_an_error(bad):
    x = np.ones((2, 3, 4))
    x[1, 2] = bad
    with pytest.raises(ValueError, match="group 1, response 2"):
        pairwise_cosines(x)


def test_single_response_groups_are_an_error():
    with pytest.raises(ValueError, match="m >= 2"):
        pairwise_cosines(np.ones((4, 1, 3)))


def test_geometry_stats_match_hand_computed_values():
    x = np.array([[[1, 0], [0, 1], [-1, 0]],  # cosines (0,1)=0, (0,2)=-1, (1,2)=0
                  [[1, 0], [1, 1], [2, 0]]],  # cosines 1/√2, 1, 1/√2
                 np.float64)
    cos = pairwise_cosines(x)
    np.testing.assert_allclose(cos, [[0, -1, 0], [2**-0.5, 1, 2**-0.5]], atol=1e-15)
    sem = np.array([[0.5, 0.25, 1.0], [-0.5, 0.0, 0.75]])
    stats = geometry_stats(cos, sem, bins=4)  # bins [-1,-.5) [-.5,0) [0,.5) [.5,1]
    assert stats["pairs"] == 6
    assert stats["negative_pair_ratio"] == pytest.approx(1 / 6, abs=1e-15)  # 0 is not negative
    assert stats["gradient_cosine_mean"] == pytest.approx(math.sqrt(2) / 6, abs=1e-15)
    assert stats["gradient_cosine_std"] == pytest.approx(np.std([0, -1, 0, 2**-0.5, 1, 2**-0.5]), abs=1e-15)
    assert stats["semantic_cosine_mean"] == pytest.approx(2.0 / 6, abs=1e-15)
    assert stats["gradient_cosine_histogram"] == {"edges": [-1.0, -0.5, 0.0, 0.5, 1.0], "counts": [1, 0, 2, 3]}
    assert stats["semantic_cosine_histogram"]["counts"] == [0, 1, 2, 3]
    no_sem = geometry_stats(cos, bins=4)
    assert no_sem["semantic_cosine_mean"] is None and no_sem["semantic_cosine_histogram"] is None
    json.dumps(stats)  # plain JSON types only


def test_geometry_stats_rejects_mismatched_pairs():
    with pytest.raises(ValueError, match="same response pairs"):
        geometry_stats(np.zeros((2, 3)), np.zeros((2, 1)))


def test_histogram_counts_both_ends_and_ignores_nothing():
    h = histogram([-1.0, -0.2, 0.0, 0.999, 1.0], bins=2)
    assert h == {"edges": [-1.0, 0.0, 1.0], "counts": [2, 3]}


# ------------------------------------------------------------------------------------------------ tiny models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny policy and a tiny Qwen3Model encoder (both with the demo's BPE tokenizer), a run dir whose
    checkpoint holds perturbed params, and a jsonl of demo problems."""
    import transformers

    from g2rl_jax.config import Config, DataConfig, ModelConfig, OptimConfig, RunConfig, save_resolved
    from g2rl_jax.demo.task import examples
    from g2rl_jax.demo.tokenizer import make_tokenizer
    from g2rl_jax.model import load_pretrained
    from g2rl_jax.train import optim as train_optim
    from g2rl_jax.train.checkpoint import Checkpointer

    root = tmp_path_factory.mktemp("analyze")
    tokenizer = make_tokenizer()
    policy_dir = make_tiny_qwen3_dir(root / "policy", **TINY)
    tokenizer.save_pretrained(policy_dir)
    embed_dir = root / "embedder"
    transformers.Qwen3Model(transformers.Qwen3Config(**{**TINY, "tie_word_embeddings": True},
                                                     max_position_embeddings=256)).save_pretrained(embed_dir)
    tokenizer.save_pretrained(embed_dir)
    data = root / "demo.jsonl"
    data.write_text("".join(json.dumps({"id": e.id, "problem": e.problem, "answer": e.answer}) + "\n"
                            for e in examples("test")[:3]))

    run_dir = root / "run_g2rl"
    cfg = Config(run=RunConfig(output_dir=str(run_dir)), model=ModelConfig(path=str(policy_dir)),
                 data=DataConfig(prompt_template="plain"))
    save_resolved(cfg, run_dir)
    graphdef, params = nnx.split(load_pretrained(policy_dir, "float32"))
    trained = jax.tree.map(lambda p: p + 0.01 * jnp.cos(jnp.arange(p.size, dtype=p.dtype).reshape(p.shape)), params)
    optimizer = train_optim.make_optimizer(OptimConfig(), total_updates=10)
    ckpt = Checkpointer(run_dir, every=1, keep=2)
    for step, p in ((1, params), (3, trained)):
        state = {"params": p, "opt_state": optimizer.init(p), "step": jnp.int32(step),
                 "rng": jax.random.key_data(jax.random.key(0))}
        ckpt.save(step, state, _NoIterator())
    ckpt.close()
    return {"policy": policy_dir, "embedder": embed_dir, "data": data, "run": run_dir, "params": params,
            "trained": trained, "root": root}


class _NoIterator:
    def get_state(self):
        return {"position": 0}


def _assert_params_equal(model, want):
    got = nnx.split(model)[1]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)


def test_load_policy_restores_the_newest_or_the_named_checkpoint(tiny):
    model, tokenizer_dir = load_policy(tiny["run"])
    assert tokenizer_dir == tiny["policy"]
    _assert_params_equal(model, tiny["trained"])  # newest: step 3
    model, _ = load_policy(tiny["run"] / "checkpoints" / "1")
    _assert_params_equal(model, tiny["params"])


def test_load_policy_errors_name_the_path(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a run directory"):
        load_policy(tmp_path)
    moved = tmp_path / "run"  # a run whose base model dir is gone
    shutil.copytree(tiny["run"] / "checkpoints" / "3", moved / "checkpoints" / "3")
    (moved / "config.yaml").write_text((tiny["run"] / "config.yaml").read_text()
                                       .replace(str(tiny["policy"]), str(tmp_path / "gone")))
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face model directory"):
        load_policy(moved)
    bare = tmp_path / "bare"  # checkpoints without the run's config.yaml
    shutil.copytree(tiny["run"] / "checkpoints" / "1", bare / "checkpoints" / "1")
    with pytest.raises(FileNotFoundError, match="config.yaml not found"):
        load_policy(bare)


def test_cli_compares_a_model_dir_and_a_checkpoint(tiny):
    """Greedy sampling makes every response of a group identical, so both cosines must be 1 for every pair
    (Φ from train.step.score on the 8-device mesh, embeddings from the trainer's encoder path)."""
    import matplotlib.image

    out = tiny["root"] / "out"
    rc = analyze.main(["--model-path", str(tiny["policy"]), "--checkpoint", str(tiny["run"]),
                       "--dataset", "demo", "--problems", "2", "--samples", "4", "--temperature", "0",
                       "--max-new-tokens", "8", "--batch-size", "2", "--micro-batch", "4", "--template", "plain",
                       "--embedding-model", str(tiny["embedder"]), "--bins", "10", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "analysis.json").read_text())
    assert list(result["models"]) == ["policy", "run_g2rl"]
    assert len(result["settings"]["problem_ids"]) == 2
    for stats in result["models"].values():
        assert stats["pairs"] == 2 * 6
        # identical rows give identical features; float64 cosines of equal vectors are 1 up to ~1e-16
        assert stats["gradient_cosine_mean"] == pytest.approx(1.0, abs=1e-12)
        assert stats["semantic_cosine_mean"] == pytest.approx(1.0, abs=1e-12)
        assert stats["negative_pair_ratio"] == 0.0
        assert stats["gradient_cosine_histogram"]["counts"] == [0] * 9 + [12]
        assert stats["semantic_cosine_histogram"]["counts"] == [0] * 9 + [12]
    assert (out / "geometry.png").read_bytes()[:8] == PNG_MAGIC
    assert matplotlib.image.imread(out / "geometry.png").ndim == 3


def test_cli_argument_errors(capsys):
    with pytest.raises(SystemExit):
        analyze.parse_args(["--dataset", "aime25"])
    assert "at least one --model-path or --checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        analyze.parse_args(["--model-path", "a", "--label", "x", "--label", "y"])
    with pytest.raises(SystemExit):
        analyze.parse_args(["--model-path", "a", "--samples", "1"])
    with pytest.raises(ValueError, match="share a label"):
        analyze.model_sources(analyze.parse_args(["--model-path", "x/m", "--model-path", "y/m"]))


def test_models_keep_command_line_order_and_labels(tiny):
    args = analyze.parse_args(["--checkpoint", str(tiny["run"] / "checkpoints" / "1"), "--model-path",
                               str(tiny["policy"]), "--checkpoint", str(tiny["run"])])
    assert [(s.kind, s.label) for s in analyze.model_sources(args)] == [
        ("checkpoint", "run_g2rl@1"), ("model", "policy"), ("checkpoint", "run_g2rl")]
    args = analyze.parse_args(["--checkpoint", str(tiny["run"]), "--model-path", "m", "--label", "G2RL",
                               "--label", "base"])
    assert [s.label for s in analyze.model_sources(args)] == ["G2RL", "base"]


# ------------------------------------------------------------------------------------------ export (uses load_policy)
def test_export_writes_a_dir_transformers_loads_with_the_trained_weights(tiny, tmp_path):
    import torch
    import transformers

    from g2rl_jax import export

    out = tmp_path / "hf"
    assert export.main(["--checkpoint", str(tiny["run"]), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert transformers.AutoTokenizer.from_pretrained(out).encode("12+34") == \
        transformers.AutoTokenizer.from_pretrained(tiny["policy"]).encode("12+34")
    ids = np.array([[5, 9, 17, 3, 40, 2]])
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    from g2rl_jax.model import load_pretrained

    exported = load_pretrained(out, "float32")
    _assert_params_equal(exported, tiny["trained"])  # the newest checkpoint's params, bit for bit
    got = np.asarray(exported(jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny["policy"], dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.abs(base(torch.tensor(ids)).logits.numpy() - want).max() > 1e-3  # the trained weights, not the base


def test_export_refuses_a_non_empty_out_dir(tiny, tmp_path, capsys):
    from g2rl_jax import export

    (tmp_path / "keep.txt").write_text("mine")
    assert export.main(["--checkpoint", str(tiny["run"]), "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_eval_accepts_a_training_checkpoint(tiny, tmp_path):
    from g2rl_jax import eval as ev

    out = tmp_path / "eval"
    code = ev.main(["--checkpoint", str(tiny["run"]), "--datasets", str(tiny["data"]), "--samples", "2",
                    "--temperature", "1.0", "--max-new-tokens", "4", "--template", "plain", "--out", str(out),
                    "--batch-size", "4"])
    assert code in (0, 1)  # 1 only when no metric could be computed
    files = list((out / "records").glob("*.jsonl"))
    assert [f.name[:6] for f in files] == ["step3-"]  # the run's newest checkpoint, resolved at the start
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(records) == 3 and all(len(r["correct"]) == 2 for r in records)
    # an older (or, after more training, a newer) checkpoint is evaluated again, never served the old records
    ev.main(["--checkpoint", str(tiny["run"] / "checkpoints" / "1"), "--datasets", str(tiny["data"]), "--samples",
             "2", "--temperature", "1.0", "--max-new-tokens", "4", "--template", "plain", "--out", str(out),
             "--batch-size", "4"])
    assert sorted(f.name[:6] for f in (out / "records").glob("*.jsonl")) == ["step1-", "step3-"]
    assert json.loads((out / "results.json").read_text())["settings"]["checkpoint_step"] == 1


def test_cli_defaults_come_from_the_run(tiny, tmp_path, capsys):
    """--checkpoint RUN: unset sampling flags take the run's config.yaml values (analyze: rollout.*, the T that
    Φ was scored at in training; eval: data.eval_*, data.prompt_template and data.max_prompt_tokens); flags still
    override."""
    import dataclasses

    from g2rl_jax import eval as ev
    from g2rl_jax.config import load_config, save_resolved

    cfg = load_config(tiny["run"] / "config.yaml")
    other = tmp_path / "other_run"
    save_resolved(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=32, temperature=0.7),
                                      data=dataclasses.replace(cfg.data, eval_max_new_tokens=24, eval_temperature=0.3,
                                                               prompt_template="plain", max_prompt_tokens=77)), other)
    shutil.copytree(tiny["run"] / "checkpoints", other / "checkpoints")
    args = analyze.parse_args(["--checkpoint", str(other)])
    assert (args.temperature, args.max_new_tokens) == (0.7, 32)
    args = analyze.parse_args(["--checkpoint", str(other), "--temperature", "0", "--max-new-tokens", "5"])
    assert (args.temperature, args.max_new_tokens) == (0.0, 5)
    args = analyze.parse_args(["--model-path", "m"])  # no run: the old defaults
    assert (args.temperature, args.max_new_tokens) == (1.0, 8192)
    with pytest.raises(SystemExit):  # two runs that disagree need the flag
        analyze.parse_args(["--checkpoint", str(other), "--checkpoint", str(tiny["run"])])
    assert "disagree on --temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        analyze.parse_args(["--checkpoint", str(other), "--checkpoint", str(tiny["run"]), "--temperature", "1"])
    assert "disagree on --max-new-tokens" in capsys.readouterr().err
    args = analyze.parse_args(["--checkpoint", str(other), "--checkpoint", str(tiny["run"]), "--max-new-tokens", "8",
                               "--temperature", "1", "--label", "a", "--label", "b"])
    assert args.max_new_tokens == 8
    args = ev.parse_args(["--checkpoint", str(other / "checkpoints" / "1")])
    assert (args.temperature, args.max_new_tokens, args.template, args.max_prompt_tokens) == (0.3, 24, "plain", 77)
    args = ev.parse_args(["--checkpoint", str(other), "--template", "chat", "--temperature", "1",
                          "--max-prompt-tokens", "5"])
    assert (args.temperature, args.max_new_tokens, args.template, args.max_prompt_tokens) == (1.0, 24, "chat", 5)
    with pytest.raises(SystemExit):
        ev.parse_args(["--checkpoint", str(tmp_path / "nothing")])
    assert "neither a run directory" in capsys.readouterr().err
