"""The `reward` config group end to end, with the real verifier and real worker processes: truncation policies,
DAPO's overlong penalty (against a float64 NumPy transcription), custom reward functions from a real user file
(values, clipping, raising, non-numbers, time-outs, on_error), their config checks, and dataset rows that keep
every field."""
import json
import textwrap

import numpy as np
import pytest

from g2rl_jax import config as C
from g2rl_jax.control.errors import RewardFunctionFailed
from g2rl_jax.data import load_dataset
from g2rl_jax.rewards.custom import custom_rewards, resolve_spec
from g2rl_jax.rewards.scoring import compute_rewards, overlong_penalty, truncated_mask

STOP = 0


def _cfg(**kw) -> C.RewardConfig:
    return C.RewardConfig(**kw)


# -- overlong penalty and truncation ------------------------------------------------------------------------------

def _dapo_reference(length: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, written out case by case in float64."""
    if buffer == 0 or length <= budget - buffer:
        return 0.0
    if length <= budget:
        return penalty * float(np.float64(budget - buffer - length) / np.float64(buffer))
    return -penalty


@pytest.mark.parametrize("budget, buffer, penalty", [(16, 4, 1.0), (8, 8, 0.5), (100, 1, 2.0), (10, 0, 1.0),
                                                      (4096, 1024, 1.0)])
def test_overlong_penalty_matches_float64_reference(budget, buffer, penalty):
    lengths = np.arange(0, budget + 1)
    want = np.array([_dapo_reference(int(n), budget, buffer, penalty) for n in lengths])
    got = overlong_penalty(lengths, budget, buffer, penalty)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[-1] == pytest.approx(-penalty if buffer else 0.0)


def test_truncated_means_full_budget_without_a_stop_token():
    ids = [[5, 6, 7, 8], [5, 6, 7, STOP], [5, STOP], [5, 6], [], [9, 9, 9, 9, 9]]
    np.testing.assert_array_equal(truncated_mask(ids, 4, (STOP,)), [True, False, False, False, False, True])


TEXTS = [r"\boxed{85}9}}", r"\boxed{85}", r"\boxed{84}7", r"\boxed{84}"]  # truncated, stopped, truncated, stopped
COMPLETIONS = [[1] * 6, [1] * 3 + [STOP], [1] * 6, [1] * 2 + [STOP]]
ROWS = [{"id": "p", "answer": "85"}] * 4


@pytest.mark.parametrize("policy, rewards, correct, in_loss", [
    ("keep", [1, 1, -1, -1], [1, 1, 0, 0], [1, 1, 1, 1]),
    ("penalize", [-1, 1, -1, -1], [0, 1, 0, 0], [1, 1, 1, 1]),
    ("mask", [1, 1, -1, -1], [1, 1, 0, 0], [0, 1, 0, 1]),
])
def test_truncation_policies(policy, rewards, correct, in_loss):
    out = compute_rewards(TEXTS, ROWS, COMPLETIONS, _cfg(truncated=policy), kind="math", max_new_tokens=6,
                          stop_ids=(STOP,))
    np.testing.assert_array_equal(out.rewards, rewards)
    np.testing.assert_array_equal(out.correct, np.array(correct, bool))
    np.testing.assert_array_equal(out.in_loss, np.array(in_loss, bool))
    np.testing.assert_array_equal(out.truncated, [True, False, True, False])


def test_overlong_penalty_is_added_after_the_policy():
    out = compute_rewards(TEXTS, ROWS, COMPLETIONS, _cfg(truncated="penalize", overlong_buffer=4, overlong_penalty=0.5),
                          kind="math", max_new_tokens=6, stop_ids=(STOP,))
    lengths = [6, 4, 6, 3]
    base = [-1, 1, -1, -1]
    want = [b + _dapo_reference(n, 6, 4, 0.5) for b, n in zip(base, lengths)]
    np.testing.assert_allclose(out.rewards, want, rtol=1e-6)
    np.testing.assert_array_equal(out.correct, [False, True, False, False])  # correctness ignores the penalty


# -- custom reward functions ---------------------------------------------------------------------------------------

USER_FILE = textwrap.dedent('''
    import time

    def length_reward(response, example):
        """+1 for a response as long as the row asks, scaled down otherwise; 5.0 to test the clip."""
        if response == "huge":
            return 5.0
        return 1.0 if len(response) == example["want_len"] else -0.5

    def raises(response, example):
        raise KeyError("no such field")

    def not_a_number(response, example):
        return "good"

    def sleeps(response, example):
        time.sleep(30)
        return 1.0
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_custom_function_values_are_clipped(user_file):
    rows = [{"id": "a", "want_len": 3}, {"id": "b", "want_len": 3}, {"id": "c", "want_len": 1}]
    got = custom_rewards(f"{user_file}:length_reward", ["abc", "huge", "xy"], rows, timeout=10.0, on_error="raise")
    np.testing.assert_array_equal(got, [1.0, 1.0, -0.5])


@pytest.mark.parametrize("name, why", [("raises", "raised KeyError"), ("not_a_number", "not a number"),
                                       ("sleeps", "timed out after 1.0s")])
def test_custom_function_failures(user_file, name, why):
    spec = f"{user_file}:{name}"
    rows = [{"id": "row-7", "want_len": 1}]
    with pytest.raises(RewardFunctionFailed) as err:
        custom_rewards(spec, ["x"], rows, timeout=1.0, on_error="raise")
    assert spec in str(err.value) and "row-7" in str(err.value) and why in str(err.value)
    assert "reward.on_error=fail" in str(err.value) and err.value.code == 5 and err.value.row == "row-7"
    np.testing.assert_array_equal(custom_rewards(spec, ["x"], rows, timeout=1.0, on_error="fail"), [-1.0])


def test_custom_function_through_compute_rewards_gets_the_whole_row(user_file, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"problem": "say hi", "answer": "hi", "want_len": 2, "meta": {"k": 1}}) + "\n")
    (example,) = load_dataset(str(data))
    row = example.as_row()
    assert row["want_len"] == 2 and row["meta"] == {"k": 1} and row["answer"] == "hi" and row["id"] == example.id
    cfg = _cfg(function=resolve_spec(f"{user_file}:length_reward"), truncated="keep")
    out = compute_rewards(["hi", "hey"], [row, row], [[1, STOP], [1, 1, STOP]], cfg, kind="math",
                          max_new_tokens=8, stop_ids=(STOP,))
    np.testing.assert_array_equal(out.rewards, [1.0, -0.5])
    np.testing.assert_array_equal(out.correct, [True, False])


def test_reward_config_checks(user_file, tmp_path):
    base = {"run.output_dir": ("x", "test"), "model.path": ("m", "test")}

    def build(**kw):
        return C.build_config(base | {f"reward.{k}": (v, "test") for k, v in kw.items()})
    assert build(function=f"{user_file}:length_reward").reward.function.endswith("length_reward")
    with pytest.raises(C.ConfigError, match="reward.function.*does not exist"):
        build(function=str(tmp_path / "missing.py") + ":fn")
    with pytest.raises(C.ConfigError, match="reward.function.*expected 'package.module:function'"):
        build(function="no_colon")
    with pytest.raises(C.ConfigError, match="reward.overlong_buffer.*must be < rollout.max_new_tokens"):
        build(overlong_buffer=8192)
    with pytest.raises(C.ConfigError, match="reward.truncated.*keep, penalize, mask"):
        build(truncated="drop")
    with pytest.raises(C.ConfigError, match="reward.timeout"):
        build(timeout=0)
    text = C.format_help()
    for key in ("reward.truncated", "reward.overlong_buffer", "reward.overlong_penalty", "reward.function",
                "reward.on_error", "reward.timeout"):
        assert key in text
