"""MATH-style string normalization of an answer, and the in-process fast path for plain numbers.

`normalize_answer` turns an answer string into a canonical LaTeX string: delimiters (`$`, `\\boxed`), sizing
(`\\left`, `\\right`), `\\dfrac`/`\\tfrac`, spacing commands, degrees, percent, currency, text units, thousands
separators and trailing periods are removed. Two answers with the same canonical string are equivalent without
any parsing; maj@k (`vote.answer_classes`) groups answers by it. It never evaluates anything.

Linear time: whitespace runs are collapsed to one space after every rewrite, so no pattern's `\\s*` can scan a
long run from many start positions (a run of `\\,` once took cubic time in the separator rule), and `\\text{}`
unwrapping decides "is there other content" from counts made once per pass, not by re-scanning the answer.
"""
from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 10_000  # longer answers are rejected up front (scored not equivalent)

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textnormal|textrm|mbox|mathrm|mathbf|mathit|operatorname|"
                          r"mathsf|textup|hbox)\s*\{([^{}]*)\}(\s*\^\s*\{?\d\}?)?")
_UNIT_WORDS = ("units?|sq\\.?|square|cubic|cm|mm|km|meters?|metres?|miles?|mph|inch(?:es)?|feet|foot|ft|yards?|"
               "hours?|minutes?|seconds?|days?|weeks?|months?|years?|degrees?|dollars?|cents?|euros?|yuan|pounds?|"
               "grams?|kg|liters?|gallons?|ways|values|people|students|points?")
_UNIT_RE = re.compile(rf"(?<=[\d}}\s])\s?(?=[A-Za-z])\b(?:{_UNIT_WORDS})\b(?:\s*\^\s*\{{?\d\}}?)?\.?", re.IGNORECASE)
_DELETE = [
    (re.compile(r"\\\\(?=(?:le|ge|leq|geq|lt|gt|neq|frac|dfrac|tfrac|left|right|sqrt|boxed|text|pi|cdot|times|"
                r"infty|pm|in|cup|cap|mathrm)(?![a-zA-Z]))"), "\\\\"),
    (re.compile(r",\\!\s*(?=\d{3}(?!\d))"), ""),  # `10,\!080`: LaTeX's thousands separator
    (re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|displaystyle)(?![a-zA-Z])\s*"), ""),
    (re.compile(r"\\(?:left|right)\."), ""),
    (re.compile(r"\\[dtc]frac(?![a-zA-Z])"), r"\\frac"),
    (re.compile(r"\\[dt]binom(?![a-zA-Z])"), r"\\binom"),
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])"), ""),
    (re.compile(r"\\%|%|\\(?:percent)(?![a-zA-Z])|\b(?:percentage|percent|pct)\b"), ""),
    (re.compile(r"\\\$|\$|€|£|¥"), ""),
    (re.compile(r"\\q?quad|(?<!\\)\\[,;:! ]|~"), " "),
    (re.compile(r"\s*\{,\s*\}\s*"), ""),
    (re.compile(r"\\(?:le|leqslant)(?![a-zA-Z])"), r"\\leq"),
    (re.compile(r"\\(?:ge|geqslant)(?![a-zA-Z])"), r"\\geq"),
    (re.compile(r"\\ne(?![a-zA-Z])"), r"\\neq"),
]
# `31,250`: thousands only for a whole answer, a right-hand side or a brace group (`(1,100)` stays a pair).
_THOUSANDS_RE = re.compile(r"(?:(?<=^)|(?<==)|(?<=[={] ))(-?\d{1,3}(?:,\d{3})+(?:\.\d+)?)(?=$|[.}]| ?[}])")
_SEPARATOR_RE = re.compile(r"\s*,?\s*\b(?:and|or)\b\s*,?\s*|(?<=[0-9)\]}])or(?=[A-Za-z(\[{\\])")
_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/(?:\d+))?")
_SPACES_RE = re.compile(r"\s\s+|[^\S ]")  # runs of whitespace, or one non-space whitespace character
_DIGIT_OR_BRACE_RE = re.compile(r"[\d}]")
_SEPARATOR_TEXT_RE = re.compile(r",?\s*(?:and|or)\s*,?")
_WORDS_RE = re.compile(r"[A-Za-z. ]{2,}")


def _strip_box(s: str) -> str:
    """Unwrap `\\boxed{...}` when it is the whole answer."""
    m = re.fullmatch(r"\\(?:boxed|fbox)\s*\{(.*)\}", s, re.DOTALL)
    return m.group(1) if m else s


def _content_chars(s: str) -> int:
    """Characters of s other than spaces, periods and commas."""
    return len(s) - s.count(" ") - s.count(".") - s.count(",")


def _unwrap_text(s: str) -> str:
    """`\\text{...}`: separators become commas, units after other content are dropped, the rest is unwrapped.
    Linear in len(s): the "other content" tests use counts and one search made before the substitution."""
    def unwrap_once(s: str) -> str:
        content = _content_chars(s)
        first_digit = _DIGIT_OR_BRACE_RE.search(s)
        first_digit_at = first_digit.start() if first_digit else len(s)

        def repl(m: re.Match) -> str:
            inner = m.group(1).strip()
            if _SEPARATOR_TEXT_RE.fullmatch(inner):
                return ", "
            rest = content - _content_chars(m.group(0)) > 0  # something besides this command, spaces, ".", ","
            if _WORDS_RE.fullmatch(inner) and rest and first_digit_at < m.start():
                return " "
            power = m.group(2) or ""
            return (" " + inner + " " if len(inner) > 1 else inner) + power
        return _SPACES_RE.sub(" ", _TEXT_CMD_RE.sub(repl, s))
    for _ in range(3):  # nested \text{\textbf{..}}
        s = unwrap_once(s)
    return s


def normalize_answer(answer: str | None) -> str | None:
    """Canonical string of an answer (see module docstring); None for a missing or over-long answer."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return None
    s = _SPACES_RE.sub(" ", answer).strip()
    s = re.sub(r"^(?:\$\$|\$|\\\[|\\\()|(?:\$\$|\$|\\\]|\\\))$", "", s.strip()).strip()
    s = _strip_box(s.strip())
    for pattern, repl in _DELETE:  # runs of spaces collapse after each rule: every `\s*` below meets at most one
        s = _SPACES_RE.sub(" ", pattern.sub(repl, s))
    s = _SPACES_RE.sub(" ", _unwrap_text(s))
    s = _SPACES_RE.sub(" ", _UNIT_RE.sub(" ", s))
    s = _SEPARATOR_RE.sub(", ", s)
    s = _THOUSANDS_RE.sub(lambda m: m.group(1).replace(",", ""), s.strip())
    s = re.sub(r"\s+", " ", s).strip().rstrip(".,;").strip()
    s = re.sub(r"(?:\s*,\s*)+", ",", s).strip(",")
    s = re.sub(r"^\((?:[A-Z])\)$", lambda m: m.group(0)[1], s)  # "(C)" -> "C"
    # Spaces only matter between a command and a following letter (`\sin b`).
    s = re.sub(r"(?<![a-zA-Z])\s+|\s+(?![a-zA-Z])", "", s)
    return s


def fast_number(canonical: str) -> Fraction | None:
    """Exact value of a canonical answer that is a plain number or a/b fraction, else None (no sympy)."""
    if not _NUMBER_RE.fullmatch(canonical) or len(canonical) > 60:
        return None
    num, _, den = canonical.partition("/")
    if den and int(den) == 0:
        return None
    return Fraction(num) / (Fraction(den) if den else 1)
