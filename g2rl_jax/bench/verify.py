"""`python -m g2rl_jax.bench verify`: answers verified per second per core, and the worst-case time of one check.

The MATH500 gold answers are checked against perturbed predictions inside boxed responses, side by side:
  exact        the gold itself                               (string fast path)
  reformatted  `\\dfrac`, `\\left(`, `$`, spaces, trailing "." (normalization fast path)
  rewritten    `1+(gold)-1`, equal but different              (bounded sympy path)
  wrong        `(gold)+1`                                     (bounded sympy path)
Throughput runs `score_batch` over each kind with --workers worker processes; per-check latencies (p50, max)
come from sequential `is_equivalent` calls on the last --latency-n golds, which the batch does not see (sympy's
cache would otherwise flatter them); the adversarial line times answers that hit the parser's guards and
one that runs into the time bound.
"""
from __future__ import annotations

import argparse
import statistics
import time

from g2rl_jax.data.datasets import load_dataset
from g2rl_jax.rewards import extract_answer, is_equivalent, score_batch
from g2rl_jax.rewards.bounded import get_pool


def _reformat(gold: str) -> str:
    return "$" + gold.replace(r"\frac", r"\dfrac").replace("(", r"\left( ").replace(")", r" \right)") + "$."


PERTURB = {
    "exact": lambda g: g,
    "reformatted": _reformat,
    "rewritten": lambda g: f"1+({g})-1",
    "wrong": lambda g: f"({g})+1",
}
ADVERSARIAL = {"tower 10^10^10^10": (r"10^{10^{10^{10}}}", "1"),
               "4,000 nested braces": ("{" * 4000 + "1" + "}" * 4000, "1"),
               "expand (a+b+c+d+1)^60": ("(a+b+c+d+1)^{60}", "(a+b+c+d+2)^{60}")}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m g2rl_jax.bench verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="number of MATH500 gold answers (default: all 500)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes = cores used (default 2)")
    ap.add_argument("--timeout", type=float, default=2.0, help="per-check time bound in seconds")
    ap.add_argument("--latency-n", type=int, default=100, help="golds timed one by one per kind")
    args = ap.parse_args(argv)
    golds = [ex.answer for ex in load_dataset("math500", limit=args.n)]
    batch_golds, lat_golds = golds[:-args.latency_n] or golds, golds[-args.latency_n:]  # latency on unseen (cold)
    print(f"verify: {len(golds)} MATH500 golds x {len(PERTURB)} perturbations, {args.workers} worker processes, "
          f"timeout {args.timeout}s (shared machine: other jobs may be running)")
    score_batch([r"\boxed{x+1}"] * args.workers, ["1+x"] * args.workers, num_workers=args.workers)  # warm pool

    print(f"{'kind':<12} {'checks':>6} {'accepted':>8} {'checks/s/core':>14} {'p50 ms':>8} {'max ms':>8}")
    for kind, perturb in PERTURB.items():
        responses = [f"So the answer is \\boxed{{{perturb(g)}}}" for g in batch_golds]
        start = time.perf_counter()
        rewards = score_batch(responses, batch_golds, timeout=args.timeout, num_workers=args.workers)
        wall = time.perf_counter() - start
        lat = []
        for gold in lat_golds:
            response = f"So the answer is \\boxed{{{perturb(gold)}}}"
            t = time.perf_counter()
            is_equivalent(extract_answer(response), gold, timeout=args.timeout)
            lat.append((time.perf_counter() - t) * 1e3)
        print(f"{kind:<12} {len(batch_golds):>6} {(rewards > 0).mean():>8.1%} "
              f"{len(batch_golds) / wall / args.workers:>14.1f} "
              f"{statistics.median(lat):>8.2f} {max(lat):>8.1f}")
    for name, (pred, gold) in ADVERSARIAL.items():
        t = time.perf_counter()
        ok = is_equivalent(pred, gold, timeout=args.timeout)
        print(f"adversarial {name:<24} verdict={ok} time={time.perf_counter() - t:.3f}s (bound {args.timeout}s)")
    get_pool().close()
    return 0
