"""`python -m g2rl_jax.bench programs`: what one training run compiles, counted and billed by kind.

    python -m g2rl_jax.bench programs --config configs/demo.yaml --random-model rollout.max_new_tokens=512 \\
        data.prompts_per_step=16 run.total_steps=20 run.eval_every=0 [algorithm.packing=true ...]

One run of this checkout's trainer in this process, with an empty compilation cache (run.compilation_cache_dir a new
directory, as on a fresh VM) and a fresh run directory. A CompileClock (train/compiles.py) counts every program the
process compiles, from before the set-up to the end; aot/bill.program_counts prices the same run without compiling,
for the shape set and prompt buckets the run chose. --random-model: model.path is bench once's random demo-size Qwen3
(long-tailed responses up to the budget). Printed: the run's wall seconds, the programs the listener counted and
the seconds spent compiling, the programs per step (metrics.jsonl: step 1 holds the set-up and the warm-up), the
bill by kind and by group (rollout segments, the rest of the rollout, the passes, the rollout's moves, the run's
own and the small ones), and the listener's programs by jitted function. The choice of the shape set depends on
run.total_steps (g2rl_jax/shapes/choice.py weighs compile against the steps' compute), so count the run length you mean.
"""
from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

GROUPS = {  # the bill's kinds (aot/bill.program_counts) by what they serve
    "rollout segments": ("segment",),
    "rollout, other": ("prefill", "start", "decode_layers"),
    "passes": ("score", "reference", "gradient"),
    "rollout moves": ("regroup",),  # the passes move their micro-batches' rows inside their own programs
    "run's own and method's": ("init", "advantages", "apply", "embed", "token_terms"),
    "small (set-up, scalars, metrics)": ("small",),
}


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench programs", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/demo.yaml", help="training config YAML")
    p.add_argument("--random-model", action="store_true", help="model.path: a random demo-size Qwen3")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    return p.parse_intermixed_args(argv)


def count(config: str, overrides: list[str], tmp: Path) -> dict:
    """One run of `config` with `overrides` under `tmp`: the listener's programs and seconds, the bill by kind,
    the programs per step and by function, the wall seconds."""
    import jax

    from g2rl_jax.aot.bill import program_counts
    from g2rl_jax.config import parse_cli
    from g2rl_jax.model import lora
    from g2rl_jax.rollout import engine
    from g2rl_jax.train.compiles import CompileClock
    from g2rl_jax.train.loop import Trainer
    from g2rl_jax.train.metrics import read_metrics

    start, clock = time.perf_counter(), CompileClock()
    cfg = parse_cli(["--config", config, *overrides, f"run.output_dir={tmp / 'run'}",
                     f"run.compilation_cache_dir={tmp / 'cache'}", "run.loggers=jsonl"])
    trainer = Trainer(cfg)
    try:  # released before the directory goes, also on an error: its run lock's lease thread would find it gone
        trainer.resume()
        trainer.run()
    finally:
        trainer.close()
    wall, seen = time.perf_counter() - start, clock.take()
    clock.close()
    shapes = {(x.shape, str(x.dtype)) for x in jax.tree.leaves(lora.trainable(trainer.params))}
    bill = program_counts(cfg, trainer.model.config, engine.batch_shards(trainer.mesh), trainer.warmup.choice,
                          trainer.eval_prompt_len, len(shapes))
    return {"wall": wall, "programs": seen.programs, "compile_s": seen.seconds, "bill": bill,
            "per_step": {r["step"]: r.get("programs_compiled", 0) for r in read_metrics(tmp / "run")},
            "by_function": collections.Counter(name.split(" ")[0] for name in seen.names),
            "shapes": trainer.warmup.layout.name, "prompts": trainer.warmup.prompts}


def main(argv: list[str]) -> int:
    a = _args(argv)
    with tempfile.TemporaryDirectory(prefix="g2rl_programs_") as tmp:
        tmp, overrides = Path(tmp), list(a.overrides)
        if a.random_model:
            import jax

            from g2rl_jax.bench.once import random_model

            overrides.append(f"model.path={random_model(tmp / 'model')}")
            jax.clear_caches()  # its initializers' programs are the run's own too: the run compiles them anew
        r = count(a.config, overrides, tmp)
    bill = r["bill"]
    grouped = {g: sum(bill.get(k, 0) for k in kinds) for g, kinds in GROUPS.items()}
    print(f"\n{a.config} {' '.join(a.overrides)}: micro-batch shapes {r['shapes']}, prompt buckets "
          f"{list(r['prompts'])}\n| run s | programs (listener) | compile s | programs (bill) | after step 1 |\n"
          f"|---|---|---|---|---|\n| {r['wall']:.1f} | {r['programs']} | {r['compile_s']:.1f} | "
          f"{sum(bill.values())} | {sum(n for step, n in r['per_step'].items() if step > 1)} |")
    print("bill by group: " + ", ".join(f"{g} {n}" for g, n in grouped.items()))
    print("bill by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(bill.items()) if n))
    print(f"programs per step (metrics.jsonl): {r['per_step']}")
    print("listener by function: " + ", ".join(f"{k} {n}" for k, n in r["by_function"].most_common()), flush=True)
    if r["programs"] != sum(bill.values()):
        print(f"the bill ({sum(bill.values())}) differs from the listener ({r['programs']})", flush=True)
    return 0
