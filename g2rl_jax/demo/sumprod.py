"""The study's second task, where length matters: a sum of products worked out step by step, in any valid order.

A problem gives TERMS products of two digits from 2-9, e.g. "Compute 3*4+5*6+7*2+8*9+6*6". A response writes one
step per line, each either a product of the problem's (a line `a*b=c` computes a term not yet computed, its
factors in either order) or a sum of two values already on hand (`x+y=z` takes two computed values, products or
partial sums, and puts their sum back), and ends with `\\boxed{V}`:

    3*4=12
    8*9=72
    12+72=84
    ...
    \\boxed{164}

It is correct when every line is one of those two moves and its arithmetic is right, every term is computed, one
value is left, and it is the one boxed. Terms and sums can come in any order, so a problem has many correct
reasoning paths (5 products: 4 sums over a growing set, interleaved with the products) and one answer; a response
of 5 terms is 9 lines, about 80 tokens of the demo tokenizer, and one slip anywhere makes it wrong.

    reward(response, example) -> float          # +1 a correct worked sum, -1 otherwise (what RL trains on)
    judge(texts, row)                           # per response: correct, its path, its vote label (explore_eval)
    examples("train"), examples("test"), examples("sft")   # disjoint splits, the same on every machine
    teacher_responses(example, rng)             # the warm start's teacher: random valid orders, right or with a slip
"""
from __future__ import annotations

import functools
import random
import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: a reward worker imports this module and must not load the data stack
    from g2rl_jax.data.datasets import Example

TERMS = 5
DIGITS = range(2, 10)
SHUFFLE_SEED = 20261126
SPLITS = (("test", 512), ("train", 4096), ("sft", 20000))
TEACHER_VARIANTS = 4
SLIPS = (-10, -1, 1, 10)  # the teacher's carry slips: a result's tens or ones digit off by one
MAX_LINES = 4 * TERMS  # a longer response is not checked (scores -1)
LINE = re.compile(r"(\d{1,4})([*+])(\d{1,4})=(\d{1,5})")
BOXED = re.compile(r"\\boxed\{(\d{1,5})\}")


# ------------------------------------------------------------------------------------------- checking
def parse(response: str) -> tuple[list[tuple[int, str, int, int]], int] | None:
    """(steps, boxed value) of a response that is step lines and a final `\\boxed{V}` line, else None."""
    lines = [line.strip() for line in response.strip().split("\n")]
    if len(lines) < 2 or len(lines) > MAX_LINES:
        return None
    final = BOXED.fullmatch(lines[-1])
    steps = [LINE.fullmatch(line) for line in lines[:-1]]
    if final is None or not all(steps):
        return None
    return [(int(m[1]), m[2], int(m[3]), int(m[4])) for m in steps], int(final[1])


def replay(steps: Sequence[tuple[int, str, int, int]], terms: Sequence[Sequence[int]]) -> int | None:
    """The value a valid worked sum of `terms` ends with, or None when a step is not a valid move (a product that
    is no term left, a sum of values not on hand, wrong arithmetic) or it does not end with every term summed."""
    todo = Counter(tuple(sorted(t)) for t in terms)
    pool: Counter = Counter()
    for a, op, b, c in steps:
        if op == "*":
            key = tuple(sorted((a, b)))
            if todo[key] == 0 or a * b != c:
                return None
            todo[key] -= 1
        else:
            need = Counter([a, b])
            if any(pool[v] < n for v, n in need.items()) or a + b != c:
                return None
            pool -= need
        pool[c] += 1
    if sum(todo.values()) or sum(pool.values()) != 1:
        return None
    return next(iter(pool))


def total(terms: Sequence[Sequence[int]]) -> int:
    return sum(a * b for a, b in terms)


def reward(response: str, example: dict) -> float:
    """+1.0 when the response works out the sum of example["terms"] by valid steps and boxes it; -1.0 otherwise."""
    parsed = parse(response)
    if parsed is None:
        return -1.0
    steps, boxed = parsed
    end = replay(steps, example["terms"])
    return 1.0 if end is not None and end == boxed == total(example["terms"]) else -1.0


def path(steps: Sequence[tuple[int, str, int, int]]) -> str:
    """One string per reasoning path: the steps in order, the factors or addends of each sorted."""
    return ";".join(f"{min(a, b)}{op}{max(a, b)}" for a, op, b, _ in steps)


