"""The step warm-up (train/warmup.py) on the tiny trainer of test_train.py (CPU, 8 devices, mesh 2 x 2 x 2): it
compiles the score, reference, gradient and optimizer-step programs of the shapes the step then runs, each once and
on its own threads, the step compiles none of them again, and the step's numbers are those of a step without it."""
import collections
import logging

import jax
import numpy as np
import pytest
from test_train import DETERMINISTIC, assets, config  # noqa: F401 - assets is a fixture

from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train.loop import Trainer

HEAVY = ("_score_micro", "_ref_micro", "accumulate", "apply_gradients")
# 16 responses of up to 40 tokens in micro-batches of 8 or 4 rows: several shapes per pass; two epochs
SHAPES = {"data.prompts_per_step": 4, "rollout.max_new_tokens": 40, "algorithm.mini_batch_size": 8,
          "algorithm.micro_batch_size": 8, "algorithm.ppo_epochs": 2}


class Compiles(logging.Handler):
    """XLA compiles per (jitted function, thread) while attached (jax_log_compiles's records)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.by = collections.Counter()

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of jit("):
            self.by[msg.split("jit(", 1)[1].split(")", 1)[0], record.threadName.startswith("compile")] += 1

    def __enter__(self):
        self.old = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("jax").removeHandler(self)
        jax.config.update("jax_log_compiles", self.old)


def one_step(assets, out, threads):  # noqa: F811
    jax.clear_caches()  # what earlier tests compiled would hide the compiles counted here
    trainer = Trainer(config(assets, out, steps=1, **{"run.compile_threads": threads, **SHAPES}))
    with Compiles() as compiles:
        result = trainer.step_stages(0)
    trainer.close()
    return trainer, result, compiles.by


@pytest.fixture(scope="module")
def warmed(assets, tmp_path_factory):  # noqa: F811
    return one_step(assets, tmp_path_factory.mktemp("warm") / "run", threads=2)


def test_warmup_compiles_what_the_step_runs(warmed):
    trainer, result, compiles = warmed
    algo = trainer.cfg.algorithm
    score = {(len(r), w) for r, w in zip(*(lambda p: (p.rows, p.widths))(micro_lib.plan_for(result.batch,
                                                                                             algo.micro_batch_size)))}
    grads = set()
    mask = np.asarray(result.batch.response_mask)
    for start in range(0, mask.shape[0], algo.mini_batch_size):
        plan = micro_lib.plan_micro(mask[start:start + algo.mini_batch_size], algo.micro_batch_size,
                                    min_rows=micro_lib.row_shards(result.batch.rewards))
        grads |= {(len(r), w) for r, w in zip(plan.rows, plan.widths)}
    expected = {"_score_micro": len(score), "_ref_micro": len(score), "accumulate": len(grads), "apply_gradients": 1}
    in_pool = {fn: compiles[fn, True] for fn in HEAVY}
    in_step = {fn: compiles[fn, False] for fn in HEAVY}
    assert in_pool == expected, (in_pool, expected)  # every shape the step ran, each compiled once
    assert in_step == dict.fromkeys(HEAVY, 0), in_step  # the step's own calls compiled none of them again
    assert len(trainer.warmup.timings) == sum(expected.values())
    assert all(t.error is None for t in trainer.warmup.timings)


def test_warmup_changes_no_number(warmed, assets, tmp_path):  # noqa: F811
    _, result, _ = warmed
    _, plain, compiles = one_step(assets, tmp_path / "run", threads=1)
    assert not any(in_pool for _, in_pool in compiles)  # threads=1: no warm-up, every program compiles on call
    for key in DETERMINISTIC:
        if key in result.metrics:
            assert result.metrics[key] == plain.metrics[key], key
