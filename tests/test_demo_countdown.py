"""The exploration demo's Countdown task: parser, canonical answers, the user-style reward, the problem set."""
from __future__ import annotations

import ast
import itertools
import random
from fractions import Fraction

import numpy as np
import pytest

from g2rl_jax.data import load_dataset
from g2rl_jax.demo import countdown as cd
from g2rl_jax.demo.explore_eval import measure

PROBLEM = {"problem": "Use 3 5 7 8 to make 22", "answer": "22", "numbers": [3, 5, 7, 8], "target": 22}


def reference_value(text: str) -> Fraction:
    """Independent evaluation: Python's own parser (test only), integer division made exact."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b}
        return ops[type(node.op)](ev(node.left), ev(node.right))
    return ev(ast.parse(text, mode="eval"))


def random_expression(rng: random.Random, depth: int = 3) -> str:
    if depth == 0 or rng.random() < 0.3:
        return str(rng.randint(1, 9))
    left, right = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    text = f"{left}{rng.choice('+-*/')}{right}"
    return f"({text})" if rng.random() < 0.5 else text


def test_parser_and_printer_agree_with_python_arithmetic():
    rng = random.Random(0)
    for _ in range(500):
        text = random_expression(rng)
        try:
            want = reference_value(text)
        except ZeroDivisionError:
            assert cd.value(cd.parse(text)) is None
            continue
        tree = cd.parse(text)
        assert cd.value(tree) == want, text
        assert reference_value(cd.render(tree)) == want, (text, cd.render(tree))
        assert cd.canonical(cd.parse(cd.render(tree))) == cd.canonical(tree)  # same answer (a*(b*c) -> a*b*c)


@pytest.mark.parametrize("bad", ["", "3+", "(3+5", "3+5)", "3 5", "-3+5", "3**5", "3+x", "3^2", "()", "3//5"])
def test_parser_rejects_malformed_expressions(bad):
    with pytest.raises(cd.ParseError):
        cd.parse(bad)


def test_canonical_merges_reorderings_only():
    same = ["3*5+7", "7+5*3", "(5*3)+7", "7+(3*5)"]
    assert len({cd.canonical(cd.parse(s)) for s in same}) == 1
    assert cd.canonical(cd.parse("8-(5-3)")) == cd.canonical(cd.parse("8+3-5"))
    assert cd.canonical(cd.parse("8/(4/2)")) == cd.canonical(cd.parse("8*2/4"))
    different = ["3*5+7", "3*(5+7)", "8-5+3", "8-(5+3)", "8/4", "4/8"]
    assert len({cd.canonical(cd.parse(s)) for s in different}) == len(different)


@pytest.mark.parametrize("response,want", [
    ("\\boxed{3*5+7}", 1.0), ("  \\boxed{7+5*3}\n", 1.0), ("\\boxed{(8-7+5)*3+...}", -1.0),
    ("\\boxed{3 * 5 + 7}", 1.0), ("\\boxed{8*3-7+5}", 1.0), ("\\boxed{(8-3)*5-7+...}", -1.0),
    ("\\boxed{3*5+7}9", -1.0), ("\\boxed{3*5+7}}", -1.0), ("The answer is \\boxed{3*5+7}", -1.0),
    ("\\boxed{3*5+7+7}", -1.0),  # 7 used twice
    ("\\boxed{22}", -1.0), ("\\boxed{15+7}", -1.0),  # numbers not given
    ("\\boxed{3*5+7", -1.0), ("\\boxed{__import__('os')}", -1.0), ("\\boxed{" + "1+" * 40 + "1}", -1.0),
])
def test_reward(response, want):
    assert cd.reward(response, PROBLEM) == want


def test_reward_does_not_use_eval(monkeypatch):
    import builtins

    def refuse(*a, **k):
        raise AssertionError("eval/exec called")
    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert cd.reward("\\boxed{3*5+7}", PROBLEM) == 1.0


@pytest.fixture(scope="module")
def splits():
    return cd.examples("train"), cd.examples("test")


def test_problems_have_many_distinct_verified_answers(splits):
    train, test = splits
    assert len(test) == cd.TEST_SIZE and not {e.problem for e in train} & {e.problem for e in test}
    assert load_dataset("countdown_test") == test
    for ex in test[:40]:
        numbers, target = ex.row["numbers"], ex.row["target"]
        assert ex.problem == cd.problem_text(numbers, target) and ex.as_row()["numbers"] == numbers
        answers = cd.solutions(tuple(numbers), target)
        assert len(answers) >= cd.MIN_SOLUTIONS and ex.answer == str(target)
        for key, expression in answers.items():
            assert reference_value(expression) == target
            assert cd.canonical(cd.parse(expression)) == key
            assert cd.reward(f"\\boxed{{{expression}}}", ex.as_row()) == 1.0


def test_solutions_are_complete_on_a_small_problem():
    """Brute force over every fully parenthesised expression of 2-4 of the numbers finds the same answers."""
    numbers, target = (1, 2, 3, 4), 10
    found = set()

    def exprs(items):
        if len(items) == 1:
            yield str(items[0])
            return
        for i in range(1, len(items)):
            for a, b, op in itertools.product(exprs(items[:i]), exprs(items[i:]), "+-*/"):
                yield f"({a}{op}{b})"
    for size in (2, 3, 4):
        for chosen in itertools.permutations(numbers, size):
            for text in exprs(chosen):
                try:
                    if reference_value(text) == target:
                        found.add(cd.canonical(cd.parse(text)))
                except ZeroDivisionError:
                    pass
    assert found == set(cd.solutions(numbers, target))


def test_teacher_gives_right_then_wrong_answers(splits):
    ex = splits[0][0]
    responses = cd.teacher_responses(ex, random.Random(0))
    k = cd.TEACHER_VARIANTS
    assert [cd.reward(r, ex.as_row()) for r in responses] == [1.0] * k + [-1.0] * k
    assert len(set(responses)) == 2 * k


def test_explore_measures():
    texts = [["\\boxed{3*5+7}", "\\boxed{7+3*5}", "\\boxed{8*3-7+5}", "junk"], ["x", "y", "z", "w"]]
    out = measure(texts, [PROBLEM] * 2, np.array([[0, 0, 0, 1], [0, 0, 0, 0]], bool))
    assert out["pass@1"] == pytest.approx((3 / 4 + 0) / 2) and out["pass@k"] == 0.5
    assert out["distinct@k"] == pytest.approx((2 + 0) / 2) and out["truncated_fraction"] == pytest.approx(1 / 8)


def test_study_config_plugs_the_reward_into_the_worker_path(splits):
    """configs/study_countdown.yaml loads, and its reward.function scores through the bounded worker processes."""
    import pathlib

    from g2rl_jax.config import load_config
    from g2rl_jax.rewards.custom import custom_rewards

    cfg = load_config(pathlib.Path(__file__).resolve().parents[1] / "configs" / "study_countdown.yaml",
                      ["run.output_dir=x", "model.path=x"])
    assert cfg.reward.function == "g2rl_jax.demo.countdown:reward" and cfg.data.train_dataset == "countdown_study"
    ex = splits[1][0]
    right = f"\\boxed{{{next(iter(cd.solutions(tuple(ex.row['numbers']), ex.row['target']).values()))}}}"
    got = custom_rewards(cfg.reward.function, [right, right + "9", "\\boxed{1+1+1+1+1}"], [ex.as_row()] * 3,
                         timeout=cfg.reward.timeout, on_error="raise")
    np.testing.assert_array_equal(np.asarray(got, np.float64), [1.0, -1.0, -1.0])
