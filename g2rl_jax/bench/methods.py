"""`python -m g2rl_jax.bench methods`: what each exploration method costs per RL step, against GRPO, in one run.

Runs the real `Trainer` on a config (default: the demo's, its tiny warm-started model built on first use) for two
steps (the first compiles), then times, on the second step's batch, the parts of a step a method changes, for
every method of `g2rl_jax.methods` (evol aside: its cost is its embedding model's forward pass) and G2RL with its
novelty after the standardisation (OPTIONS): the advantages program (novelty, shaping, groups; Miner's token
weights), the token rule (Clip-Cov, KL-Cov, forking tokens) and the update over every mini-batch, exactly as
`Trainer._update` runs it (the method's rows, token terms and loss). Each method is
compiled before timing; then `--repeats` rounds time every method once per round, in a new random order each
round, and the medians are printed, with the update's spread over the rounds (min–max) and each method's
fastest round against GRPO's (on a busy machine the least disturbed figures). The rest of a step
(rollout, rewards, scoring) is the same for every method; "step vs grpo" adds it back: (rest + this method's
parts) / (rest + GRPO's parts), the rest from the second step's stage times (a compile there, from a length
bucket the first step did not meet, would count in it).
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from g2rl_jax import cli

ROOT = Path(__file__).resolve().parents[2]
SKIP = ("evol",)  # its cost is the embedding model's forward pass, not a method's arithmetic
KNOBS = {"entropy_bonus": {"entropy_coef": 0.01}}  # what a method needs set besides its name
# rows that are a method with options rather than a registered name: (the method, its options)
OPTIONS = {"g2rl_after_text": ("g2rl", {"novelty_placement": "advantage"}),
           "g2rl_after_literal": ("g2rl", {"novelty_placement": "advantage", "shaping_mode": "literal"})}


def parse_args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench methods", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds over all methods, after one compiling round")
    p.add_argument("--methods", default=None, help="comma-separated subset (default: every method but evol, and "
                   f"{', '.join(OPTIONS)}: g2rl with its novelty after the standardisation)")
    p.add_argument("overrides", nargs="*", help="config key=value overrides")
    return p.parse_intermixed_args(argv)


def _copy(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, tree)


def time_method(trainer, result, algo, step: int) -> dict[str, float]:
    """Seconds of one method's advantages, token rule and update on `result`'s batch; the trainer's parameters
    and optimizer state are restored afterwards (the update donates them, so it runs on copies)."""
    import jax

    from g2rl_jax import methods
    from g2rl_jax.train import step as train_step
    from g2rl_jax.train import update as train_update

    method = methods.get(algo.exploration)
    batch, scores = result.batch, result.scores
    logp = scores.logp_BxT if "seq_logp" in method.needs else None
    t0 = time.perf_counter()
    signal = jax.block_until_ready(train_step.advantages(batch, scores.phi_BxD, algo, None, None, logp))
    t1 = time.perf_counter()
    if method.tokens is not None:  # timed apart here; _update computes them again inside the update
        jax.block_until_ready(methods.token_terms(signal["advantages"], scores.logp_BxT, scores.entropy_BxT,
                                                  scores.logp_BxT, batch.response_mask, jax.random.key(step), algo=algo,
                                                  mini_batch_size=algo.mini_batch_size))
    t2 = time.perf_counter()
    saved = (trainer.cfg, trainer.method, trainer.settings, trainer.params, trainer.opt_state)
    trainer.cfg = dataclasses.replace(trainer.cfg, algorithm=algo)
    trainer.method = method
    trainer.settings = train_update.LossSettings.from_config(algo, trainer.cfg.rollout.temperature)
    trainer.params, trainer.opt_state = _copy(saved[3]), _copy(saved[4])
    in_loss = np.ones(batch.rewards.shape[0], np.float32)
    jax.block_until_ready(trainer.params)
    t3 = time.perf_counter()
    trainer._update(batch, scores.logp_BxT, result.ref_logp, signal["advantages"], in_loss, None, scores.entropy_BxT,
                    step, token_weight=signal.get("token_weight"))
    jax.block_until_ready(trainer.params)
    t4 = time.perf_counter()
    trainer.cfg, trainer.method, trainer.settings, trainer.params, trainer.opt_state = saved
    return {"advantages": t1 - t0, "tokens": t2 - t1 if method.tokens is not None else 0.0, "update": t4 - t3}


def main(argv) -> int:
    import jax

    from g2rl_jax import methods
    from g2rl_jax.config import load_config
    from g2rl_jax.demo import resolve_demo_paths
    from g2rl_jax.train.loop import Trainer

    args = parse_args(argv)
    known = (*methods.NAMES, *OPTIONS)
    names = [n for n in (args.methods.split(",") if args.methods else known) if n not in SKIP]
    unknown = [n for n in names if n not in known]
    if unknown:
        return cli.fail("bench methods", f"--methods: unknown {unknown}; choose from {', '.join(known)}")
    if "grpo" not in names:
        names.insert(0, "grpo")
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"run.output_dir={tmp}/run", "run.checkpoint_every=100000", "run.eval_every=0",
                  "algorithm.exploration=grpo", *args.overrides]
        cfg = load_config(args.config, common)
        model_path, _ = resolve_demo_paths(cfg.model.path, None)
        cfg = load_config(args.config, [*common, f"model.path={model_path}", "run.total_steps=3"])
        trainer = Trainer(cfg)
        try:  # closed before the directory goes: its run lock's lease thread would find the lock gone
            print(f"config {args.config} {' '.join(args.overrides)}; devices: {jax.device_count()} x "
                  f"{jax.devices()[0].device_kind}; model {trainer.model.config.num_params() / 1e6:.2f}M params")
            trainer.step_stages(0)  # compiles the shared stages
            result = trainer.step_stages(1)  # the batch every method is timed on, and the rest of a step's time
            rest = sum(result.metrics[k] for k in ("rollout_seconds", "reward_seconds", "score_seconds"))
            algos = {n: dataclasses.replace(cfg.algorithm, exploration=OPTIONS.get(n, (n,))[0],
                                            **KNOBS.get(n, {}), **OPTIONS.get(n, (n, {}))[1]) for n in names}
            for n in names:  # compile each method's programs
                time_method(trainer, result, algos[n], 2)
            order = np.random.default_rng(0)
            rounds = []
            for r in range(args.repeats):  # every round in its own order: the machine's load drifts within a round
                timed = {n: time_method(trainer, result, algos[n], 3 + r) for n in order.permutation(names)}
                rounds.append(timed)
        finally:
            trainer.close()
        print(f"batch {tuple(result.batch.input_ids.shape)}; rollout + rewards + scoring of the step: {rest:.3f} s")
    med = {n: {part: float(np.median([r[n][part] for r in rounds])) for part in ("advantages", "tokens", "update")}
           for n in names}
    best = {n: min(sum(r[n].values()) for r in rounds) for n in names}  # the least disturbed round of each method
    base = sum(med["grpo"].values())
    print(f"\nmedian over {args.repeats} interleaved rounds (ms; update in s)")
    print("| method | advantages ms | token rule ms | update s (min–max) | method parts s | vs grpo | step vs grpo "
          "| fastest round vs grpo's |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        parts = sum(med[n].values())
        spread = [r[n]["update"] for r in rounds]
        print(f"| {n} | {1e3 * med[n]['advantages']:.2f} | {1e3 * med[n]['tokens']:.2f} | {med[n]['update']:.3f} "
              f"({min(spread):.3f}–{max(spread):.3f}) | {parts:.3f} | {parts / base:.3f} | "
              f"{(rest + parts) / (rest + base):.3f} | {best[n] / best['grpo']:.3f} |")
    return 0
