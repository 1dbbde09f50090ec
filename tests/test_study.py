"""The study of gradient-guided novelty (g2rl_jax/demo/study.py): its measures against brute force, its bootstrap
against a plain resampling loop, the study task's splits, and a 2-run, 2-step study through the real command."""
from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from g2rl_jax.demo import countdown as cd
from g2rl_jax.demo import study
from g2rl_jax.demo.explore_eval import judge, problem_record
from g2rl_jax.demo.study_report import bootstrap, bootstrap_runs, training_summary

ROW = {"numbers": [3, 5, 7, 8], "target": 22}
TEXTS = ["\\boxed{3*5+7}", "\\boxed{7+5*3}", "\\boxed{8*3-7+5}", "\\boxed{3+5}", "\\boxed{3+5}", "junk",
         "\\boxed{8+8+6}", "\\boxed{3*(8-5)+7+...}"]


# ------------------------------------------------------------------------------------------------ measures
def test_judge_votes_on_values_of_well_formed_expressions():
    correct, canonical, labels, used = judge(TEXTS, ROW)
    assert correct == [True, True, True, False, False, False, False, False]
    assert canonical[0] == canonical[1] != canonical[2] and canonical[3:] == [None] * 5
    # 22, 22, 22, 8, 8, no vote (not an expression), no vote (8 used twice, 6 not given), no vote (malformed)
    assert labels == [0, 0, 0, 1, 1, None, None, None]
    assert used == [3, 3, 4, 2, 2, 0, 0, 0]
    assert judge(["\\boxed{8/(5-5)}", "\\boxed{8/(7-5)}"], ROW)[2] == [None, 0]  # 5 is given once
    assert judge(["\\boxed{3/(8-8)}"], {"numbers": [3, 8, 8, 1], "target": 1})[2:] == ([None], [3])


def test_problem_record_matches_brute_force_over_subsets():
    """pass@k, distinct@k: averages over every k-subset of the n samples; maj@n: the plurality value."""
    record = problem_record(TEXTS, ROW)
    correct, canonical, _, _ = judge(TEXTS, ROW)
    n = len(TEXTS)
    assert (record["n"], record["c"]) == (n, 3)
    assert (record["valid"], record["two_numbers"], record["unique"]) == (5 / 8, 2 / 8, 7)
    for k in (1, 2, 4, 8):
        subsets = list(itertools.combinations(range(n), k))
        want_pass = np.mean([any(correct[i] for i in s) for s in subsets])
        want_distinct = np.mean([len({canonical[i] for i in s if correct[i]}) for s in subsets])
        assert record["pass"][k] == pytest.approx(want_pass)
        assert record["distinct"][k] == pytest.approx(want_distinct)
    assert record["maj"][8] == 1.0  # 22 has three votes, 8 has two
    assert record["maj"][1] == 1.0 and record["maj"][4] == 1.0  # the first k: 22 leads from the start
    wrong_first = TEXTS[3:5] + TEXTS[:1] + TEXTS[5:]
    assert problem_record(wrong_first, ROW)["maj"][4] == 0.0  # 8, 8, 22, junk: 8 wins


# ------------------------------------------------------------------------------------------------ statistics
def np_bootstrap(x, y=None, draws=300, seed=0):
    """The resampling written out: per draw, resample problems (shared), then each array's seeds; the mean."""
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(a, np.float64) for a in (x, y) if a is not None]
    p = arrays[0].shape[1]
    problems = rng.integers(0, p, (draws, p))
    stats = np.zeros(draws)
    seeds = [rng.integers(0, a.shape[0], (draws, a.shape[0])) for a in arrays]
    for d in range(draws):
        means = [a[s[d]][:, problems[d]].mean() for a, s in zip(arrays, seeds)]
        stats[d] = means[0] - (means[1] if len(means) > 1 else 0.0)
    return np.percentile(stats, [2.5, 97.5])


