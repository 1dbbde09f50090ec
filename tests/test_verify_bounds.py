"""The verifier under load and abuse, with real processes: degenerate 30,000-character responses (repetitions of
every construct the extractor and normaliser handle) score within score_batch's documented bound; workers exit
when their parent is killed (SIGKILL) or terminated (SIGTERM) mid-check; a slow check does not hold up a fast one
queued behind it; maj@k classes equal the all-pairs classes."""
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from g2rl_jax import eval as ev
from g2rl_jax.rewards import bounded, is_equivalent, score_batch
from g2rl_jax.rewards import IN_PROCESS_S_PER_RESPONSE
from g2rl_jax.rewards.vote import answer_classes

CONSTRUCTS = [r"\boxed{", r"\fbox{", "$", "$$", r"\(", r"\[", r"\text{ab}", r"\, ", "~", r"\quad ", "answer is ",
              "Answer: *", ", ", "1,000", " and ", " or ", r"\left(", r"\frac", r"\dfrac12", "{", "}", "{ ", r"^\circ",
              "%", r"\$", "7", "1 ", "(C)", "**", " units", " cm", "\n", r"\\", " ", r"\text{", r"\!", "=", ".",
              r"\boxed{1}", "$1$ and ", r"\mathrm{ab}", r"\le ", "1/2", "-", r"3\frac12"]
WRAPS = [lambda s: s, lambda s: r"\boxed{" + s + "}", lambda s: "The answer is " + s,
         lambda s: r"So \boxed{" + s[:9_000] + "}"]  # under the 10,000-character answer cap: normalised in full
CHARS = 30_000
TIMEOUT_S = 1.0


def _degenerate() -> list[str]:
    return [wrap((unit * (CHARS // len(unit) + 1))[:CHARS]) for unit in CONSTRUCTS for wrap in WRAPS]


def test_degenerate_responses_score_within_the_documented_bound():
    responses = _degenerate()
    assert len(responses) >= 2 * 64 and sum(len(r) >= CHARS for r in responses) == 3 * len(CONSTRUCTS)
    workers = bounded.get_pool().max_workers
    assert is_equivalent("x+x", "2x")  # a ready worker (start-up is not part of the bound)
    for start in range(0, len(responses), 64):
        batch = responses[start:start + 64]
        t = time.perf_counter()
        rewards = score_batch(batch, ["1"] * len(batch), timeout=TIMEOUT_S)
        took = time.perf_counter() - t
        bound = len(batch) * IN_PROCESS_S_PER_RESPONSE + math.ceil(len(batch) / workers) * TIMEOUT_S
        assert took <= bound, f"score_batch over responses {start}..{start + len(batch)} took {took:.1f}s > {bound}s"
        assert rewards.shape == (len(batch),)


# -- workers die with their parent ------------------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import sys, threading
    from g2rl_jax.rewards import bounded
    pool = bounded.BoundedPool(1)
    assert pool.check("x+x", "2x", 60.0)
    print(pool._all[0].proc.pid, flush=True)
    pool.check("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}", 600.0)  # busy for minutes
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return sys.platform.startswith("linux") is False
    return True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_worker_exits_when_its_parent_dies_mid_check(sig):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ))
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(1.0)  # the worker is now expanding a huge polynomial
        assert _alive(worker_pid)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), f"worker {worker_pid} outlived its parent ({sig.name}) by 5 s"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# -- a slow check does not hold up the fast ones ----------------------------------------------------------------

def test_fast_check_is_not_held_up_by_a_slow_one():
    pool = bounded.BoundedPool(1)  # one slot: without the straggler lane the fast check waits the full bound
    try:
        assert pool.check("x+x", "2x", 60.0)
        slow_done = []
        slow = threading.Thread(target=lambda: slow_done.append(
            pool.check("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}", 20.0)))
        slow.start()
        time.sleep(bounded.STRAGGLER_AFTER_S + 0.2)
        t = time.perf_counter()
        assert pool.check(r"\sqrt{8}", r"2\sqrt{2}", 20.0)  # spawns a second worker (start-up included here)
        fast_s = time.perf_counter() - t
        assert not slow_done, "the slow check finished before the fast one was asked; the test proves nothing"
        assert fast_s < 15.0, f"the fast check waited {fast_s:.1f}s behind the slow one"
        slow.join()
        assert slow_done == [False]
    finally:
        pool.close()


# -- maj@k ------------------------------------------------------------------------------------------------------

def test_vote_classes_equal_all_pairs_classes():
    answers = [r"\frac12", "0.5", "1/2", "x+1", "1+x", "(x+1)^2", "x^2+2x+1", None, r"3\frac12", "7/2", r"\{1,2\}",
               r"\{2,1\}", "0.33", r"\frac13", r"2\sqrt2", r"\sqrt8", "x=3", "3", "(1,2)", "(2,1)", "0.5000", "1.5",
               "1.50"]
    assert answer_classes(answers) == ev.answer_classes(answers, is_equivalent)
    assert answer_classes(["", r"\,", "1"]) == [None, None, 0]  # an empty answer does not vote
