"""The jitted halves of `generate`: prefill once per prompt, then a `lax.while_loop` decode over the group.

`prefill_fn(mesh, num_kv_heads)` / `decode_fn(mesh, num_kv_heads)` return jitted functions (one pair per mesh,
cached), each taking the model as (graphdef, state) split at the jit boundary; decode donates the suffix cache.
jax.jit caches one executable per bucket (shapes plus the static num_samples / sampler spec), so a training run
compiles once per bucket. `TRACE_COUNTS` counts traces per function (tests and the benchmark read it to check that
a bucket compiles once).

Decode loop state, B = P*m samples (sample b = p*m + j), T bucketed new-token slots:
  token t of sample b is drawn from the logits after token t-1 (token 0 from the prompt's prefill logits, shared
  by its m samples), with the PRNG key fold_in(fold_in(key(seed), b), t): a sample's draws do not depend on the
  batch padding or the sharding. A sample stops after a stop token; stopped samples keep being fed token 0
  (static batch) but record nothing. Dummy rows (bucket padding) start stopped. The loop ends when every sample
  has stopped or max_new_tokens is reached.
"""
from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from g2rl_jax import parallel
from g2rl_jax.model.qwen3 import PrefixCache, SuffixCache
from g2rl_jax.parallel import DEFAULT_RULES
from g2rl_jax.rollout.sampling import SamplerSpec, sample_tokens

TRACE_COUNTS: collections.Counter = collections.Counter()


def batch_shards(mesh) -> int:
    """How many ways the batch is split on `mesh` (1 without a mesh)."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in DEFAULT_RULES.mesh_axes("batch"))


def _prefill(graphdef, state, ids_PxS, mask_PxS, *, num_samples: int, new_tokens: int):
    """Last-token logits [P, V], the prompt K/V cache, and an empty suffix cache for P*num_samples samples."""
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    logits_PxV, prefix = model.prefill(ids_PxS, mask_PxS)
    return logits_PxV, prefix, model.init_suffix(prefix, num_samples=num_samples, max_new_tokens=new_tokens)


def _is_stop(tokens_B, stops_Z):
    return (tokens_B[:, None] == stops_Z[None, :]).any(-1)


def _decode(graphdef, state, logits_PxV, prefix: PrefixCache, suffix: SuffixCache, key, temperature, top_p,
            stops_Z, max_new_tokens, num_real, *, num_samples: int, spec: SamplerSpec):
    """Sample up to max_new_tokens per sample: (tokens [B, T] (0 after the end), log-probs [B, T], lengths [B],
    stopped [B], steps: tokens generated per sample at most) and the final suffix cache (returned only so the
    donated input buffer is updated in place). Samples b >= num_real (dummy prompts) count as stopped."""
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    P_, T = logits_PxV.shape[0], suffix.k.shape[3]
    B = P_ * num_samples
    sample_keys_B = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(B))

    def draw(logits_BxV, t):
        step_keys_B = jax.vmap(jax.random.fold_in, (0, None))(sample_keys_B, t)
        return sample_tokens(logits_BxV, step_keys_B, temperature, top_p, spec)

    tok0_B, lp0_B = draw(jnp.repeat(logits_PxV, num_samples, axis=0), 0)
    tokens_BxT = jnp.zeros((B, T), jnp.int32).at[:, 0].set(tok0_B)
    logprobs_BxT = jnp.zeros((B, T), jnp.float32).at[:, 0].set(lp0_B)
    stopped_B = _is_stop(tok0_B, stops_Z) | (jnp.arange(B) >= num_real)
    carry = (jnp.int32(1), tokens_BxT, logprobs_BxT, jnp.ones((B,), jnp.int32), stopped_B, suffix)

    def cond(c):
        t, *_, stopped_B, _ = c
        return (t < max_new_tokens) & ~stopped_B.all()

    def body(c):
        t, tokens_BxT, logprobs_BxT, lengths_B, stopped_B, suffix = c
        prev_B = jax.lax.dynamic_index_in_dim(tokens_BxT, t - 1, axis=1, keepdims=False)
        logits_BxV, suffix = model.decode_step(prev_B, prefix, suffix, step=t - 1)
        tok_B, lp_B = draw(logits_BxV, t)
        live_B = ~stopped_B
        tok_B, lp_B = jnp.where(live_B, tok_B, 0), jnp.where(live_B, lp_B, 0.0)
        tokens_BxT = jax.lax.dynamic_update_index_in_dim(tokens_BxT, tok_B, t, axis=1)
        logprobs_BxT = jax.lax.dynamic_update_index_in_dim(logprobs_BxT, lp_B, t, axis=1)
        stopped_B = stopped_B | (live_B & _is_stop(tok_B, stops_Z))
        return t + 1, tokens_BxT, logprobs_BxT, lengths_B + live_B, stopped_B, suffix

    steps, tokens_BxT, logprobs_BxT, lengths_B, stopped_B, suffix = jax.lax.while_loop(cond, body, carry)
    return (tokens_BxT, logprobs_BxT, lengths_B, stopped_B, steps), suffix


def _kv_sharding(mesh, num_kv_heads: int) -> NamedSharding:
    """[layers, batch, kv_heads, length, head_dim]: batch over data/fsdp, KV heads over tensor (parallel's rules).

    Errors if the model's KV heads do not divide the tensor axis (the batch is bucketed to divide its axes)."""
    check_shape = (1, batch_shards(mesh), num_kv_heads, 1, 1)
    spec = DEFAULT_RULES.spec(("layers", "batch", "kv_heads", "seq", "head_dim"), check_shape, mesh, "KV cache")
    return NamedSharding(mesh, spec)


def batch_sharding(mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis over data/fsdp, the rest replicated."""
    return parallel.batch_sharding(mesh, ndim=ndim)


@functools.lru_cache(maxsize=None)
def prefill_fn(mesh, num_kv_heads: int):
    """jit(_prefill), with the caches' shardings pinned on `mesh` (None: single device, no constraints)."""
    static = ("graphdef", "num_samples", "new_tokens")
    if mesh is None:
        return jax.jit(_prefill, static_argnames=static)
    kv = _kv_sharding(mesh, num_kv_heads)
    prefix = PrefixCache(k=kv, v=kv, mask=batch_sharding(mesh, 2), lengths=batch_sharding(mesh, 1))
    return jax.jit(_prefill, static_argnames=static,
                   out_shardings=(batch_sharding(mesh, 2), prefix, SuffixCache(k=kv, v=kv)))


@functools.lru_cache(maxsize=None)
def decode_fn(mesh, num_kv_heads: int):
    """jit(_decode) with the suffix cache donated; outputs sharded over the batch on `mesh`."""
    static = ("graphdef", "num_samples", "spec")
    if mesh is None:
        return jax.jit(_decode, static_argnames=static, donate_argnames=("suffix",))
    kv = _kv_sharding(mesh, num_kv_heads)
    out = (batch_sharding(mesh, 2), batch_sharding(mesh, 2), batch_sharding(mesh, 1), batch_sharding(mesh, 1),
           NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return jax.jit(_decode, static_argnames=static, donate_argnames=("suffix",),
                   out_shardings=(out, SuffixCache(k=kv, v=kv)))
