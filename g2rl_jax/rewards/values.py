"""Parsed answers: the containers the LaTeX parser returns next to plain sympy objects (tuples/intervals, sets,
lists, set operations, relations), the `\\pm` marker, and the label test for `x = 3`-style answers."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

PM = sympy.Symbol("__pm__")  # a \pm b is parsed as a + PM*b and expanded into two answers afterwards


@dataclass(frozen=True)
class Bracket:
    """`(a, b)`, `[a, b)`, ...: a tuple, or an interval when it has two items."""
    open: str
    close: str
    items: tuple


@dataclass(frozen=True)
class SetOf:
    """`\\{a, b\\}`: an unordered set of answers."""
    items: tuple


@dataclass(frozen=True)
class ListOf:
    """`a, b` at top level (or `{a, b}`): several answers, unordered."""
    items: tuple


@dataclass(frozen=True)
class SetOp:
    """`A \\cup B`, `A \\cap B`, `A \\setminus B` over intervals and sets."""
    op: str
    parts: tuple


@dataclass(frozen=True)
class Relation:
    """A chain `t0 op0 t1 op1 t2 ...` with ops among = < > <= >= != in. `label` marks `x = 3`-style chains
    (a name on the left of `=`/`\\in`) whose value is the last term."""
    terms: tuple
    ops: tuple
    label: bool


def is_label(value) -> bool:
    """A name-like term (`x`, `f(x)`, `|AB|`, `a_{37}`, `(p, q)`, `A:B`): symbols, no numbers, no sums."""
    if isinstance(value, Bracket):
        return all(isinstance(v, sympy.Symbol) for v in value.items)
    if not isinstance(value, sympy.Expr) or not value.free_symbols or PM in value.free_symbols:
        return False
    nodes = list(sympy.preorder_traversal(value))
    return not any(isinstance(n, sympy.Add) for n in nodes) and all(
        abs(n) == 1 for n in nodes if isinstance(n, sympy.Number))


def expand_pm(value) -> list:
    """The answers a value stands for: `a \\pm b` gives two, anything else one."""
    if isinstance(value, sympy.Expr) and PM in value.free_symbols:
        return [value.subs(PM, 1), value.subs(PM, -1)]
    return [value]
