"""The exploration demo's and the study's task: Countdown. Reach a target with some given numbers and + - * / .

A problem gives four numbers from 1-9 and a target from 1-40, e.g. "Use 3 5 7 8 to make 22"; a response is an
arithmetic expression in `\\boxed{}` that uses each given number at most once (at least two of them) and evaluates
exactly to the target: `\\boxed{3*5+7}`, `\\boxed{8*3-7+5}`. Problems have several answers that differ in more
than the order of their terms, which is what lets a policy collapse onto one of them or keep several.

Two problem sets (`ProblemSet`), each cut into disjoint splits:
    MEMORISE  the first exploration demo's (datasets `countdown`, `countdown_test`; tests use it): every 5th
              multiset of digits, problems with >= 10 answers; 303 training problems, which a tiny policy memorises
    STUDY     the study (configs/study_countdown.yaml, g2rl_jax/demo/study.py; datasets `countdown_study`,
              `countdown_study_test`): every multiset, problems with >= 3 answers, 10,005 problems cut into
              "test" (512 held out), "train" (4,096 for RL: 100 steps x 32 prompts never draw one twice) and "sft"
              (the rest, 5,397: only the warm start sees them)

The reward is a plain Python function of the kind a user plugs in with `reward.function`:

    reward(response: str, example: dict) -> float      # +1 a correct expression and nothing else, -1 otherwise

It parses with a small recursive-descent parser over digits, + - * / and parentheses and computes with exact
fractions; nothing reaches `eval`. Two correct answers are the same answer when `canonical()` maps them to the
same string (sums and products flattened, their terms sorted: "3*5+7" and "7+5*3" are one answer).

    examples("train"), examples("test", STUDY)   # list[Example]; row = {"numbers": [3, 5, 7, 8], "target": 22}
    solutions(numbers, target)                   # every distinct answer (canonical form -> one printed expression)
    expression_value(response, numbers)          # the value of a well-formed answer of those numbers, right or not
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # imported where used: a reward worker imports this module and must not load the data stack
    from g2rl_jax.data.datasets import Example

Split = Literal["train", "test"]
DIGITS = range(1, 10)
NUM_NUMBERS = 4
MULTISET_STRIDE = 5  # every 5th multiset of four digits (99 of 495): enumerating them all takes ~40 s
TARGETS = range(1, 41)
MIN_SOLUTIONS = 10  # distinct answers a kept problem has at least
SHUFFLE_SEED = 20251215
TEST_SIZE = 256
MAX_EXPRESSION_CHARS = 64  # a longer boxed expression is not parsed (scores -1)
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


# ------------------------------------------------------------------------------------------- parsing
class ParseError(ValueError):
    pass


def _tokens(text: str) -> list[str]:
    out = re.findall(r"\d+|[-+*/()]|\S", text)  # whitespace separates tokens: "3 5" is not 35
    bad = [t for t in out if not (t.isdigit() or t in "+-*/()")]
    if bad:
        raise ParseError(f"unexpected character {bad[0]!r}")
    return out


def parse(text: str):
    """The expression tree of `text`: an int leaf or (op, left, right). Grammar: sum := prod (('+'|'-') prod)*,
    prod := atom (('*'|'/') atom)*, atom := number | '(' sum ')'. No unary minus. Raises ParseError."""
    toks, pos = _tokens(text), 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def chain(sub, ops):
        node = sub()
        while peek() is not None and peek() in ops:
            op = take()
            node = (op, node, sub())
        return node

    def atom():
        tok = peek()
        if tok is None:
            raise ParseError("expression ends early")
        if tok.isdigit():
            take()
            return int(tok)
        if tok == "(":
            take()
            node = chain(prod, "+-")
            if peek() != ")":
                raise ParseError("missing ')'")
            take()
            return node
        raise ParseError(f"unexpected {tok!r}")

    def prod():
        return chain(atom, "*/")

    tree = chain(prod, "+-")
    if pos != len(toks):
        raise ParseError(f"unexpected {toks[pos]!r}")
    return tree


def value(tree) -> Fraction | None:
    """Exact value of a tree; None on division by zero."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, a, b = tree[0], value(tree[1]), value(tree[2])
    if a is None or b is None or (op == "/" and b == 0):
        return None
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]


def leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else leaves(tree[1]) + leaves(tree[2])