def test_bootstrap_equals_the_resampling_loop():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 40)), rng.normal(0.3, 1, size=(3, 40))
    for args in ((x,), (x, y)):
        got = bootstrap(*args, draws=300, seed=0)
        np.testing.assert_allclose([got["lo"], got["hi"]], np_bootstrap(*args), rtol=1e-12)
    assert bootstrap(x)["mean"] == pytest.approx(x.mean())
    assert bootstrap(x, y)["mean"] == pytest.approx(x.mean() - y.mean())
    runs = bootstrap_runs([0.1, 0.2, 0.3], draws=300)
    assert runs["lo"] >= 0.1 and runs["hi"] <= 0.3 and runs["mean"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="same problems"):
        bootstrap(x, y[:, :10])


def test_bootstrap_interval_covers_the_truth_about_95_percent():
    """Seeds and problems both add noise; the interval over both covers the true mean in most repetitions."""
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(60):
        seed_effect = rng.normal(0, 0.05, size=(5, 1))
        x = 0.3 + seed_effect + rng.normal(0, 0.2, size=(5, 64))
        ci = bootstrap(x, draws=400, seed=int(rng.integers(1 << 30)))
        hits += ci["lo"] <= 0.3 <= ci["hi"]
    assert hits >= 48  # ~0.9 or more of 60 (percentile intervals with 5 seeds run a little narrow)


def test_training_summary_weights_steps_by_their_groups():
    records = [{"step": 0, "val/x/mean@4": 0.1}] + [
        {"step": s, "accuracy": 0.1 * s, "entropy": 1.0 / s, "novelty": 0.5, "single_class_fraction": f,
         "all_wrong_fraction": f, "single_class_adv_most_novel": a, "single_class_adv_least_novel": a and -a,
         "all_wrong_adv_most_novel": a, "all_wrong_adv_least_novel": a and -a}
        for s, f, a in ((1, 0.5, 1.0), (2, 0.25, -2.0), (3, 0.0, None))]
    out = training_summary(records)
    assert out["train accuracy"] == pytest.approx(0.2) and out["single-class share"] == pytest.approx(0.25)
    assert out["A(most novel), single-class"] == pytest.approx((0.5 * 1.0 + 0.25 * -2.0) / 0.75)
    assert out["A(least novel), all-wrong"] == pytest.approx(-(0.5 * 1.0 + 0.25 * -2.0) / 0.75)
    assert out["entropy first"] == 1.0 and out["novelty last"] == 0.5


# ------------------------------------------------------------------------------------------------ the grid
def test_grid_seed_major_and_the_better_g2rl_variant():
    runs = study.grid(["grpo", "g2rl_zero"], 2)
    assert [r.name for r in runs] == ["grpo_s0", "g2rl_zero_s0", "grpo_s1", "g2rl_zero_s1"]
    assert runs[1].overrides == ("algorithm.exploration=g2rl", "algorithm.single_class_groups=zero")
    lam = study.lambda_runs("g2rl_zero", [0.25, 1.0], 1)
    assert [r.name for r in lam] == ["g2rl_zero_lam0.25_s0", "g2rl_zero_lam1_s0"]
    assert lam[0].overrides[-1] == "algorithm.lam=0.25"
    assert study.better_g2rl({"g2rl_shaped": [0.2, 0.3], "g2rl_zero": [0.3, 0.3]}) == "g2rl_zero"
    assert study.better_g2rl({"g2rl_shaped": [0.3, 0.3], "g2rl_zero": [0.3, 0.3]}) == "g2rl_shaped"
    assert study.better_g2rl({"g2rl_zero": [0.1]}) == "g2rl_zero"


