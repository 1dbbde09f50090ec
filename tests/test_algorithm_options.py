"""Algorithm options in the training loop: DAPO dynamic sampling (group choice, merging rounds, resume
determinism), truncated importance weights against the sampler, the sequence-level ratio, single-class groups.

The equations themselves are checked against float64 NumPy in test_losses.py and test_g2rl.py; here they run
inside real Trainer steps on the tiny random Qwen3 of test_train.py.
"""
import pathlib

import numpy as np
import pytest
from test_train import assets, config  # noqa: F401 - the module-scoped tiny-model fixture and its config

from g2rl_jax.config import ConfigError, format_help, load_config
from g2rl_jax.rollout import generate
from g2rl_jax.train import dynamic
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics

STEPS = 3
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, message", [
    ("algorithm.dynamic_sampling=true", "needs algorithm.filter_equal_groups=true"),
    ("algorithm.rollout_is_cap=0.5", "must be >= 1 or null"),
    ("algorithm.ratio_level=response", "choose one of token, sequence"),
    ("algorithm.single_class_groups=drop", "choose one of shaped, zero"),
    ("algorithm.max_sampling_rounds=0", "must be >= 1"),
    ("algorithm.embedding_max_tokens=1", "must be >= 2"),
    ("run.loggers=tensorboard", "must include jsonl"),
    ("run.loggers=jsonl,mlflow", "unknown logger"),
])
def test_new_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml", [override])