def judge(texts: Sequence[str], row: dict):
    """Per response: correct, its path (correct ones, else None), a vote label (the index of its boxed value among
    the problem's distinct boxed values, None when it is not step lines and a box), and None (the Countdown
    judge's numbers-used count has no meaning here); the shape of `explore_eval.judge`'s answer."""
    correct, paths, labels, values = [], [], [], {}
    for text in texts:
        parsed = parse(text)
        ok = reward(text, row) > 0
        correct.append(ok)
        paths.append(path(parsed[0]) if ok else None)
        labels.append(None if parsed is None else values.setdefault(parsed[1], len(values)))
    return correct, paths, labels, None


# ------------------------------------------------------------------------------------------- problems
def problem_text(terms: Sequence[Sequence[int]]) -> str:
    return "Compute " + "+".join(f"{a}*{b}" for a, b in terms)


@functools.cache
def _problems() -> tuple[tuple[tuple[int, int], ...], ...]:
    """Distinct problems (ordered term lists) in a fixed random order, enough for every split."""
    rng = random.Random(SHUFFLE_SEED)
    seen, out = set(), []
    need = sum(size for _, size in SPLITS)
    while len(out) < need:
        terms = tuple((rng.choice(DIGITS), rng.choice(DIGITS)) for _ in range(TERMS))
        key = tuple(sorted(tuple(sorted(t)) for t in terms))  # the same sum of products in another order
        if key not in seen:
            seen.add(key)
            out.append(terms)
    return tuple(out)


def examples(split: str) -> list[Example]:
    """The examples of `split`: "test" (512 held out), "train" (4,096 for RL), "sft" (20,000 for the warm start);
    no sum of products is in two splits (nor twice in one)."""
    from g2rl_jax.data.datasets import Example

    names = [name for name, _ in SPLITS]
    if split not in names:
        raise ValueError(f"unknown sumprod split {split!r}; choose one of {names}")
    start = sum(size for name, size in SPLITS[:names.index(split)])
    chosen = _problems()[start:start + dict(SPLITS)[split]]
    return [Example(id="sumprod-" + "+".join(f"{a}*{b}" for a, b in terms), problem=problem_text(terms),
                    answer=str(total(terms)), row={"terms": [list(t) for t in terms]}) for terms in chosen]


# ------------------------------------------------------------------------------------------- the warm start
def worked_sum(terms: Sequence[Sequence[int]], rng: random.Random, slip: bool = False) -> str:
    """A response in a random valid order: at each step, one legal move drawn uniformly (compute a term not yet
    computed, or add two values on hand). slip=True: one line, drawn uniformly, writes a result off by one of
    SLIPS (a carry slip, kept positive) and the later lines carry the wrong value on, so the response is wrong."""
    todo = [tuple(t) for t in terms]
    pool: list[int] = []
    lines = []
    slip_at = rng.randrange(2 * len(todo) - 1) if slip else -1
    while todo or len(pool) > 1:
        moves = [("*", i) for i in range(len(todo))]
        moves += [("+", (i, j)) for i in range(len(pool)) for j in range(len(pool)) if i != j]
        op, pick = rng.choice(moves)
        if op == "*":
            a, b = todo.pop(pick)
            value = a * b
        else:
            a, b = pool[pick[0]], pool[pick[1]]
            for index in sorted(pick, reverse=True):
                pool.pop(index)
            value = a + b
        if len(lines) == slip_at:
            value = value + rng.choice([d for d in SLIPS if value + d > 0])
        lines.append(f"{a}{op}{b}={value}")
        pool.append(value)
    return "\n".join(lines + [f"\\boxed{{{pool[0]}}}"])


def teacher_responses(example: Example, rng: random.Random) -> list[str]:
    """TEACHER_VARIANTS correct responses of the example, each in an independently drawn order, then
    TEACHER_VARIANTS with one carry slip each (the warm start's teacher picks among them)."""
    terms = example.row["terms"]
    return ([worked_sum(terms, rng) for _ in range(TEACHER_VARIANTS)]
            + [worked_sum(terms, rng, slip=True) for _ in range(TEACHER_VARIANTS)])


def corpus(count: int = 64) -> list[str]:
    """Texts the demo tokenizer's merges are learned from: prompts and teacher responses of sft problems."""
    from g2rl_jax.data.prompts import plain_prompt

    rng = random.Random(SHUFFLE_SEED)
    return [plain_prompt(ex) + teacher_responses(ex, rng)[0] for ex in examples("sft")[:count]]
