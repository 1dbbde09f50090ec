"""A safe LaTeX -> sympy parser for answers: a tokenizer and a recursive-descent parser that builds sympy objects
directly. No string ever reaches `eval`, `sympify` or `parse_expr`; unknown syntax raises `LatexError`.

Supported: numbers (exact Integer/Rational, `204_5` base subscripts, mixed numbers: an integer literal directly
followed by `\\frac` of two integer literals, `3\\frac{1}{2}` = 7/2, while `2\\frac{\\pi}{3}`, `x\\frac12` and
`3\\cdot\\frac12` stay products; a sign applies to the whole mixed number), symbols with subscripts, `\\frac`,
`\\sqrt[n]{}`, `^`, `\\cdot`/`\\times`/`\\div`/`:`, implicit multiplication, `!`, `\\binom`, `|x|`,
`\\lfloor`/`\\lceil`, trig/log/exp functions, `\\pi`, `\\infty`, `e`, `i`, `\\pm`/`\\mp`, `\\sum`/`\\prod`,
tuples and intervals `(a,b]`, sets `\\{..\\}`, `\\cup`/`\\cap`/`\\setminus`, matrices (`pmatrix`, `bmatrix`,
`array`, ...), equations and (chained) inequalities, `\\in`, `\\approx`. Input is a canonical string from
`normalize_answer`; results are sympy objects or the containers of `values.py`.

Size guards run before sympy evaluates anything: nesting depth, literal digits, power and factorial
magnitudes. They raise `TooBig` (scored not equivalent). The tokenizer, the command tables and the guarded
arithmetic are in `latex_lexer.py`; this module is the grammar.
"""
from __future__ import annotations

import re

import sympy

from g2rl_jax.rewards.latex_lexer import (
    ATOM_CMDS,
    CONSTS,
    FUNCS,
    GREEK,
    MATRIX_ENVS,
    MAX_DEPTH,
    MAX_FACTORIAL,
    MAX_LITERAL_DIGITS,
    NOT_SYMBOLS,
    RELOPS,
    SETOPS,
    LatexError,
    TooBig,
    arith,
    bounded_power,
    need_sympy,
    number_literal,
    tokenize,
)
from g2rl_jax.rewards.values import Bracket, ListOf, Relation, SetOf, SetOp, is_label

__all__ = ["LatexError", "TooBig", "parse_answer", "tokenize"]


