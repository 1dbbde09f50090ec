"""`python -m g2rl_jax.bench NAME` smoke runs at tiny sizes: each benchmark in docs/performance.md still runs and prints
the figures it is quoted for (the figures themselves are measured, never asserted)."""
import pytest

from g2rl_jax.bench.__main__ import main

CASES = {
    "score": (["--batch", "2", "--length", "64", "--dim", "32", "--vocab", "512", "--chunk", "16", "--repeats", "1",
               "--grad-repeats", "1"], ["(a)", "(b)", "(c)"]),
    "forward": (["--layers", "1", "--hidden", "64", "--vocab", "512", "--batch", "2", "--seq", "16", "--iters", "1"],
                ["tokens/s", "compile"]),
    "rollout": (["--vocab", "512", "--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "32", "--prompts", "2", "--samples", "2", "--prompt-len", "8",
                 "--new-tokens", "4", "--repeats", "1"], ["tokens/s", "compile", "prefill FLOPs"]),
    "update": (["--preset", "tiny", "--rows", "4", "--prompt-len", "8", "--response-len", "32", "--iters", "1",
                "--long-tail", "--variant", "micro=2"], ["update s", "tokens/s", "resp MFU", "long-tailed / equal"]),
    "verify": (["--n", "12", "--latency-n", "4"], ["checks/s/core", "worst-case time of one check"]),
    "lora": (["--preset", "tiny", "--rank", "2", "--rows", "2", "--micro", "2", "--prompt-len", "4",
              "--response-len", "8", "--prompts", "1", "--samples", "2", "--new-tokens", "4", "--iters", "1"],
             ["s/update", "lora / full: time", "lora merged / base: tokens/s", "per-layer decode weights"]),
    "ladder": (["--config", "configs/qwen3_1p7b_g2rl.yaml", "--preset", "qwen3-1.7b", "--target", "v5p-8", "--buckets",
                "1", "--growth", "2", "--shrink", "2", "--first", "128", "--first", "512", "--draws", "1",
                "model.path=unused"], ["decode s per step", "| 1024 | 2 | 2 | 128 |", "| 1024 | 2 | 2 | 512 |"]),
    # --random-model: the demo's policy build (1,000 supervised steps, into the working directory) is not what this
    # smoke run covers; two prompts a step of the demo's 8 samples (105 -> 22 s of CPU)
    "programs": (["--config", "configs/demo.yaml", "--random-model", "run.total_steps=2", "run.eval_every=0",
                  "data.prompts_per_step=2", "algorithm.mini_batch_size=16", "algorithm.micro_batch_size=16"],
                 ["programs (listener)", "bill by group", "listener by function"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_runs_and_prints_its_figures(name, capsys):
    argv, needles = CASES[name]
    assert main([name, *argv]) == 0
    out = capsys.readouterr().out
    for needle in needles:
        assert needle in out, (name, needle, out[-2000:])
    if name == "update":  # `bench gpu` reads this table
        from g2rl_jax.bench.gpu import parse_update

        grouped = parse_update(out)["grouped"]
        assert grouped["update_s"] > 0 and grouped["us_per_response_token"] > 0 and grouped["resp_mfu"], grouped


def test_storage_benchmark_runs_on_the_emulator(gcs, capsys):
    """`bench storage` at a tiny size against the session's GCS server (its own would be a second server in this
    process, which tensorstore, reading the address once, would not see)."""
    assert main(["storage", "--url", gcs.url("bench"), "--hidden", "32", "--layers", "1", "--repeats", "1", "--steps",
                 "3", "--tail", "2", "--scalars", "4", "--first-repeats", "0"]) == 0
    out = capsys.readouterr().out
    for needle in ("checkpoint save s", "| local disk |", "| bucket |", "metrics ms/step"):
        assert needle in out, out[-2000:]


def test_fence_benchmark_runs_on_the_emulator(gcs, capsys):
    """`bench fence` at a tiny size: tensorstore straight to the session's GCS server and through the fence's
    forwarder, each path's figures printed, nothing refused (the lease is held throughout)."""
    assert main(["fence", "--url", gcs.url("bench-fence"), "--mb", "4", "--value-mb", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("| straight to the endpoint |", "| through the fence's forwarder |",
                   "requests the fence refused: 0"):
        assert needle in out, out[-2000:]


def test_once_update_cost_per_response_token(tmp_path):
    """bench once's update cost: update seconds over response tokens trained, steps 3 on, from a run's files."""
    import json

    from g2rl_jax.bench.once import update_us_per_token

    (tmp_path / "config.yaml").write_text("data:\n  prompts_per_step: 4\nrollout:\n  num_samples: 2\n")
    steps = [{"step": 0, "accuracy": 0.1}, {"step": 1, "update_seconds": 9.0, "response_length": 10.0},
             {"step": 2, "update_seconds": 0.5, "response_length": 12.0},
             {"step": 3, "update_seconds": 0.25, "response_length": 20.0},
             {"step": 4, "update_seconds": 0.75, "response_length": 30.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert update_us_per_token(tmp_path) == 1e6 * (0.25 + 0.75) / (8 * 20.0 + 8 * 30.0)


def test_once_step_split(tmp_path):
    """bench once's step split: each part's seconds summed over steps 3 on, and their sum."""
    import json

    from g2rl_jax.bench.once import step_split

    parts = ("rollout_seconds", "reward_seconds", "score_seconds", "update_seconds")
    steps = [{"step": s, **{k: s * (i + 1) for i, k in enumerate(parts)}} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert step_split(tmp_path) == {"rollout_seconds": 7, "reward_seconds": 14, "score_seconds": 21,
                                    "update_seconds": 28, "step": 70}


def test_once_metrics_differ(tmp_path):
    """bench once --keep: two runs' metrics.jsonl compared key by key, the clock's numbers left out."""
    import json

    from g2rl_jax.bench.once import metrics_differ

    def write(name, steps):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))

    write("a", [{"step": 1, "reward_mean": 0.5, "update_seconds": 1.0, "programs_compiled": 9}])
    write("b", [{"step": 1, "reward_mean": 0.5, "update_seconds": 2.0, "programs_compiled": 0}])
    write("c", [{"step": 1, "reward_mean": 0.25, "update_seconds": 1.0}])
    write("d", [])
    assert metrics_differ(tmp_path / "a", tmp_path / "b") == []
    assert metrics_differ(tmp_path / "a", tmp_path / "c") == ["1: reward_mean"]
    assert metrics_differ(tmp_path / "a", tmp_path / "d") == ["records: 1 before, 0 after"]


def test_once_rollout_runs_both_checkouts(capsys):
    """`bench once` at its cheapest: the rollout mode, this checkout against itself, one new seed."""
    from g2rl_jax.bench.once import ROOT

    argv = ["once", "rollout", "--before", str(ROOT), "--new-seeds", "1", "--budget", "16", "--hidden", "64",
            "--vocab", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| before |" in out and "| after |" in out and "new / again" in out, out


def test_unknown_benchmark_lists_the_known_ones(capsys):
    assert main(["nope"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_rollout_long_tail_prints_its_figures(capsys):
    tiny = ["--vocab", "512", "--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2", "--kv-heads",
            "1", "--head-dim", "32", "--prompts", "2", "--samples", "2", "--prompt-len", "8", "--repeats", "1"]
    assert main(["rollout", "--long-tail", *tiny, "--new-tokens", "16", "--budget-ratio", "2", "--split"]) == 0
    out = capsys.readouterr().out
    for needle in ("lengths mean", "p90", "useful tokens/s", "budget independence", "completions the same",
                   "budget 32, CPU s by piece", "decode segments", "compactions"):
        assert needle in out, (needle, out)


def test_memory_and_plan_only_modes_print_without_running(capsys):
    score = ["--batch", "2", "--length", "40", "--dim", "32", "--vocab", "512", "--chunk", "16", "--memory-only"]
    assert main(["score", *score]) == 0
    out = capsys.readouterr().out
    assert "vs the f32 logits" in out and "(c) fwd+bwd temp memory" in out and "(a)" not in out, out
    update = ["--preset", "qwen3-1.7b", "--rows", "8", "--prompt-len", "16", "--response-len", "512", "--long-tail",
              "--plan-only", "--variant", "micro=4"]
    assert main(["update", *update]) == 0
    out = capsys.readouterr().out
    assert "widths" in out and "FLOP model long-tailed / equal" in out and "update s" not in out, out


def test_update_benchmark_out_of_device_memory_is_one_line(monkeypatch, capsys):
    """A device that runs out of memory (three 1.7B variants on one H100) ends bench update with one line naming
    what every variant holds and what to do, not XLA's autotuner trace."""
    import jax

    from g2rl_jax.bench import update as bench_update

    def exhausted(runners, iters):
        raise jax.errors.JaxRuntimeError("NOT_FOUND: All configs failed during profiling.\nFailures (13):\n"
                                         "EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate")

    monkeypatch.setattr(bench_update, "run_variants", exhausted)
    args = ["--preset", "tiny", "--rows", "4", "--prompt-len", "8", "--response-len", "16", "--iters", "1",
            "--variant", "micro=2", "--variant", "micro=2,param_dtype=bfloat16"]
    assert main(["update", *args]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if "out of memory" in line]
    from g2rl_jax.model import PRESETS

    gb = PRESETS["tiny"].num_params() * 3 / 1e9
    assert lines == [f"bench update: the device ran out of memory with 2 variants held at once (each keeps its params "
                     f"and AdamW's two moments between updates: {4 * gb:.1f} + {2 * gb:.1f} GB, before any update's "
                     "own memory); run fewer --variant per call"], lines


def test_methods_benchmark_on_a_tiny_model(tmp_path, capsys):
    """bench methods times every method it is given against GRPO on one step of a tiny random model: a token rule,
    a method with per-step token weights that needs the log-probs (miner), and a method with options (OPTIONS)."""
    import json

    from g2rl_jax.demo import countdown as cd
    from g2rl_jax.demo.tokenizer import make_tokenizer

    from hf_tiny import make_tiny_qwen3_dir

    tok = make_tokenizer(cd.corpus(8))
    model = make_tiny_qwen3_dir(tmp_path / "model", vocab_size=-(-len(tok) // 64) * 64, max_position_embeddings=128,
                                num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=16,
                                num_attention_heads=2, num_key_value_heads=2)
    tok.save_pretrained(model)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(ex.as_row()) + "\n" for ex in cd.examples("test")[:16]))
    argv = ["methods", "--repeats", "1", "--methods", "kl_cov,miner,g2rl_after_literal", "--config",
            "configs/study_countdown.yaml",
            f"model.path={model}", f"data.train_dataset={data}", f"data.eval_datasets={data}",
            "data.prompts_per_step=2", "rollout.num_samples=4", "algorithm.mini_batch_size=8",
            "algorithm.micro_batch_size=8", "run.loggers=jsonl"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for needle in ("| grpo |", "| kl_cov |", "| miner |", "| g2rl_after_literal |", "step vs grpo"):
        assert needle in out, (needle, out[-2000:])


def test_gpu_batch_at_a_tiny_size(tmp_path, capsys):
    """`bench gpu --tiny`: the GPU batch's decode, long-tail and step parts run, each in its own process, on this CPU
    at a tiny size (the update parts are `bench update`, run above; their table's parsing is checked there);
    gpu_batch.json holds each part's figures and gpu_batch.md its table; a second call runs nothing again."""
    import json

    only = ["--only", "decode", "--only", "long_tail", "--only", "step_cold", "--only", "step_warm"]
    assert main(["gpu", "--tiny", "--out", str(tmp_path), *only]) == 0
    parts = json.loads((tmp_path / "gpu_batch.json").read_text())["parts"]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(
        ("decode", "step_cold", "step_warm", "long_tail"), "ok"), parts
    decode = parts["decode"]["figures"]
    assert set(decode["variants"]) == {"rungs", "switch", "ladder"} and decode["same_tokens"] == "yes", decode
    assert all(v["roofline_share"] > 0 for v in decode["variants"].values()), decode
    assert parts["long_tail"]["figures"]["useful_tokens_per_s"] > 0
    for name in ("step_cold", "step_warm"):
        step = parts[name]["figures"]
        assert step["first_step_s"] > 0 and step["step_s"] > 0 and step["rollout_share"].endswith("%"), step
    table = (tmp_path / "gpu_batch.md").read_text()
    assert "| decode | rungs: **" in table and "| step_warm | first step **" in table, table
    assert "| update_1k | – | not run" in table, table
    capsys.readouterr()
    assert main(["gpu", "--tiny", "--out", str(tmp_path), *only]) == 0
    assert "[decode]" not in capsys.readouterr().out  # measured already: nothing runs
