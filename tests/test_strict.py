"""A late compile fails: run.strict_compiles raises when a step after the warm-up step compiles anything (naming the
program and its shapes), and every kind of run here runs under it with validation on: every registered exploration
method, dynamic sampling, LoRA, and validation after a resume (the two-process run: tests/test_multihost.py). Two
steps each (the first compiles, the second must not), on test_train's tiny policy; the compilation cache the suite
shares serves each method the programs another one compiled (rollout, score, validation)."""
import json

import pytest
from test_train import assets, config  # noqa: F401 - assets is a fixture

from g2rl_jax.train.compiles import CompileClock, LateCompile
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics

STRICT = {"run.strict_compiles": True, "run.eval_every": 1, "data.eval_samples": 2, "data.eval_max_new_tokens": 8,
          "data.eval_temperature": 1.0}


@pytest.fixture(scope="module")
def evalset(tmp_path_factory):
    path = tmp_path_factory.mktemp("strict_eval") / "eval.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "problem": f"{i}+{i}", "answer": str(2 * i)}) + "\n"
                            for i in range(10, 14)))
    return path


def _run(assets, out, evalset, steps=2, **kw):  # noqa: F811
    trainer = Trainer(config(assets, out, steps=steps, **{**STRICT, "data.eval_datasets": str(evalset), **kw}))
    trainer.resume()
    trainer.run()
    return read_metrics(out)


def _check(records, steps=2):
    assert [r["step"] for r in records] == list(range(steps + 1))
    assert all(any(k.startswith("val/") for k in r) for r in records)
    assert records[1]["programs_compiled"] > 0 and all(r["programs_compiled"] == 0 for r in records[2:])


# Every registered method runs strict, with validation on, in tests/test_program_count.py (one process, one
# device, the bill's count checked on the same runs).


def test_dynamic_sampling_compiles_nothing_after_its_first_step(assets, evalset, tmp_path):  # noqa: F811
    _check(_run(assets, tmp_path / "run", evalset, **{"algorithm.filter_equal_groups": True,
                                                      "algorithm.dynamic_sampling": True,
                                                      "algorithm.max_sampling_rounds": 3}))


def test_lora_compiles_nothing_after_its_first_step(assets, evalset, tmp_path):  # noqa: F811
    _check(_run(assets, tmp_path / "run", evalset, **{"model.lora.rank": 4, "algorithm.kl_coef": 0.001}))


def test_validation_after_a_resume_compiles_nothing_after_the_first_step(assets, evalset, tmp_path,  # noqa: F811
                                                                          monkeypatch):
    from test_warmup import fresh_process

    out = tmp_path / "run"
    trainer = Trainer(config(assets, out, steps=3, **{**STRICT, "data.eval_datasets": str(evalset),
                                                      "run.eval_every": 2}))
    trainer.resume()
    trainer.run(stop_after=1)
    fresh_process(monkeypatch)  # as a relaunch: nothing compiled in memory, the persistent cache kept
    records = _run(assets, out, evalset, steps=3, **{"run.eval_every": 2})  # validates at 2 and 3, after resuming
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["programs_compiled"] > 0 and records[3]["programs_compiled"] == 0
    assert any(k.startswith("val/") for k in records[3])


def test_a_late_compile_raises_and_names_the_program():
    import jax
    import jax.numpy as jnp

    clock = CompileClock()
    try:
        x = jax.block_until_ready(jnp.ones((5, 7), jnp.float32))
        clock.step_figures(1, after_warmup=False, strict=True)  # the warm-up step may compile
        jax.jit(lambda x: x * 3 + 1)(x)
        with pytest.raises(LateCompile, match=r"step 2 compiled 1 program\(s\) after the warm-up step .*: "
                                              r"<lambda> float32\[5,7\]"):
            clock.step_figures(2, after_warmup=True, strict=True)
    finally:
        clock.close()
