"""Bad input to every command is one line on stderr, `<command> error: ...`, exit code 2, no traceback.

Every case runs the command as `python -m MODULE ...` does (runpy, its `__main__`), in a subprocess that is not
the test's (tests/bad_input_worker.py), with what reaches file descriptor 2 captured per case: the cases share that
one process, so JAX, Orbax and transformers are imported once for all of them.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
TOKENIZER = Path(__file__).parent / "assets" / "qwen3_tokenizer"


def _files(root: Path) -> dict[str, Path]:
    """The bad inputs: YAML files, a data file with a malformed line, and a model dir that holds only a
    tokenizer (enough for the trainer to reach its data)."""
    files = {"syntax": root / "syntax.yaml", "lr": root / "lr.yaml", "verl": root / "verl.yaml",
             "data": root / "bad.jsonl", "model": root / "model"}
    files["syntax"].write_text("run:\n  output_dir: out\n  total_steps: [1,\nmodel:\n  path: x\n")
    files["lr"].write_text(f"base: {DEMO}\noptim:\n  lr: 1.0e-3\n")
    files["verl"].write_text(f"base: {DEMO}\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 4\n")
    files["data"].write_text(json.dumps({"problem": "1+1", "answer": "2"}) + '\n{"problem": "2+2", answer: 4}\n')
    shutil.copytree(TOKENIZER, files["model"])
    (files["model"] / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return files


def _cases(f: dict[str, Path], out: Path) -> dict[str, tuple[list[str], str]]:
    """{case: (command after `python -m`, text the one line must hold)}."""
    train = ["g2rl_jax.train", "--config"]
    return {
        "train_yaml_syntax": ([*train, str(f["syntax"])], f"config error: {f['syntax']}:5:7: YAML syntax error"),
        "train_verl_key_in_yaml": ([*train, str(f["lr"])],
                                   "unknown key 'optim.lr'; did you mean 'optim.learning_rate'? (verl's lr)"),
        "train_verl_group_in_yaml": ([*train, str(f["verl"])], "did you mean 'algorithm.mini_batch_size'?"),
        "train_trl_override": ([*train, str(DEMO), "num_generations=4"],
                               "unknown key 'num_generations'; did you mean 'rollout.num_samples'? (TRL's"),
        "train_malformed_data_line": ([*train, str(DEMO), f"model.path={f['model']}", f"data.train_dataset={f['data']}",
                                       f"run.output_dir={out / 'run'}"],
                                      f"config error: data.train_dataset: {f['data']}:2: not valid JSON"),
        "eval_malformed_data_line": (["g2rl_jax.eval", "--model-path", str(f["model"]), "--datasets", str(f["data"])],
                                     f"eval error: {f['data']}:2: not valid JSON"),
        "eval_unknown_dataset": (["g2rl_jax.eval", "--model-path", str(f["model"]), "--datasets", "nope"],
                                 "eval error: unknown dataset 'nope'"),
        "eval_no_model_dir": (["g2rl_jax.eval", "--model-path", str(out / "nope")], "eval error: --model-path"),
        "eval_no_checkpoint": (["g2rl_jax.eval", "--checkpoint", str(out / "nope")],
                               "eval error: --checkpoint"),
        "analyze_malformed_data_line": (["g2rl_jax.analyze", "--model-path", str(f["model"]), "--dataset",
                                         str(f["data"])], f"analyze error: {f['data']}:2: not valid JSON"),
        "analyze_no_checkpoint": (["g2rl_jax.analyze", "--checkpoint", str(out / "nope")],
                                  "analyze error: --checkpoint"),
        "export_missing_flag": (["g2rl_jax.export", "--out", str(out / "x")],
                                "export error: the following arguments are required: --checkpoint"),
        "export_no_checkpoint": (["g2rl_jax.export", "--checkpoint", str(out / "nope"), "--out", str(out / "x")],
                                 "export error: --checkpoint"),
        "plan_yaml_syntax": (["g2rl_jax.plan", "--config", str(f["syntax"])], "plan error: "),
        "bench_config_key": (["g2rl_jax.bench", "step", "--config", str(DEMO), "beta=0.04"],
                             "bench step error: command-line override 'beta=0.04': unknown key 'beta'; did you mean "
                             "'algorithm.kl_coef'?"),
        "bench_bad_variant": (["g2rl_jax.bench", "update", "--variant", "micro=x"],
                              "bench update error: --variant 'micro=x': micro='x' is not int"),
        "plot_no_run": (["g2rl_jax.plot", str(out / "nope")], "plot error: "),
        "demo_explore_eval_no_run": (["g2rl_jax.demo.explore_eval", str(out / "nope")], "demo.explore_eval error: "),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    cases = _cases(_files(root), root)
    (root / "cases.json").write_text(json.dumps({name: cmd for name, (cmd, _) in cases.items()}))
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "bad_input_worker.py"), "cases.json",
                           "results.json"], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((root / "results.json").read_text())
    return {name: (*found[name], expected) for name, (_, expected) in cases.items()}


@pytest.mark.parametrize("case", sorted(_cases({k: Path(k) for k in ("syntax", "lr", "verl", "data", "model")},
                                               Path("out"))))
def test_bad_input_is_one_line(results, case):
    code, err, expected = results[case]
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert code == 2, (code, err)
    assert expected in lines[0], lines[0]
