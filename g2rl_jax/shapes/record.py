"""Shape files: a run's layout and prompt buckets written down, so that a resume keeps them and a measured choice
can be pinned.

    key = choice_key(micro, min_rows, resp_len, shares)    # the sizes a file holds for
    text = choice_record(key, layout, prompts, "model")    # the file's text (CHOICE_FILE in the run directory)
    read_record(path, key, names, buckets, pinned=False)   # (layout name, prompt buckets), or None

The run directory's CHOICE_FILE records what the run chose at its first step (its resumes read it back); a file
named by run.shapes_file pins what `python -m g2rl_jax.bench tune-shapes` chose from measured prices.
"""
from __future__ import annotations

import json

from g2rl_jax import storage
from g2rl_jax.shapes.layouts import Layout

CHOICE_FILE = "micro_shapes.json"  # in the run directory: the layout the run uses, for its resumes
TUNE = "`python -m g2rl_jax.bench tune-shapes --config FILE --out FILE`"


def choice_key(micro: int, min_rows: int, resp_len: int, shares: dict[int, float]) -> dict:
    """The sizes a shape file holds for: micro-batch rows, row shards, response width, the data's prompt buckets."""
    return {"micro": micro, "min_rows": min_rows, "resp_len": resp_len, "prompts": sorted(shares)}


def choice_record(key: dict, layout: Layout, prompts: tuple[int, ...], source: str) -> str:
    """A shape file's text (CHOICE_FILE, run.shapes_file): the sizes it holds for, the layout by name and shapes,
    the prompt buckets and where they came from."""
    return json.dumps({"key": key, "name": layout.name, "shapes": [list(s) for s in layout.shapes],
                       "prompts": list(prompts), "source": source}, sort_keys=True) + "\n"


def read_record(path, key: dict, names, buckets, *, pinned: bool) -> tuple[str, tuple[int, ...]] | None:
    """(layout name, prompt buckets) of a shape file made for the same sizes whose layout is one of `names` and whose
    buckets are among `buckets`; None when there is none (or, for a run's own record, when it holds for other
    sizes or layouts: the run then chooses again). A pinned file that does not fit raises ConfigError."""
    from g2rl_jax.config import ConfigError

    where = f"run.shapes_file={path}"
    if not storage.is_file(path):
        if pinned:
            raise ConfigError(f"{where}: no such file; write one with {TUNE} or leave run.shapes_file empty")
        return None
    try:
        saved = json.loads(storage.read_text(path))
        name, prompts = saved["name"], tuple(saved["prompts"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        if pinned:
            raise ConfigError(f"{where}: not a shape file ({err}); write it again with {TUNE}") from None
        return None
    fits = saved.get("key") == key and name in names and prompts and set(prompts) <= set(buckets)
    if pinned and not fits:
        raise ConfigError(f"{where} holds {name!r} for {saved.get('key')}, this run has {key} (and "
                          "algorithm.packing's layouts); tune it again for this config (`python -m g2rl_jax.bench "
                          "tune-shapes`) or leave run.shapes_file empty")
    return (name, prompts) if fits else None
