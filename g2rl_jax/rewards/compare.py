"""Equivalence of parsed answers (sympy objects and the containers of `values.py`).

Layers, cheapest first: structural equality; numbers (exact, or a decimal of d >= 2 places that equals an
irrational/non-terminating value rounded to d places); tuples (ordered), lists and sets (unordered, one-to-one),
intervals and unions (as sympy sets; a chained inequality in one variable counts as its solution set);
equations (`a = b` and `c = d` are equivalent when a-b and c-d are proportional) and inequalities (positive
proportionality, same strictness); `x = 3`-style labels compare by their value; matrices elementwise; finally
symbolic equivalence of expressions: sympy identity checks plus numeric probes at fixed points.

This module runs sympy and so only ever runs inside a time-bounded worker (see `bounded.py`).
"""
from __future__ import annotations

import math

import sympy

from g2rl_jax.rewards.latex import LatexError, parse_answer
from g2rl_jax.rewards.values import Bracket, ListOf, Relation, SetOf, SetOp, expand_pm

_REL_TOL = 1e-9
_PROBES = ((0.7312, 1.4213, 0.3857), (1.2917, 0.5531, 2.1173), (2.3719, 1.8837, 0.9431))
_MAX_ITEMS = 64


def equivalent_canonical(pred: str, gold: str) -> bool:
    """Equivalence of two canonical answer strings (output of `normalize_answer`)."""
    if pred == gold:
        return True
    try:
        return equal(parse_answer(pred), parse_answer(gold))
    except (LatexError, TypeError, ValueError, ZeroDivisionError, RecursionError, AttributeError):
        return False


def _answers(value) -> list:
    """The separate answers a value stands for (lists and sets flattened, `\\pm` expanded)."""
    if isinstance(value, (ListOf, SetOf)):
        out = [a for item in value.items for a in _answers(item)]
    else:
        out = expand_pm(value)
    if len(out) > _MAX_ITEMS:
        raise LatexError(f"more than {_MAX_ITEMS} answers")
    return out


def equal(a, b) -> bool:
    la, lb = _answers(a), _answers(b)
    if len(la) == 1 and len(lb) == 1:
        return _equal_one(la[0], lb[0])
    for many, one in ((la, lb), (lb, la)):  # `{1, 3}` vs the tuple `(1, 3)`: ordered
        if len(one) == 1 and isinstance(one[0], Bracket) and one[0].open == "(" and one[0].close == ")":
            items = one[0].items
            return len(items) == len(many) and all(equal(x, y) for x, y in zip(many, items))
    return _same_set(la, lb)


def _same_set(la: list, lb: list) -> bool:
    """Set semantics: every answer on each side equals some answer on the other (repeats do not count)."""
    matched_b = set()
    for x in la:
        hits = [j for j, y in enumerate(lb) if _equal_one(x, y)]
        if not hits:
            return False
        matched_b.update(hits)
    return len(matched_b) == len(lb)


def _equal_one(x, y) -> bool:
    if isinstance(x, Relation) or isinstance(y, Relation):
        return _relation_equal(x, y)
    if isinstance(x, SetOp) or isinstance(y, SetOp):
        return _set_equal(x, y)
    if isinstance(x, Bracket) and isinstance(y, Bracket):
        return (x.open, x.close) == (y.open, y.close) and len(x.items) == len(y.items) and all(
            equal(p, q) for p, q in zip(x.items, y.items))
    if isinstance(x, sympy.MatrixBase) and isinstance(y, sympy.MatrixBase):
        return x.shape == y.shape and all(expr_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, sympy.Expr) and isinstance(y, sympy.Expr):
        return expr_equal(x, y)
    return False


# -- relations -------------------------------------------------------------------------------------------------

def _relation_equal(x, y) -> bool:
    if isinstance(x, Relation) and isinstance(y, Relation):
        if len(x.ops) == 1 and len(y.ops) == 1 and _single_relation_equal(x, y):
            return True
        if x.label and y.label:
            return equal(x.terms[-1], y.terms[-1])
        if "=" not in x.ops + y.ops:
            return _set_equal(x, y)
        return x.label != y.label and _label_vs_equation(x, y)
    rel, other = (x, y) if isinstance(x, Relation) else (y, x)
    if rel.label:
        return equal(rel.terms[-1], other)
    return isinstance(other, (Bracket, SetOp)) and _set_equal(rel, other)


