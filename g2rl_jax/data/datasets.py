"""Named datasets over the vendored files, plus any local jsonl file, normalized to `Example` records.

`load_dataset("math500")` reads the package's own copy (g2rl_jax/data/files, see LICENSES.md there);
`load_dataset("path/to/x.jsonl", fields={"problem": "question", "answer": "gold"})` reads a local file whose keys
differ from the defaults. Other modules add datasets with `register_dataset(name, loader)`. The demo's datasets
(`demo`, `demo_test`, `countdown`, ...) are known here by name only, through g2rl_jax/registry.py: the first
`load_dataset` of one imports the module the registry names, which registers them (the demo builds on `data`, never
the other way round).
A file or name that cannot be read raises `DataError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import io
import json
import random
import string
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from g2rl_jax import registry, storage

FILES_DIR = Path(__file__).parent / "files"
GPQA_PASSWORD = b"g2rl-gpqa"  # see files/LICENSES.md: the zip keeps GPQA out of plain-text crawls
GPQA_SHUFFLE_SEED = 0
LETTERS = string.ascii_uppercase

Kind = Literal["math", "choice"]


class DataError(ValueError):
    """A dataset name or file that cannot be read; the message names the file and line and says what to fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One prompt: `answer` is the gold answer string (math) or the gold option letter (choice)."""

    id: str
    problem: str
    answer: str
    kind: Kind = "math"
    choices: tuple[str, ...] | None = None
    row: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # every field read

    def as_row(self) -> dict[str, Any]:
        """The dataset row with all its fields (a jsonl row keeps every key it had), plus id, problem, answer, kind
        and choices under those names where the row has no such key: what a custom reward function gets."""
        row = dict(self.row)
        for key in ("id", "problem", "answer", "kind", "choices"):
            row.setdefault(key, list(self.choices) if key == "choices" and self.choices else getattr(self, key))
        return row

    def __post_init__(self):
        if self.kind not in ("math", "choice"):
            raise ValueError(f"Example {self.id!r}: kind must be 'math' or 'choice', got {self.kind!r}")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > len(LETTERS):
                raise ValueError(f"Example {self.id!r}: a choice example needs 1..26 choices, got {self.choices!r}")
            letters = LETTERS[: len(self.choices)]
            if self.answer not in letters:
                raise ValueError(f"Example {self.id!r}: gold letter {self.answer!r} is not one of {list(letters)}")
        elif self.choices is not None:
            raise ValueError(f"Example {self.id!r}: a math example takes no choices (got {self.choices!r})")


Loader = Callable[[], Sequence[Example]]
_REGISTRY: dict[str, Loader] = {}


def register_dataset(name: str, loader: Loader, *, overwrite: bool = False) -> None:
    """Make `load_dataset(name)` call `loader()`, which returns the dataset's Examples."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"dataset {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = loader


def dataset_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(registry.DATASETS))


def load_dataset(
    name_or_path: str | Path, *, fields: Mapping[str, str] | None = None, kind: Kind | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Examples of a registered dataset, or of a local .jsonl / .jsonl.gz file read with `fields` and `kind`.

    For files only: `fields` maps Example field names (id, problem, answer, choices) to the file's keys (defaults:
    the same names; a missing id becomes "file:line"), `kind` is "math" (default) or "choice" (answer = a letter).
    `limit` keeps the first `limit` examples.
    """
    key = str(name_or_path)
    if key in registry.DATASETS and key not in _REGISTRY:
        importlib.import_module(registry.DATASETS[key])  # registers it
    if key in _REGISTRY:
        if fields is not None or kind is not None:
            raise DataError(f"fields= and kind= apply to jsonl files only; {key!r} is a registered dataset")
        examples = list(_REGISTRY[key]())
        if not examples:
            raise DataError(f"dataset {key!r} has no usable rows (its loader returned nothing)")
    elif storage.is_file(key):  # a local file or a URL (gs://bucket/data.jsonl)
        examples = read_jsonl_examples(storage.path(key), fields=fields or {}, kind=kind or "math")
    else:
        raise DataError(
            f"unknown dataset {key!r}: it is neither a registered name ({', '.join(dataset_names())}) "
            "nor an existing .jsonl/.jsonl.gz file"
        )
    return examples if limit is None else examples[:limit]


def iter_jsonl(path, text: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line of a local or URL `path`; a malformed line raises naming the file
    and line."""
    if text is None:
        data = storage.read_bytes(path)
        try:
            text = (gzip.decompress(data) if path.name.endswith(".gz") else data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of the decoded stream); "
                             "save the file as UTF-8") from None
    for lineno, line in enumerate(io.StringIO(text), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                            "JSON object") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        yield lineno, row


def _field(row: dict[str, Any], key: str, path: Path, lineno: int) -> Any:
    if key not in row:
        raise DataError(
            f"{path}:{lineno}: missing key {key!r} (the line has {sorted(row)}); map your keys with "
            "data.fields=problem=KEY,answer=KEY in the config (fields={'problem': ..., 'answer': ...} in Python)"
        )
    return row[key]