def test_help_and_configs_name_the_new_keys():
    text = format_help()
    for key in ("ratio_level", "rollout_is_cap", "dynamic_sampling", "max_sampling_rounds", "single_class_groups",
                "embedding_max_tokens", "run.loggers"):
        assert key in text
    assert "paper: low_var_kl" not in text and "paper: same as training" not in text  # the paper says neither
    other = load_config(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml", ["algorithm.mini_batch_size=16"])
    responses = other.data.prompts_per_step * other.rollout.num_samples
    assert responses // other.algorithm.mini_batch_size == 16  # the other reading: 1 prompt x 16 per update
    for mode in ("grpo", "entropy_bonus", "evol", "g2rl"):
        cfg = load_config(ROOT / "configs" / f"qwen3_4b_{mode}.yaml")
        assert (cfg.algorithm.exploration, cfg.rollout.max_new_tokens, cfg.model.path) == (
            mode, 12288, "Qwen/Qwen3-4B-Base")


def np_choose(mixed_per_round, blocks, block):
    """Plain-Python transcription: walk rounds then groups of this block; mixed first, then single-class."""
    share = len(mixed_per_round[0]) // blocks
    rows = range(block * share, (block + 1) * share)
    mixed, single = [], []
    for r, mask in enumerate(mixed_per_round):
        for k, g in enumerate(rows):
            (mixed if mask[g] else single).append((r, k))
    return (mixed + single)[:share]


def test_choose_groups_matches_python_and_every_block_agrees():
    rng = np.random.default_rng(0)
    for blocks in (1, 2, 4):
        rounds = [rng.uniform(size=8) < 0.3 for _ in range(3)]
        for block in range(blocks):
            assert dynamic.choose_groups(rounds, blocks, block) == np_choose(rounds, blocks, block)
        per_block = [sum(int(m[b * 8 // blocks:(b + 1) * 8 // blocks].sum()) for m in rounds) for b in range(blocks)]
        assert dynamic.enough(rounds, blocks) == all(n >= 8 // blocks for n in per_block)
    correct = np.array([1, 0, 1, 1, 0, 0, 1, 1], bool)  # groups of 2: mixed, all right, all wrong, all right
    np.testing.assert_array_equal(dynamic.mixed_groups(correct, 2), [True, False, False, False])


def test_merge_rollouts_keeps_each_picked_row(assets):  # noqa: F811
    """Rounds of different widths merge into one Rollout whose rows equal the picked rows, re-padded."""
    from g2rl_jax.model import load_pretrained

    model = load_pretrained(assets["policy"], "float32")
    short = generate(model, [[5, 6], [7, 8, 9]], max_new_tokens=3, num_samples=2, seed=1)
    long = generate(model, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [4]], max_new_tokens=9, num_samples=2, seed=2)
    merged = dynamic.merge_rollouts([short, long], [(1, 0), (0, 1)])
    picked = [(long, 0), (long, 1), (short, 2), (short, 3)]
    assert merged.prompt_ids_BxS.shape[1] == max(short.prompt_ids_BxS.shape[1], long.prompt_ids_BxS.shape[1])
    assert merged.completion_ids_BxT.shape[1] == max(short.completion_ids_BxT.shape[1],
                                                     long.completion_ids_BxT.shape[1])
    for row, (src, b) in enumerate(picked):
        prompt = src.prompt_ids_BxS[b][src.prompt_mask_BxS[b].astype(bool)]
        assert merged.prompt_ids_BxS[row][merged.prompt_mask_BxS[row].astype(bool)].tolist() == prompt.tolist()
        assert merged.prompt_mask_BxS[row, -1] == 1  # still left-padded
        n = src.completion_lengths[b]
        assert merged.completion_ids[row] == src.completion_ids[b] == merged.completion_ids_BxT[row, :n].tolist()
        np.testing.assert_array_equal(merged.logprobs_BxT[row, :n], src.logprobs_BxT[b, :n])
        assert not merged.completion_mask_BxT[row, n:].any() and merged.completion_mask_BxT[row, :n].all()


EVEN_LENGTH_REWARD = """
def reward(response, example):
    # correct iff the response has even length: mixed outcomes on a random policy, deterministic
    return 1.0 if len(response) % 2 == 0 else -1.0
"""


OPTIONS = {"algorithm.filter_equal_groups": True, "algorithm.dynamic_sampling": True,
           "algorithm.max_sampling_rounds": 3, "algorithm.rollout_is_cap": 2.0, "algorithm.ratio_level": "sequence",
           "algorithm.single_class_groups": "zero", "algorithm.loss_agg": "seq-mean-token-mean"}


@pytest.fixture(scope="module")
def options_run(assets, tmp_path_factory):  # noqa: F811
    """One uninterrupted run with every option on, a reward with mixed groups, and what it logged."""
    root = tmp_path_factory.mktemp("options")
    (root / "even_length.py").write_text(EVEN_LENGTH_REWARD)  # a user's reward file, through reward.function
    options = dict(OPTIONS, **{"reward.function": f"{root / 'even_length.py'}:reward", "reward.truncated": "keep"})
    out = root / "run"
    trainer = Trainer(config(assets, out, steps=STEPS, **options))
    trainer.resume()
    trainer.run()
    yield {"records": read_metrics(out), "options": options}


def test_options_log_their_metrics(options_run):
    records = options_run["records"]
    assert any(r["single_class_fraction"] < 1 for r in records), "no mixed group was ever chosen: a weak test"
    for r in records:
        assert 1 <= r["sampling_rounds"] <= 3 and 0 <= r["sampled_accuracy"] <= 1
        assert 0 <= r["single_class_fraction"] <= 1 and r["groups_kept"] == 1 - r["single_class_fraction"]
        assert 0 <= r["rollout_is_capped_frac"] <= 1 and 0 < r["rollout_is_weight_mean"] <= 2.0
        # float32 sampler and trainer on the same weights: the weights are 1 up to rounding
        assert abs(r["rollout_is_weight_mean"] - 1) < 1e-3 and r["rollout_is_capped_frac"] == 0
        assert np.isfinite(r["loss"]) and r["skipped_updates"] == 0


def test_dynamic_sampling_resume_equals_uninterrupted(assets, tmp_path, options_run):  # noqa: F811
    part = Trainer(config(assets, tmp_path / "part", steps=STEPS, **options_run["options"]))
    part.resume()
    part.run(stop_after=2)
    again = Trainer(config(assets, tmp_path / "part", steps=STEPS, **options_run["options"]))
    assert again.resume() == 2
    again.run()
    resumed, straight = read_metrics(tmp_path / "part"), options_run["records"]
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [1, 2, 3]
    for a, b in zip(resumed, straight):
        for key in ("sampling_rounds", "sampled_accuracy", "accuracy", "reward", "loss", "single_class_fraction",
                    "rollout_is_weight_mean", "response_length", "grad_norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-6, err_msg=f"step {a['step']}: {key}")