class _Parser:
    def __init__(self, tokens: list[str]):
        self.toks, self.i, self.depth, self.abs_depth = tokens, 0, 0, 0

    # -- token helpers
    def peek(self, k: int = 0) -> str | None:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def take(self) -> str:
        if self.i >= len(self.toks):
            raise LatexError("unexpected end of answer")
        self.i += 1
        return self.toks[self.i - 1]

    def expect(self, tok: str) -> None:
        got = self.take()
        if got != tok:
            raise LatexError(f"expected {tok!r}, got {got!r}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise TooBig(f"nesting deeper than {MAX_DEPTH}")

    # -- answers
    def answer(self):
        groups = [self.comma_list()]
        while self.peek() == ";":
            self.take()
            groups.append(self.comma_list())
        if self.peek() is not None:
            raise LatexError(f"unexpected {self.peek()!r}")
        if len(groups) > 1:  # `p=5,q=2;p=7,q=2`: each group is one ordered answer
            return ListOf(tuple(g[0] if len(g) == 1 else Bracket("(", ")", tuple(g)) for g in groups))
        return groups[0][0] if len(groups[0]) == 1 else ListOf(tuple(groups[0]))

    def comma_list(self) -> list:
        items = [self.item()]
        while self.peek() == ",":
            self.take()
            items.append(self.item())
        return items

    def item(self):
        terms, ops = [self.union()], []
        while self.peek() in RELOPS:
            op = RELOPS[self.take()]
            if op == "~" and "=" in ops:  # `x = 1/3 \approx 0.33`: the approximation is commentary
                self.union()
                continue
            ops.append("=" if op == "~" else op)
            terms.append(self.union())
        if not ops:
            return terms[0]
        label = all(o in ("=", "in") for o in ops) and (any(is_label(t) for t in terms[:-1]) or (
            set(ops) == {"="} and all(isinstance(t, sympy.Expr) and not t.free_symbols for t in terms)))
        return Relation(tuple(terms), tuple(ops), label)

    def union(self):
        parts, op = [self.expr()], None
        while self.peek() in SETOPS:
            this = SETOPS[self.take()]
            if op is not None and this != op:
                parts, op = [SetOp(op, tuple(parts))], None
            op = this
            parts.append(self.expr())
        return parts[0] if op is None else SetOp(op, tuple(parts))

    # -- arithmetic
    def expr(self):
        self.enter()
        value = self.term()
        while self.peek() in ("+", "-", r"\pm", r"\mp"):
            op = self.take()
            rhs = self.term()
            value = arith(value, rhs, op)
        self.depth -= 1
        return value

    def term(self):
        value = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", r"\cdot", r"\times"):
                self.take()
                value = arith(value, self.unary(), "*")
            elif tok in ("/", r"\div", ":"):
                self.take()
                value = arith(value, self.unary(), "/")
            elif self.starts_atom(tok):
                value = arith(value, self.power(), "*")
            else:
                return value

    def unary(self):
        tok = self.peek()
        if tok in ("-", "+", r"\pm", r"\mp"):
            self.take()
            self.enter()
            inner = self.unary()
            self.depth -= 1
            return arith(sympy.Integer(0), inner, tok)
        return self.power()

    def starts_atom(self, tok: str | None) -> bool:
        if tok is None:
            return False
        if tok == "|":
            return self.abs_depth == 0
        return (tok[0].isdigit() or tok[0] == "." or tok.isalpha() or tok in ("(", "[", "{")
                or tok in ATOM_CMDS or tok in FUNCS or tok in CONSTS or tok in GREEK)

    def power(self):
        base = self.atom()
        while self.peek() in ("!", "'"):
            if self.take() == "!":
                if not (base.is_Integer and 0 <= base <= MAX_FACTORIAL):
                    raise TooBig("factorial of a large or non-integer value")
                base = sympy.factorial(base)
        if self.peek() == "^":
            self.take()
            self.enter()
            exp = self.single_arg()
            self.depth -= 1
            need_sympy(base, exp)
            base = bounded_power(base, exp)
        return base

    def single_arg(self):
        """A `{group}` or one token: `\\frac94`, `x^23` -> x^2 * 3, `\\sqrt 2`."""
        tok = self.peek()
        if tok == "{":
            self.take()
            value = self.expr()
            self.expect("}")
            return value
        if tok is not None and tok[0].isdigit() and len(tok) > 1:
            self.toks[self.i] = tok[1:]
            return sympy.Integer(tok[0])
        if tok == "-":  # x^-1
            self.take()
            return -self.single_arg()
        return self.atom(mixed=False)  # `x^3\frac12` is x^3 / 2, not x^(7/2)

    def atom(self, mixed: bool = True):
        tok = self.take()
        self.enter()
        try:
            return self._atom(tok, mixed)
        finally:
            self.depth -= 1

    def mixed_fraction(self):
        """After an integer literal: the fraction of integer literals that makes it a mixed number (`3\frac{1}{2}`,
        `3\frac12`), consumed and returned as a Rational; None (nothing consumed) when the next tokens are not
        `\frac` with two integer-literal arguments."""
        toks, i = self.toks, self.i
        if i >= len(toks) or toks[i] != r"\frac":
            return None
        i += 1
        if i < len(toks) and len(toks[i]) == 2 and toks[i].isdigit():  # `\frac12`: one token, two digits
            return sympy.Rational(int(toks[i][0]), int(toks[i][1])) if self._consume(i + 1, toks[i][1]) else None
        parts = []
        for _ in range(2):
            if i + 2 < len(toks) and toks[i] == "{" and toks[i + 1].isdigit() and toks[i + 2] == "}":
                parts.append(toks[i + 1])
                i += 3
            elif i < len(toks) and len(toks[i]) == 1 and toks[i].isdigit():
                parts.append(toks[i])
                i += 1
            else:
                return None
        if len(parts[0]) > MAX_LITERAL_DIGITS or len(parts[1]) > MAX_LITERAL_DIGITS:
            raise TooBig("mixed number with an over-long literal")
        return sympy.Rational(int(parts[0]), int(parts[1])) if self._consume(i, parts[1]) else None

    def _consume(self, end: int, denominator: str):
        """Move past a mixed number's fraction ending before token `end`; False for a zero denominator."""
        if int(denominator) == 0:
            return False
        self.i = end
        return True

    def _atom(self, tok: str, mixed: bool = True):
        if tok[0].isdigit() or tok[0] == ".":
            value = number_literal(tok)
            fraction = self.mixed_fraction() if mixed and tok.isdigit() else None
            if fraction is not None:  # `3\frac{1}{2}` is 7/2, the way MATH and graders read it
                return value + fraction
            if self.peek() == "_":  # 204_5: a numeral in base 5
                self.take()
                base = self.single_arg()
                try:
                    return sympy.Integer(int(tok, int(base)))
                except (ValueError, TypeError) as err:
                    raise LatexError(f"bad base numeral {tok}_{base}") from err
            return value
        if tok.isalpha() or tok in GREEK:
            return self.symbol(tok.lstrip("\\"))
        if tok in CONSTS:
            return CONSTS[tok]
        if tok in ("(", "["):
            return self.bracket(tok)
        if tok == "{":
            items = self.comma_list()
            self.expect("}")
            return items[0] if len(items) == 1 else ListOf(tuple(items))
        if tok == r"\{":
            items = [] if self.peek() == r"\}" else self.comma_list()
            self.expect(r"\}")
            return SetOf(tuple(items))
        if tok == "|":
            self.abs_depth += 1
            inner = self.expr()
            self.abs_depth -= 1
            self.expect("|")
            return sympy.Abs(need_sympy(inner))
        if tok == r"\frac":
            num = self.single_arg()
            den = self.single_arg()
            return arith(num, den, "/")
        if tok == r"\sqrt":
            if self.peek() == "[":
                self.take()
                n = self.expr()
                self.expect("]")
                return bounded_power(need_sympy(self.single_arg()), 1 / need_sympy(n))
            return sympy.sqrt(need_sympy(self.single_arg()))
        if tok == r"\binom":
            n, k = self.single_arg(), self.single_arg()
            if not (n.is_Number and abs(n) <= MAX_FACTORIAL or not n.is_Number):
                raise TooBig("binomial too large")
            return sympy.binomial(n, k)
        if tok in (r"\lfloor", r"\lceil"):
            inner = self.expr()
            self.expect(r"\rfloor" if tok == r"\lfloor" else r"\rceil")
            return (sympy.floor if tok == r"\lfloor" else sympy.ceiling)(need_sympy(inner))
        if tok in FUNCS:
            return self.function(tok)
        if tok in (r"\sum", r"\prod"):
            return self.big_operator(tok)
        if tok == r"\begin":
            return self.matrix()
        if re.fullmatch(r"\\[a-zA-Z]+", tok) and tok not in NOT_SYMBOLS:
            return self.symbol(tok[1:])  # an unknown command such as `\zeta` or `\zzz` names a symbol
        raise LatexError(f"unsupported token {tok!r}")

    def symbol(self, name: str):
        if self.peek() == "_":
            self.take()
            start = self.i
            self.single_arg()
            name = f"{name}_{{{''.join(self.toks[start:self.i]).strip('{}')}}}"
        elif name == "e":
            return sympy.E
        elif name == "i":
            return sympy.I
        return sympy.Symbol(name)

    def bracket(self, opening: str):
        items = self.comma_list()
        while self.peek() == ";":
            self.take()
            items += self.comma_list()
        closing = self.take()
        if closing not in (")", "]"):
            raise LatexError(f"unclosed {opening!r}")
        if len(items) == 1 and not (opening == "(" and closing == "]" or opening == "[" and closing == ")"):
            return items[0]
        return Bracket(opening, closing, tuple(items))

    def function(self, tok: str):
        exponent, base = None, None
        if tok == r"\log" and self.peek() == "_":
            self.take()
            base = self.single_arg()
        if self.peek() == "^":
            self.take()
            exponent = self.single_arg()
        if self.peek() == "(":
            self.take()
            arg = self.expr()
            self.expect(")")
        else:
            arg = self.power()
        value = FUNCS[tok](need_sympy(arg)) if base is None else sympy.log(arg, base)
        return value if exponent is None else bounded_power(value, exponent)

    def big_operator(self, tok: str):
        self.expect("_")
        self.expect("{")
        var = self.symbol(self.take())
        self.expect("=")
        lower = self.expr()
        self.expect("}")
        self.expect("^")
        upper = self.single_arg()
        body = self.term()
        cls = sympy.Sum if tok == r"\sum" else sympy.Product
        return cls(need_sympy(body), (var, lower, upper))

    def matrix(self):
        self.expect("{")
        env = "".join(iter(self.take, "}"))
        if env not in MATRIX_ENVS:
            raise LatexError(f"unsupported environment {env!r}")
        if env == "array" and self.peek() == "{":
            while self.take() != "}":
                pass
        rows, row = [], [self.expr()]
        while True:
            tok = self.take()
            if tok == "&":
                row.append(self.expr())
            elif tok == "\\\\":
                rows.append(row)
                if self.peek() == r"\end":
                    row = []
                    continue
                row = [self.expr()]
            elif tok == r"\end":
                if row:
                    rows.append(row)
                self.expect("{")
                while self.take() != "}":
                    pass
                break
            else:
                raise LatexError(f"unexpected {tok!r} in matrix")
        if len({len(r) for r in rows}) != 1:
            raise LatexError("ragged matrix")
        return sympy.ImmutableMatrix([[need_sympy(x) for x in r] for r in rows])


def parse_answer(canonical: str):
    """Parse a canonical answer string into a sympy object or one of the answer containers above."""
    return _Parser(tokenize(canonical)).answer()
