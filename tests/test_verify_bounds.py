"""The verifier under load and abuse, with real processes: degenerate 30,000-character responses (repetitions of
every construct the extractor and normaliser handle) score within score_batch's documented bound; workers and their
template exit when their parent is killed (SIGKILL) or terminated (SIGTERM) mid-check, also with the parent-pid
watchdog alone (macOS's only mechanism); fast checks queued behind slow ones finish quickly, and a check restarted
in the slow lane gives the uninterrupted verdict; maj@k classes equal the all-pairs classes."""
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
from g2rl_jax.rewards import IN_PROCESS_S_PER_RESPONSE, bounded, is_equivalent, score_batch, workers
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
    print(pool._all[0].pid, pool._template.proc.pid, flush=True)
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


@pytest.mark.parametrize("watchdog_only", [False, True], ids=["pdeathsig+watchdog", "watchdog-only"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_worker_exits_when_its_parent_dies_mid_check(sig, watchdog_only):
    """watchdog-only: PR_SET_PDEATHSIG skipped, the only mechanism macOS has, tested here on Linux too."""
    env = dict(os.environ, **({workers.WATCHDOG_ONLY_ENV: "1"} if watchdog_only else {}))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker_pid, template_pid = map(int, parent.stdout.readline().split())
        time.sleep(1.0)  # the worker is now expanding a huge polynomial
        assert _alive(worker_pid) and _alive(template_pid)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        while (_alive(worker_pid) or _alive(template_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), f"worker {worker_pid} outlived its parent ({sig.name}) by 5 s"
        assert not _alive(template_pid), f"the template {template_pid} outlived its parent ({sig.name}) by 5 s"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_GET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("watchdog_only", [False, True])
def test_watchdog_only_switch_skips_the_death_signal(watchdog_only):
    """The switch the test above relies on really skips PR_SET_PDEATHSIG (read back with PR_GET_PDEATHSIG)."""
    code = ("import ctypes, os; from g2rl_jax.rewards.workers import die_with_parent; die_with_parent(os.getppid()); "
            "sig = ctypes.c_int(-1); ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); print(sig.value)")
    env = dict(os.environ, **({workers.WATCHDOG_ONLY_ENV: "1"} if watchdog_only else {}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == ("0" if watchdog_only else str(int(signal.SIGKILL))), out.stderr


# -- a slow check does not hold up the fast ones, whatever the order ---------------------------------------------

SLOW_BOUND_S = 8.0


def test_fast_checks_queued_behind_slow_ones_finish_quickly():
    """2 * workers + 2 checks that run into an 8 s bound, queued first, then 4 fast ones: every fast one is done
    within 4 s (a loaded 2-core machine included), where the design before the fast lane made them wait for at
    least one slow check's full bound (8 s), and more as the slow ones outnumber the slots."""
    pool = bounded.BoundedPool(2)
    try:
        assert pool.check("x+x", "2x", 60.0)  # the template has started (not part of any check's time)
        n_slow, done, threads = 2 * pool.max_workers + 2, {}, []
        start = time.monotonic()

        def run(key, pred, gold):
            ok = pool.check(pred, gold, SLOW_BOUND_S)
            done[key] = (ok, time.monotonic() - start)
        for k in range(n_slow):
            threads.append(threading.Thread(target=run, args=(("slow", k), f"(a+b+c+d+{k})^{{60}}",
                                                              f"(a+b+c+d+{k + 1})^{{60}}")))
            threads[-1].start()
        time.sleep(0.2)  # the slow checks are queued (most of them already in the slots) before any fast one
        for k in range(4):
            threads.append(threading.Thread(target=run, args=(("fast", k), f"x^{{2}}+{k}x", f"x(x+{k})")))
            threads[-1].start()
        for thread in threads[n_slow:]:
            thread.join(timeout=120)
        fast = [done[("fast", k)] for k in range(4)]
        assert all(ok for ok, _ in fast)
        assert max(t for _, t in fast) < 4.0, f"fast checks done at {[round(t, 2) for _, t in fast]} s"
        assert not any(key[0] == "slow" for key in done), "a slow check ended early; the test proves nothing"
    finally:
        pool.close()  # the slow checks in flight score False
    for thread in threads:
        thread.join(timeout=60)
    assert all(not done[("slow", k)][0] for k in range(n_slow))


def test_a_request_that_waits_without_cpu_leaves_the_fast_lane(tmp_path):
    """A reward function that sleeps uses no CPU: it leaves the fast lane after workers.SLICE_WALL_S of wall-clock
    time, so a check queued behind it on a one-slot pool does not wait out the sleep, and its value still comes.
    A fast check that itself outruns its slice (a very busy machine: SLICE_WALL_S is wall-clock) rightly restarts
    behind the sleeper in the slow lane and proves nothing, so the scenario is tried up to three times."""
    import json

    fn = tmp_path / "sleepy.py"
    fn.write_text("import time\n\ndef reward(response, example):\n    time.sleep(5)\n    return 0.5\n")
    pool = bounded.BoundedPool(1)
    try:
        assert pool.check("x+x", "2x", 60.0)
        sleepy = ["fn", f"{fn}:reward", "r", {}]
        for _ in range(3):
            out, restarted = [], pool.restarted
            sleeper = threading.Thread(target=lambda out=out: out.append(pool.request(sleepy, 30.0)))
            sleeper.start()
            time.sleep(0.2)
            t = time.monotonic()
            assert pool.check(r"\sqrt{8}", r"2\sqrt{2}", 30.0)
            waited = time.monotonic() - t
            sleeper.join(timeout=60)
            assert json.loads(out[0]) == {"value": 0.5}
            if pool.restarted == restarted:  # neither check restarted: the fast one kept its slice
                assert waited < 3.0, "the fast check waited for the sleeping reward function"
                break
        else:
            pytest.fail("the fast check outran its own slice three times (machine too busy): nothing was shown")
    finally:
        pool.close()


def test_slice_restart_gives_the_verdict_of_an_uninterrupted_check():
    """A check that outruns its fast-lane slice while the slow lane is full restarts from scratch: its verdict is
    the one an uninterrupted check gives (same answers, one of them slower than the slice)."""
    pool = bounded.BoundedPool(1)
    try:
        assert pool.check("x+x", "2x", 60.0)
        blocker = threading.Thread(target=pool.check, args=("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}", 5.0))
        blocker.start()  # moves to the slow lane and fills it until its 5 s bound
        time.sleep(workers.SLICE_S + 0.5)
        t = time.monotonic()
        slower = ("(a+b+c+d+1)^{8}", "(a+b+c+d+1)^{7}(a+b+c+d)+(a+b+c+d+1)^{7}")  # equal; about 1 s of sympy
        assert pool.check(*slower, 30.0)  # too slow for the slice: restarted in the slow lane, still True
        assert time.monotonic() - t > workers.SLICE_S and pool.restarted == 1
        pool.close()
        blocker.join(timeout=60)
    finally:
        pool.close()


# -- maj@k ------------------------------------------------------------------------------------------------------

def test_vote_classes_equal_all_pairs_classes():
    answers = [r"\frac12", "0.5", "1/2", "x+1", "1+x", "(x+1)^2", "x^2+2x+1", None, r"3\frac12", "7/2", r"\{1,2\}",
               r"\{2,1\}", "0.33", r"\frac13", r"2\sqrt2", r"\sqrt8", "x=3", "3", "(1,2)", "(2,1)", "0.5000", "1.5",
               "1.50"]
    assert answer_classes(answers) == ev.answer_classes(answers, is_equivalent)
    assert answer_classes(["", r"\,", "1"]) == [None, None, 0]  # an empty answer does not vote
