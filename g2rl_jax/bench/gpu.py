"""`python -m g2rl_jax.bench gpu`: the GPU measurement batch, one command sized for a short window on one GPU.

    PYTHONPATH=$PWD python -m g2rl_jax.bench gpu --out gpu_out --cache /tmp/g2rl_gpu_cache   # one H100 / H200
    python -m g2rl_jax.bench gpu --tiny --out /tmp/gpu_tiny                               # every part, tiny, on CPU

Each part is another `bench` command in a subprocess of its own (a fresh process: its memory freed after it, its
compiles its own), under its own time limit and one deadline for the batch (--deadline-s); its whole output is kept
in OUT/logs/PART.txt. In order:
  decode     random Qwen3-1.7B, bf16, 16 prompts x 16 samples, 256-token prompts, 1,024 new tokens, no stop:
             decode ms per step against the HBM roofline, side by side: the read rungs as the sampler runs them
             on a GPU (a while loop per rung), the read rungs chosen by a lax.switch in each layer (as on CPU and
             TPU: a conditional per layer and step), and the capacity ladder (the cache grown 128, 256, ... slots,
             as before 2026-11-28: bench/capacity_ladder.py)
  step_cold  `bench step` on the paper's config at 1,024 new tokens, packing on, one timed step, with an EMPTY
             compilation cache: the first step cold (it compiles the whole step), then the step's split and MFU
  step_warm  the same command again on the cache step_cold filled: the first step with a warm cache
  update_1k  `bench update` at 1k, long-tailed, grouped and packed: MFU over response tokens
  long_tail  useful tokens/s at the 8k budget, long-tailed (16 prompts x 4 samples: the cache holds the budget for
             every row, 64 rows x 8,192 slots = 60 GB at 1.7B)
  update_8k  `bench update` at 8k, grouped and packed
The parts other than the steps share --cache (JAX's persistent compilation cache), so a second run on the same
machine compiles little; the steps' cache is OUT/step_cache. A part already in OUT/gpu_batch.json for this device
kind is not run again (--redo: all of them), so a batch cut by its deadline finishes with a second call.
OUT/gpu_batch.json (every figure, each part's command, seconds and status, the device and the versions) and
OUT/gpu_batch.md (one table for docs/performance.md) are written after each part.

The step parts run the Trainer, which needs grain and tensorboardX; the other parts import neither. Where they are
missing, --wheels DIR installs the wheels in DIR (pip --no-index, into OUT/site, on the steps' PYTHONPATH only);
without them the step parts are skipped with one line saying so.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from g2rl_jax import cli

ROOT = Path(__file__).resolve().parents[2]
PEAK_TFLOPS = 989  # dense bf16, H100 and H200
STEP_CONFIG = ["--config", "configs/qwen3_1p7b_g2rl.yaml", "--preset", "qwen3-1.7b", "--peak-tflops", str(PEAK_TFLOPS),
               "--steps", "1", "model.path=tests/assets/qwen3_tokenizer", "rollout.max_new_tokens=1024",
               "data.max_prompt_tokens=256", "run.eval_every=0", "algorithm.packing=true"]
TINY_MODEL = ["--vocab", "512", "--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2",
              "--kv-heads", "1", "--head-dim", "32"]


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]  # after `python -m g2rl_jax.bench`
    expect_s: float  # what it should take on an H200 from cold (an estimate): it starts only with this much left
    limit_s: float  # the most it may take
    needs_trainer: bool = False  # imports grain and tensorboardX


def parts(out: Path, tiny: bool) -> list[Part]:
    """The batch's parts, in the order they run (module docstring), at the GPU size or --tiny."""
    if tiny:
        model = TINY_MODEL
        decode = [*model, "--prompts", "2", "--samples", "2", "--prompt-len", "8", "--new-tokens", "24"]
        tail = [*model, "--prompts", "2", "--samples", "2", "--prompt-len", "8", "--new-tokens", "32"]
        update = ["--preset", "tiny", "--rows", "4", "--prompt-len", "8", "--iters", "1", "--long-tail"]
        variants = ["--variant", "micro=2", "--variant", "micro=2,layout=packed"]
        up_1k, up_8k = [*update, "--response-len", "16", *variants], [*update, "--response-len", "32", *variants]
        # 8 responses: rows for up to 8 devices (the tests' fake ones)
        step = ["--config", "configs/demo.yaml", "--steps", "1", f"model.path={out / 'tiny_model'}",
                "data.prompts_per_step=4", "rollout.num_samples=2", "algorithm.mini_batch_size=8",
                "algorithm.micro_batch_size=8", "rollout.max_new_tokens=8"]
    else:
        decode = ["--preset", "qwen3-1.7b", "--dtype", "bfloat16", "--prompts", "16", "--samples", "16",
                  "--prompt-len", "256", "--new-tokens", "1024"]
        tail = ["--preset", "qwen3-1.7b", "--dtype", "bfloat16", "--prompts", "16", "--samples", "4",
                "--prompt-len", "256", "--new-tokens", "8192", "--compile-threads", str(os.cpu_count() or 1)]
        update = ["--preset", "qwen3-1.7b", "--prompt-len", "256", "--long-tail", "--peak-tflops", str(PEAK_TFLOPS),
                  "--iters", "2"]
        up_1k = [*update, "--rows", "32", "--response-len", "1024", "--variant", "remat=full,micro=16,attention=cudnn",
                 "--variant", "remat=full,micro=16,attention=cudnn,layout=packed"]
        up_8k = [*update, "--rows", "8", "--response-len", "8192", "--variant", "remat=full,micro=2,attention=cudnn",
                 "--variant", "remat=full,micro=2,attention=cudnn,layout=packed"]
        step = STEP_CONFIG
    cache = f"run.compilation_cache_dir={out / 'step_cache'}"
    return [
        Part("decode", ("rollout", *decode, "--no-hf", "--roofline", "--repeats", "1", "--variant", "rungs",
                        "--variant", "switch", "--variant", "ladder", "--json", str(out / "decode.json")), 200, 300),
        Part("step_cold", ("step", *step, cache), 330, 420, needs_trainer=True),
        Part("step_warm", ("step", *step, cache), 120, 240, needs_trainer=True),
        Part("update_1k", ("update", *up_1k), 110, 180),
        Part("long_tail", ("rollout", "--long-tail", *tail, "--budget-ratio", "1", "--repeats", "1",
                           "--json", str(out / "long_tail.json")), 160, 240),
        Part("update_8k", ("update", *up_8k), 100, 180),
    ]


