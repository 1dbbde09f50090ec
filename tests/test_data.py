"""Vendored datasets, the registry, bad-input errors, prompt templates and the grain pipeline with Orbax state."""

import gzip
import json
import re
import subprocess
import sys
from collections import Counter

import jax.numpy as jnp
import pytest

from g2rl_jax.data import (
    Example,
    dataset_names,
    load_dataset,
    make_prompt_loader,
    register_dataset,
)
from g2rl_jax.data.datasets import FILES_DIR, shuffle_options
from g2rl_jax.data.prompts import plain_prompt, user_message

EXPECTED_COUNTS = {
    "math_train": 7498,
    "math500": 500,
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "gpqa_diamond": 198,
    "mmlu_pro": 12032,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_vendored_counts_and_fields(name):
    examples = load_dataset(name)
    assert len(examples) == EXPECTED_COUNTS[name]
    assert len({e.id for e in examples}) == len(examples), "ids must be unique"
    for e in examples:
        assert e.problem.strip() and e.answer.strip()
    kinds = {e.kind for e in examples}
    assert kinds == ({"choice"} if name in ("gpqa_diamond", "mmlu_pro") else {"math"})


def test_known_answers():
    by_id = {e.id: e for e in load_dataset("aime24")}
    assert by_id["2024-I-1"].answer == "204"
    math500 = load_dataset("math500")
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    train_ids = {e.id for e in load_dataset("math_train")}
    assert "train/number_theory/7115.json" not in train_ids and "train/number_theory/7117.json" not in train_ids
    mmlu = {e.id: e for e in load_dataset("mmlu_pro")}
    assert mmlu["70"].answer == "I" and len(mmlu["70"].choices) == 9
    assert mmlu["3983"].answer == "C"  # upstream quirk: answer_index says B, the letter wins


def test_gpqa_shuffle_is_fixed_and_gold_follows():
    first, again = load_dataset("gpqa_diamond"), load_dataset("gpqa_diamond")
    assert first == again
    letters = Counter(e.answer for e in first)
    assert set(letters) == set("ABCD") and max(letters.values()) < 80, letters  # not all gold at one position
    for e in first:  # two questions repeat a wrong option upstream; the gold option is always unique
        gold = e.choices[ord(e.answer) - ord("A")]
        assert len(e.choices) == 4 and e.choices.count(gold) == 1
    assert sum(len(set(e.choices)) < 4 for e in first) == 2
    options, gold = shuffle_options("right", ["w1", "w2", "w3"], key="q1")
    assert options[ord(gold) - ord("A")] == "right"
    assert shuffle_options("right", ["w1", "w2", "w3"], key="q1") == (options, gold)
    orders = {shuffle_options("right", ["w1", "w2", "w3"], key=f"q{i}")[0] for i in range(40)}
    assert len(orders) > 5, "different questions get different orders"


def test_gpqa_never_on_disk_unzipped():
    assert not list(FILES_DIR.glob("gpqa*.jsonl*"))
    assert (FILES_DIR / "gpqa_diamond.zip").is_file() and (FILES_DIR / "LICENSES.md").is_file()


def test_local_jsonl_with_field_mapping(tmp_path):
    path = tmp_path / "x.jsonl"
    rows = [{"question": "1+1?", "gold": "2"}, {"question": "2+2?", "gold": "4", "id": "b"},
            {"question": "", "gold": "0"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    examples = load_dataset(str(path), fields={"problem": "question", "answer": "gold"})
    assert examples == [Example(id="x.jsonl:1", problem="1+1?", answer="2"),
                        Example(id="b", problem="2+2?", answer="4")]
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"id": 7, "problem": "Pick", "answer": "B", "choices": ["x", "y"]}) + "\n")
    assert load_dataset(gz, kind="choice") == [Example(id="7", problem="Pick", answer="B", kind="choice",
                                                       choices=("x", "y"))]
    assert len(load_dataset("math500", limit=3)) == 3


