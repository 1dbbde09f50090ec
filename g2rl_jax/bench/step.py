"""`python -m g2rl_jax.bench step`: where the time of one RL step goes (rollout, rewards, scoring, update).

Runs the real `Trainer` on a config (default: the demo's, with its tiny warm-started model built on first use),
one warm-up step that compiles, then `--steps` timed steps; prints each stage's seconds and share of the step and
the generated tokens per second. On a GPU/TPU, `--preset qwen3-1.7b` runs random Qwen3-1.7B-shaped weights and
also prints the update step's model FLOP utilisation (MFU) against `--peak-tflops`.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from g2rl_jax import cli
from g2rl_jax.shapes.prices import train_flops

STAGES = (("rollout", "rollout_seconds"), ("rewards", "reward_seconds"), ("scoring", "score_seconds"),
          ("update", "update_seconds"))
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench step", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--preset", help="random weights of a Qwen3 preset (e.g. qwen3-1.7b) instead of model.path")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak for MFU (e.g. 989 for H100 bf16)")
    p.add_argument("overrides", nargs="*", help="config key=value overrides")
    return p.parse_intermixed_args(argv)


def _random_model_dir(preset: str, tokenizer_dir: str, out: Path) -> Path:
    """A Hugging Face dir of random weights in the shape of `preset`, with the given tokenizer."""
    from flax import nnx
    from transformers import AutoTokenizer

    from g2rl_jax.model import PRESETS, Qwen3, save_pretrained

    save_pretrained(Qwen3(PRESETS[preset], rngs=nnx.Rngs(0)), out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def update_flops(trainer, metrics) -> float:
    """Useful model FLOPs of one step's update: 6 · params · response tokens (forward + backward), per PPO epoch."""
    cfg = trainer.cfg
    n_params = trainer.model.config.num_params()
    responses = cfg.data.prompts_per_step * cfg.rollout.num_samples
    tokens = responses * metrics["response_length"]
    return 6.0 * n_params * tokens * cfg.algorithm.ppo_epochs


def processed_update_flops(trainer, input_shape: tuple[int, int]) -> float:
    """Model FLOPs of the update over every position it runs, prompt padding included (as `bench update`)."""
    rows, length = input_shape
    return train_flops(trainer.model.config, rows, length) * trainer.cfg.algorithm.ppo_epochs


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring event of one XLA compile


def compile_clock() -> list[float]:
    """A one-element list that accumulates the seconds XLA spends compiling from now on (any thread)."""
    import jax

    total = [0.0]

    def listen(event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    return total


def main(argv) -> int:
    import jax

    from g2rl_jax.config import load_config
    from g2rl_jax.demo import resolve_demo_paths
    from g2rl_jax.train.loop import Trainer

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [f"run.output_dir={tmp}/run", "run.checkpoint_every=100000",
                                        "run.eval_every=0", *args.overrides])
        model_path, _ = resolve_demo_paths(cfg.model.path, None)
        if args.preset:
            model_path = str(_random_model_dir(args.preset, model_path, Path(tmp) / "random"))
        cfg = load_config(args.config, [f"run.output_dir={tmp}/run", "run.checkpoint_every=100000",
                                        "run.eval_every=0", *args.overrides, f"model.path={model_path}",
                                        f"run.total_steps={args.steps + 1}"])
        trainer = Trainer(cfg)
        try:  # closed before the directory goes, also on an error: its run lock's lease thread would find the lock gone
            print(f"config {args.config} {' '.join(args.overrides)}; devices: {jax.device_count()} x "
                  f"{jax.devices()[0].device_kind}; model {trainer.model.config.num_params() / 1e6:.2f}M params")
            compiled = compile_clock()
            warm = trainer.step_stages(0)
            print(f"warm-up step (compiles): {sum(warm.metrics[k] for _, k in STAGES):.2f} s, "
                  f"batch {tuple(warm.batch.input_ids.shape)}")
            compiled[0] = 0.0
            results = [trainer.step_stages(step) for step in range(1, args.steps + 1)]
            if compiled[0] > 0:
                print(f"WARNING: XLA compiled for {compiled[0]:.1f} s inside the timed steps (a prompt or response "
                      "length bucket the warm-up step did not see); the stage times below include it. Rerun with "
                      "more --steps, or prompts of one length bucket, for compile-free figures.")
            runs = [r.metrics for r in results]
            shapes = [tuple(r.batch.input_ids.shape) for r in results]
        finally:
            trainer.close()
        print(f"batches [rows, prompt + response positions]: {shapes} "
              f"(response {results[-1].batch.response_mask.shape[1]})")
    means = {name: float(np.mean([m[key] for m in runs])) for name, key in STAGES}
    total = sum(means.values())
    print(f"\nstep time over {args.steps} steps: {total:.3f} s")
    print("| stage | seconds | share |\n|---|---|---|")
    for name, sec in means.items():
        print(f"| {name} | {sec:.3f} | {100 * sec / total:.1f}% |")
    tokens = float(np.mean([m["response_length"] for m in runs])) * cfg.data.prompts_per_step * cfg.rollout.num_samples
    print(f"generated tokens/s (whole step): {tokens / total:.1f}; rollout only: {tokens / means['rollout']:.1f}")
    if args.peak_tflops > 0:
        flops = float(np.mean([update_flops(trainer, m) for m in runs]))
        mfu = flops / means["update"] / (args.peak_tflops * 1e12 * jax.device_count())
        print(f"update MFU: {100 * mfu:.1f}% ({flops / 1e12:.2f} TFLOP in {means['update']:.3f} s "
              f"on {jax.device_count()} devices at {args.peak_tflops} TFLOP/s peak each), counting response tokens")
        done = float(np.mean([processed_update_flops(trainer, shape) for shape in shapes]))
        print(f"update MFU over every position processed (prompt padding included, as `bench update`): "
              f"{100 * done / means['update'] / (args.peak_tflops * 1e12 * jax.device_count()):.1f}%")
    return 0
