"""One process per side (parallel.side_meshes, train/weight_sync.SideSync): the training mesh on one process, the
rollout mesh on two others, joined by jax.distributed on localhost (CPU, gloo, JAX's socket transfers across
hosts), one fake device each. The rollout mesh spans its two processes (tensor 2 across them).

Checks (g2rl_jax/bench/async_sides.py runs the processes): each push of the changed params arrives on both rollout
processes, whose forward pass over their mesh gives the training side's logits (sent through the key-value store)
to float32 precision; each push moves the params' bytes once. And the settings of one process per side fail in
one line when they cannot work.
"""
import argparse
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from g2rl_jax import parallel
from g2rl_jax.bench import async_sides
from g2rl_jax.config import ConfigError, MeshConfig
from g2rl_jax.model import Qwen3
from g2rl_jax.model.config import PRESETS


def test_weights_cross_to_a_rollout_mesh_on_other_processes():
    a = argparse.Namespace(processes=3, rollout_processes=2, devices=1, rollout_tensor=2, model="tiny", pushes=2,
                           dtype="float32", pin=False)
    rows = async_sides.launch(a, timeout=300)
    assert sorted(r["process"] for r in rows) == [1, 2]  # the rollout processes report, the trainer does not
    params = nnx.state(nnx.eval_shape(lambda: Qwen3(PRESETS["tiny"], rngs=nnx.Rngs(0))), nnx.Param)
    want_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))  # float32
    for r in rows:
        assert r["bytes_per_push"] == want_bytes
        assert r["max_logit_diff"] < 1e-4, r



def test_one_process_per_side_settings():
    with pytest.raises(ConfigError, match="leave mesh.rollout_devices at 0"):
        MeshConfig(rollout_processes=1, rollout_devices=2)
    with pytest.raises(ConfigError, match="leaves 0 training processes"):  # this test is one process
        parallel.set_sides(MeshConfig(rollout_processes=1))
    assert parallel.side_processes() is None and parallel.host_count() == jax.process_count()
    with pytest.raises(ConfigError, match="each side needs at least one process"):
        parallel.side_meshes(MeshConfig(), 1)


def test_joined_blocks_are_the_whole_batch():
    """Several rollout processes each send their block of a step's samples; `joined` must give back the whole."""
    from g2rl_jax.rewards.scoring import RewardResult
    from g2rl_jax.rollout.generate import _assemble
    from g2rl_jax.train.ahead import joined

    rng, m, B = np.random.default_rng(0), 2, 8
    lengths_B = rng.integers(1, 6, B)
    whole_rollout = _assemble(m, rng.integers(1, 50, (B, 4)), rng.integers(0, 2, (B, 4)).astype(bool),
                              rng.integers(1, 50, (B, 8)), rng.normal(size=(B, 8)).astype(np.float32), lengths_B,
                              rng.integers(0, 2, B).astype(bool), decode_steps=int(lengths_B.max()))
    whole_scored = RewardResult(rewards=rng.normal(size=B), correct=rng.integers(0, 2, B).astype(bool),
                                in_loss=np.ones(B, bool), truncated=np.zeros(B, bool))
    examples, texts, correct = [f"prompt {i}" for i in range(B // m)], [f"text {b}" for b in range(B)], [np.ones(B)]

    def block(i, n=2):
        rows = slice(i * B // n, (i + 1) * B // n)
        part = lambda x: {f.name: getattr(x, f.name)[rows] for f in dataclasses.fields(x)  # noqa: E731
                          if f.name not in ("num_samples", "decode_steps", "segments")}
        return (examples[i * len(examples) // n:(i + 1) * len(examples) // n],
                type(whole_rollout)(**part(whole_rollout), num_samples=m, decode_steps=whole_rollout.decode_steps),
                texts[rows], RewardResult(**part(whole_scored)), float(i + 1), correct)

    got = joined([block(0), block(1)])
    assert got[0] == examples and got[2] == texts and got[4] == 2.0 and got[5] is correct
    for want, have in ((whole_rollout, got[1]), (whole_scored, got[3])):
        assert_fields_equal(have, want)
    single = block(0, 1)  # one rollout process: its block is the step
    assert joined([single]) is single


def assert_fields_equal(got, want):
    """Every field of two dataclasses of arrays (or lists of arrays) is equal, element for element."""
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, list):
            assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), f.name
        else:
            np.testing.assert_array_equal(a, b, err_msg=f.name)