@functools.lru_cache(maxsize=1 << 16)
def canonical(tree) -> str:
    """One string per answer up to commutativity and associativity: a sum is its sorted added and subtracted
    terms, a product its sorted multiplied and divided factors."""
    if isinstance(tree, int):
        return str(tree)
    kind = "+" if tree[0] in "+-" else "*"
    plus, minus = [], []

    def collect(node, positive):
        if not isinstance(node, int) and (node[0] in "+-") == (kind == "+"):  # same kind: flatten
            collect(node[1], positive)
            collect(node[2], positive if node[0] in "+*" else not positive)
        else:
            (plus if positive else minus).append(canonical(node))

    collect(tree, True)
    inverse = "-" if kind == "+" else "/"
    return "(" + kind.join(sorted(plus)) + "".join(inverse + t for t in sorted(minus)) + ")"


def render(tree, parent: str = "", right: bool = False) -> str:
    """The expression with only the parentheses its meaning needs."""
    if isinstance(tree, int):
        return str(tree)
    op = tree[0]
    text = render(tree[1], op) + op + render(tree[2], op, True)
    prec, outer = PRECEDENCE[op], PRECEDENCE.get(parent, 0)
    needs = prec < outer or (right and prec == outer and parent in "-/")
    return f"({text})" if needs else text


# ------------------------------------------------------------------------------------------- the reward
def boxed_expression(response: str) -> str | None:
    """The text inside a response that is exactly `\\boxed{...}` (surrounding whitespace allowed), else None."""
    match = re.fullmatch(r"\s*\\boxed\{([^{}]*)\}\s*", response)
    return match.group(1) if match else None


def expression_tree(response: str, numbers: list[int]):
    """The tree of a response that is `\\boxed{expr}` and nothing else, expr a well-formed expression of at least
    two of `numbers` (each used at most once); else None."""
    expression = boxed_expression(response)
    if expression is None or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = parse(expression)
    except ParseError:
        return None
    used = leaves(tree)
    pool = list(numbers)
    for x in used:
        if x not in pool:
            return None
        pool.remove(x)
    return tree if len(used) >= 2 else None


def expression_value(response: str, numbers: list[int]) -> Fraction | None:
    """The exact value of the response's expression (expression_tree); None if it has none."""
    tree = expression_tree(response, numbers)
    return None if tree is None else value(tree)


def check(response: str, numbers: list[int], target: int):
    """The answer's tree if `response` is a correct answer, else None."""
    tree = expression_tree(response, numbers)
    return tree if tree is not None and value(tree) == target else None


def reward(response: str, example: dict) -> float:
    """+1.0 when the response is `\\boxed{expr}` and nothing else, expr uses each of `example["numbers"]` at
    most once (at least two of them) and equals `example["target"]` exactly; -1.0 otherwise."""
    numbers, target = example["numbers"], example["target"]
    return 1.0 if check(response, list(numbers), int(target)) is not None else -1.0


# ------------------------------------------------------------------------------------------- problems
def _expressions(numbers: tuple[int, ...]) -> dict[tuple[int, ...], dict[str, tuple]]:
    """For every sub-multiset (as sorted index tuple) of `numbers`: canonical form -> (tree, value) of every
    distinct expression using exactly those numbers, built bottom-up from pairs of disjoint parts."""
    n = len(numbers)
    table: dict[tuple[int, ...], dict[str, tuple]] = {(i,): {str(x): (x, Fraction(x))} for i, x in enumerate(numbers)}
    for size in range(2, n + 1):
        for subset in itertools.combinations(range(n), size):
            found: dict[str, tuple] = {}
            for k in range(1, size):
                for left in itertools.combinations(subset, k):
                    right = tuple(i for i in subset if i not in left)
                    for (ta, va), (tb, vb) in itertools.product(table[left].values(), table[right].values()):
                        for op in "+-*/":
                            if op == "/" and vb == 0:
                                continue
                            tree = (op, ta, tb)
                            v = {"+": va + vb, "-": va - vb, "*": va * vb}[op] if op != "/" else va / vb
                            found.setdefault(canonical(tree), (tree, v))
            table[subset] = found
    return table


@functools.cache
def _all_solutions(numbers: tuple[int, ...]) -> dict[int, dict[str, str]]:
    """target -> {canonical form: rendered expression} over every expression of >= 2 of the numbers."""
    out: dict[int, dict[str, str]] = {}
    for subset, found in _expressions(numbers).items():
        if len(subset) < 2:
            continue
        for key, (tree, v) in found.items():
            if v.denominator == 1 and int(v) in TARGETS:
                out.setdefault(int(v), {}).setdefault(key, render(tree))
    return out


