"""The README and docs/ stay true to the repository: every relative link resolves to a file (and heading), nothing
points outside the repository, no page carries a commit hash, an issue number or a working note, the README stays
short enough to read to the end, and docs/config.md is exactly what `python -m g2rl_jax.train --help` prints now.
What a user runs from the docs works: a run directory the docs read is one a config or the page's own command writes,
every launcher's `--help` exits 0 and tpu.sh's header names every subcommand, and every TPU type the docs name is one
`launch/tpu.sh` understands. The figures of the README and of the docs pages in FIGURE_PAGES are dated, with their
command (or the page that holds it), or called what they are (an estimate, a model, a bound).

`python tests/test_docs.py` rewrites docs/config.md from the current help."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from g2rl_jax.config import format_help

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
from tpu import accelerator_type, parser, runtime_version  # noqa: E402 - launch/ is not a package

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
NOTES = re.compile(r"trimming is owed|the session had|in a later session|(?:ended|died) with the session|"
                   r"in one session and the next|\bthis stop\b|the stop before|\bfixed since\b|this page's changes|"
                   r"\bthe issue(?:'s| allows| asks)", re.I)
# notes other engineers remove from their pages; each exemption is the exact text, so a new note still fails
NOTES_EXEMPT = {"docs/study.md": ["died with the session", "in one session and the next", "the issue allows",
                                  "The issue's"],
                "docs/performance.md": ["the issue's"]}
README_MAX_LINES = 170


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_commit_hashes_issue_numbers_or_working_notes(page):
    text = page.read_text(encoding="utf-8")
    notes = [n for n in NOTES.findall(text) if n not in NOTES_EXEMPT.get(page.relative_to(ROOT).as_posix(), [])]
    found = HASH.findall(text) + ISSUE.findall(text) + notes
    assert not found, f"{page.name}: {found}"


def test_the_checks_above_catch_what_they_are_for():
    assert HASH.findall("measured at abc1234, before") == ["abc1234"]
    assert not HASH.findall("a 2026-11-26 run, 1234567 s, deadbeef")
    assert ISSUE.findall("(issue 29)") and ISSUE.findall("Issues #4") and not ISSUE.findall("an issue of 29 GB")
    assert NOTES.findall("over the goal, trimming is owed")
    for note in ("the last of this stop", "1,239 s the stop before", "with this page's changes", "fixed since",
                 "its first process died with the session", "in one session and the next session resumed it",
                 "15 minutes the issue allows"):  # working notes docs/testing.md and docs/study.md carried
        assert NOTES.findall(note), note
    assert not NOTES.findall("the session's compilation cache; Runtime > Restart session; the stop flag")


# ------------------------------------------------------------------------------- figures: dated, or an estimate
FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?\s?(?:s|ms|min|minutes|hours?|GB|GiB|MB|%|tokens/s|programs)"
                    r"(?![\w/])|\b\d\.\d+ → \d\.\d+")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# a command (in backticks), or the page that holds it
SOURCE = re.compile(r"`(?:[A-Z_][A-Z0-9_]*=\S+ )*(?:python|pytest|bash|du|uv|pip|launch/)[^`]*`"
                    r"|\]\((?:docs/)?[\w/]+\.md")
BOUND = re.compile(r"\b(?:estimated?s?|modell?ed|model|not measured|at most|at least|default|up to|within|limit|"
                   r"below|above)\b", re.I)
FIGURE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # every page
# figures a model produced, with the subject that identifies them: wherever quoted, the sentence says estimate
ESTIMATES = [re.compile(r"\b147\b.{0,40}\b1\.7B\b|\b1\.7B\b.{0,40}\b147\b")]


def figure_blocks(text: str):
    """(sentence, its paragraph with the paragraph before a table) of the prose and table rows, code left out. A
    heading is a title, judged with the paragraph under it, which carries the date and command of what it names."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks = re.split(r"\n\s*\n", text)
    before = ""
    for i, block in enumerate(blocks):
        rows = block.splitlines()[2:] if block.lstrip().startswith("|") else None
        under = blocks[i + 1] if re.fullmatch(r"#{1,6} [^\n]+", block.strip()) and i + 1 < len(blocks) else ""
        for part in rows if rows is not None else re.split(r"(?<=[.;:])\s+(?=[A-Z(`*])", block):
            yield " ".join(part.split()), block + (before if rows is not None else under)
        before = block if rows is None else before


def undated(text: str) -> list[str]:
    return [sentence for sentence, block in figure_blocks(text) if FIGURE.search(sentence)
            and not (DATE.search(block) and SOURCE.search(block)) and not BOUND.search(sentence)]


def unmarked_estimates(text: str) -> list[str]:
    return [sentence for sentence, _ in figure_blocks(text) if any(e.search(sentence) for e in ESTIMATES)
            and not re.search(r"\bestimate", sentence)]


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_figures_are_dated_with_their_command_or_called_estimates(page):
    text = page.read_text(encoding="utf-8")
    assert not undated(text) and not unmarked_estimates(text), undated(text) + unmarked_estimates(text)


