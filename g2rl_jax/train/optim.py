"""The optimizer of the RL update: AdamW after global-norm clipping, with linear warm-up and cosine decay, and its
state placed like the parameters.

    optimizer = make_optimizer(cfg.optim, total_updates)     # cached: equal configs share one object
    opt_state = init_optimizer(optimizer, trainable_params)  # each moment sharded like its parameter
"""
from __future__ import annotations

import functools

import jax
import optax

from g2rl_jax.config import OptimConfig


@functools.lru_cache(maxsize=8)
def make_optimizer(optim: OptimConfig, total_updates: int) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay to min_lr_ratio·peak, after global-norm clipping. Cached, so
    equal configs share one object and the jitted update compiles once."""
    schedule = learning_rate_schedule(optim, total_updates)
    return optax.chain(
        optax.clip_by_global_norm(optim.max_grad_norm),
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay),
    )


def optimizer_init_fn(optimizer: optax.GradientTransformation, params):
    """jit(optimizer.init) for `params` (arrays or abstract ShapeDtypeStructs) whose outputs are placed like the
    parameters: each moment with its parameter's sharding, the step counts replicated on the parameters' mesh.
    AdamW's moments are zeros_like(params), through which jit sees no sharding; a plain jit(optimizer.init) made
    them replicated on every device."""
    meshes = {x.sharding.mesh for x in jax.tree.leaves(params)
              if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)}
    if not meshes:
        return jax.jit(optimizer.init)
    replicated = jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec())
    return jax.jit(optimizer.init, out_shardings=_state_shardings(optimizer, params, replicated))


def _state_shardings(optimizer: optax.GradientTransformation, params, replicated):
    """The placement of each leaf of optimizer.init(params): a moment's its parameter's, the rest `replicated`.
    optax.tree_map_params runs init on a placeholder, whose step counts (jnp.zeros) would each compile a program
    of their own: run inside eval_shape's trace, they are traced, not compiled."""
    found = []

    def trace():
        found.append(optax.tree_map_params(optimizer, lambda _, p: p.sharding, jax.eval_shape(optimizer.init, params),
                                           params, transform_non_params=lambda _: replicated))
        return ()

    jax.eval_shape(trace)
    return found[0]


def init_optimizer(optimizer: optax.GradientTransformation, params):
    """The optimizer state of `params`, each moment sharded like its parameter (`optimizer_init_fn`)."""
    return optimizer_init_fn(optimizer, params)(params)


def learning_rate_schedule(optim: OptimConfig, total_updates: int) -> optax.Schedule:
    decay_steps = max(total_updates - optim.warmup_steps, 1)
    cosine = optax.cosine_decay_schedule(optim.learning_rate, decay_steps, alpha=optim.min_lr_ratio)
    if optim.warmup_steps == 0:
        return cosine
    warmup = optax.linear_schedule(0.0, optim.learning_rate, optim.warmup_steps)
    return optax.join_schedules([warmup, cosine], [optim.warmup_steps])
