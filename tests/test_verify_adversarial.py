"""Adversarial answers: each scores -1 within its time bound, nothing is executed, and the bound holds from a
thread and from inside a (daemonic) multiprocessing child."""
import multiprocessing
import os
import threading
import time

import pytest

from g2rl_jax.rewards import is_equivalent, math_reward, score_batch

BOUND_S = 2.0
SLACK_S = 1.5  # pipe round trip, killing the worker, a loaded shared machine

ADVERSARIAL = [
    r"10^{10^{10^{10}}}",
    r"9^{9^{9^{9}}}",
    r"\underbrace{(x+1)}^{10^{12}}",
    "(a+b+c+d+1)^{60}",  # legal, but expanding it against the gold takes far longer than the bound
    "{" * 10_000 + "1" + "}" * 10_000,
    "{" * 4_000 + "1" + "}" * 4_000,
    "(" * 3_000 + "1" + ")" * 3_000,
    "1" * 1_000_000,
    "9" * 5_000 + "!",
    "1000000!",
    r"\binom{10^{9}}{5000}",
    "__import__('os').system('touch {marker}')",
    "exec(\"open('{marker}','w')\")",
    "eval('__import__(\"os\").system(\"touch {marker}\")')",
    r"\text{__import__('os').system('touch {marker}')}",
    "lambda: open('{marker}', 'w')",
]


def _warm():
    """Make sure an idle worker exists: a worker killed by the previous timeout is replaced lazily, and its start-up
    (importing sympy) is not part of any check's bound."""
    assert is_equivalent("x+x", "2x")


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield str(path)
    assert not os.path.exists(path), "an answer string was executed"


@pytest.mark.parametrize("answer", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_answer_scores_minus_one_within_bound(answer, marker):
    answer = answer.replace("{marker}", marker)
    gold = "(a+b+c+d+2)^{60}" if answer.startswith("(a+b") else "1"
    _warm()
    start = time.monotonic()
    reward = math_reward(rf"The answer is \boxed{{{answer}}}", gold)
    elapsed = time.monotonic() - start
    assert reward == -1.0
    assert elapsed < BOUND_S + SLACK_S, f"{elapsed:.2f}s for {answer[:40]!r}"


def test_one_megabyte_response_is_fast():
    start = time.monotonic()
    assert math_reward("x" * 1_000_000 + r" \boxed{3}", "3") == 1.0
    assert math_reward("$" * 500_000 + r"\(" * 100_000, "3") == -1.0
    assert time.monotonic() - start < BOUND_S


def test_timeout_is_honoured_and_pool_recovers():
    _warm()
    start = time.monotonic()
    assert not is_equivalent("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}", timeout=0.5)
    assert time.monotonic() - start < 0.5 + SLACK_S
    assert is_equivalent(r"\sqrt{8}", r"2\sqrt{2}")  # a fresh worker replaces the killed one


def test_batch_with_pathological_answers_keeps_order():
    responses = [r"\boxed{(a+b+c+d+1)^{60}}", r"\boxed{\sqrt{8}}", r"\boxed{10^{10^{10^{10}}}}", r"\boxed{2}"]
    golds = ["(a+b+c+d+2)^{60}", r"2\sqrt{2}", "1", "2"]
    score_batch([r"\boxed{x+x}"] * 2, ["2x"] * 2, num_workers=2)  # two idle workers
    start = time.monotonic()
    got = score_batch(responses, golds, timeout=1.0, num_workers=2)
    assert got.tolist() == [-1.0, 1.0, -1.0, 1.0]
    assert time.monotonic() - start < 1.0 + SLACK_S


def test_bound_from_a_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(
        (is_equivalent("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}", timeout=0.5), is_equivalent("x+x", "2x"))))
    _warm()
    start = time.monotonic()
    thread.start()
    thread.join(timeout=30)
    assert out == [(False, True)]
    assert time.monotonic() - start < 0.5 + 2 * SLACK_S


def _child_check(queue):
    start = time.monotonic()
    slow = is_equivalent("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}", timeout=0.5)
    queue.put((slow, is_equivalent("x+x", "2x"), time.monotonic() - start))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_bound_inside_daemonic_child_process(method):
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_check, args=(queue,), daemon=True)
    proc.start()
    slow, fast, elapsed = queue.get(timeout=120)
    proc.join(timeout=30)
    assert (slow, fast) == (False, True)
    assert elapsed < 0.5 + SLACK_S + 60  # includes starting a worker (imports sympy) inside the child
