"""The bill counts what a run compiles: for every registered method, the programs aot/bill.program_counts predicts
(without compiling) equal those a jax.monitoring listener counts on a 2-step run with validation on (test_train's
tiny policy on one CPU device, as the demo runs), and with packed passes (algorithm.packing) for g2rl and a token-rule
method, each run strict (`run.strict_compiles`: a compile after the first
step raises, naming the program). One process runs every method in turn, its in-memory caches
cleared between them (the shared persistent cache only makes the compiles cheaper: a program read back counts)."""
import json
import os
import subprocess
import sys

import pytest

from g2rl_jax import methods

from _helpers import xla_flags

CASES = (*methods.NAMES, "g2rl+packing", "clip_cov+packing")  # "+packing": with algorithm.packing

RUN = r'''
import json, pathlib, shutil, sys
sys.path.insert(0, sys.argv[1])
import g2rl_jax  # noqa: F401 - sizes XLA:CPU's pool first
import jax
import test_train
from test_train import config
from g2rl_jax import methods
from g2rl_jax.aot.bill import program_counts
from g2rl_jax.model import lora
from g2rl_jax.rollout import engine, prewarm
from g2rl_jax.train.compiles import CompileClock
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics
from g2rl_jax.demo.tokenizer import make_tokenizer
root = pathlib.Path(sys.argv[2])
test_train.VOCAB = -(-len(make_tokenizer()) // 64) * 64
assets = json.loads(sys.argv[3])
out = {}
for case in json.loads(sys.argv[5]):
    method, packing = case.split("+")[0], case.endswith("+packing")
    kw = {"algorithm.packing": packing, "run.strict_compiles": True, "run.eval_every": 1, "data.eval_samples": 2,
          "data.eval_max_new_tokens": 8, "data.eval_temperature": 1.0,
          "data.eval_datasets": sys.argv[4], "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1}
    if method == "passk":
        kw["algorithm.passk_k"] = 2
    jax.clear_caches()
    prewarm.WARMED.clear()
    prewarm._ROWS.clear()
    clock = CompileClock()
    cfg = config(assets, root / case, mode=method, steps=2, **kw)
    trainer = Trainer(cfg)
    trainer.resume()
    trainer.run()
    seen = clock.take()
    clock.close()
    shapes = {(x.shape, str(x.dtype)) for x in jax.tree.leaves(lora.trainable(trainer.params))}
    counts = program_counts(cfg, trainer.model.config, engine.batch_shards(trainer.mesh), trainer.warmup.choice,
                            trainer.eval_prompt_len, len(shapes))
    late = [r["programs_compiled"] for r in read_metrics(root / case)[2:]]
    out[case] = {"listener": seen.programs, "names": list(seen.names), "bill": counts, "late": late}
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def counted(tmp_path_factory, request):
    """Runs the cases the session selected (all by default; `-k` picks fewer)."""
    picked = [item.callspec.params["case"] for item in request.session.items  # this module's cases only
              if item.path == request.path and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    from test_train import assets as make_assets

    root = tmp_path_factory.mktemp("program_count")
    assets = make_assets.__wrapped__(tmp_path_factory)
    evalset = root / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"id": str(i), "problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n"
                               for i in range(10, 14)))
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")])}
    paths = json.dumps({k: str(v) for k, v in assets.items()})
    proc = subprocess.run([sys.executable, "-c", RUN, tests, str(root), paths, str(evalset),
                           json.dumps(picked or CASES)], env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", CASES)
def test_the_bill_counts_what_the_run_compiles(counted, case):
    got = counted[case]
    assert sum(got["bill"].values()) == got["listener"], (got["bill"], got["names"])
    assert got["late"] == [0], got["late"]  # step 2 compiled nothing (strict mode would have raised)