def _text(row: dict[str, Any], key: str, path: Path, lineno: int) -> str:
    """A string field; an integer (AIME-style answers stored as JSON numbers) is written as its digits. null,
    booleans, floats, lists and objects are errors: str() of them would become a gold such as "None"."""
    value = _field(row, key, path, lineno)
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{path}:{lineno}: {key!r} is {json.dumps(value)} ({type(value).__name__}); it must be a string "
                     "(or an integer); fix or delete that line")


def read_jsonl_examples(path: Path, *, fields: Mapping[str, str], kind: Kind) -> list[Example]:
    """Examples from a jsonl file; rows with an empty problem or answer are skipped, a null or non-string one is an
    error naming the line."""
    unknown = set(fields) - {"id", "problem", "answer", "choices"}
    if unknown:
        raise DataError(f"fields= has unknown Example fields {sorted(unknown)}; use id, problem, answer, choices")
    keys = {"id": "id", "problem": "problem", "answer": "answer", "choices": "choices", **fields}
    examples = []
    for lineno, row in iter_jsonl(path):
        problem = _text(row, keys["problem"], path, lineno)
        answer = _text(row, keys["answer"], path, lineno)
        choices = _choices(row, keys["choices"], path, lineno) if kind == "choice" else None
        if problem and answer:
            example_id = str(row.get(keys["id"], f"{path.name}:{lineno}"))
            try:
                examples.append(Example(id=example_id, problem=problem, answer=answer, kind=kind, choices=choices,
                                        row=row))
            except ValueError as err:  # e.g. a gold letter that is not one of the choices
                raise DataError(f"{path}:{lineno}: {err}") from None
    if not examples:
        raise DataError(f"{path}: no usable rows (every row has an empty {keys['problem']!r} or {keys['answer']!r})")
    return examples


def _choices(row: dict[str, Any], key: str, path: Path, lineno: int) -> tuple[str, ...]:
    options = _field(row, key, path, lineno)
    if not isinstance(options, list) or not all(isinstance(o, (str, int)) and not isinstance(o, bool)
                                                 for o in options):
        raise DataError(f"{path}:{lineno}: {key!r} must be a list of strings, got {json.dumps(options)[:200]}")
    return tuple(str(o).strip() for o in options)


def _vendored_math(filename: str, id_key: str) -> Loader:
    return lambda: read_jsonl_examples(FILES_DIR / filename, fields={"id": id_key}, kind="math")


def shuffle_options(correct: str, incorrect: Sequence[str], key: str, seed: int = GPQA_SHUFFLE_SEED):
    """(options, gold letter): the options in an order fixed by (seed, key), the gold letter following them."""
    options = [correct, *incorrect]
    random.Random(f"{seed}:{key}").shuffle(options)  # str seeds hash with SHA-512: stable across runs and platforms
    return tuple(options), LETTERS[options.index(correct)]


def load_gpqa_diamond(seed: int = GPQA_SHUFFLE_SEED) -> list[Example]:
    """GPQA diamond, decrypted in memory; options shuffled per question with a fixed seed."""
    path = FILES_DIR / "gpqa_diamond.zip"
    with zipfile.ZipFile(path) as archive:
        text = archive.read("gpqa_diamond.jsonl", pwd=GPQA_PASSWORD).decode("utf-8")
    examples = []
    for lineno, row in iter_jsonl(path, text):
        record_id = str(_field(row, "record_id", path, lineno))
        incorrect = [str(o).strip() for o in _field(row, "incorrect_answers", path, lineno)]
        correct = str(_field(row, "correct_answer", path, lineno)).strip()
        options, gold = shuffle_options(correct, incorrect, record_id, seed)
        problem = str(_field(row, "question", path, lineno)).strip()
        examples.append(Example(id=record_id, problem=problem, answer=gold, kind="choice", choices=options))
    return examples


def load_mmlu_pro() -> list[Example]:
    """MMLU-Pro test; the gold is the `answer` letter (question 3983's answer_index disagrees upstream)."""
    path = FILES_DIR / "mmlu_pro_test.jsonl.gz"
    return [
        Example(
            id=str(_field(row, "question_id", path, lineno)),
            problem=str(_field(row, "question", path, lineno)).strip(),
            answer=str(_field(row, "answer", path, lineno)),
            kind="choice",
            choices=tuple(str(o).strip() for o in _field(row, "options", path, lineno)),
        )
        for lineno, row in iter_jsonl(path)
    ]


register_dataset("math_train", _vendored_math("math_train.jsonl.gz", "unique_id"))
register_dataset("math500", _vendored_math("math500_test.jsonl", "unique_id"))
register_dataset("aime24", _vendored_math("aime2024.jsonl", "id"))
register_dataset("aime25", _vendored_math("aime2025.jsonl", "id"))
register_dataset("amc23", _vendored_math("amc2023.jsonl", "id"))
register_dataset("gpqa_diamond", load_gpqa_diamond)
register_dataset("mmlu_pro", load_mmlu_pro)

