"""The bill's pass programs (aot/bill.micro_counts) against what jax compiles: the score, reference and gradient
programs take a micro-batch's rows from the whole batch and put the score passes' results into the step's arrays
themselves, so a shape set compiles one program per pass and shape and no move besides (the demo-size long-tailed
run's `2/octave x single` set: 9 shapes, 27 programs, where the separate row moves were 31 more). The trainer-level
count on a real run: `python -m g2rl_jax.bench programs` (docs/performance.md)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax.aot.bill import micro_counts
from g2rl_jax.config import AlgorithmConfig
from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.shapes.layouts import ShapeSet
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update
from g2rl_jax.train.compiles import CompileClock

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
RT = RuntimeConfig(param_dtype="float32", compute_dtype="float32", remat="none", attention="xla")
B, S, T = 8, 4, 8
SHAPES = ShapeSet(widths=((4, (2, 4, 8)), (2, (6, 8))), name="two widths per row count")
KINDS = {"score_micro": "score", "ref_micro": "reference", "accumulate": "gradient"}


def _batch() -> train_step.Batch:
    rng = np.random.default_rng(0)
    ones = np.ones((B, S), np.int32)
    mask = (np.arange(T)[None] < rng.integers(1, T + 1, (B, 1))).astype(np.int32)
    return train_step.build_batch(ones, ones, rng.integers(1, CFG.vocab_size, (B, T)) * mask, mask,
                                  np.ones(B, np.float32), np.ones(B, bool), group_size=4)


def test_each_pass_compiles_once_per_shape_and_no_move():
    graphdef, params = nnx.split(Qwen3(CFG, RT, rngs=nnx.Rngs(0)))
    batch = _batch()
    settings = train_update.LossSettings.from_config(dataclasses.replace(AlgorithmConfig(), kl_coef=0.01), 1.0)
    zeros = jnp.zeros((B, T))
    mini = train_step.MiniBatch(batch, old_logp_BxT=zeros, ref_logp_BxT=zeros, advantages_B=jnp.ones(B))
    like = train_step.take_rows(mini, np.arange(4, dtype=np.int32), 8)  # the accumulator's layout
    acc = train_update.zero_accumulator(train_update.policy_loss, graphdef, params, (like,), settings, batch.rewards)
    clock = CompileClock()  # from here: the passes only
    outs = train_step.score_outs(batch, CFG.hidden_size)
    ref = train_step.zeros_rows(batch.rewards, (B, T))
    for _ in range(2):  # a second round meets every shape again and compiles nothing
        for rows, width in SHAPES.shapes:
            rows_X = np.arange(rows, dtype=np.int32)
            outs = train_step.score_micro(graphdef, params, batch, rows_X, outs, temperature=1.0, chunk=4,
                                          width=width)
            ref = train_step.ref_micro(graphdef, params, batch, rows_X, ref, temperature=1.0, chunk=4, width=width)
            acc = train_update.accumulate(graphdef, params, acc, mini, rows_X, settings=settings, total_rows=B,
                                          width=width)
    jnp.asarray(acc[1]).block_until_ready()
    names = [n.split(" ")[0] for n in clock.take().names]
    clock.close()
    compiled = {KINDS[n]: names.count(n) for n in KINDS}
    assert sorted(names) == sorted(n for n in KINDS for _ in range(compiled[KINDS[n]])), names  # nothing else
    assert compiled == micro_counts(SHAPES, kl=True) == dict.fromkeys(KINDS.values(), len(SHAPES.shapes)), compiled
