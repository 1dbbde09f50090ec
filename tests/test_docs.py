"""The README and docs/ stay true to the repository: every relative link resolves to a file (and heading), nothing
points outside the repository, no page carries a commit hash, an issue number or a working note, the README stays
short enough to read to the end, and docs/config.md is exactly what `python -m g2rl_jax.train --help` prints now.

`python tests/test_docs.py` rewrites docs/config.md from the current help."""

import re
import sys
from pathlib import Path

import pytest

from g2rl_jax.config import format_help

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

CONFIG_DOC_HEAD = """# Configuration reference

Every key of every config group, its type, its default and what it means: the output of
`python -m g2rl_jax.train --help`, which is generated from the typed dataclasses in `g2rl_jax/config_groups.py`.
Where a default says "paper", it is the value the paper gives; "chosen" marks a value the paper leaves open (the
readings behind them: [paper.md](paper.md)). How YAML files, `base:` and dotted overrides work: the README's
[Configuration](../README.md#configuration) section. `tests/test_docs.py` fails when this page differs from the
current help; `python tests/test_docs.py` rewrites it.

"""

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def render_config_doc() -> str:
    return CONFIG_DOC_HEAD + "```\n" + format_help() + "```\n"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else None
        if rel is None:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {rel}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_nothing_points_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"[/]work[/]|\.\.[/]shared", text), page.name  # this machine's checkout, the shared folder


# a 7-40 digit hex word with a letter and a digit (a commit hash), "issue 29" / "issues #4", and notes about how a
# measurement was made rather than what it measured
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
ISSUE = re.compile(r"\bissues? #?\d+", re.I)
NOTES = re.compile(r"trimming is owed|the session had|in a later session|ended with the session", re.I)
README_MAX_LINES = 170


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_commit_hashes_issue_numbers_or_working_notes(page):
    text = page.read_text(encoding="utf-8")
    found = HASH.findall(text) + ISSUE.findall(text) + NOTES.findall(text)
    assert not found, f"{page.name}: {found}"


def test_the_checks_above_catch_what_they_are_for():
    assert HASH.findall("measured at abc1234, before") == ["abc1234"]
    assert not HASH.findall("a 2026-11-26 run, 1234567 s, deadbeef")
    assert ISSUE.findall("(issue 29)") and ISSUE.findall("Issues #4") and not ISSUE.findall("an issue of 29 GB")
    assert NOTES.findall("over the goal, trimming is owed")


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


def test_readme_quick_start_matches_python_requirement():
    """The README's Python floor is pyproject's requires-python (jax, flax, orbax and grain need 3.11)."""
    import tomllib

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor == ">=3.11" and "Python ≥ 3.11" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_config_doc_matches_the_help():
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert doc == render_config_doc(), "docs/config.md is stale: run `python tests/test_docs.py` to rewrite it"


if __name__ == "__main__":
    (ROOT / "docs" / "config.md").write_text(render_config_doc(), encoding="utf-8")
    sys.exit(0)
