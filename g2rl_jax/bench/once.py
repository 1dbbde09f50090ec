"""`python -m g2rl_jax.bench once MODE --before DIR`: a run compiles once, measured against an older checkout.

    python -m g2rl_jax.bench once trainer --before DIR --config configs/demo.yaml --random-model \\
        rollout.max_new_tokens=512 data.prompts_per_step=16 run.total_steps=20 run.eval_every=0
    python -m g2rl_jax.bench once trainer --before DIR --config configs/demo.yaml      # the demo, 200 steps
    python -m g2rl_jax.bench once trainer --before DIR --config configs/demo.yaml --random-model --budgets 128,512 \
        data.prompts_per_step=16 run.total_steps=10 run.eval_every=0               # the update per token by budget
    python -m g2rl_jax.bench once study --before DIR --steps 10                        # one study run's time
    python -m g2rl_jax.bench once rollout --before DIR --new-seeds 6                   # new lengths every call
    python -m g2rl_jax.bench once bill --before DIR --config configs/qwen3_1p7b_g2rl.yaml --preset qwen3-1.7b \\
        --target v5p-8 model.path=tests/assets/qwen3_tokenizer run.total_steps=1000 run.eval_every=0

DIR is a checkout of the code to compare with (e.g. `git worktree add DIR 952094e`); each mode runs it and this
checkout the same way, one after the other, in processes whose PYTHONPATH names the checkout.

trainer: `python -m g2rl_jax.train` with the config and overrides, each with an empty compilation cache
(run.compilation_cache_dir set to a new directory, as on a fresh VM) and a fresh run directory. A listener on
jax.monitoring's backend-compile event (installed around the trainer's own `main`, so it needs nothing from the
checkout) counts the programs each step compiled and the seconds the process spent compiling (overlapping compiles
counted once), by the time each step's metrics line appeared (step 1's count includes the set-up and the
validation before training). --random-model: model.path is a random Qwen3 of the
demo's architecture (with the demo tokenizer and 1,024 positions), whose responses are long-tailed up to the
budget. Printed: per checkout the wall time, the programs and compile seconds in all and after step 1, the per-step
counts, the update's microseconds per response token trained over steps 3 on (metrics.jsonl), the step's split
over the same steps (rollout, rewards, score, update: their seconds' shares of the steps'), and the ratios. With
--budgets B1,B2,... each checkout runs at each response budget (rollout.max_new_tokens), the runs interleaved
(budget by budget, the two checkouts one after the other, --repeats times over), and it prints each run's
update microseconds per response token and, per checkout, their ratio of the last budget to the first (medians
over the repeats): what the update's padding costs as responses grow.
With --keep DIR the runs stay in DIR and it says whether the two metrics.jsonl are equal, every key but the
clock's (seconds, throughputs, programs compiled) compared.

study: one run of `python -m g2rl_jax.demo.study` (variant g2rl_shaped, seed 0, --steps steps, 64 held-out
problems x 8 samples) on a random policy of the study's architecture and tokenizer (no warm start is built): the
training's wall and CPU seconds (its study_time.json) and the process's CPU seconds.

rollout: `generate` on a long-tailed workload (bench rollout --long-tail's: a random Qwen3 of --hidden 256, 4
layers, --vocab 32,768, float32, 4 prompts x 8 samples, --budget new tokens, a stop set that ends a response with
probability ~8 / budget per token), with run.compile_threads' default of this machine: one untimed call (seed 0: it
compiles what it meets, or with the warm-up everything a call can reach), then --new-seeds calls with new seeds
(new lengths, so new decode shapes, as between RL steps), timed with whatever they compile, then the same seeds
again, every shape now compiled. Printed per checkout: useful tokens/s (the tokens returned per second) of each
pass and their ratio, new seeds / same seeds again (the goal: >= 0.9).

bill: the whole-run compile bill of a config on a TPU slice, before and after. This checkout compiles the largest
program of each kind for the target (`plan --compile --programs largest`) and prices its bounded set
(aot/bill.py). The older one is priced from the same compile seconds per kind with its own rules (the programs its
aot/first_step.py says each step meets anew, each step's new score, reference and gradient programs compiled on the
threads of its warm-up, the decode segments prewarmed at the first step when they fit its rounds), over the same
number of steps. The estimated run time is this checkout's (aot/bill.py), the same for both.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HARNESS = r'''
import json, sys, threading, time
from pathlib import Path
out, argv = sys.argv[1], sys.argv[2:]
import jax
events, lines, t0 = [], [], time.perf_counter()
def listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        events.append((time.perf_counter() - t0, duration))
jax.monitoring.register_event_duration_secs_listener(listen)
run_dir = Path([a.split("=", 1)[1] for a in argv if a.startswith("run.output_dir=")][0])
stop = []
def watch():
    seen = 0
    while not stop:
        path = run_dir / "metrics.jsonl"
        text = path.read_text().splitlines() if path.exists() else []
        for line in text[seen:]:
            if line.strip():
                lines.append((time.perf_counter() - t0, json.loads(line)["step"]))
        seen = len(text)
        time.sleep(0.05)
thread = threading.Thread(target=watch, daemon=True)
thread.start()
try:
    from g2rl_jax.train.command import main
except ModuleNotFoundError:  # a checkout from before train/command.py
    from g2rl_jax.train.loop import main
code = main(argv)
time.sleep(0.3)
stop.append(1)
thread.join()
Path(out).write_text(json.dumps({"wall": time.perf_counter() - t0, "events": events, "lines": lines, "code": code}))
'''


def _env(checkout: Path) -> dict:
    """The environment of a process that runs `checkout`'s code (it also starts in that directory: `python -c` and
    `-m` put the working directory ahead of PYTHONPATH)."""
    return dict(os.environ, PYTHONPATH=str(checkout), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))


def random_model(out: Path, countdown: bool = False) -> Path:
    """A random Qwen3 of the demo's architecture with the demo's tokenizer (the study's with countdown)."""
    import dataclasses

    from flax import nnx

    from g2rl_jax.demo import countdown as cd
    from g2rl_jax.demo.build import PolicySpec
    from g2rl_jax.demo.tokenizer import make_tokenizer
    from g2rl_jax.model import Qwen3, save_pretrained

    tok = make_tokenizer(cd.corpus(8)) if countdown else make_tokenizer()
    cfg = dataclasses.replace(PolicySpec().qwen3_config(len(tok)), max_position_embeddings=1024)
    save_pretrained(Qwen3(cfg, rngs=nnx.Rngs(0)), out)
    tok.save_pretrained(out)
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    from g2rl_jax.train.compiles import union_seconds

    return union_seconds(intervals)


def _trainer_once(checkout: Path, config: str, overrides: list[str], tmp: Path, name: str) -> dict:
    run_dir, cache, out = tmp / f"{name}_run", tmp / f"{name}_cache", tmp / f"{name}.json"
    cmd = [sys.executable, "-c", HARNESS, str(out), "--config", config, *overrides, f"run.output_dir={run_dir}",
           f"run.compilation_cache_dir={cache}", "run.loggers=jsonl"]
    with (tmp / f"{name}.log").open("w") as log:
        code = subprocess.call(cmd, cwd=checkout, env=_env(checkout), stdout=log, stderr=subprocess.STDOUT)
    if code != 0 or not out.exists():
        tail = "\n".join((tmp / f"{name}.log").read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"{tail}\nbench once error: the trainer of {checkout} failed (exit {code}); its log's "
                         "last lines are above (the log itself goes with the temporary directory)")
    data = json.loads(out.read_text())
    lines = [(t, step) for t, step in data["lines"] if step >= 1]  # step 0: the validation before training
    per_step = [0] * len(lines)
    after = []
    for t, seconds in data["events"]:
        i = next((i for i, (end, _) in enumerate(lines) if t <= end), len(lines) - 1)
        per_step[i] += 1
        if i >= 1:
            after.append((t - seconds, t))
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {"wall": data["wall"], "programs": len(data["events"]), "per_step": per_step, "summary": summary,
            "compile_s": _union([(t - s, t) for t, s in data["events"]]), "after_programs": sum(per_step[1:]),
            "after_s": _union(after), "steps": len(lines), "update_us": update_us_per_token(run_dir),
            "split": step_split(run_dir)}


def update_us_per_token(run_dir: Path, first: int = 3) -> float:
    """The update's microseconds per response token trained over steps >= `first` (the warm-up and the first warm
    step left out): summed update_seconds over summed response tokens (response_length x the step's rows)."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = cfg["data"]["prompts_per_step"] * cfg["rollout"]["num_samples"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in steps if m.get("step", 0) >= first and "update_seconds" in m]
    tokens = sum(m["response_length"] * rows for m in steps)
    return 1e6 * sum(m["update_seconds"] for m in steps) / tokens if tokens else float("nan")


SPLIT = ("rollout_seconds", "reward_seconds", "score_seconds", "update_seconds")


def step_split(run_dir: Path, first: int = 3) -> dict[str, float]:
    """Seconds of each part of a step (SPLIT, metrics.jsonl) summed over steps >= `first`, and "step" their sum."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in steps if m.get("step", 0) >= first and "update_seconds" in m]
    out = {k: sum(m[k] for m in steps) for k in SPLIT}
    return {**out, "step": sum(out.values())}


def budgets(a) -> int:
    """--budgets: the update's cost per response token of both checkouts at each budget (module docstring)."""
    import statistics

    sizes = [int(b) for b in a.budgets.split(",")]
    per: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="g2rl_once_") as tmp:
        tmp = Path(tmp)
        overrides = list(a.overrides)
        if a.random_model:
            overrides.append(f"model.path={random_model(tmp / 'model')}")
        print(f"trainer runs of {a.config} {' '.join(a.overrides)} at budgets {sizes}, {a.repeats} round(s), "
              "interleaved, each with an empty compilation cache\n| round | budget | code | run s | update µs per "
              "response token (steps 3+) | layout |\n|---|---|---|---|---|---|", flush=True)
        for rnd in range(a.repeats):
            for size in sizes:
                for name, checkout in (("before", Path(a.before)), ("after", ROOT)):
                    tag = f"{name}_{size}_{rnd}"
                    r = _trainer_once(checkout, a.config, [*overrides, f"rollout.max_new_tokens={size}"], tmp, tag)
                    shapes = tmp / f"{tag}_run" / "micro_shapes.json"
                    layout = json.loads(shapes.read_text())["name"] if shapes.exists() else "?"
                    per.setdefault((name, size), []).append(r["update_us"])
                    print(f"| {rnd} | {size} | {name} | {r['wall']:.1f} | {r['update_us']:.1f} | {layout} |",
                          flush=True)
    for name in ("before", "after"):
        first, last = (statistics.median(per[name, s]) for s in (sizes[0], sizes[-1]))
        print(f"{name}: {last:.1f} / {first:.1f} µs per response token = {last / first:.2f}x at budget "
              f"{sizes[-1]} against {sizes[0]}", flush=True)
    return 0


