"""`python -m g2rl_jax.bench async`: the rollout ahead of the update (docs/async.md) against the colocated run, side
by side in one invocation: tokens trained per second and accuracy after a fixed number of samples.

Each variant is one `Trainer` run in its own process with --devices fake CPU devices (XLA_FLAGS), the same config,
seed, data and number of steps (so the same number of samples):

- colocated: one mesh over every device (mesh.fsdp=-1), rollout and update in turn;
- split k=0: mesh.rollout_devices=--rollout-devices, the rest train; serial (on-policy);
- k=1 (one-step-off) and k=2: the same split, the rollout 1 or 2 steps ahead (algorithm.rollout_is_cap=2);
- sides_k1 and sides_k2: one process per side (mesh.rollout_processes=1, train/sides.py), two processes joined by
  jax.distributed on localhost, one fake CPU device each, process i pinned to core i (os.sched_setaffinity):
  process 0 trains, process 1 draws 1 or 2 steps ahead; the weights cross by cross-host jax.device_put.

Per variant it prints the response tokens trained per second after the first step (the first step compiles and runs
alone: steps 2..N's trained tokens over their wall time, each step timed from the end of the previous one, so
metrics, checkpoints and waits count), the mean training accuracy of the last quarter of the steps, the validation
mean@k after the last step (data.eval_datasets, when the config has one), the mean rollout and update idle seconds
and the weight-sync seconds and bytes per step; then each variant's tokens/s against the colocated run's.

Default workload: the demo (configs/demo.yaml, its warm-started tiny Qwen3, built on first use). --random-model: a
random Qwen3 of the demo's architecture with --budget new tokens, whose responses are long-tailed up to the budget
(the rollout then dominates a step); its accuracy is about 0 and says nothing. This machine's CPU devices share its
cores, so a split gives each side fewer cores rather than devices of its own: the figures say what overlap buys on
this machine, not on a TPU slice.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from g2rl_jax import cli

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"colocated": {}, "k0": {"rollout.max_staleness": 0}, "k1": {"rollout.max_staleness": 1},
            "k2": {"rollout.max_staleness": 2}, "sides_k1": {"rollout.max_staleness": 1},
            "sides_k2": {"rollout.max_staleness": 2}}

HARNESS = r"""
import json, os, sys, time
out, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
pin = os.environ.get("G2RL_BENCH_PIN")
if pin:  # one core per process
    os.sched_setaffinity(0, {int(pin)})
from g2rl_jax import parallel
from g2rl_jax.config import load_config
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.weight_sync import enable_cross_host_transfers
cfg = load_config(config, overrides)
if cfg.distributed.transfer_address:  # one process per side: what train/command.py main does first
    enable_cross_host_transfers(cfg.distributed.transfer_address)
    parallel.initialize_distributed(cfg.distributed)
    parallel.set_sides(cfg.mesh)
    if parallel.is_rollout_process(cfg.mesh):
        from g2rl_jax.train.sides import run_rollout_process
        sys.exit(run_rollout_process(cfg))
trainer = Trainer(cfg)
trainer.resume()
ends, stages = [], trainer.step_stages
def timed(step):
    result = stages(step)
    ends.append(time.perf_counter())
    return result
trainer.step_stages = timed
start = time.perf_counter()
history = trainer.run()
json.dump({"start": start, "ends": ends, "history": history}, open(out, "w"))
"""


def parse_args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench async", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--steps", type=int, default=40, help="training steps of every variant (the first compiles)")
    p.add_argument("--devices", type=int, default=2, help="fake CPU devices of each run")
    p.add_argument("--rollout-devices", type=int, default=1, help="of --devices, the rollout side's in a split")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--random-model", action="store_true", help="a random demo-size Qwen3: long-tailed responses")
    p.add_argument("--budget", type=int, default=128, help="rollout.max_new_tokens with --random-model")
    p.add_argument("--quick", action="store_true", help="a smoke test: 3 steps of 4 prompts x 4 samples of the "
                   "random model with a budget of 16 tokens, no validation (checks the variants run, measures nothing)")
    p.add_argument("overrides", nargs="*", help="config key=value overrides for every variant (run.eval_every=0: no "
                   "validation)")
    return p.parse_intermixed_args(argv)


def variant_overrides(name: str, rollout_devices: int) -> dict:
    """The settings of one variant on top of the shared ones."""
    if name == "colocated":
        return {"mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1}
    if name.startswith("sides_"):
        return {"mesh.rollout_processes": 1, "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1, **VARIANTS[name],
                "algorithm.rollout_is_cap": 2.0}
    ahead = VARIANTS[name]["rollout.max_staleness"]
    return {"mesh.rollout_devices": rollout_devices, "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1,
            **VARIANTS[name], **({"algorithm.rollout_is_cap": 2.0} if ahead else {})}


def summarize(run: dict, samples_per_step: int) -> dict[str, float]:
    """Tokens trained per second after the first step, accuracies and the async figures of one run's record."""
    history, ends = run["history"], run["ends"]
    later = history[1:]
    tokens = sum(h["response_length"] * samples_per_step for h in later)
    seconds = ends[-1] - ends[0] if len(ends) > 1 else float("nan")
    tail = history[-max(1, len(history) // 4):]
    out = {"tokens_trained_per_s": tokens / seconds if later else float("nan"),
           "accuracy_last_quarter": sum(h["accuracy"] for h in tail) / len(tail),
           "seconds_after_step_1": seconds}
    val = [k for k in history[-1] if k.startswith("val/") and "/mean@" in k]
    if val:
        out["val_mean_after"] = history[-1][val[0]]
    for key in ("update_idle_seconds", "rollout_idle_seconds", "weight_sync_seconds", "weight_sync_bytes",
                "rollout_is_capped_frac", "staleness_mean", "truncated_fraction"):
        if later and key in later[0]:
            out[key] = sum(h[key] for h in later) / len(later)
    if later and "staleness_max" in later[0]:
        out["staleness_max"] = max(h["staleness_max"] for h in later)
    return out


def _run(name: str, a, shared: dict, tmp: Path) -> dict:
    variant = {**variant_overrides(name, a.rollout_devices), "run.output_dir": str(tmp / name)}
    sides = name.startswith("sides_")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
    env["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={1 if sides else a.devices}", *flags])
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-c", HARNESS, str(out), a.config, *[f"{k}={v}" for k, v in shared.items()],
           *a.overrides, *[f"{k}={v}" for k, v in variant.items()]]  # the variant's settings win, then the user's
    if not sides:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{name}: the run failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())
    from g2rl_jax import localhost

    ran = localhost.run(lambda i, port: [*cmd, *localhost.distributed_args(i, port, 2, transfers=True)],
                        timeout=86400.0, devices=1,
                        env=lambda i: dict(env, G2RL_BENCH_PIN=str(i % (os.cpu_count() or 1))))
    failed = [f"process {i}:\n{log[-2000:]}" for i, (code, log) in enumerate(ran) if code != 0]
    if failed:
        raise SystemExit(f"{name}: the run failed:\n" + "\n".join(failed))
    return json.loads(out.read_text())


