"""The LaTeX answer parser's lexical layer (`g2rl_jax.rewards.latex` builds on it): its errors, the tokenizer,
the tables of known commands, and the size guards and arithmetic every parsed value goes through.

Size guards run before sympy evaluates anything: nesting depth (checked by the parser), literal digits, power and
factorial magnitudes. They raise `TooBig` (scored not equivalent).
"""
from __future__ import annotations

import re

import sympy

from g2rl_jax.rewards.values import PM

MAX_DEPTH = 60            # nesting of brackets / braces / sub-expressions
MAX_LITERAL_DIGITS = 300  # digits in one number literal
MAX_POWER_DIGITS = 2_000  # digits of an evaluated numeric power
MAX_EXPONENT = 1_000      # |integer exponent| on a symbolic base
MAX_FACTORIAL = 500



class LatexError(ValueError):
    """The answer is not LaTeX this parser understands (the caller falls back to string comparison)."""


class TooBig(LatexError):
    """The answer would make sympy build an enormous object (scored not equivalent)."""


TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|(\\[a-zA-Z]+|\\\\|\\[{}|])|([a-zA-Z])|"
                      r"(<=|>=|!=|[-+*/^_()\[\]{}=<>,;:|!&']))")
RELOPS = {"=": "=", "<": "<", ">": ">", "<=": "<=", ">=": ">=", "!=": "!=", r"\leq": "<=", r"\geq": ">=",
          r"\lt": "<", r"\gt": ">", r"\neq": "!=", r"\in": "in", r"\approx": "~", r"\equiv": "="}
FUNCS = {r"\sin": sympy.sin, r"\cos": sympy.cos, r"\tan": sympy.tan, r"\sec": sympy.sec, r"\csc": sympy.csc,
         r"\cot": sympy.cot, r"\arcsin": sympy.asin, r"\arccos": sympy.acos, r"\arctan": sympy.atan,
         r"\sinh": sympy.sinh, r"\cosh": sympy.cosh, r"\tanh": sympy.tanh, r"\ln": sympy.log,
         r"\log": sympy.log, r"\exp": sympy.exp}
CONSTS = {r"\pi": sympy.pi, r"\infty": sympy.oo, r"\emptyset": sympy.S.EmptySet,
          r"\varnothing": sympy.S.EmptySet}
GREEK = set(r"\alpha \beta \gamma \delta \epsilon \varepsilon \zeta \eta \theta \vartheta \iota \kappa \lambda \mu "
            r"\nu \xi \rho \sigma \tau \upsilon \phi \varphi \chi \psi \omega \Gamma \Delta \Theta \Lambda \Xi \Pi "
            r"\Sigma \Phi \Psi \Omega".split())
MATRIX_ENVS = {"pmatrix", "bmatrix", "matrix", "vmatrix", "Bmatrix", "smallmatrix", "array"}
SETOPS = {r"\cup": "cup", r"\cap": "cap", r"\setminus": "setminus"}
NOT_SYMBOLS = {r"\dots", r"\cdots", r"\ldots", r"\vdots", r"\ddots", r"\end", r"\rfloor", r"\rceil",
               r"\text", r"\over", r"\choose", r"\mod", r"\pmod", r"\bmod", r"\to", r"\infty", r"\rightarrow",
               r"\Rightarrow", r"\implies", r"\iff", r"\forall", r"\exists", r"\subset", r"\subseteq"}
ATOM_CMDS = {r"\frac", r"\sqrt", r"\binom", r"\lfloor", r"\lceil", r"\begin", r"\sum", r"\prod", r"\{"}


def tokenize(s: str) -> list[str]:
    tokens, pos = [], 0
    s = s.rstrip()
    while pos < len(s):
        m = TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise LatexError(f"cannot tokenize {s[pos:pos + 10]!r}")
        tokens.append(m.group(m.lastindex))
        pos = m.end()
    return tokens


def number_literal(text: str) -> sympy.Expr:
    if len(text) > MAX_LITERAL_DIGITS:
        raise TooBig(f"number literal with {len(text)} digits")
    return sympy.Rational(text) if "." in text else sympy.Integer(text)


def decimal_digits(x: sympy.Expr) -> float:
    """Decimal digits of a numeric sympy value (for the power guard)."""
    if x.is_Rational:
        return max(len(str(abs(x.p))), len(str(x.q)))
    return 1.0


def bounded_power(base, exp):
    """base**exp, refusing results that would be enormous."""
    if isinstance(base, sympy.MatrixBase):
        if not (exp.is_Integer and 0 <= exp <= 20):
            raise LatexError("matrix power must be a small non-negative integer")
        return base ** int(exp)
    if exp.is_Number and abs(exp) > MAX_EXPONENT and not (base.is_Number and abs(base) in (0, 1)):
        raise TooBig(f"exponent {exp} too large")
    if base.is_Number and exp.is_Number and decimal_digits(base) * float(abs(exp)) > MAX_POWER_DIGITS:
        raise TooBig(f"power {base}^{exp} too large")
    return base ** exp


def need_sympy(*values):
    for v in values:
        if not isinstance(v, (sympy.Basic, sympy.MatrixBase)):
            raise LatexError(f"{type(v).__name__} used in arithmetic")
    return values[0]


def arith(a, b, op: str):
    need_sympy(a, b)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op in (r"\pm", r"\mp"):
        return a + (PM if op == r"\pm" else -PM) * b
    if op == "*":
        return a * b
    if isinstance(b, sympy.MatrixBase) or b == 0:
        raise LatexError("division by zero or by a matrix")
    return a / b