def _workdir(a):
    """--keep DIR (the runs stay there to read) or a temporary directory."""
    if a.keep:
        Path(a.keep).mkdir(parents=True, exist_ok=True)
        return contextlib.nullcontext(a.keep)
    return tempfile.TemporaryDirectory(prefix="g2rl_once_")


TIMING = ("seconds", "per_second", "tokens_per_s", "programs_compiled", "mfu")  # metrics that measure the clock


def metrics_differ(before: Path, after: Path) -> list[str]:
    """The metrics.jsonl keys whose values differ between two runs (`step: key`), timings (TIMING) aside."""
    def rows(run_dir: Path) -> list[dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not any(t in k for t in TIMING)} for x in lines if x]

    b, n = rows(before), rows(after)
    if len(b) != len(n):
        return [f"records: {len(b)} before, {len(n)} after"]
    return [f"{x.get('step')}: {k}" for x, y in zip(b, n) for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)]


def trainer(a) -> int:
    if a.budgets:
        return budgets(a)
    with _workdir(a) as tmp:
        tmp = Path(tmp)
        overrides = list(a.overrides)
        if a.random_model:
            overrides.append(f"model.path={random_model(tmp / 'model')}")
        model = " (random demo-size model)" if a.random_model else ""
        print(f"trainer runs of {a.config} {' '.join(a.overrides)}{model}, each with an empty compilation cache; "
              f"jax on {os.environ.get('JAX_PLATFORMS', 'cpu')}", flush=True)
        results = {}
        for name, checkout in (("before", Path(a.before)), ("after", ROOT)):
            start = time.perf_counter()
            results[name] = _trainer_once(checkout, a.config, overrides, tmp, name)
            print(f"{name} ({checkout}): {time.perf_counter() - start:.0f} s", flush=True)
    print("\n| code | run s | programs | compile s | share | programs after step 1 | compile s after step 1 "
          "| update µs per response token (steps 3+) |\n|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['wall']:.1f} | {r['programs']} | {r['compile_s']:.1f} | {r['compile_s'] / r['wall']:.1%} "
              f"| {r['after_programs']} | {r['after_s']:.1f} | {r['update_us']:.1f} |")
    print("\n| code | step s (steps 3+) | rollout | rewards | score | update |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["split"]
        print(f"| {name} | {s['step']:.2f} | " + " | ".join(f"{s[k] / max(s['step'], 1e-9):.1%}" for k in SPLIT)
              + " |")
    for name, r in results.items():
        print(f"{name}: programs per step {r['per_step']}")
        accuracy = {k: v for k, v in r["summary"].items() if k.startswith("accuracy")}
        if accuracy:  # the numbers the run reached: the shape set moves padding, not results (tests/test_warmup.py)
            print(f"{name}: summary.json {accuracy}")
    differ = metrics_differ(tmp / "before_run", tmp / "after_run") if a.keep else None
    if differ is not None:  # the same rewards and metrics, the clock's numbers aside (TIMING)
        print("metrics.jsonl, timings aside: " + ("equal" if not differ else f"{len(differ)} differ: {differ[:8]}"))
    b, n = results["before"], results["after"]
    print(f"after / before: run time {n['wall'] / b['wall']:.2f}x, programs {n['programs'] / b['programs']:.2f}x, "
          f"compile seconds {n['compile_s'] / max(b['compile_s'], 1e-9):.2f}x", flush=True)
    return 0


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def study(a) -> int:
    with tempfile.TemporaryDirectory(prefix="g2rl_once_") as tmp:
        tmp = Path(tmp)
        model = random_model(tmp / "model", countdown=True)
        print(f"one study run (g2rl_shaped, seed 0, {a.steps} steps) on a random policy of the study's architecture",
              flush=True)
        rows = []
        for name, checkout in (("before", Path(a.before)), ("after", ROOT)):
            out = tmp / name
            cmd = [sys.executable, "-m", "g2rl_jax.demo.study", "--out", str(out), "--variants", "g2rl_shaped",
                   "--seeds", "1", "--lambda-seeds", "0", "--problems", "64", "--samples", "8",
                   "--geometry-samples", "4", f"run.total_steps={a.steps}", f"model.path={model}",
                   "run.loggers=jsonl", f"run.compilation_cache_dir={tmp / (name + '_cache')}"]
            cpu, start = _cpu_children(), time.perf_counter()
            with (tmp / f"{name}.log").open("w") as log:
                code = subprocess.call(cmd, cwd=checkout, env=_env(checkout), stdout=log, stderr=subprocess.STDOUT)
            if code != 0:
                raise SystemExit(f"bench once error: the study of {checkout} failed (exit {code}); see "
                                 f"{tmp / name}.log")
            timing = json.loads(next(out.glob("runs/g2rl_shaped_s0/study_time.json")).read_text())
            rows.append((name, timing["train"]["wall_s"], timing["train"]["cpu_s"], time.perf_counter() - start,
                         _cpu_children() - cpu))
    print("\n| code | train wall s | train CPU s | process wall s | process CPU s |\n|---|---|---|---|---|")
    for name, *values in rows:
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    (_, bw, bc, _, _), (_, aw, ac, _, _) = rows
    print(f"after / before: training CPU {ac / bc:.2f}x, training wall {aw / bw:.2f}x", flush=True)
    return 0


ROLLOUT = r'''
import json, sys, time
import numpy as np
from flax import nnx
from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.rollout import generate
from g2rl_jax.train.warmup import resolve_threads
args = json.loads(sys.argv[1])
cfg = Qwen3Config(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=3 * args["hidden"],
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  tie_word_embeddings=True, max_position_embeddings=4096)
model = Qwen3(cfg, RuntimeConfig(param_dtype="float32", compute_dtype="float32", kv_cache_dtype="float32"),
              rngs=nnx.Rngs(0))
rng = np.random.default_rng(0)
prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in np.linspace(48, 64, 4).astype(int)]
budget = args["budget"]
count = max(1, round(cfg.vocab_size * 8 / budget))
stops = tuple(range(1, cfg.vocab_size, max(1, cfg.vocab_size // count)))[:count]
kw = dict(max_new_tokens=budget, num_samples=8, stop_token_ids=stops, compile_threads=resolve_threads(0))
generate(model, prompts, seed=0, **kw)
passes = []
for _ in range(2):
    tokens = seconds = 0.0
    for seed in range(1, args["seeds"] + 1):
        start = time.perf_counter()
        r = generate(model, prompts, seed=seed, **kw)
        seconds += time.perf_counter() - start
        tokens += float(np.sum(r.completion_lengths))
    passes.append((tokens, seconds))
print(json.dumps(passes))
'''


def rollout(a) -> int:
    payload = json.dumps({"hidden": a.hidden, "vocab": a.vocab, "budget": a.budget, "seeds": a.new_seeds})
    print(f"generate, long-tailed, budget {a.budget}, {a.new_seeds} new seeds then the same again; "
          f"jax on {os.environ.get('JAX_PLATFORMS', 'cpu')}\n"
          "| code | new seeds: useful tokens/s | same seeds again: useful tokens/s | new / again |\n|---|---|---|---|",
          flush=True)
    for name, checkout in (("before", Path(a.before)), ("after", ROOT)):
        out = subprocess.run([sys.executable, "-c", ROLLOUT, payload], cwd=checkout, env=_env(checkout),
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"bench once error: the rollout of {checkout} failed:\n{out.stderr[-2000:]}")
        (new_t, new_s), (again_t, again_s) = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {new_t / new_s:,.0f} | {again_t / again_s:,.0f} | "
              f"**{(new_t / new_s) / (again_t / again_s):.2f}** |", flush=True)
    return 0


