"""One process per side (parallel.side_meshes, train/weight_sync.SideSync): the training mesh on one process, the
rollout mesh on two others, joined by jax.distributed on localhost (CPU, gloo, JAX's socket transfers across
hosts), one fake device each. The rollout mesh spans its two processes (tensor 2 across them).

Checks (g2rl_jax/bench/async_sides.py runs the processes): each push of the changed params arrives on both rollout
processes, whose forward pass over their mesh gives the training side's logits (sent through the key-value store)
to float32 precision; each push moves the params' bytes once. And the settings of one process per side fail in
one line when they cannot work.
"""
import argparse

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
