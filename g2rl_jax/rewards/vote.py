"""Answer classes for maj@k without comparing every pair through sympy.

`answer_classes(answers)` gives each answer the class of the first earlier answer it is equivalent to (the same
classes as comparing all pairs with `is_equivalent`), cheapest evidence first:
  1. equal canonical strings (`normalize_answer`) are one class, by hashing;
  2. plain numbers and fractions are compared exactly in this process (`fast_number`);
  3. every other distinct canonical answer gets a fingerprint in a worker process, once (its values at the probe
     points `expr_equal` uses, all fingerprints computed in parallel); two answers whose values clearly differ at a
     probe point cannot be equivalent and are not sent to sympy;
  4. only the remaining pairs (values that agree, or answers without a fingerprint: tuples, sets, equations) go
     through the bounded sympy check.
So n distinct answers cost n fingerprint calls plus one sympy check per answer that matches a class, not n^2/2.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from g2rl_jax.rewards.bounded import get_pool
from g2rl_jax.rewards.normalize import fast_number, normalize_answer

_SEPARATE_REL = 1e-6  # values further apart than this (relative) differ beyond expr_equal's 1e-9 tolerance


def _fingerprints(canonicals: list[str], timeout: float) -> dict[str, dict | None]:
    pool = get_pool()

    def one(c: str):
        reply = pool.request(["fp", c], timeout)
        try:
            return json.loads(reply) if reply is not None else None
        except ValueError:
            return None
    with ThreadPoolExecutor(max_workers=max(1, min(pool.max_workers * 2, len(canonicals)))) as ex:
        return dict(zip(canonicals, ex.map(one, canonicals)))


def clearly_different(a: dict | None, b: dict | None) -> bool:
    """Whether two fingerprints prove the answers are not equivalent: same symbols, no decimal that the verifier
    may accept as a rounding, and values further apart than _SEPARATE_REL at some probe point."""
    if a is None or b is None or a["syms"] != b["syms"] or a["decimal"] or b["decimal"]:
        return False
    for va, vb in zip(a["vals"], b["vals"]):
        if va is None or vb is None:
            continue
        za, zb = complex(*va), complex(*vb)
        if abs(za - zb) > _SEPARATE_REL * max(1.0, abs(zb)):
            return True
    return False


def answer_classes(answers: list[str | None], *, timeout: float = 2.0) -> list[int | None]:
    """Class label per answer: the label of the first earlier answer it is equivalent to, else a new label; None
    for a missing answer, one over the length cap, or one empty after normalisation (`\\boxed{}`), which does not
    vote (all-pairs `is_equivalent` would make each empty answer its own class)."""
    canon = [normalize_answer(a) or None for a in answers]
    distinct = list(dict.fromkeys(c for c in canon if c is not None))
    numbers = {c: fast_number(c) for c in distinct}
    prints = _fingerprints([c for c in distinct if numbers[c] is None], timeout)
    reps: list[str] = []      # canonical string of each class's first answer
    label_of: dict[str, int] = {}
    pool = get_pool()
    for c in distinct:
        label = None
        for j, rep in enumerate(reps):
            x, y = numbers[c], numbers[rep]
            if x is not None and y is not None:
                if x == y:
                    label = j
                    break
                if "/" not in c and "/" not in rep:  # two terminating decimals: exact comparison is final
                    continue
            if clearly_different(prints.get(c), prints.get(rep)):
                continue
            if pool.check(c, rep, timeout):
                label = j
                break
        if label is None:
            label = len(reps)
            reps.append(c)
        label_of[c] = label
    return [None if c is None else label_of[c] for c in canon]