BEFORE_BILL = r'''
import json, sys
from g2rl_jax import parallel
from g2rl_jax.aot import first_step, parse_target, programs
from g2rl_jax.aot.report import Result
from g2rl_jax.config import load_config
from g2rl_jax.plan import model_config
args = json.loads(sys.argv[1])
cfg = load_config(args["config"], args["overrides"])
model, _ = model_config(cfg, args["preset"])
target = parse_target(args["target"])
mesh = parallel.make_mesh(cfg.mesh, target.devices())
shapes = programs.step_shapes(cfg, mesh)
progs = {p.kind: p for p in programs.step_programs(cfg, model, mesh, scope="largest")}
results = [Result(progs[k], s, 0.0, lower_seconds=l) for k, (s, l) in args["seconds"].items() if k in progs]
threads, reachable = args["threads"], first_step.reachable(cfg, shapes).get("segment", 0)
firsts = first_step.first_steps(cfg, shapes, steps=args["steps"])
total, programs_met = 0.0, 0
for i, meets in enumerate(firsts):
    if i and reachable <= first_step.prewarm.ROUNDS * threads:  # every segment prewarmed at the first step
        meets = first_step.StepMeets(frozenset(n for n in meets.names if not n.startswith("decode segment")),
                                     meets.small)
    est = first_step.estimate(meets, results, threads=(threads,), segments=reachable if i == 0 else 0)
    total += est.warm_s[threads]
    programs_met += est.programs + est.small
print(json.dumps({"compile_s": total, "programs": programs_met, "first_s": None}))
'''


