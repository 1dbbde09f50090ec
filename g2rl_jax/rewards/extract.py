"""Answer extraction from model text: `\\boxed{}` contents, "final answer is ..." sentences, LaTeX math spans,
plain numbers, and multiple-choice letters.

Everything here is plain string scanning, linear in the input (no backtracking-prone regexes over the whole
response), so it runs in the calling process without a time bound. Inputs are cut to their last
`MAX_RESPONSE_CHARS` characters first: the answer of a long response is at its end.
"""
from __future__ import annotations

import re

MAX_RESPONSE_CHARS = 50_000  # answers live at the end of a response; older text is never scanned
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_MARKER_RE = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)
_STOP_RE = re.compile(r"I hope|<\||\n\n")
# A plain number in prose: thousands groups (1,000 / 1 000), decimal point or comma, optional /denominator.
_PLAIN_NUM_RE = re.compile(
    r"(?<![A-Za-z0-9_.])-?(?:\d{1,3}(?:(?:,|\s)\d{3})+(?![\d])|\d+)(?:[.,]\d+)?(?:/\d+)?|(?<![\w.])-?\.\d+")
_JOIN_WORD_RE = re.compile(r"\band\b|\bor\b|,|;")
_MAX_JOIN_GAP = 50
_GLUED_OR_RE = re.compile(r"(?<=[0-9)\]}])(?:or|and)(?=[A-Za-z(\[{\\])")
_BROKEN_SPAN_RE = re.compile(r"(?<!\\)\$[^$]*(?<!\\)\$|\\\(.{0,500}?\\\)", re.DOTALL)
_UNIT_WORDS_RE = re.compile(r"\b(?:percentage|percent|pct)\b")