def test_the_figure_rules_catch_what_they_are_for():
    """The README's sentences as they were: an undated suite time, a range with no date, the bill's estimate
    reading as a measurement."""
    assert undated("The suite runs on CPU in three workers, about 14 minutes on two cores ([testing](docs/t.md)).")
    assert undated("Expect, in a few minutes on two CPU cores (150–190 s):")
    assert not undated("Two runs, 2026-11-27 (`python -m g2rl_jax.train`): 189 s and 150 s.")
    assert not undated("A backoff of at most 30 s.")
    # a heading's figure is dated by the paragraph under it, not by the page's other paragraphs
    assert undated("### The bill: 263 programs\n\nA table.\n\nOn 2026-11-27, `python -m x`.")
    assert not undated("### The bill: 263 programs\n\nThe bill of 2026-11-27, `python -m x`.\n\nNo figure.")
    # an environment variable's name may hold digits
    assert not undated("The full demo took 273 s of CPU, 2026-11-27 (`G2RL_FULL_DEMO=1 python -m pytest -q`).")
    old = "A run compiles once: 59 programs for a demo-size run, 147 at 1.7B on v5p-8: [perf](docs/performance.md)."
    assert unmarked_estimates(old) and not unmarked_estimates(old.replace("147", "147 (an estimate)"))


# ------------------------------------------------------------------------------- paths the docs read
READS = re.compile(r"(?:--checkpoint|--best-from|--table)\s+((?:gs://[\w.-]+/)?runs/[\w./-]+)")
WRITES = re.compile(r"(?:--out|--log|run\.output_dir=|output_dir:|demo:)\s*((?:gs://[\w.-]+/)?runs/[\w./-]+)")


def read_paths(text: str) -> list[str]:
    """The run directories a page's commands read: --checkpoint, --best-from, --table, plot's arguments."""
    reads = READS.findall(text)
    for line in text.splitlines():
        if "g2rl_jax.plot " in line:
            words = shlex.split(line.split("g2rl_jax.plot ", 1)[1].split("#")[0].replace("\\", ""))
            reads += [w for w in words[:words.index("--out") if "--out" in words else None] if "runs/" in w]
    return reads


def config_output_dirs() -> set[str]:
    return {m.group(1) for path in (ROOT / "configs").glob("*.yaml")
            for m in re.finditer(r"^\s*output_dir:\s*(\S+)", path.read_text(encoding="utf-8"), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_run_directory_the_docs_read_is_one_something_writes(page):
    """A path a command in the docs reads (eval's --checkpoint, plot's runs, ...) is a config's run.output_dir or
    one the page's own commands write (--out, run.output_dir=...): runs/g2rl_1p7b, which no config writes, was."""
    text = page.read_text(encoding="utf-8")
    written = config_output_dirs() | set(WRITES.findall(text))
    orphans = [p for p in read_paths(text) if not any(p == w or p.startswith(w.rstrip("/") + "/") for w in written)]
    assert not orphans, f"{page.name}: {orphans} (no config writes them: {sorted(config_output_dirs())})"


def test_the_path_rule_catches_what_it_is_for():
    old = "python -m g2rl_jax.plot runs/grpo_1p7b runs/g2rl_1p7b --out curves.png"
    assert read_paths(old) == ["runs/grpo_1p7b", "runs/g2rl_1p7b"]
    assert not {"runs/grpo_1p7b", "runs/g2rl_1p7b"} & config_output_dirs()
    assert "runs/qwen3_1p7b_g2rl" in config_output_dirs()


# ------------------------------------------------------------------------------- the launchers
LAUNCHERS = sorted(p for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.name)
def test_every_launchers_help_exits_0(launcher):
    done = subprocess.run(["bash", str(launcher), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), (done.stdout, done.stderr)


def test_tpu_sh_header_names_every_subcommand():
    header = (ROOT / "launch" / "tpu.sh").read_text(encoding="utf-8").splitlines()[1]
    subcommands = parser()._subparsers._group_actions[0].choices
    assert header.split(": ", 1)[1].split(" | ") == list(subcommands)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_tpu_type_the_docs_name_is_one_tpu_sh_understands(page):
    """`--accelerator-type X` and `v5e-N` in the docs: tpu.sh maps each to a type with a default runtime (v5e-N, as
    the product is called, is gcloud's v5litepod-N)."""
    text = page.read_text(encoding="utf-8")
    for name in re.findall(r"--accelerator-type ([\w-]+)", text) + re.findall(r"\bv5e-\d+", text):
        assert runtime_version(accelerator_type(name)), name
    assert accelerator_type("v5e-8") == "v5litepod-8" and runtime_version("v5litepod-8") == "v2-alpha-tpuv5-lite"


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