def _args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_batch.json, gpu_batch.md and the parts' logs")
    p.add_argument("--cache", default="", help="JAX's persistent compilation cache for the parts other than the "
                   "steps (default: OUT/cache); keep it to make a second run compile little")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on this machine (CPU): every part, in seconds")
    p.add_argument("--deadline-s", type=float, default=540, help="the whole batch's time (default 540 s: under a "
                   "10-minute call); a part that would run past it is cut, one that cannot start is skipped")
    p.add_argument("--only", action="append", default=[], help="run only these parts (repeatable)")
    p.add_argument("--redo", action="store_true", help="run the parts already measured in OUT again")
    p.add_argument("--wheels", default="", help="a directory of wheels (grain, array-record, portpicker, "
                   "tensorboardX) for the step parts where they are not installed")
    return p.parse_args(argv)


def _device() -> dict:
    """The device and versions, from a subprocess (this process never initialises a backend)."""
    code = ("import json, platform, jax; d = jax.devices()[0]; print(json.dumps({'device_kind': d.device_kind, "
            "'platform': d.platform, 'devices': jax.device_count(), 'jax': jax.__version__, "
            "'python': platform.python_version()}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-500:]}


def _trainer_path(out: Path, wheels: str) -> tuple[str, str]:
    """(extra PYTHONPATH for the step parts, "" or why they cannot run)."""
    missing = [m for m in ("grain", "tensorboardX") if importlib.util.find_spec(m) is None]
    if not missing:
        return "", ""
    if not wheels:
        return "", (f"{' and '.join(missing)} not installed: pass --wheels DIR (docs/performance.md, 'The GPU "
                    "batch') or pip install them")
    site = out / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(site),
                           *map(str, sorted(Path(wheels).glob("*.whl")))], capture_output=True, text=True)
    if done.returncode != 0:
        return "", f"installing the wheels in {wheels} failed: {done.stderr.strip().splitlines()[-1:]}"
    return str(site), ""