def main(argv=None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    from g2rl_jax.config import load_config

    if a.quick:
        a.random_model, a.budget, a.steps = True, 16, 3
        a.overrides = ["run.eval_every=0", "data.prompts_per_step=4", "rollout.num_samples=4",
                       "algorithm.mini_batch_size=16", "algorithm.micro_batch_size=16", *a.overrides]

    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="g2rl_bench_async_") as tmp_name:
        tmp = Path(tmp_name)
        shared = {"run.total_steps": a.steps, "run.checkpoint_every": a.steps, "run.eval_every": a.steps}
        if a.random_model:
            from g2rl_jax.bench.once import random_model

            shared |= {"model.path": str(random_model(tmp / "model")), "rollout.max_new_tokens": a.budget}
        cfg = load_config(a.config, [*[f"{k}={v}" for k, v in shared.items()], *a.overrides])
        if not cfg.data.eval_datasets:
            shared["run.eval_every"] = 0
        per_step = cfg.data.prompts_per_step * cfg.rollout.num_samples
        model = f", random model, budget {a.budget}" if a.random_model else ""
        print(f"bench async: {a.config} {' '.join(a.overrides)}{model}, {a.steps} steps x {per_step} "
              f"samples, {a.devices} CPU devices (split: {a.rollout_devices} rollout)", flush=True)
        rows = {}
        for name in names:
            rows[name] = summarize(_run(name, a, shared, tmp), per_step)
            print(f"{name:10s} " + "  ".join(f"{k} {v:.4g}" for k, v in rows[name].items()), flush=True)
    print(table(rows))
    print(json.dumps(rows))


COLUMNS = (("tok/s", "tokens_trained_per_s", "{:.0f}"), ("val mean@k", "val_mean_after", "{:.3f}"),
           ("train acc", "accuracy_last_quarter", "{:.3f}"), ("sync s", "weight_sync_seconds", "{:.4f}"),
           ("sync MB", "weight_sync_bytes", "{:.2f}"), ("stale mean", "staleness_mean", "{:.2f}"),
           ("stale max", "staleness_max", "{:.0f}"), ("IS capped", "rollout_is_capped_frac", "{:.3f}"),
           ("truncated", "truncated_fraction", "{:.3f}"), ("update idle s", "update_idle_seconds", "{:.3f}"),
           ("rollout idle s", "rollout_idle_seconds", "{:.3f}"))


def table(rows: dict[str, dict[str, float]]) -> str:
    """The variants side by side (per step means after the first step; sync MB = bytes / 1e6; '-' = not measured
    for that variant), with tokens trained per second against the colocated run's."""
    base = rows.get("colocated", {}).get("tokens_trained_per_s")
    head = ["variant", "tok/s", "vs colocated", *[c for c, _, _ in COLUMNS[1:]]]
    lines = []
    for name, r in rows.items():
        cells = [name, COLUMNS[0][2].format(r["tokens_trained_per_s"]),
                 f"{r['tokens_trained_per_s'] / base:.2f}x" if base else "-"]
        for _, key, fmt in COLUMNS[1:]:
            value = r.get(key)
            cells.append("-" if value is None else fmt.format(value / 1e6 if key == "weight_sync_bytes" else value))
        lines.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in [head, *lines])


if __name__ == "__main__":
    main()
