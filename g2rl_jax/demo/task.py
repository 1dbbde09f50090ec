"""The demo's synthetic verifiable task: two-digit addition, answered as `\\boxed{sum}`.

Every problem "a+b" with 10 <= a, b <= 99 (8,100 of them) is shuffled once with a fixed seed; the first
`TEST_SIZE` form the held-out split ("test", dataset `demo_test`) and the rest the training split ("train",
dataset `demo`), both registered with `g2rl_jax.data` when this module is imported (`import g2rl_jax.demo`).
The splits are disjoint and the same on every machine (`random.Random` with an int seed).

    examples("train")          # list[Example], e.g. Example(id="demo-37+48", problem="37+48", answer="85")
    solution(example)          # the correct response: "\\boxed{85}"; solution(example, 10) -> "\\boxed{95}"
    TEACHER_ERRORS             # the mistakes of the warm start's noisy teacher (see g2rl_jax/demo/sft.py)

The answer needs carries across both digit columns, so a tiny model after a short warm start gets part of it
right at temperature 1 and RL has room to improve it.
"""
from __future__ import annotations

import functools
import random
from typing import Literal

from g2rl_jax.data.datasets import Example, register_dataset

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")
OPERANDS = range(10, 100)
SHUFFLE_SEED = 20240601
TEST_SIZE = 256
TEACHER_ERRORS = (-10, -1, 1, 10)  # carry slips: a tens or ones digit off by one


@functools.cache
def _shuffled_pairs() -> tuple[tuple[int, int], ...]:
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(SHUFFLE_SEED).shuffle(pairs)
    return tuple(pairs)


def _example(a: int, b: int) -> Example:
    return Example(id=f"demo-{a}+{b}", problem=f"{a}+{b}", answer=str(a + b), kind="math")


def examples(split: Split) -> list[Example]:
    """The examples of `split` ("train": 7,844 problems, "test": 256 held-out problems), in a fixed order."""
    pairs = _shuffled_pairs()
    if split == "train":
        return [_example(a, b) for a, b in pairs[TEST_SIZE:]]
    if split == "test":
        return [_example(a, b) for a, b in pairs[:TEST_SIZE]]
    raise ValueError(f"unknown demo split {split!r}; choose one of {SPLITS}")


def solution(example: Example, error: int = 0) -> str:
    """The response answering `example` with its sum + `error` (0: the correct response)."""
    return f"\\boxed{{{int(example.answer) + error}}}"


register_dataset("demo", functools.partial(examples, "train"))  # registered here: the demo builds on `data`,
register_dataset("demo_test", functools.partial(examples, "test"))  # never the other way round


def _countdown(split: str, study: bool = False) -> list[Example]:
    from g2rl_jax.demo import countdown  # the exploration demo's task

    return countdown.examples(split, countdown.STUDY if study else countdown.MEMORISE)


register_dataset("countdown", functools.partial(_countdown, "train"))  # g2rl_jax/demo/countdown.py
register_dataset("countdown_test", functools.partial(_countdown, "test"))  # its held-out problems
register_dataset("countdown_study", functools.partial(_countdown, "train", True))  # the study's RL problems
register_dataset("countdown_study_test", functools.partial(_countdown, "test", True))  # its held-out problems


def _sumprod(split: str) -> list[Example]:
    from g2rl_jax.demo import sumprod  # the study's second task

    return sumprod.examples(split)


register_dataset("sumprod", functools.partial(_sumprod, "train"))  # g2rl_jax/demo/sumprod.py: RL's problems
register_dataset("sumprod_test", functools.partial(_sumprod, "test"))  # its held-out problems
