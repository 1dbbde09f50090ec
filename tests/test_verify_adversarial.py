"""Adversarial answers: each scores -1 within its time bound, nothing is executed, and the bound holds from a
thread and from inside a (daemonic) multiprocessing child; a killed worker is reaped and the next check gets a fresh
fork of the same template, a killed template is restarted, and a template that cannot start scores -1 with one
warning (an error only when none can ever start)."""
import logging
import multiprocessing
import os
import sys
import threading
import time

import pytest

import g2rl_jax.rewards as rewards
from g2rl_jax.rewards import bounded, is_equivalent, math_reward, score_batch

BOUND_S = 2.0
SLACK_S = 1.5  # pipe round trip, killing the worker, a loaded shared machine (worker start-up is never timed)
SLOW = ("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}")  # legal; expanding it takes far longer than any bound here

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
    """Make sure the pool's template has started (importing sympy is not part of any check's bound)."""
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

    def run():
        start = time.monotonic()
        slow = is_equivalent(*SLOW, timeout=0.5)
        elapsed = time.monotonic() - start
        out.append((slow, elapsed, is_equivalent("x+x", "2x")))  # untimed: may wait for the replacement to start

    thread = threading.Thread(target=run)
    _warm()
    thread.start()
    thread.join(timeout=150)
    assert len(out) == 1, "the thread did not finish"
    slow, elapsed, fast = out[0]
    assert (slow, fast) == (False, True)
    assert elapsed < 0.5 + SLACK_S, f"{elapsed:.2f}s for a 0.5s bound"


def _child_check(queue):
    warm = is_equivalent("x+x", "2x")  # untimed: starts this process's first worker (imports sympy)
    start = time.monotonic()
    slow = is_equivalent(*SLOW, timeout=0.5)
    elapsed = time.monotonic() - start
    queue.put((warm, slow, elapsed, is_equivalent(r"\sqrt{8}", r"2\sqrt{2}")))  # the replacement answers


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_bound_inside_daemonic_child_process(method):
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_check, args=(queue,), daemon=True)
    proc.start()
    warm, slow, elapsed, fast = queue.get(timeout=300)  # a child and two workers start: sympy imports, twice
    proc.join(timeout=30)
    assert (warm, slow, fast) == (True, False, True)
    assert elapsed < 0.5 + SLACK_S, f"{elapsed:.2f}s for a 0.5s bound in a {method} child"


# -- worker replacement and start failures ----------------------------------------------------------------------

@pytest.fixture
def pool():
    """A private one-worker pool, so these tests see exactly which worker serves which check."""
    p = bounded.BoundedPool(1)
    yield p
    p.close()


def _gone(pid: int) -> bool:
    """No such process, not even a zombie: it was killed and reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_worker_is_reaped_and_the_next_check_gets_a_fresh_fork(pool):
    assert pool.check("x+x", "2x", BOUND_S)
    (first,) = pool._all
    template = pool._template.proc.pid
    assert not pool.check(*SLOW, 0.5)
    assert first.killed and first not in pool._all, "the worker that ran over its bound was not killed"
    deadline = time.monotonic() + 5.0  # the pool's filler thread has the template reap it
    while not _gone(first.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(first.pid), "the killed worker was not reaped within 5 s"
    start = time.monotonic()
    assert pool.check(r"\sqrt{8}", r"2\sqrt{2}", 0.5)
    assert time.monotonic() - start < 0.5 + SLACK_S
    assert first not in pool._all and pool._all, "no fresh worker answered"
    assert pool._template.proc.pid == template, "a new template was started (sympy imported again)"


def test_killed_template_is_restarted_and_takes_its_workers_with_it(pool):
    assert pool.check("x+x", "2x", BOUND_S)
    (worker,) = pool._all
    pool._template.proc.kill()
    pool._template.proc.wait()
    deadline = time.monotonic() + 5.0
    while not _gone(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker.pid), "a worker outlived its template by 5 s"
    pool.check("x+x", "2x", BOUND_S)  # the idle worker is gone: scores False, and is discarded
    assert pool.check("x+x", "2x", BOUND_S)  # a new template, a new worker


def _failures(caplog):
    return [r for r in caplog.records if r.name == bounded.__name__ and r.levelno == logging.WARNING]


def test_template_that_cannot_start_scores_minus_one_with_one_warning(pool, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=bounded.__name__)
    working = bounded.TEMPLATE_ARGV
    assert pool.check("x+x", "2x", BOUND_S)
    pool.close()  # the next check starts a new template
    monkeypatch.setattr(bounded, "TEMPLATE_ARGV", [sys.executable, "-c", "import sys; sys.exit(3)"])
    monkeypatch.setattr(rewards, "get_pool", lambda: pool)
    got = score_batch([r"\boxed{x+x}", r"\boxed{5}"], ["2x", "5"])  # must not raise
    assert got.tolist() == [-1.0, 1.0]  # the worker path scores -1; the fast path is unaffected
    (warning,) = _failures(caplog)
    assert "exited (status 3) before saying 'ready'" in warning.getMessage()
    assert "scores -1" in warning.getMessage() and "check that" in warning.getMessage()
    assert not pool.check("x+x", "2x", BOUND_S)
    assert len(_failures(caplog)) == 1, "warned more than once"
    monkeypatch.setattr(bounded, "TEMPLATE_ARGV", working)
    assert pool.check("x+x", "2x", BOUND_S)  # a working template again: the pool recovers


def test_template_that_hangs_at_start_scores_minus_one_after_the_start_timeout(pool, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=bounded.__name__)
    assert pool.check("x+x", "2x", BOUND_S)
    pool.close()  # the next check starts a template that never says "ready"
    monkeypatch.setattr(bounded, "WORKER_START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(bounded, "TEMPLATE_ARGV", [sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    assert not pool.check("x+x", "2x", BOUND_S)
    assert time.monotonic() - start < 1.0 + SLACK_S
    (warning,) = _failures(caplog)
    assert "did not say 'ready' within 1s" in warning.getMessage()


def test_no_worker_can_ever_start_is_an_error(pool, monkeypatch):
    monkeypatch.setattr(bounded, "TEMPLATE_ARGV", [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match=r"no verifier worker process could start: the first one exited "
                                           r"\(status 3\).*check that"):
        pool.check("x+x", "2x", BOUND_S)
    monkeypatch.setattr(rewards, "get_pool", lambda: pool)
    with pytest.raises(RuntimeError, match="no verifier worker process could start"):
        score_batch([r"\boxed{x+x}"], ["2x"])
