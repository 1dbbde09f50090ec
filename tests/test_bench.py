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
    "ladder": (["--config", "configs/qwen3_1p7b_g2rl.yaml", "--preset", "qwen3-1.7b", "--target", "v5p-8", "--first",
                "128", "--first", "512", "--steps", "2", "model.path=unused"],
               ["decode roofline s per step", "| 128 | 12 |", "| 512 | 10 |"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_runs_and_prints_its_figures(name, capsys):
    argv, needles = CASES[name]
    assert main([name, *argv]) == 0
    out = capsys.readouterr().out
    for needle in needles:
        assert needle in out, (name, needle, out[-2000:])


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
    assert main(["rollout", "--long-tail", *tiny, "--new-tokens", "16", "--budget-ratio", "2"]) == 0
    out = capsys.readouterr().out
    for needle in ("lengths mean", "p90", "useful tokens/s", "budget independence", "completions the same"):
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