def _run(part: Part, out: Path, env: dict, limit: float) -> dict:
    """Run one part; its record: status (ok, failed, cut), seconds, the command, its log's path."""
    log = out / "logs" / f"{part.name}.txt"
    argv = [sys.executable, "-m", "g2rl_jax.bench", *part.argv]
    print(f"[{part.name}] {' '.join(part.argv)} (limit {limit:.0f} s)", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=limit).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"cut at {limit:.0f} s"
    seconds = time.perf_counter() - start
    print(f"[{part.name}] {status} in {seconds:.1f} s", flush=True)
    return {"status": status, "seconds": round(seconds, 1), "command": "python -m g2rl_jax.bench " +
            " ".join(part.argv), "log": str(log.relative_to(out))}


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of a printed markdown table's rows whose first cell starts with `first_cell`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [r for r in rows if r[0].startswith(first_cell)]


def _number(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1).replace(",", "")) if m else None


def parse_update(text: str) -> dict:
    """`bench update`'s long-tailed rows: per variant its update s, µs per response token and MFU over response
    tokens (the table's columns)."""
    out = {}
    for cells in _table_rows(text, ""):
        if len(cells) >= 11 and cells[0].endswith("long-tailed"):
            layout = "packed" if "layout=packed" in cells[0] else "grouped"
            out[layout] = {"update_s": float(cells[3]), "us_per_response_token": float(cells[5]),
                           "resp_mfu": cells[10], "compile_first_s": float(cells[2]), "micro_batches": cells[1]}
    return out


def parse_step(text: str) -> dict:
    """`bench step`'s figures: the first step (it compiles), the timed step's split and the update's MFU."""
    out = {"first_step_s": _number(r"warm-up step \(compiles\): ([\d.,]+) s", text),
           "step_s": _number(r"step time over \d+ steps: ([\d.,]+) s", text),
           "update_mfu_response": _number(r"update MFU: ([\d.]+)%", text)}
    for stage in ("rollout", "rewards", "scoring", "update"):
        for cells in _table_rows(text, stage):
            if cells[0] == stage and len(cells) == 3:
                out[f"{stage}_s"], out[f"{stage}_share"] = float(cells[1]), cells[2]
    return out


def _figures(part: str, out: Path, text: str) -> dict:
    if part in ("decode", "long_tail"):
        path = out / f"{part}.json"
        return json.loads(path.read_text()) if path.exists() else {}
    if part.startswith("update"):
        return parse_update(text)
    return parse_step(text)