def bill(a) -> int:
    from g2rl_jax import parallel
    from g2rl_jax.aot import bill as bill_lib
    from g2rl_jax.aot import parse_target, programs
    from g2rl_jax.aot import report as report_lib
    from g2rl_jax.config import load_config
    from g2rl_jax.plan import model_config
    from g2rl_jax.shapes import choice as choice_lib
    from g2rl_jax.shapes.step import step_shapes

    cfg = load_config(a.config, a.overrides)
    model, source = model_config(cfg, a.preset)
    target = parse_target(a.target)
    mesh = parallel.make_mesh(cfg.mesh, target.devices())
    shapes = step_shapes(cfg, mesh)
    lengths = choice_lib.training_prompt_lengths(cfg)
    packed = choice_lib.run_choice(cfg, model, shapes, bill_lib.target_device(target), lengths).packed
    progs = programs.step_programs(cfg, model, mesh, scope="largest", packed=packed)
    print(f"compiling the largest program of each kind of {a.config} ({source}) for {target.name}", flush=True)
    results = report_lib.compile_programs(progs, lambda line: print(line, flush=True), a.threads, target.kernel_mark)
    after = bill_lib.bill(cfg, model, shapes, results, target, lengths)
    seconds = {r.program.kind: (r.seconds, r.lower_seconds) for r in results if r.error is None}
    payload = json.dumps({"config": a.config, "overrides": a.overrides, "preset": a.preset, "target": a.target,
                          "seconds": seconds, "threads": after.threads, "steps": after.steps})
    out = subprocess.run([sys.executable, "-c", BEFORE_BILL, payload], cwd=Path(a.before), env=_env(Path(a.before)),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench once error: the older checkout's estimate failed:\n{out.stderr[-2000:]}")
    before = json.loads(out.stdout.strip().splitlines()[-1])
    run_s = after.steps * after.step_s
    print("\n" + "\n".join(after.lines()))
    print(f"\n| code | programs compiled over the run | compile s at {after.threads} threads | run s (estimate) | "
          f"compile share |\n|---|---|---|---|---|")
    print(f"| before | {before['programs']} | {before['compile_s']:,.0f} | {run_s:,.0f} | "
          f"{before['compile_s'] / (before['compile_s'] + run_s):.1%} |")
    print(f"| after | {after.programs} | {after.wall_s:,.0f} | {run_s:,.0f} | {after.share:.1%} |", flush=True)
    return 0


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench once", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("trainer", "study", "rollout", "bill"))
    p.add_argument("--before", required=True, help="a checkout of the code to compare with")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--random-model", action="store_true", help="trainer: a random demo-size model.path")
    p.add_argument("--budgets", help="trainer: comma-separated response budgets, each checkout at each (interleaved)")
    p.add_argument("--keep", help="trainer: keep the runs in this directory and compare their metrics.jsonl")
    p.add_argument("--repeats", type=int, default=1, help="trainer --budgets: rounds over the budgets")
    p.add_argument("--steps", type=int, default=10, help="study: training steps of the run")
    p.add_argument("--preset", help="bill: architecture preset")
    p.add_argument("--target", default="v5p-8", help="bill: the TPU slice")
    p.add_argument("--threads", type=int, default=1, help="bill: compile this many programs here at once")
    p.add_argument("--new-seeds", type=int, default=6, help="rollout: calls with new seeds")
    p.add_argument("--budget", type=int, default=1024, help="rollout: new tokens per response at most")
    p.add_argument("--hidden", type=int, default=256, help="rollout: the random model's hidden size")
    p.add_argument("--vocab", type=int, default=32768, help="rollout: the random model's vocabulary")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    a = _args(argv)
    return {"trainer": trainer, "study": study, "rollout": rollout, "bill": bill}[a.mode](a)
