"""Rewards: the verifier whose +-1 is the only supervision signal in training.

Pipeline for a math response:
  extract (`extract.py`: last `\\boxed{}` run, "final answer is ...", math spans, plain numbers)
  -> normalize (`normalize.py`: MATH-style canonical string; equal strings are equivalent at once)
  -> fast path in this process (plain numbers and fractions compared exactly with `fractions.Fraction`)
  -> bounded path (`bounded.py`): a worker process (a fork of a template that imported sympy once, `workers.py`)
     parses both answers with our own LaTeX parser (`latex.py` over `latex_lexer.py`; it builds sympy objects
     directly; nothing reaches `eval`/`sympify`/`parse_expr`) and compares them (`compare.py`: numbers, tuples,
     intervals, sets, matrices, equations, inequalities, sympy identity). A check that exceeds its timeout (2 s by
     default) kills its worker and scores False. This works from any thread and inside other worker processes, because
     workers are plain processes, not signal alarms. Every check gets a 20 ms CPU slice in a fast lane first; one that
     needs more continues (or restarts) in a slow lane, so slow checks never hold up the fast ones queued behind them.
     A template that cannot start scores False with one warning (a `RuntimeError` only if none has ever started: a
     broken install).

Guards: answers over 10,000 characters are not equivalent; the parser refuses nesting deeper than 60, number
literals over 300 digits, powers over 2,000 digits, exponents over 1,000 and factorials over 500, before sympy
evaluates them; workers run with a 4 GiB address-space cap.

Public API: `extract_boxed`, `extract_answer`, `normalize_answer`, `is_equivalent`, `math_reward`,
`extract_choice`, `choice_reward`, `score_batch`, `answers_found`. Beside them: `vote.answer_classes` (maj@k
classes without all-pairs sympy), `custom.custom_rewards` (a user's `fn(response, example)` in the same bounded
workers), `scoring.compute_rewards` (the `reward` config group: truncation policy, overlong penalty).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from g2rl_jax.rewards.bounded import get_pool
from g2rl_jax.rewards.extract import extract_answer, extract_boxed, extract_choice
from g2rl_jax.rewards.normalize import fast_number, normalize_answer

__all__ = ["answers_found", "extract_boxed", "extract_answer", "normalize_answer", "is_equivalent", "math_reward",
           "extract_choice", "choice_answer", "choice_reward", "score_batch"]

DEFAULT_TIMEOUT_S = 2.0
# Documented bound of the in-process part (extraction and normalisation, linear time) per response of up to
# 30,000 characters; the worst degenerate case measured 0.4 s on a shared, loaded core (tests/test_verify_bounds.py).
IN_PROCESS_S_PER_RESPONSE = 1.0


def _fast_verdict(pred: str, gold: str) -> bool | None:
    """Verdict without sympy for canonical strings, or None when the bounded path must decide."""
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    a, b = fast_number(pred), fast_number(gold)
    if a is not None and b is not None:
        if a == b:
            return True
        if "/" not in pred and "/" not in gold:  # two terminating decimals: exact comparison is final
            return False
    return None


def is_equivalent(pred: str | None, gold: str | None, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether answer strings pred and gold are mathematically equivalent (bounded by timeout seconds)."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p is None or g is None:
        return False
    verdict = _fast_verdict(p, g)
    return verdict if verdict is not None else get_pool().check(p, g, timeout)


def math_reward(response: str, gold: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> float:
    """The paper's +-1: 1.0 if the response's final answer is equivalent to gold, else -1.0."""
    return 1.0 if is_equivalent(extract_answer(response), gold, timeout=timeout) else -1.0


def _check_letter(gold_letter: str) -> str:
    if not (isinstance(gold_letter, str) and len(gold_letter.strip()) == 1 and gold_letter.strip().isalpha()):
        raise ValueError(f"gold_letter must be one letter A-Z, got {gold_letter!r}")
    return gold_letter.strip().upper()


def choice_answer(response: str, gold_letter: str) -> str | None:
    """The letter `choice_reward` compares with gold_letter (letters up to J, or up to the gold's if later)."""
    gold = _check_letter(gold_letter)
    return extract_choice(response, num_choices=max(10, ord(gold) - ord("A") + 1))


def choice_reward(response: str, gold_letter: str) -> float:
    """+-1 for multiple choice (GPQA, MMLU-Pro): 1.0 if the extracted letter is gold_letter."""
    return 1.0 if choice_answer(response, gold_letter) == _check_letter(gold_letter) else -1.0


def answers_found(responses: list[str], kind: str = "math") -> np.ndarray:
    """bool [len(responses)]: whether a final answer can be extracted at all (the extraction `score_batch` uses).
    The EVOL-RL baseline treats responses without one as invalid (reward −1, no novelty)."""
    if kind not in ("math", "choice"):
        raise ValueError(f"answers_found: kind must be 'math' or 'choice', got {kind!r}")
    extract = extract_choice if kind == "choice" else extract_answer
    return np.array([extract(r) is not None for r in responses], dtype=bool)


def _canonical_pairs(responses: list[str], golds: list[str]) -> tuple[list, list[bool | None]]:
    """(canonical answer, canonical gold) per response, and the in-process verdict of each pair (None: the pair
    goes to a worker process)."""
    pairs = [(normalize_answer(extract_answer(r)), normalize_answer(g)) for r, g in zip(responses, golds)]
    return pairs, [False if p is None or g is None else _fast_verdict(p, g) for p, g in pairs]


def score_batch(responses: list[str], golds: list[str], kind: str = "math", *,
                timeout: float = DEFAULT_TIMEOUT_S, num_workers: int | None = None) -> np.ndarray:
    """Rewards (+-1, float32, order preserved) for a batch; math checks run in parallel worker processes.

    A pathological answer costs at most `timeout` seconds and scores -1; it never raises or stalls (a worker
    that cannot start scores -1 with a warning). RuntimeError only if no worker process can start at all.
    Bound (with ready workers): len(responses) * IN_PROCESS_S_PER_RESPONSE for extraction and normalisation in
    this process, plus ceil(len(responses) / workers) * timeout for the checks sent to the workers.
    """
    if len(responses) != len(golds):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(golds)} golds; pass one gold each")
    if kind == "choice":
        return np.array([choice_reward(r, g) for r, g in zip(responses, golds)], dtype=np.float32)
    if kind != "math":
        raise ValueError(f"score_batch: kind must be 'math' or 'choice', got {kind!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    pairs, verdicts = _canonical_pairs(responses, golds)
    pending = [k for k, v in enumerate(verdicts) if v is None]
    if pending:
        pool = get_pool()
        with ThreadPoolExecutor(max_workers=max(1, min(num_workers or 64, len(pending)))) as ex:
            results = ex.map(lambda k: pool.check(pairs[k][0], pairs[k][1], timeout), pending)
            for k, ok in zip(pending, results):
                verdicts[k] = ok
    return np.where(np.array(verdicts, dtype=bool), 1.0, -1.0).astype(np.float32)
