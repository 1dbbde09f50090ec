"""`python -m g2rl_jax.bench verify`: answers verified per second per core, and the worst-case time of one check.

The MATH500 gold answers are checked against perturbed predictions inside boxed responses, side by side:
  exact        the gold itself                               (string fast path)
  reformatted  `\\dfrac`, `\\left(`, `$`, spaces, trailing "." (normalization fast path, a few via workers)
  rewritten    `1+(gold)-1`, equal but different              (bounded sympy path)
  wrong        `(gold)+1`                                     (bounded sympy path)
Each kind's checks are split by the path `score_batch` takes for them, and each part is timed on its own:
  fast    decided in the calling process (extraction, normalization, exact numbers), one thread: its per-core
          rate is per 1 core of the calling process (median of 5 runs; nothing is cached on this path);
  worker  sent to the worker processes (--workers threads, at most one worker per CPU): its per-core rate is
          per worker process (the calling process extracts and normalizes alongside); one run, as a repeat
          would hit sympy's cache.
Per-check latencies (p50, max) come from sequential `is_equivalent` calls on the last --latency-n golds, which
the batch does not see (sympy's cache would otherwise flatter them); the adversarial line times answers that hit
the parser's guards and one that runs into the time bound.

`--slow N` (e.g. 64) measures the verifier under load instead, side by side in one run:
  queue    N checks that run into the time bound, then N fast ones queued behind them (as `score_batch` queues
           them, one thread each on a pool of --workers processes, in a fresh process): when the fast ones finish
           (median, max); with `--before DIR`, the same for the source tree DIR of an earlier version, alternating;
  maj@k    the answer classes of N distinct answers that each need sympy (`(x+y+k)^E`): all pairs through
           `is_equivalent` (eval.answer_classes, the old way) against `rewards.vote.answer_classes`, with the
           number of worker requests each made.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from g2rl_jax import cli
from g2rl_jax.data.datasets import load_dataset
from g2rl_jax.rewards import _canonical_pairs, extract_answer, is_equivalent, score_batch
from g2rl_jax.rewards.bounded import get_pool

_SRC_ROOT = str(Path(__file__).resolve().parents[2])


def _reformat(gold: str) -> str:
    return "$" + gold.replace(r"\frac", r"\dfrac").replace("(", r"\left( ").replace(")", r" \right)") + "$."


PERTURB = {
    "exact": lambda g: g,
    "reformatted": _reformat,
    "rewritten": lambda g: f"1+({g})-1",
    "wrong": lambda g: f"({g})+1",
}
FAST_REPEATS = 5  # fast-path batches take milliseconds: the median of 5 runs (no cache is involved)
ADVERSARIAL = {"tower 10^10^10^10": (r"10^{10^{10^{10}}}", "1"),
               "4,000 nested braces": ("{" * 4000 + "1" + "}" * 4000, "1"),
               "expand (a+b+c+d+1)^60": ("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}")}


def _response(perturbed: str) -> str:
    return f"So the answer is \\boxed{{{perturbed}}}"


def main(argv: list[str]) -> int:
    ap = cli.ArgumentParser(prog="python -m g2rl_jax.bench verify", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="number of MATH500 gold answers (default: all 500)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes for the worker path (default 2)")
    ap.add_argument("--timeout", type=float, default=2.0, help="per-check time bound in seconds")
    ap.add_argument("--latency-n", type=int, default=100, help="golds timed one by one per kind")
    ap.add_argument("--slow", type=int, default=0, help="measure N slow answers (queue and maj@k), nothing else")
    ap.add_argument("--slow-exponent", type=int, default=3, help="E of the maj@k answers (x+y+k)^E")
    ap.add_argument("--before", default=None, help="with --slow: the source tree of an earlier version (e.g. from "
                    "`git archive COMMIT | tar -x -C DIR`), whose queue is measured side by side in the same run")
    args = ap.parse_args(argv)
    if args.slow:
        return slow_answers(args.slow, args.workers, args.timeout, args.slow_exponent, args.before)
    if args.workers < 1 or args.latency_n < 1 or args.n <= args.latency_n:
        ap.error(f"need --workers >= 1 and 1 <= --latency-n < --n, got --workers {args.workers} "
                 f"--latency-n {args.latency_n} --n {args.n}")
    golds = [ex.answer for ex in load_dataset("math500", limit=args.n)]
    batch_golds, lat_golds = golds[:-args.latency_n], golds[-args.latency_n:]  # latency on unseen (cold) golds
    pool = get_pool()
    workers = min(args.workers, pool.max_workers)
    print(f"verify: {len(golds)} MATH500 golds x {len(PERTURB)} perturbations, timeout {args.timeout}s; fast path "
          f"in the calling process (1 core), worker path on {workers} worker processes "
          f"(--workers {args.workers}, pool of {pool.max_workers}); shared machine: other jobs may be running")
    score_batch([r"\boxed{x+1}"] * workers, ["1+x"] * workers, num_workers=workers)  # warm pool

    print(f"{'kind':<12} {'path':<7} {'checks':>6} {'accepted':>8} {'checks/s':>9} {'checks/s/core':>14} "
          f"{'per':<16} {'p50 ms':>7} {'max ms':>7}")
    for kind, perturb in PERTURB.items():
        responses = [_response(perturb(g)) for g in batch_golds]
        _, verdicts = _canonical_pairs(responses, batch_golds)
        lat_responses = [_response(perturb(g)) for g in lat_golds]
        _, lat_verdicts = _canonical_pairs(lat_responses, lat_golds)
        for path, on_workers in (("fast", False), ("worker", True)):
            idx = [k for k, v in enumerate(verdicts) if (v is None) == on_workers]
            if not idx:
                continue
            walls = []
            for _ in range(1 if on_workers else FAST_REPEATS):  # a worker-path repeat would hit sympy's cache
                start = time.perf_counter()
                rewards = score_batch([responses[k] for k in idx], [batch_golds[k] for k in idx],
                                      timeout=args.timeout, num_workers=workers)
                walls.append(time.perf_counter() - start)
            wall = statistics.median(walls)
            lat = []
            for response, gold, v in zip(lat_responses, lat_golds, lat_verdicts):
                if (v is None) == on_workers:
                    t = time.perf_counter()
                    is_equivalent(extract_answer(response), gold, timeout=args.timeout)
                    lat.append((time.perf_counter() - t) * 1e3)
            cores, per = (workers, f"worker ({workers})") if on_workers else (1, "caller core (1)")
            p50, worst = (f"{statistics.median(lat):>7.2f}", f"{max(lat):>7.1f}") if lat else (f"{'-':>7}",) * 2
            print(f"{kind:<12} {path:<7} {len(idx):>6} {(rewards > 0).mean():>8.1%} {len(idx) / wall:>9.1f} "
                  f"{len(idx) / wall / cores:>14.1f} {per:<16} {p50} {worst}")
    worst_s, worst_name = 0.0, ""
    for name, (pred, gold) in ADVERSARIAL.items():
        t = time.perf_counter()
        ok = is_equivalent(pred, gold, timeout=args.timeout)
        took = time.perf_counter() - t
        worst_s, worst_name = max((worst_s, worst_name), (took, name))
        print(f"adversarial {name:<24} verdict={ok} time={took:.3f}s (bound {args.timeout}s)")
    print(f"worst-case time of one check: {worst_s:.3f}s ({worst_name}; the bound is {args.timeout}s)")
    pool.close()
    return 0


def _counting(pool):
    """Wrap pool.request to count the requests sent to workers; returns the counter (a one-item list)."""
    count, call = [0], pool.request

    def counted(*args):
        count[0] += 1
        return call(*args)
    pool.request = counted
    return count


# Run in a fresh process with PYTHONPATH set to the tree measured (this one, or --before's): only APIs that every
# version of the pool has (`BoundedPool(n[, spares])`, `check`, `close`); prints one JSON line.
_QUEUE_DRIVER = r"""
import inspect, json, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from g2rl_jax.rewards import bounded
n_slow, n_fast, workers, timeout = json.loads(sys.argv[1])
spares = {"spares": min(workers, 2)} if "spares" in inspect.signature(bounded.BoundedPool).parameters else {}
pool = bounded.BoundedPool(workers, **spares)
warm = [threading.Thread(target=pool.check, args=("x+x", "2x", 300.0)) for _ in range(workers)]
for t in warm:
    t.start()
