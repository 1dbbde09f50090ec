"""Shared test helpers (tiny HF checkpoints themselves are in hf_tiny.py).

    from _helpers import create_sharded, tiny_qwen3_fixtures
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), mesh=mesh), mesh)   # random init, in place
    model_dir, model = tiny_qwen3_fixtures()   # module-scoped fixtures of one tiny random Qwen3 per test module
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable

import jax
import pytest
from flax import nnx

from g2rl_jax.model import load_pretrained
from g2rl_jax.parallel import DEFAULT_RULES, state_shardings

from hf_tiny import make_tiny_qwen3_dir


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess with `devices` fake CPU devices: the suite's flags (conftest.py) with that
    device count. (g2rl_jax, imported first there, sizes XLA:CPU's pool for that count.)"""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+ ?", "", os.environ.get("XLA_FLAGS", ""))
    return f"--xla_force_host_platform_device_count={devices} {flags}".strip()


def create_sharded(make_module: Callable[[], nnx.Module], mesh, rules=DEFAULT_RULES):
    """Build `make_module()` with every parameter created directly in the sharding the library gives it
    (`parallel.state_shardings`); runs load their weights with `load_pretrained(..., mesh=mesh)` instead."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make_module))
    shardings = state_shardings(abstract_state, mesh, rules)
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make_module()), out_shardings=shardings)())


def tiny_qwen3_fixtures(**config_overrides):
    """(model_dir, model): module-scoped fixtures of a tiny random Qwen3 checkpoint (hf_tiny) and the model
    `load_pretrained` reads from it. Assign them at module level under these names."""

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory):
        return make_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny_qwen3"), **config_overrides)

    @pytest.fixture(scope="module")
    def model(model_dir):
        return load_pretrained(model_dir)

    return model_dir, model


def placed_on_mesh_and_one_device(trainer, batch):
    """The trainer's params, optimizer state and `batch` placed twice: on the trainer's mesh (as sharded there) and
    on one device, each with the graphdef that says where activations live; yields (graphdef, params, opt_state,
    batch) for the mesh, then for the one device (the "sharded step equals unsharded" tests)."""
    import numpy as np

    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    for mesh in (trainer.mesh, one):
        def put(tree, mesh=mesh):
            named = lambda x: jax.sharding.NamedSharding(mesh, x.sharding.spec)  # noqa: E731
            return jax.tree.map(lambda x: jax.device_put(np.asarray(x), named(x)), tree)

        placed = jax.tree.map(lambda x, mesh=mesh: jax.device_put(np.asarray(x), jax.devices()[0] if mesh is one
                                                                  else x.sharding), batch)
        params = put(trainer.params)
        model = nnx.merge(trainer.graphdef, params)
        model.mesh = None if mesh is one else trainer.mesh  # the graphdef carries where activations live
        yield nnx.graphdef(model), params, put(trainer.opt_state), placed