def _match_brace(text: str, open_idx: int) -> int | None:
    """Index of the `}` closing the `{` at open_idx (escaped `\\{`/`\\}` do not count), or None."""
    depth, i, n = 0, open_idx, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _boxed_at(text: str, m: re.Match) -> tuple[str, int, int] | None:
    """(content, start, end) of the box command matched at m; `end` is one past its last character."""
    i = m.end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        close = _match_brace(text, i)
        if close is None:
            return None
        return text[i + 1:close], m.start(), close + 1
    word = re.match(r"[^\s$]+", text[i:])
    if word is None:
        return None
    return word.group(0).rstrip("."), m.start(), i + word.end()


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\boxed 5` / `\\fbox{...}` in text, or None if there is none."""
    text = text[-MAX_RESPONSE_CHARS:]
    for m in reversed(list(_BOX_RE.finditer(text))[-8:]):
        found = _boxed_at(text, m)
        if found is not None:
            return found[0]
    return None


def _joinable(gap: str) -> bool:
    """Whether the text between two answer pieces only separates them ("and", ",", `\\quad`, punctuation)."""
    if len(gap) > _MAX_JOIN_GAP:
        return False
    stripped = re.sub(r"\\q?quad|\\text\{|[{}$\\]", " ", gap)
    if _JOIN_WORD_RE.search(stripped):
        return True
    return not re.search(r"[A-Za-z0-9]", stripped)


def _boxed_run(text: str) -> tuple[str, int] | None:
    """The last box, joined with the boxes just before it when only separators lie between them."""
    boxes = [b for b in (_boxed_at(text, m) for m in list(_BOX_RE.finditer(text))[-16:]) if b is not None]
    if not boxes:
        # An unclosed last box: everything after it is the answer.
        last = list(_BOX_RE.finditer(text))
        if last and text[last[-1].end():].lstrip().startswith("{"):
            body = text[last[-1].end():].lstrip()[1:]
            return body, last[-1].start()
        return None
    run = [boxes[-1]]
    for prev in reversed(boxes[:-1]):
        if prev[2] > run[0][1] or not _joinable(text[prev[2]:run[0][1]]):
            break
        run.insert(0, prev)
    return ", ".join(b[0] for b in run), run[-1][1]


def math_spans(text: str) -> list[tuple[str, int, int]]:
    """LaTeX math spans `$..$`, `$$..$$`, `\\(..\\)`, `\\[..\\]` as (content, start, end); inline ones end at a
    newline. Escaped `\\$` is not a delimiter. Linear time: the next closer of each kind is found once and reused."""
    spans, i, n = [], 0, len(text)
    closers = {"$$": "$$", "$": "$", "\\(": "\\)", "\\[": "\\]"}
    next_at: dict[str, int] = {}

    def find(token: str, pos: int) -> int:
        cached = next_at.get(token, -2)
        if cached == -1 or cached >= pos:
            return cached
        j = text.find(token, pos)
        while token.startswith("$") and j > 0 and text[j - 1] == "\\":
            j = text.find(token, j + 1)
        next_at[token] = j
        return j

    while i < n:
        opener = next((o for o in ("$$", "$", "\\(", "\\[") if text.startswith(o, i)), None)
        if opener is None:
            i += 2 if text[i] == "\\" else 1
            continue
        close = closers[opener]
        j = find(close, i + len(opener))
        newline = find("\n", i) if opener in ("$", "\\(") else -1
        if j == -1 or (newline != -1 and newline < j):
            i += len(opener)
            continue
        spans.append((text[i + len(opener):j], i, j + len(close)))
        i = j + len(close)
    return spans


def _plain_number(s: str) -> str:
    """Canonical form of a number found in prose: thousands separators dropped, decimal comma -> point."""
    s = s.strip()
    if re.fullmatch(r"-?[1-9]\d{0,2}(?:[, ]\d{3})+(?:\.\d+)?", s):
        return re.sub(r"[, ]", "", s)
    return s.replace(",", ".")


def _candidate(segment: str, first: bool) -> str | None:
    """The first (or last) math-span run or plain number in segment that carries a digit, else the first (or
    last) math-span run."""
    spans = math_spans(segment)
    cands = [(start, k) for k, (_, start, _) in enumerate(spans)]
    masked = list(segment)
    for _, start, end in spans:
        masked[start:end] = " " * (end - start)
    for m in _BROKEN_SPAN_RE.finditer("".join(masked)):  # `$ \n 9 \n $`: not math, and not prose either
        masked[m.start():m.end()] = " " * (m.end() - m.start())
    cands += [(m.start(), _plain_number(m.group(0))) for m in _PLAIN_NUM_RE.finditer("".join(masked))]
    cands.sort()
    text_of = lambda c: _span_run(segment, spans, c) if isinstance(c, int) else c  # noqa: E731
    with_digit = [c for _, c in cands if re.search(r"\d", spans[c][0] if isinstance(c, int) else c)]
    if with_digit:
        return text_of(with_digit[0] if first else with_digit[-1])
    return text_of(0 if first else len(spans) - 1) if spans else None


def _span_run(text: str, spans: list, k: int) -> str:
    """Math span k joined with its neighbours when only "and"/"or"/commas separate them."""
    lo = hi = k
    while lo > 0 and _span_gap_joins(text[spans[lo - 1][2]:spans[lo][1]]):
        lo -= 1
    while hi + 1 < len(spans) and _span_gap_joins(text[spans[hi][2]:spans[hi + 1][1]]):
        hi += 1
    return ", ".join(s[0] for s in spans[lo:hi + 1])


def _span_gap_joins(gap: str) -> bool:
    return len(gap) <= 12 and _JOIN_WORD_RE.search(gap) is not None and not re.search(r"\d", gap)


def _looks_like_prose(text: str) -> bool:
    """Two or more words of three letters or more, outside LaTeX commands."""
    words = re.findall(r"(?<![\\a-zA-Z])[A-Za-z]{3,}", text)
    return len([w for w in words if w.lower() not in ("and", "percent", "percentage", "pct")]) >= 2


def extract_answer(text: str) -> str | None:
    """The final answer of a model response, as a LaTeX answer string.

    Priority: the later of the last boxed run and the last "answer is ..." sentence; then, for text with math
    spans, the last span run (or a later plain number); for short text without prose, the text itself; else the
    last plain number.
    """
    text = text[-MAX_RESPONSE_CHARS:].strip()
    boxed = _boxed_run(text)
    markers = list(_MARKER_RE.finditer(text))
    if markers and (boxed is None or markers[-1].start() > boxed[1]):
        segment = text[markers[-1].end():]
        stop = _STOP_RE.search(segment)
        found = _candidate(segment[:stop.start()] if stop else segment[:400], first=True)
        if found is not None:
            return found
    if boxed is not None:
        return boxed[0]
    spans = math_spans(text)
    if not spans and _PLAIN_NUM_RE.fullmatch(text):
        return _plain_number(text)
    bare = _GLUED_OR_RE.sub(" ", _UNIT_WORDS_RE.sub("", text))
    if not spans and not re.search(r"(?<![\\a-zA-Z])[A-Za-z]{3,}", bare):
        return text  # a bare answer such as `\frac{1}{2}` or `x^2+1`
    if spans and not _looks_like_prose(text):
        return _span_run(text, spans, len(spans) - 1)
    return _candidate(text, first=False)


# A choice letter after "answer is" / "Answer:": in parentheses or between `*` (any case: `(c)`, `**c**`), or a
# bare capital that ends the sentence (`C.`, `C)`, `$C$`, `C` at a line's end) or is followed by "because",
# "since" or "as". A bare lowercase letter, or a capital followed by other words, is English ("the answer is a
# tricky one", "the answer is I think ..."), not a choice. After "option"/"choice", "is correct" decides.
_ENCLOSED_LETTER = r"\(\s*([A-Za-z])\s*\)|(?<=\*)([A-Za-z])(?=\*)"
_CHOICE_PATTERNS = [
    re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{\s*)?\(?([A-Z])\)?\s*(?:\}\s*)?\}"),
    re.compile(r"\banswer\s*(?:is|:)[\s*:$]*(?:(?:option|choice)[\s*:$]*)?(?:" + _ENCLOSED_LETTER +
               r"|(?-i:([A-Z]))(?=[ \t]*(?:$|[\n.,;:!?)\]*$\-–—])|\s+(?:because|since|as)\b))", re.IGNORECASE),
    re.compile(r"\b(?:option|choice)\s*(?:" + _ENCLOSED_LETTER + r"|(?-i:([A-Z]))(?!\w))\s*is\s*(?:the\s*)?correct",
               re.IGNORECASE),
]


def extract_choice(text: str, num_choices: int = 10) -> str | None:
    """The chosen letter (A.. up to num_choices) from `\\boxed{C}`, "The answer is (C)", "Answer: C" and the like.

    Takes the last match of the most specific pattern that matches; letters past num_choices are ignored.
    """
    if not 1 <= num_choices <= 26:
        raise ValueError(f"num_choices must be in 1..26, got {num_choices}")
    text = text[-MAX_RESPONSE_CHARS:]
    valid = {chr(ord("A") + k) for k in range(num_choices)}
    for pattern in _CHOICE_PATTERNS:
        letters = [next(g for g in m.groups() if g).upper() for m in pattern.finditer(text)]
        letters = [c for c in letters if c in valid]
        if letters:
            return letters[-1]
    stripped = re.sub(r"[\s().*:$]", "", text)
    return stripped if stripped in valid else None


def text_after_answer(text: str) -> str | None:
    """What follows the last complete `\\boxed{...}` of text (None when it has none): "" for a response that ends
    with its answer, the trailing text otherwise (the demo's summary counts non-blank tails as junk)."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        found = _boxed_at(text, m)
        if found is not None:
            return text[found[2]:]
    return None
