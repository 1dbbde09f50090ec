"""A fake `python -m g2rl_jax.train` for tests/test_tpu_watch.py, run by the fake worker's .venv/bin/python when
FAKE_TRAINER is set: a trainer that exits with each code of g2rl_jax/control/exits.py, without JAX.

FAKE_TRAINER (JSON) holds one entry per launch, in order (the last one repeats); launches are counted in
FAKE_DIR/trainer_launches. `{"steps": N, "exit": CODE, "line": TEXT}`: resume after the last step in
run.output_dir/metrics.jsonl, write N more step records FAKE_STEP_SECONDS (default 0.05) apart, print TEXT (the
trainer's one line) and exit with CODE; exit 0 also writes summary.json. `{"until": "SIGTERM"}`: write a step record
every FAKE_STEP_SECONDS until a SIGTERM, then exit 143 (as the trainer does within its grace).
"""
import json
import os
import signal
import sys
import time
from pathlib import Path


def launch_index() -> int:
    counter = Path(os.environ["FAKE_DIR"]) / "trainer_launches"
    with open(counter, "a") as fh:
        fh.write("x")
    return counter.stat().st_size - 1


def main(argv: list[str]) -> int:
    specs = json.loads(os.environ["FAKE_TRAINER"])
    spec = specs[min(launch_index(), len(specs) - 1)]
    run = Path(next(a for a in argv if a.startswith("run.output_dir=")).split("=", 1)[1])
    run.mkdir(parents=True, exist_ok=True)
    metrics = run / "metrics.jsonl"
    step = max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=0) \
        if metrics.exists() else 0
    print(f"fake trainer: resuming after step {step}", flush=True)
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    pause = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
    for _ in range(10**6 if "until" in spec else spec["steps"]):
        if stopped:
            print("preempted (SIGTERM): the step in progress is abandoned", flush=True)
            return 143
        time.sleep(pause)
        step += 1
        with open(metrics, "a") as fh:
            fh.write(json.dumps({"step": step, "loss": 0.1}) + "\n")
    if spec["exit"] == 0:
        (run / "summary.json").write_text(json.dumps({"steps": step}))
    print(spec.get("line", f"fake trainer: exit {spec['exit']}"), flush=True)
    return spec["exit"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