def _fmt(x, spec: str = ",.0f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(record: dict) -> str:
    """One table of the batch's figures (docs/performance.md's GPU section)."""
    dev, p = record.get("device", {}), record["parts"]
    lines = [f"GPU batch, {record['date']}: {dev.get('device_kind', '?')} x {dev.get('devices', '?')}, jax "
             f"{dev.get('jax', '?')}, python {dev.get('python', '?')}; `{record['command']}`", "",
             "| part | measured | status, s |", "|---|---|---|"]

    def row(name: str, text: str) -> None:
        r = p.get(name, {})
        lines.append(f"| {name} | {text if r.get('status') == 'ok' else '–'} | {r.get('status', 'not run')}, "
                     f"{r.get('seconds', '–')} |")

    dec = p.get("decode", {}).get("figures", {})
    text = "; ".join(f"{v}: **{_fmt(f.get('ms_per_step'), '.2f')} ms/step**, {_fmt(f.get('roofline_share'), '.0%')} "
                     f"of the HBM roofline ({_fmt(f.get('roofline_ms'), '.2f')} ms), {_fmt(f.get('tokens_per_s'))} "
                     f"tokens/s, compile {_fmt(f.get('compile_s'), '.1f')} s"
                     for v, f in dec.get("variants", {}).items())
    row("decode", text + (f"; same tokens: {dec['same_tokens']}" if "same_tokens" in dec else ""))
    for name in ("step_cold", "step_warm"):
        s = p.get(name, {}).get("figures", {})
        split = ", ".join(f"{k} {s.get(k + '_share', '–')}" for k in ("rollout", "rewards", "scoring", "update"))
        row(name, f"first step **{_fmt(s.get('first_step_s'), '.1f')} s**; step {_fmt(s.get('step_s'), '.2f')} s "
                  f"({split}); update MFU over response tokens {_fmt(s.get('update_mfu_response'), '.1f')}%")
    for name in ("update_1k", "update_8k"):
        u = p.get(name, {}).get("figures", {})
        row(name, "; ".join(f"{k}: **{v['resp_mfu']}** MFU over response tokens, {v['update_s']:.3f} s, "
                            f"{v['us_per_response_token']:.0f} µs/response token" for k, v in u.items()))
    lt = p.get("long_tail", {}).get("figures", {})
    row("long_tail", f"**{_fmt(lt.get('useful_tokens_per_s'))} useful tokens/s** ({_fmt(lt.get('tokens'))} tokens "
                     f"in {_fmt(lt.get('seconds'), '.2f')} s, {lt.get('lengths', '')})")
    return "\n".join(lines) + "\n"


def _write(out: Path, record: dict) -> None:
    (out / "gpu_batch.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "gpu_batch.md").write_text(markdown(record))


def main(argv: list[str]) -> int:
    a = _args(argv)
    out = Path(a.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    known = {p.name for p in parts(out, a.tiny)}
    if set(a.only) - known:
        return cli.fail("bench gpu", f"--only {sorted(set(a.only) - known)}: choose from {sorted(known)}")
    previous = json.loads((out / "gpu_batch.json").read_text()) if (out / "gpu_batch.json").exists() else {}
    device = _device()
    same_device = previous.get("device", {}).get("device_kind") == device.get("device_kind")
    record = {"date": datetime.date.today().isoformat(), "command": "python -m g2rl_jax.bench gpu " + " ".join(argv),
              "device": device, "parts": previous.get("parts", {}) if same_device and not a.redo else {}}
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(Path(a.cache).resolve() if a.cache else out / "cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    trainer_path, no_trainer = _trainer_path(out, a.wheels)
    # the steps set their own cache (run.compilation_cache_dir): jax would keep one set by the environment
    trainer_env = {k: v for k, v in env.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    trainer_env["PYTHONPATH"] = os.pathsep.join(x for x in (trainer_path, env.get("PYTHONPATH", "")) if x)
    if a.tiny and not (out / "tiny_model").exists():
        from g2rl_jax.bench.once import random_model

        random_model(out / "tiny_model")
    for part in parts(out, a.tiny):
        if (a.only and part.name not in a.only) or record["parts"].get(part.name, {}).get("status") == "ok":
            continue
        if part.name == "step_cold" and (out / "step_cache").exists():
            shutil.rmtree(out / "step_cache")  # cold: nothing compiled yet
        if part.name == "step_warm" and record["parts"].get("step_cold", {}).get("status") != "ok":
            record["parts"][part.name] = {"status": "skipped: step_cold did not finish (its cache is this part's)"}
            continue
        left = a.deadline_s - (time.perf_counter() - start)
        if part.needs_trainer and no_trainer:
            record["parts"][part.name] = {"status": f"skipped: {no_trainer}"}
        elif left < (1 if a.tiny else part.expect_s):
            record["parts"][part.name] = {"status": f"skipped: {left:.0f} s left of --deadline-s, it takes "
                                                    f"~{part.expect_s:.0f} s"}
        else:
            result = _run(part, out, trainer_env if part.needs_trainer else env, min(part.limit_s, left))
            text = (out / result["log"]).read_text()
            result["figures"] = _figures(part.name, out, text) if result["status"] == "ok" else {}
            result["tail"] = text.splitlines()[-3:] if result["status"] != "ok" else []
            record["parts"][part.name] = result
        _write(out, record)
    _write(out, record)
    print(markdown(record))
    print(f"wrote {out / 'gpu_batch.json'} and {out / 'gpu_batch.md'} in {time.perf_counter() - start:.0f} s")
    return 0