def _label_vs_equation(x: Relation, y: Relation) -> bool:
    """`y = -x/2 + 3/4` vs `2x + 4y - 3 = 0`: compare as equations through the first and last terms."""
    return _proportional(x.terms[0] - x.terms[-1], y.terms[0] - y.terms[-1], positive=False)


def _oriented(rel: Relation):
    """(e, strict) with the relation equivalent to e < 0 (strict) or e <= 0; None for = and !=."""
    lhs, rhs, op = rel.terms[0], rel.terms[1], rel.ops[0]
    if op in ("<", "<="):
        return lhs - rhs, op == "<"
    if op in (">", ">="):
        return rhs - lhs, op == ">"
    return None


def _single_relation_equal(x: Relation, y: Relation) -> bool:
    if not all(isinstance(t, sympy.Expr) for t in x.terms + y.terms):
        return False
    if x.ops[0] in ("=", "!=") or y.ops[0] in ("=", "!="):
        if x.ops[0] != y.ops[0]:
            return False
        e1, e2 = x.terms[0] - x.terms[1], y.terms[0] - y.terms[1]
        if not (e1.free_symbols or e2.free_symbols):
            return expr_equal(x.terms[0], y.terms[0]) and expr_equal(x.terms[1], y.terms[1])
        return _proportional(e1, e2, positive=False)
    (e1, s1), (e2, s2) = _oriented(x), _oriented(y)
    return s1 == s2 and _proportional(e1, e2, positive=True)