@pytest.mark.parametrize("argv, message", [
    (["--variants", "grpo,ppo"], "unknown"), (["--seeds", "0"], "--seeds must be >= 1"),
    (["--lambdas", "a"], "comma-separated numbers"), (["--geometry-samples", "1"], "geometry-samples"),
    (["run.total_steps"], "key=value"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        study.parse_args(argv)
    assert err.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the task
@pytest.fixture(scope="module")
def study_splits():
    return {name: cd.examples(name, cd.STUDY) for name, _ in cd.STUDY.splits}


def test_study_splits_are_disjoint_and_every_problem_has_three_answers(study_splits):
    sizes = {name: len(v) for name, v in study_splits.items()}
    assert sizes["test"] == 512 and sizes["train"] == 4096 and sizes["sft"] > 4000
    keys = {name: {(tuple(sorted(e.row["numbers"])), e.row["target"]) for e in v} for name, v in study_splits.items()}
    assert sum(len(k) for k in keys.values()) == sum(sizes.values())  # no problem twice, within or across splits
    rng = np.random.default_rng(0)
    for name, examples in study_splits.items():
        for i in rng.choice(len(examples), 30, replace=False):
            ex = examples[i]
            answers = cd.solutions(tuple(ex.row["numbers"]), ex.row["target"])
            assert len(answers) >= 3, (name, ex.problem)
            assert all(cd.reward(f"\\boxed{{{a}}}", ex.as_row()) == 1.0 for a in answers.values())
    assert cd.examples("test") == cd.examples("test", cd.MEMORISE)  # the old demo's problems are unchanged
    counts = Counter(len(e.row["numbers"]) for e in study_splits["test"])
    assert counts == {4: 512}


def test_study_warm_start_recipe():
    """countdown-study:DIR builds the demo architecture on the `sft` split with an always-right teacher; its spec
    (and so its cache key) differs from the exploration demo's."""
    from g2rl_jax.demo import build

    spec = build.policy_spec(0, build.default_sft_steps("countdown_study"), "countdown_study")
    assert build.SCHEMES["countdown-study:"] == "countdown_study"
    assert spec["task"]["splits"] == [["test", 512], ["train", 4096], ["sft", None]]
    assert spec["sft"]["steps"] == 5000 and spec["sft"]["batch_size"] == 128 and spec["sft"]["teacher_accuracy"] == 1
    assert spec["architecture"] == build.policy_spec(0, 1000, "countdown")["architecture"]
    assert build._spec_hash(spec) != build._spec_hash(build.policy_spec(0, 5000, "countdown"))


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """A 2-run, 2-step study on a tiny random Qwen3 and 8 held-out problems, run twice (the second skips both)."""
    from g2rl_jax.demo.tokenizer import make_tokenizer

    from hf_tiny import make_tiny_qwen3_dir

    root = tmp_path_factory.mktemp("study")
    tok = make_tokenizer(cd.corpus(8))
    model = make_tiny_qwen3_dir(root / "model", vocab_size=-(-len(tok) // 64) * 64, max_position_embeddings=128,
                                num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=16,
                                num_attention_heads=2, num_key_value_heads=2)
    tok.save_pretrained(model)
    rows = [ex.as_row() for ex in cd.examples("test")[:24]]
    for name, part in (("train.jsonl", rows[8:]), ("test.jsonl", rows[:8])):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    argv = ["--out", str(root / "out"), "--variants", "grpo,g2rl_shaped", "--seeds", "1", "--lambda-seeds", "0",
            "--problems", "8", "--samples", "4", "--geometry-samples", "4", "--batch-size", "8",
            "run.total_steps=2", f"model.path={model}", f"data.train_dataset={root / 'train.jsonl'}",
            f"data.eval_datasets={root / 'test.jsonl'}", "data.prompts_per_step=2", "rollout.num_samples=4",
            "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=8", "run.loggers=jsonl"]
    assert study.main(argv) == 0
    return root / "out", argv


def test_tiny_study_writes_the_report(tiny_study, capsys):
    out, argv = tiny_study
    for name in ("study.md", "study.json", "passk.png", "geometry.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "study.json").read_text())
    assert list(summary["table"]) == ["warmstart", "grpo", "g2rl_shaped"]
    assert summary["measures"] == ["pass@1", "maj@4", "pass@4", "distinct@4", "gradient cosine", "negative pairs"]
    shaped = summary["table"]["g2rl_shaped"]
    assert "A(least novel), single-class" in shaped and "single-class share" in shaped
    assert "A(least novel), single-class" not in summary["table"]["grpo"]
    assert set(summary["differences"]) == {"g2rl_shaped − grpo"}
    for name in ("grpo_s0", "g2rl_shaped_s0"):
        run = summary["runs"][name]
        assert run["time"]["train"]["cpu_s"] > 0 and run["time"]["eval"]["wall_s"] > 0
        assert 0 <= run["held_out_pass@1"] <= 1 and len(run["responses"]) == 6
        evaluation = json.loads((out / "runs" / name / study.EVAL_FILE).read_text())
        assert len(evaluation["cosine_mean"]) == 8 and evaluation["ks"] == [1, 2, 4]
        assert all(-1 <= c <= 1 for c in evaluation["cosine_mean"])
    table = (out / "study.md").read_text()
    assert "| g2rl_shaped | 1 |" in table and "g2rl_shaped − grpo" in table
    capsys.readouterr()
    assert study.main(argv) == 0  # restarted: every run is finished, so nothing trains again
    printed = capsys.readouterr().out
    assert printed.count("done earlier, skipped") == 2 and "training (" not in printed
    times = {name: json.loads((out / "runs" / name / study.TIME_FILE).read_text()) for name in ("grpo_s0",)}
    assert study.main([*argv, "--reevaluate"]) == 0  # evaluated again, the training (and its time) kept
    printed = capsys.readouterr().out
    assert printed.count("evaluating 8 held-out problems") == 3 and "training (" not in printed
    assert json.loads((out / "runs" / "grpo_s0" / study.TIME_FILE).read_text())["train"] == times["grpo_s0"]["train"]
    assert "two-number responses" in (out / "study.md").read_text()


def test_report_only_needs_finished_runs(tmp_path):
    with pytest.raises(SystemExit, match="no finished run"):
        study.main(["--out", str(tmp_path), "--report-only"])


# ------------------------------------------------------------------------------------------------ the extended grid
def test_every_variant_is_a_config_and_belongs_to_a_family():
    from g2rl_jax.config import load_config

    for task in study.TASKS.values():
        for overrides in study.VARIANTS.values():
            cfg = load_config(task.config, list(overrides))
            assert cfg.algorithm.exploration in overrides[0]
    assert {"grpo", *study.PEERS, *study.GRADIENT_GUIDED, *study.SINGLE_CLASS} == set(study.VARIANTS)
    assert study.VARIANTS["g2rl_after_literal"][1:] == ("algorithm.novelty_placement=advantage",
                                                        "algorithm.shaping_mode=literal")
    assert study.variant_overrides("g2rl_zero_lam0.25")[-1] == "algorithm.lam=0.25"
    assert study.VARIANTS["g2rl_correct_peers"][-1] == "algorithm.single_class_groups=zero"


def test_best_variants_by_held_out_pass_at_n(tmp_path):
    def finished(name, variant, pass_n):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / study.EVAL_FILE).write_text(json.dumps({"run": {"variant": variant}, "samples": 4,
                                                       "pass": {"1": [0.9, 0.9], "4": pass_n}}))

    finished("grpo_s0", "grpo", [1.0, 1.0])
    finished("passk_s0", "passk", [0.6, 0.8])
    finished("passk_s1", "passk", [0.8, 0.8])
    finished("nsr_s0", "nsr", [0.7, 0.7])
    finished("g2rl_zero_s0", "g2rl_zero", [0.5, 0.5])
    finished("g2rl_zero_lam0.25_s0", "g2rl_zero_lam0.25", [0.6, 0.6])
    assert study.best_variants(tmp_path) == ("passk", "g2rl_zero_lam0.25")  # pass@n, not pass@1; λ points count
    (tmp_path / "runs" / "nsr_s0" / study.EVAL_FILE).unlink()
    for name in ("passk_s0", "passk_s1"):
        (tmp_path / "runs" / name / study.EVAL_FILE).unlink()
    with pytest.raises(SystemExit, match="no finished run of entropy_bonus"):
        study.best_variants(tmp_path)


def test_task_arguments_and_defaults(tmp_path, capsys):
    args = study.parse_args(["--task", "sumprod"])
    assert (args.seeds, args.lambda_seeds, args.max_new_tokens, args.problems, str(args.config)) == (
        3, 0, 128, 256, "configs/study_sumprod.yaml")
    assert study.parse_args([]).max_new_tokens == 16 and study.parse_args(["--seeds", "2"]).seeds == 2
    with pytest.raises(SystemExit):
        study.parse_args(["--best-from", str(tmp_path)])
    assert "no finished study there" in capsys.readouterr().err
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit):
        study.parse_args(["--best-from", str(tmp_path), "--variants", "grpo"])
    assert "drop --variants" in capsys.readouterr().err


def test_time_totals_count_the_warm_start_build():
    from g2rl_jax.demo.study_report import time_totals

    t = lambda w, c: {"wall_s": w, "cpu_s": c}  # noqa: E731
    summary = {"times": {"warmstart": {"build": t(600, 500), "eval": t(60, 30)},
                         "grpo_s0": {"train": t(100, 90), "eval": t(10, 5)},
                         "grpo_s1": {"train": t(120, 80), "eval": t(20, 6)}}}
    totals = time_totals(summary)
    assert totals["training, 2 runs"] == t(220, 170) and totals["evaluation, 2 runs"] == t(30, 11)
    assert totals["total"] == t(910, 711)
    summary["times"]["warmstart"] = {"build": t(615, None), "build_and_eval": t(114, 42)}  # a build without CPU
    assert time_totals(summary)["total"] == t(979, None)


def test_tiny_study_draws_the_tradeoff_and_the_totals(tiny_study):
    out, _ = tiny_study
    assert (out / "tradeoff.png").stat().st_size > 0
    text = (out / "study.md").read_text()
    assert "| total |" in text and "| training, 2 runs |" in text


def test_an_earlier_reports_rows_are_read_back_and_drawn(tiny_study, tmp_path):
    """earlier_rows reads a report's held-out table back to its printed digits; --earlier-report draws the variants
    this study did not run beside its own; a file without the table is one line."""
    from g2rl_jax.demo.study_report import earlier_rows

    out, _ = tiny_study
    summary = json.loads((out / "study.json").read_text())
    rows = earlier_rows(out / "study.md")
    assert list(rows) == list(summary["table"]) and rows["grpo"]["seeds"] == 1
    for variant, row in summary["table"].items():
        for measure in summary["measures"]:
            assert {k: round(row[measure][k], 3) for k in ("mean", "lo", "hi")} == rows[variant][measure]
    earlier = tmp_path / "earlier.md"
    text = (out / "study.md").read_text()
    earlier.write_text("Quoted:\n\n" + text.replace("| g2rl_shaped | 1 |", "| passk | 5 |", 1))
    assert "passk" in earlier_rows(earlier)
    assert study.main(["--out", str(out), "--report-only", "--earlier-report", str(earlier)]) == 0
    assert (out / "tradeoff.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="holds no held-out table"):
        earlier_rows(out / "study.json")


def test_a_lambda_point_without_its_base_is_paired_with_grpo_only(tiny_study, tmp_path):
    """--best-from may pick a λ point ("g2rl_zero_lam0.25") whose base variant that study never ran: the report
    pairs it with GRPO and not with the missing base (it raised KeyError before)."""
    out, _ = tiny_study
    for name in ("warmstart", "grpo_s0", "g2rl_shaped_s0"):
        shutil.copytree(out / "runs" / name, tmp_path / "runs" / name.replace("g2rl_shaped", "g2rl_zero_lam0.25"))
    evaluation = tmp_path / "runs" / "g2rl_zero_lam0.25_s0" / study.EVAL_FILE
    evaluation.write_text(json.dumps(json.loads(evaluation.read_text()) | {
        "run": {"variant": "g2rl_zero_lam0.25", "seed": 0, "overrides": []}}))
    assert study.main(["--out", str(tmp_path), "--report-only"]) == 0
    summary = json.loads((tmp_path / "study.json").read_text())
    assert list(summary["table"]) == ["warmstart", "grpo", "g2rl_zero_lam0.25"]
    assert set(summary["differences"]) == {"g2rl_zero_lam0.25 − grpo"}


# ------------------------------------------------------------------------------------------------ the second task
PROBLEM = {"terms": [[3, 4], [5, 6], [7, 2]]}  # 12 + 30 + 14 = 56


@pytest.mark.parametrize("response, expected", [
    ("3*4=12\n5*6=30\n7*2=14\n12+30=42\n42+14=56\n\\boxed{56}", 1.0),
    ("7*2=14\n12+14=26\n3*4=12\n\\boxed{56}", -1.0),  # 12 is not on hand yet
    ("2*7=14\n4*3=12\n14+12=26\n6*5=30\n30+26=56\n\\boxed{56}", 1.0),  # factors and addends in any order
    ("3*4=12\n5*6=30\n7*2=14\n12+30=42\n42+14=57\n\\boxed{57}", -1.0),  # wrong arithmetic
    ("3*4=12\n3*4=12\n5*6=30\n7*2=14\n12+30=42\n42+14=56\n\\boxed{56}", -1.0),  # a term twice
    ("3*4=12\n5*6=30\n12+30=42\n\\boxed{42}", -1.0),  # a term missing
    ("3*4=12\n5*6=30\n7*2=14\n12+30=42\n\\boxed{42}", -1.0),  # two values left
    ("3*4=12\n5*6=30\n7*2=14\n12+12=24\n\\boxed{56}", -1.0),  # a value used twice
    ("3*4=12\n5*6=30\n7*2=14\n12+30=42\n42+14=56\n\\boxed{55}", -1.0),  # the wrong value boxed
    ("3*4=12\n5*6=30\n7*2=14\n12+30=42\n42+14=56\n\\boxed{56} done", -1.0),  # something after the box
    ("\\boxed{56}", -1.0), ("", -1.0), ("3*4=12 \n 5*6=30\n7*2=14\n12+30=42\n42+14=56\n\\boxed{56}", 1.0),
])
def test_sumprod_reward(response, expected):
    from g2rl_jax.demo import sumprod

    assert sumprod.reward(response, PROBLEM) == expected


def test_sumprod_splits_teacher_and_judge():
    import random

    from g2rl_jax.demo import sumprod
    from g2rl_jax.demo.explore_eval import problem_record

    splits = {name: sumprod.examples(name) for name, _ in sumprod.SPLITS}
    assert {k: len(v) for k, v in splits.items()} == {"test": 512, "train": 4096, "sft": 20000}
    keys = [tuple(sorted(tuple(sorted(t)) for t in e.row["terms"])) for v in splits.values() for e in v]
    assert len(set(keys)) == len(keys)  # no sum of products twice, within or across splits
    rng = random.Random(0)
    example = splits["test"][0]
    taught = sumprod.teacher_responses(example, rng)  # 4 right, then 4 with one carry slip each
    texts = taught[:4] + ["junk", "3*4=12\n\\boxed{12}"]
    assert [sumprod.reward(t, example.row) for t in taught] == [1.0] * 4 + [-1.0] * 4
    for slipped in taught[4:]:  # exactly one line's arithmetic is off, by a carry slip
        steps, boxed = sumprod.parse(slipped)
        offs = [c - (a * b if op == "*" else a + b) for a, op, b, c in steps]
        assert sorted(offs, key=abs)[:-1] == [0] * (len(offs) - 1) and offs[np.argmax(np.abs(offs))] in sumprod.SLIPS
    correct, paths, labels, used = sumprod.judge(texts, example.row)
    assert correct == [True] * 4 + [False, False] and used is None
    assert len(set(paths[:4])) > 1 and paths[4:] == [None, None]  # random orders: different paths
    assert labels[:4] == [0] * 4 and labels[4] is None and labels[5] == 1  # the vote is on the boxed value
    record = problem_record(texts, example.row, judge=sumprod.judge)
    assert record["c"] == 4 and "two_numbers" not in record and record["valid"] == 5 / 6
    from g2rl_jax.demo import build

    assert build.SCHEMES["sumprod:"] == "sumprod" and build.default_sft_steps("sumprod") == build.SUMPROD_SFT_STEPS
    assert build.policy_spec(0, 2000, "sumprod")["task"]["terms"] == sumprod.TERMS