def solutions(numbers: tuple[int, ...], target: int) -> dict[str, str]:
    """Every distinct answer to the problem: canonical form -> a rendered expression."""
    return dict(_all_solutions(tuple(sorted(numbers))).get(target, {}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProblemSet:
    """A seeded set of Countdown problems cut into disjoint splits: every (numbers, target) of every `stride`-th
    multiset of NUM_NUMBERS digits that has at least `min_solutions` distinct answers, shuffled with `shuffle_seed`
    (each problem's numbers in a shuffled order), then cut into `splits` ((name, size), in order; size None: all
    the rest)."""

    stride: int
    min_solutions: int
    shuffle_seed: int
    splits: tuple[tuple[str, int | None], ...]

    def spec(self) -> dict:
        return {"digits": [DIGITS.start, DIGITS.stop], "numbers": NUM_NUMBERS, "stride": self.stride,
                "targets": [TARGETS.start, TARGETS.stop], "min_solutions": self.min_solutions,
                "shuffle_seed": self.shuffle_seed, "splits": [list(s) for s in self.splits]}


# the first exploration demo's problems (datasets countdown, countdown_test): 303 training problems a tiny policy
# can memorise
MEMORISE = ProblemSet(stride=MULTISET_STRIDE, min_solutions=MIN_SOLUTIONS, shuffle_seed=SHUFFLE_SEED,
                      splits=(("test", TEST_SIZE), ("train", None)))
# the study (g2rl_jax/demo/study.py): every multiset, >= 3 answers; the warm start learns from "sft", RL draws
# "train" (each problem at most once per run), "test" is held out from both
STUDY = ProblemSet(stride=1, min_solutions=3, shuffle_seed=20260215,
                   splits=(("test", 512), ("train", 4096), ("sft", None)))


@functools.cache
def _problems(problem_set: ProblemSet) -> tuple[tuple[tuple[int, ...], int], ...]:
    kept = []
    for numbers in list(itertools.combinations_with_replacement(DIGITS, NUM_NUMBERS))[::problem_set.stride]:
        for target, answers in sorted(_all_solutions(numbers).items()):
            if len(answers) >= problem_set.min_solutions:
                kept.append((numbers, target))
    rng = random.Random(problem_set.shuffle_seed)
    rng.shuffle(kept)
    return tuple((tuple(rng.sample(numbers, len(numbers))), target) for numbers, target in kept)


def problem_text(numbers: tuple[int, ...], target: int) -> str:
    return f"Use {' '.join(map(str, numbers))} to make {target}"


def examples(split: str, problem_set: ProblemSet = MEMORISE) -> list[Example]:
    """The examples of `split` of `problem_set` (MEMORISE: "test", the first TEST_SIZE shuffled problems, and
    "train", the rest; STUDY: "test", "train" and "sft")."""
    from g2rl_jax.data.datasets import Example

    names = [name for name, _ in problem_set.splits]
    if split not in names:
        raise ValueError(f"unknown countdown split {split!r}; choose one of {names}")
    problems, start = _problems(problem_set), 0
    for name, size in problem_set.splits:
        stop = len(problems) if size is None else start + size
        if name == split:
            break
        start = stop
    if stop > len(problems):
        raise ValueError(f"countdown split {split!r} needs problems up to {stop}, the set has {len(problems)}")
    return [Example(id=f"countdown-{'.'.join(map(str, n))}-{t}", problem=problem_text(n, t), answer=str(t),
                    row={"numbers": list(n), "target": t}) for n, t in problems[start:stop]]


# ------------------------------------------------------------------------------------------- the warm start
TEACHER_VARIANTS = 4  # correct and wrong responses per problem the warm start's teacher picks from


def teacher_responses(example: Example, rng: random.Random) -> list[str]:
    """TEACHER_VARIANTS distinct correct answers, then TEACHER_VARIANTS wrong ones (answers of the same numbers to
    other targets: well-formed, wrong value), each as `\\boxed{expr}`."""
    numbers, target = example.row["numbers"], example.row["target"]
    table = _all_solutions(tuple(sorted(numbers)))
    right = sorted(solutions(numbers, target).values())
    wrong = sorted(expr for t, answers in table.items() if t != target for expr in answers.values())
    picks = (rng.sample(right, TEACHER_VARIANTS) if len(right) >= TEACHER_VARIANTS  # fewer: some repeat
             else [rng.choice(right) for _ in range(TEACHER_VARIANTS)]) + rng.sample(wrong, TEACHER_VARIANTS)
    return [f"\\boxed{{{expr}}}" for expr in picks]


def corpus(count: int = 64) -> list[str]:
    """Texts the demo tokenizer's merges are learned from: prompts and teacher responses of training problems."""
    from g2rl_jax.data.prompts import plain_prompt

    rng = random.Random(SHUFFLE_SEED)
    return [plain_prompt(ex) + teacher_responses(ex, rng)[0] for ex in examples("train")[:count]]