def _points(expr_syms: list[sympy.Symbol]):
    for probe in _PROBES:
        yield {s: sympy.Float(probe[k % len(probe)] + 0.1 * (k // len(probe))) for k, s in enumerate(expr_syms)}


def _value(expr: sympy.Expr, point: dict) -> complex | None:
    try:
        v = complex(expr.subs(point).evalf(30))
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    return v if math.isfinite(v.real) and math.isfinite(v.imag) else None


def _proportional(e1, e2, positive: bool) -> bool:
    """e1 = c * e2 for one nonzero constant c (c > 0 when positive)."""
    if not isinstance(e1, sympy.Expr) or not isinstance(e2, sympy.Expr):
        return False
    if e1 == e2 and e1 != 0:  # c = 1, without evaluating (sums with symbolic limits evaluate slowly)
        return True
    syms = sorted(e1.free_symbols | e2.free_symbols, key=str)
    if not syms:
        return False
    ratios = []
    for point in _points(syms):
        v1, v2 = _value(e1, point), _value(e2, point)
        if v1 is None or v2 is None or abs(v2) < 1e-12:
            continue
        ratios.append(v1 / v2)
    if len(ratios) < 2 or abs(ratios[0]) < 1e-12:
        return False
    if any(abs(r - ratios[0]) > 1e-8 * abs(ratios[0]) for r in ratios):
        return False
    return not positive or (abs(ratios[0].imag) < 1e-12 and ratios[0].real > 0)


# -- sets ------------------------------------------------------------------------------------------------------

def _to_set(v) -> sympy.Set:
    if isinstance(v, Bracket) and len(v.items) == 2 and all(isinstance(t, sympy.Expr) for t in v.items):
        lo, hi = v.items
        if lo.free_symbols or hi.free_symbols:
            raise LatexError("interval with symbolic ends")
        return sympy.Interval(lo, hi, v.open == "(", v.close == ")")
    if isinstance(v, SetOp):
        parts = [_to_set(p) for p in v.parts]
        if v.op == "cup":
            return sympy.Union(*parts)
        if v.op == "cap":
            return sympy.Intersection(*parts)
        return sympy.Complement(parts[0], sympy.Union(*parts[1:]))
    if isinstance(v, SetOf):
        return sympy.FiniteSet(*v.items)
    if isinstance(v, sympy.Set):
        return v
    if isinstance(v, Relation):
        if v.label and v.ops == ("in",):
            return _to_set(v.terms[-1])
        return _relation_set(v)
    raise LatexError(f"{type(v).__name__} is not a set")


_SYMPY_REL = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge}


def _relation_set(v: Relation) -> sympy.Set:
    """Solution set over the reals of an inequality chain in one variable."""
    if any(op not in _SYMPY_REL for op in v.ops) or not all(isinstance(t, sympy.Expr) for t in v.terms):
        raise LatexError("not an inequality chain")
    syms = set().union(*(t.free_symbols for t in v.terms))
    if len(syms) != 1:
        return _middle_interval(v)
    (var,) = syms
    real = sympy.Symbol(var.name, real=True)
    result = sympy.S.Reals
    for lhs, op, rhs in zip(v.terms, v.ops, v.terms[1:]):
        rel = _SYMPY_REL[op](lhs.subs(var, real), rhs.subs(var, real))
        result = sympy.Intersection(result, sympy.solveset(rel, real, sympy.S.Reals))
    return result


def _middle_interval(v: Relation) -> sympy.Set:
    """`0 < f(x) < 1` -> (0, 1): the range of the middle term of a constant-bounded chain."""
    lo, _, hi = v.terms if len(v.terms) == 3 else (None, None, None)
    if lo is None or lo.free_symbols or hi.free_symbols or len({op[0] for op in v.ops}) != 1:
        raise LatexError("not an interval chain")
    if v.ops[0][0] == ">":
        lo, hi = hi, lo
    return sympy.Interval(lo, hi, v.ops[0] in "<>", v.ops[1] in "<>")


def _set_equal(x, y) -> bool:
    try:
        sx, sy = _to_set(x), _to_set(y)
    except (LatexError, TypeError, ValueError, NotImplementedError):
        return False
    if sx == sy:
        return True
    return sympy.Complement(sx, sy) == sympy.S.EmptySet and sympy.Complement(sy, sx) == sympy.S.EmptySet


# -- expressions -----------------------------------------------------------------------------------------------

def _decimal_places(x: sympy.Expr) -> int | None:
    """Smallest d <= 40 with x * 10^d an integer (x written as a terminating decimal), else None."""
    if not x.is_Rational:
        return None
    for d in range(41):
        if (x * 10 ** d).is_Integer:
            return d
    return None


def _numbers_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    va, vb = _value(a, {}), _value(b, {})
    if va is None or vb is None:
        return False
    exact = a.is_Rational and b.is_Rational  # two exact rationals: equal only if identical (or rounded, below)
    if not exact and abs(va - vb) <= _REL_TOL * max(1.0, abs(vb)):
        return True
    for x, vy, y in ((a, vb, b), (b, va, a)):  # 0.33 for 1/3: a decimal that is the value rounded to d places
        d = _decimal_places(x)
        if d is not None and d >= 2 and _decimal_places(y) is None and abs(vy.imag) < 1e-12:
            if abs(sympy.N(y - x, 60)) <= sympy.Rational(1, 2) * sympy.Rational(10) ** -d:
                return True
    return False


def expr_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    if a == b:
        return True
    if a.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return False
    syms = sorted(a.free_symbols | b.free_symbols, key=str)
    if not syms:
        return _numbers_equal(a, b)
    diff = a - b
    if diff == 0 or sympy.expand(diff) == 0:
        return True
    if diff.has(sympy.Sum, sympy.Product):
        return sympy.simplify(diff) == 0
    finite = 0
    for point in _points(syms):
        va, vb = _value(a, point), _value(b, point)
        if va is None or vb is None:
            continue
        if abs(va - vb) > _REL_TOL * max(1.0, abs(vb)):
            return False
        finite += 1
    if finite >= 2:
        return True
    return sympy.simplify(diff) == 0


# -- fingerprints for maj@k --------------------------------------------------------------------------------------

def fingerprint(canonical: str) -> dict | None:
    """Values of a single expression answer at the probe points `expr_equal` uses, for `vote.answer_classes`:
    {"syms": names, "vals": [[re, im] or None per probe], "decimal": a terminating decimal of >= 2 places}.
    None for anything else (containers, relations, sums and products), which is then compared pair by pair."""
    try:
        value = parse_answer(canonical)
    except (LatexError, TypeError, ValueError, ZeroDivisionError, RecursionError, AttributeError):
        return None
    if not isinstance(value, sympy.Expr) or value.has(sympy.Sum, sympy.Product) or len(expand_pm(value)) != 1:
        return None
    syms = sorted(value.free_symbols, key=str)
    points = list(_points(syms)) if syms else [{}]
    vals = [_value(value, point) for point in points]
    decimal = not syms and (_decimal_places(value) or 0) >= 2
    return {"syms": [str(s) for s in syms], "vals": [None if v is None else [v.real, v.imag] for v in vals],
            "decimal": decimal}