for t in warm:
    t.join()
time.sleep(3.0)  # spare workers (where the pool keeps some) have started: start-up is not what is measured
slow = [(f"(a+b+c+d+{k})^{{60}}", f"(a+b+c+d+{k + 1})^{{60}}") for k in range(n_slow)]
fast = [(f"x^{{2}}+{k}x", f"x(x+{k})") for k in range(n_fast)]
start, done = time.perf_counter(), {"slow": [], "fast": []}
def run(item):
    kind, (pred, gold) = item
    ok = pool.check(pred, gold, timeout)
    done[kind].append(time.perf_counter() - start)
    return ok
with ThreadPoolExecutor(max_workers=n_slow + n_fast) as ex:
    verdicts = list(ex.map(run, [("slow", p) for p in slow] + [("fast", p) for p in fast]))
print(json.dumps({"wall": time.perf_counter() - start, "fast": done["fast"], "slow": done["slow"],
                  "ok_fast": sum(verdicts[n_slow:]), "ok_slow": sum(verdicts[:n_slow]),
                  "restarted": getattr(pool, "restarted", None)}))
pool.close()
"""


def _queue(tree: str, n_slow: int, n_fast: int, workers: int, timeout: float) -> dict:
    """n_slow checks that run into the bound, then n_fast fast ones, one thread each (as `score_batch` queues
    them), on a pool of `workers` from the source tree `tree`, in a fresh process: when the fast ones finish."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _QUEUE_DRIVER, json.dumps([n_slow, n_fast, workers, timeout])],
                         env=env, cwd=tree, capture_output=True, text=True, timeout=3600)  # cwd: `-c` imports from it
    if out.returncode:
        raise SystemExit(f"the queue measurement of {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def slow_answers(n: int, workers: int, timeout: float, exponent: int, before: str | None) -> int:
    """`--slow N`: queue latency of fast checks behind N slow ones (this tree, and --before's side by side), and
    maj@k classes of N sympy answers."""
    from g2rl_jax import eval as ev
    from g2rl_jax.rewards.vote import answer_classes

    trees = ([("before", str(Path(before).resolve()))] if before else []) + [("after", _SRC_ROOT)]
    print(f"verify --slow {n}: pools of {workers} worker processes, timeout {timeout}s, {os.cpu_count()} CPUs"
          + (f"; before = {trees[0][1]}" if before else "") + "; shared machine: other jobs may be running")
    for n_slow in (0, workers, n):  # 0: the fast checks alone, the baseline of the two others
        for label, tree in trees:
            r = _queue(tree, n_slow, n, workers, timeout)
            fast_t, slow_t = sorted(r["fast"]), sorted(r["slow"] or [0.0])
            restarted = "" if r["restarted"] is None else f"; {r['restarted']} restarted in the slow lane"
            print(f"queue {label:<6} {n_slow:3d} slow (bound {timeout}s) then {n} fast: wall {r['wall']:5.1f}s; "
                  f"fast done at median {statistics.median(fast_t):5.1f}s, last {fast_t[-1]:5.1f}s; slow last "
                  f"{slow_t[-1]:5.1f}s; accepted fast {r['ok_fast']}/{n}, slow {r['ok_slow']}/{n_slow}{restarted}")
    pool = get_pool()  # maj@k: this process's pool, one worker per CPU
    answers = [f"(x+y+{k})^{{{exponent}}}" for k in range(n)]
    count = _counting(pool)
    rows = [("rewards.vote.answer_classes", lambda: answer_classes(answers, timeout=timeout)),
            ("all pairs (is_equivalent)", lambda: ev.answer_classes(answers, lambda a, b: is_equivalent(
                a, b, timeout=timeout)))]
    for name, classes in rows:
        count[0] = 0
        t = time.perf_counter()
        labels = classes()
        print(f"maj@k classes of {n} distinct (x+y+k)^{exponent}: {name:<28} {time.perf_counter() - t:7.1f}s, "
              f"{count[0]:5d} worker requests, {len(set(labels))} classes")
    pool.close()
    return 0