def test_bad_input_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": \n')
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2: not valid JSON")):
        load_dataset(bad)
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'.*aime24.*math500"):
        load_dataset("nope")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"problem": "a", "answer": ""}\n')
    with pytest.raises(ValueError, match="no usable rows"):
        load_dataset(empty)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "a", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"missing.jsonl:1: missing key 'problem'.*fields="):
        load_dataset(missing)
    with pytest.raises(ValueError, match="gold letter 'E'"):
        Example(id="q", problem="p", answer="E", kind="choice", choices=("a", "b"))
    register_dataset("test_empty_dataset", lambda: [], overwrite=True)
    with pytest.raises(ValueError, match="'test_empty_dataset' has no usable rows"):
        load_dataset("test_empty_dataset")
    with pytest.raises(ValueError, match="apply to jsonl files only"):
        load_dataset("math500", kind="choice")
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("math500", lambda: [])


@pytest.mark.parametrize("value, shown", [(None, "null"), (True, "true"), (1.5, "1.5"), ([1], "[1]"),
                                          ({"a": 1}, '{"a": 1}')])
def test_null_or_non_string_answer_is_an_error_naming_the_line(tmp_path, value, shown):
    """json null used to become the gold "None" (and \\boxed{None} scored +1)."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"problem": "a", "answer": "1"}) + "\n" + json.dumps({"problem": "b", "answer": value}))
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: 'answer' is {shown} (")):
        load_dataset(path)
    path.write_text(json.dumps({"problem": None, "answer": "1"}))
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: 'problem' is null")):
        load_dataset(path)


def test_integer_answers_are_their_digits(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text(json.dumps({"problem": "a", "answer": 204}) + "\n")
    assert load_dataset(path)[0].answer == "204"


def test_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"problem": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not UTF-8 text")):
        load_dataset(path)


def test_data_fields_from_the_config_reach_the_file(tmp_path):
    from g2rl_jax.config import DataConfig
    from g2rl_jax.train.setup import load_examples

    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "gold": "2"}) + "\n")
    data = DataConfig(train_dataset=str(path), fields=("problem=question", "answer=gold"))
    assert load_examples(str(path), data) == [Example(id="x.jsonl:1", problem="1+1?", answer="2")]
    assert len(load_examples("math500", data)) == 500  # registered datasets ignore data.fields
    with pytest.raises(ValueError, match=r"missing key 'problem'.*data\.fields=problem=KEY"):
        load_examples(str(path), DataConfig(train_dataset=str(path)))


def test_register_dataset():
    demo = [Example(id=str(i), problem=f"{i}+{i}?", answer=str(2 * i)) for i in range(5)]
    register_dataset("test_demo", lambda: demo, overwrite=True)
    assert "test_demo" in dataset_names()
    assert load_dataset("test_demo") == demo


def test_prompt_templates():
    choice = Example(id="q", problem="Which?", answer="B", kind="choice", choices=("red", "blue", "green"))
    text = user_message(choice)
    assert "A. red\nB. blue\nC. green" in text and "\\boxed{}" in text and "(A, B, C)" in text
    plain = plain_prompt(Example(id="m", problem="What is 1+1?", answer="2"))
    assert plain.startswith("Please reason step by step, and put your final answer within \\boxed{}.")
    assert "What is 1+1?" in plain


# ---- grain pipeline -------------------------------------------------------------------------------------------

EXAMPLES = [Example(id=str(i), problem=f"p{i}", answer=str(i)) for i in range(23)]


def _ids(iterator, n_batches):
    return [[e.id for e in next(iterator)] for _ in range(n_batches)]


def test_same_seed_same_order_and_epochs_reshuffle():
    a = _ids(make_prompt_loader(EXAMPLES, batch_size=5, seed=7, shard_index=0, shard_count=1), 9)
    b = _ids(make_prompt_loader(EXAMPLES, batch_size=5, seed=7, shard_index=0, shard_count=1), 9)
    c = _ids(make_prompt_loader(EXAMPLES, batch_size=5, seed=8, shard_index=0, shard_count=1), 9)
    assert a == b and a != c
    flat = [i for batch in a for i in batch]
    assert sorted(flat[:23]) == sorted(e.id for e in EXAMPLES), "first epoch is a permutation"
    assert flat[:22] != flat[23:45], "second epoch is reshuffled"


def test_shards_are_contiguous_slices_of_the_global_batch():
    """Every shard walks the same global order; shard i keeps rows [i*local, (i+1)*local) of each global batch,
    so the shards are disjoint, together cover the global batch, and the global batches match one process."""
    whole = _ids(make_prompt_loader(EXAMPLES, batch_size=6, seed=1, shard_index=0, shard_count=1), 8)
    shards = [_ids(make_prompt_loader(EXAMPLES, batch_size=6, seed=1, shard_index=i, shard_count=3), 8)
              for i in range(3)]
    for step, batch in enumerate(whole):
        parts = [s[step] for s in shards]
        assert [len(p) for p in parts] == [2, 2, 2]
        assert sum(parts, []) == batch
    seen = []
    for shard in range(3):  # one epoch: 23 examples in global batches of 3, the incomplete last one dropped
        it = make_prompt_loader(EXAMPLES, batch_size=3, seed=1, shard_index=shard, shard_count=3, num_epochs=1)
        seen.append([e.id for batch in it for e in batch])
    assert [len(s) for s in seen] == [7, 7, 7]
    assert len(set(sum(seen, []))) == 21 and set(sum(seen, [])) <= {e.id for e in EXAMPLES}
    with pytest.raises(ValueError, match="shard_index"):
        make_prompt_loader(EXAMPLES, batch_size=3, seed=1, shard_index=3, shard_count=3)
    with pytest.raises(ValueError, match="multiple of shard_count"):
        make_prompt_loader(EXAMPLES, batch_size=4, seed=1, shard_index=0, shard_count=3)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        make_prompt_loader(EXAMPLES, batch_size=24, seed=1, shard_index=0, shard_count=3)


def test_finite_epochs_drop_incomplete_batch():
    it = make_prompt_loader(EXAMPLES, batch_size=5, seed=0, shard_index=0, shard_count=1, num_epochs=2)
    assert len(list(it)) == 46 // 5


def test_orbax_save_restore_gives_same_next_batches(tmp_path):
    """Through the training checkpointer (Orbax), as a resumed run uses it."""
    from g2rl_jax.train.checkpoint import Checkpointer

    def loader():
        return make_prompt_loader(EXAMPLES, batch_size=4, seed=11, shard_index=0, shard_count=1)

    state = {"w": jnp.arange(3.0)}
    iterator = loader()
    _ids(iterator, 7)  # cross an epoch boundary before saving
    ckpt = Checkpointer(tmp_path, every=1, keep=2)
    assert ckpt.save(3, state, iterator)
    ckpt.close()
    expected = _ids(iterator, 6)

    restored = loader()
    _ids(restored, 2)  # a stale position that restore must overwrite
    ckpt = Checkpointer(tmp_path, every=1, keep=2)
    ckpt.restore(3, state, restored)
    ckpt.close()
    assert _ids(restored, 6) == expected


def test_every_demo_dataset_is_known_by_name_before_the_demo_is_imported():
    """A fresh process: the names `dataset_names` lists lazily (g2rl_jax/registry.py) are exactly the ones importing
    the demo registers."""
    code = ("from g2rl_jax.data import datasets as d; from g2rl_jax import registry; import sys\n"
            "before = set(d._REGISTRY)\n"
            "assert 'g2rl_jax.demo.task' not in sys.modules\n"
            "assert len(d.load_dataset('demo_test')) > 0  # by name: imports the demo, which registers the rest\n"
            "assert set(d._REGISTRY) - before == set(registry.DATASETS), sorted(set(d._REGISTRY) - before)\n"
            "print(sorted(registry.DATASETS))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "countdown_study_test" in done.stdout, done.stderr[-2000:]
