"""Qwen3 decoder in Flax NNX: scanned layers, GQA, per-head q/k RMSNorm, rotate-half RoPE, SwiGLU, no biases.

Public API (shape letters of the legend in `g2rl_jax`'s docstring; masks are 1/True for real tokens, 0 for padding):

    model = Qwen3(config, RuntimeConfig(...), rngs=nnx.Rngs(0), mesh=None)  # mesh: rows over (data, fsdp)
    model(input_ids, attention_mask=None) -> logits_BxLxV (float32)   # input_ids [B, L] int, attention_mask [B, L]
    model.hidden_states(input_ids, attention_mask=None) -> h_BxLxD (after the final norm)
    model.lm_head_weight() -> W_VxD (the embedding table when tie_word_embeddings)
    model.adapters -> None, or LoRA adapters (g2rl_jax.model.lora.attach): every projection in `layer_params()`
        that has them computes x·W + x·A·(alpha/r)·B (`project`); `decode_layers()` merges them into its copies

Positions are cumsum(mask) - 1 (clipped at 0), so a left-padded row computes exactly what it would unpadded.

KV cache for group sampling (a prompt is prefilled once, its m samples decode against the shared prefix):

    logits_PxV, prefix = model.prefill(prompt_ids_PxS, prompt_mask_PxS)   # prompts LEFT-padded
    suffix = model.init_suffix(prefix, num_samples=m, max_new_tokens=W)   # W: slots (the capacity)
    for t in range(W):                                                  # B = P*m, sample b = p*m + j
        logits_BxV, suffix = model.decode_step(tokens_B, prefix, suffix, step=t)

`prefill` returns the logits of each prompt's last token (position S-1, hence left padding). `decode_step`
feeds token t of every sample at position len(prompt p) + t, stores its K/V in suffix slot t and attends to the
prefix of its prompt plus suffix slots 0..t in one softmax. Both caches hold ONE BUFFER PER LAYER (tuples), so
that the decode step, whose layer loop is unrolled, writes slot t of layer i in place (a jitted caller donates
the suffix) and reads it without copying it (with a stacked [layers, ...] cache XLA copied each layer's slice on
every step). `PrefixCache` holds K/V [P, KVH, S, Dh] per layer once per prompt; `SuffixCache` holds K/V
[P*m, KVH, W, Dh] per layer per sample, in `RuntimeConfig.kv_cache_dtype`. KV heads sit before length so that
both attention matmuls read the cache in place (batch dims major, the contracted and free dims minor). The
prefix may also hold one row per sample (P = B, m = 1): the sampler switches to that layout when it compacts the
live samples of different prompts into a smaller batch (g2rl_jax/rollout/engine.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from g2rl_jax.model import attention as attn
from g2rl_jax.model.config import Qwen3Config, RuntimeConfig
from g2rl_jax.parallel import DEFAULT_RULES

# Per-layer parameters (HF names), each stacked with a leading layers axis: logical axes of one layer.
LAYER_AXES = {
    "q_proj": ("embed", "heads", "head_dim"),
    "k_proj": ("embed", "kv_heads", "head_dim"),
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "o_proj": ("heads", "head_dim", "embed"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "input_layernorm": ("embed",),
    "post_attention_layernorm": ("embed",),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}
_NORMS = ("q_norm", "k_norm", "input_layernorm", "post_attention_layernorm")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Keys of a layer dict holding projection NAME's LoRA factors (g2rl_jax.model.lora): NAME + LORA_A, NAME + LORA_B.
LORA_A, LORA_B = ".lora_a", ".lora_b"


def layer_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Shape of each per-layer parameter of one layer (without the layers axis)."""
    D, F, H, G, K = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                     cfg.num_key_value_heads, cfg.head_dim)
    return {"q_proj": (D, H, K), "k_proj": (D, G, K), "v_proj": (D, G, K), "o_proj": (H, K, D),
            "q_norm": (K,), "k_norm": (K,), "input_layernorm": (D,), "post_attention_layernorm": (D,),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def _param(rngs: nnx.Rngs, shape, axes, dtype, ones: bool = False) -> nnx.Param:
    """A parameter tagged with its logical axes (mapped to mesh axes by g2rl_jax.parallel)."""
    value = jnp.ones(shape, dtype) if ones else (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class DecoderLayers(nnx.Module):
    """All decoder layers' parameters, stacked as [num_layers, ...] for `lax.scan`."""

    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        for name, shape in layer_shapes(cfg).items():
            setattr(self, name, _param(rngs, (cfg.num_hidden_layers, *shape), ("layers", *LAYER_AXES[name]),
                                       dtype, ones=name in _NORMS))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in LAYER_AXES}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "mask", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PrefixCache:
    """Prompt K/V, once per prompt: k, v one [P, KVH, S, Dh] array per layer; mask [P, S] bool; lengths [P]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    mask: jax.Array
    lengths: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SuffixCache:
    """Generated-token K/V, one row per sample b = p*m + j: k, v one [P*m, KVH, W, Dh] array per layer."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def capacity(self) -> int:
        """Slots W per sample."""
        return self.k[0].shape[2]


def rms_norm(x, weight, eps: float):
    """RMSNorm as Qwen3: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight.astype(x.dtype)


def rope(x_BxLxHxK, positions_BxL, theta: float):
    """Rotary embedding of H query or G key/value heads, rotate-half: x*cos + [-x2, x1]*sin with angles
    pos * theta^(-2i/K)."""
    K = x_BxLxHxK.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K)
    angles_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
    angles_BxLx1xK = jnp.concatenate([angles_BxLxK2, angles_BxLxK2], axis=-1)[:, :, None, :]
    x32 = x_BxLxHxK.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * jnp.cos(angles_BxLx1xK) + rotated * jnp.sin(angles_BxLx1xK)).astype(x_BxLxHxK.dtype)


def positions_from_mask(mask_BxL):
    """Per-token positions that ignore padding: cumsum(mask) - 1, clipped at 0 (padding included)."""
    return jnp.maximum(jnp.cumsum(mask_BxL.astype(jnp.int32), axis=-1) - 1, 0)


def project(eq: str, x, p: dict, name: str):
    """x times layer p's projection `name` (einsum `eq`, "x,W->y"), plus its LoRA term x·A·B' when p holds one
    (p[name + LORA_A] [*in, r], p[name + LORA_B] [r, *out], B' = (alpha/r)·B, see g2rl_jax.model.lora)."""
    y = jnp.einsum(eq, x, p[name].astype(x.dtype))
    if name + LORA_A not in p:
        return y
    (x_dims, w_dims), y_dims = eq.split("->")[0].split(","), eq.split("->")[1]
    w_in = "".join(c for c in w_dims if c in x_dims)
    w_out = "".join(c for c in w_dims if c not in x_dims)
    rows = "".join(c for c in x_dims if c not in w_dims)
    xa = jnp.einsum(f"{x_dims},{w_in}r->{rows}r", x, p[name + LORA_A].astype(x.dtype))
    return y + jnp.einsum(f"{rows}r,r{w_out}->{y_dims}", xa, p[name + LORA_B].astype(x.dtype))


def _qkv(x_BxLxD, p, positions_BxL, cfg: Qwen3Config):
    """Pre-norm, q/k/v projections, per-head q/k RMSNorm, then RoPE."""
    h = rms_norm(x_BxLxD, p["input_layernorm"], cfg.rms_norm_eps)
    q = project("bld,dhk->blhk", h, p, "q_proj")
    k = project("bld,dgk->blgk", h, p, "k_proj")
    v = project("bld,dgk->blgk", h, p, "v_proj")
    q = rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), positions_BxL, cfg.rope_theta)
    k = rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), positions_BxL, cfg.rope_theta)
    return q, k, v


def _out_and_mlp(x_BxLxD, a_BxLxHxK, p, cfg: Qwen3Config):
    """Attention output projection + residual, then SwiGLU MLP + residual."""
    x = x_BxLxD + project("blhk,hkd->bld", a_BxLxHxK, p, "o_proj")
    h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = project("bld,df->blf", h, p, "gate_proj")
    up = project("bld,df->blf", h, p, "up_proj")
    return x + project("blf,fd->bld", jax.nn.silu(gate) * up, p, "down_proj")


_REMAT = {"full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Qwen3(nnx.Module):
    """Qwen3 causal LM (see the module docstring for the API)."""

    def __init__(self, config: Qwen3Config, runtime: RuntimeConfig = RuntimeConfig(), *, rngs: nnx.Rngs,
                 mesh: jax.sharding.Mesh | None = None):
        self.config, self.runtime = config, runtime
        self.mesh = mesh  # where activations live: rows over data x fsdp (None: no constraint, one device)
        pd = runtime.param_jnp
        V, D = config.vocab_size, config.hidden_size
        self.embed_tokens = _param(rngs, (V, D), ("vocab", "embed"), pd)
        self.layers = DecoderLayers(config, pd, rngs)
        self.norm = _param(rngs, (D,), ("embed",), pd, ones=True)
        self.lm_head = None if config.tie_word_embeddings else _param(rngs, (V, D), ("vocab", "embed"), pd)
        self.adapters = nnx.data(None)  # LoRA: g2rl_jax.model.lora.attach sets a lora.Adapters here

    def layer_params(self) -> dict[str, jax.Array]:
        """The stacked [layers, ...] weights the decoder layers read: the base, plus each adapted projection's
        LoRA factors when adapters are attached and enabled."""
        stacked = self.layers.stacked()
        if self.adapters is not None and self.adapters.enabled:
            stacked |= self.adapters.stacked()
        return stacked

    def lm_head_weight(self) -> jax.Array:
        """The output projection [V, D] (the embedding table when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

    def __call__(self, input_ids, attention_mask=None) -> jax.Array:
        """float32 logits [B, L, V] of token ids [B, L]; attention_mask [B, L] (1 real, 0 padding; None: all real)."""
        return self.logits(self.hidden_states(input_ids, attention_mask))

    def logits(self, h_BxLxD) -> jax.Array:
        """float32 logits from final hidden states."""
        W_VxD = self.lm_head_weight().astype(h_BxLxD.dtype)
        return jnp.einsum("bld,vd->blv", h_BxLxD, W_VxD, preferred_element_type=jnp.float32)

    def hidden_states(self, input_ids, attention_mask=None, positions=None, block: int = 0) -> jax.Array:
        """Final-norm hidden states [B, L, D] in the compute dtype, of ids [B, L] and mask [B, L] (as __call__).
        Packed rows (several sequences per row): `attention_mask` holds segment ids (0 padding, a sequence >= 1;
        model.attention) and `positions` [B, L] each token's position in its own sequence (default
        positions_from_mask); `block` > 0 lets the xla attention skip other sequences' key blocks of that size."""
        h_BxLxD, _ = self._forward(input_ids, attention_mask, keep_kv=False, positions_BxL=positions, block=block)
        return h_BxLxD

    def _rows_sharded(self, x_Bx___):
        """Pin an activation's rows to the batch mesh axes (data x fsdp), its other dims replicated. Without it
        GSPMD follows the fsdp-sharded `embed` dim of the weights: every device then computes on all rows and
        all-reduces activations; with it, weights are all-gathered per layer (FSDP)."""
        if self.mesh is None:
            return x_Bx___
        spec = DEFAULT_RULES.spec(("batch",) + (None,) * (x_Bx___.ndim - 1))
        return jax.lax.with_sharding_constraint(x_Bx___, jax.sharding.NamedSharding(self.mesh, spec))

    def _forward(self, input_ids_BxL, mask_BxL, keep_kv: bool, positions_BxL=None, block: int = 0):
        cfg, rt = self.config, self.runtime
        if mask_BxL is None:
            mask_BxL = jnp.ones(input_ids_BxL.shape, jnp.bool_)
        if positions_BxL is None:
            positions_BxL = positions_from_mask(mask_BxL)
        x = self._rows_sharded(jnp.take(self.embed_tokens[...], input_ids_BxL, axis=0).astype(rt.compute_jnp))

        def body(x_BxLxD, p):
            q, k, v = _qkv(x_BxLxD, p, positions_BxL, cfg)
            a = attn.attention(q, k, v, mask_BxL, rt.attention, self.mesh, block)
            kv = (k.astype(rt.kv_cache_jnp), v.astype(rt.kv_cache_jnp)) if keep_kv else None
            return self._rows_sharded(_out_and_mlp(x_BxLxD, a, p, cfg)), kv

        if rt.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT[rt.remat])
        x, kv = jax.lax.scan(body, x, self.layer_params())
        return rms_norm(x, self.norm[...], cfg.rms_norm_eps), kv

    def prefill(self, input_ids_PxS, attention_mask_PxS) -> tuple[jax.Array, PrefixCache]:
        """Run LEFT-padded prompts once: last-token logits [P, V] (float32) and their K/V cache."""
        h, (k_NxPxSxGxK, v_NxPxSxGxK) = self._forward(input_ids_PxS, attention_mask_PxS, keep_kv=True)
        mask = attention_mask_PxS.astype(bool)

        def per_layer(x_NxPxSxGxK):  # -> one [P, KVH, S, Dh] buffer per layer, the layout decode reads
            return tuple(x_NxPxSxGxK[i].transpose(0, 2, 1, 3) for i in range(x_NxPxSxGxK.shape[0]))

        cache = PrefixCache(k=per_layer(k_NxPxSxGxK), v=per_layer(v_NxPxSxGxK), mask=mask,
                            lengths=mask.sum(-1).astype(jnp.int32))
        return self.logits(h[:, -1:])[:, 0], cache

    def init_suffix(self, prefix: PrefixCache, num_samples: int, max_new_tokens: int) -> SuffixCache:
        """An empty per-sample cache for `num_samples` samples of each prompt and `max_new_tokens` slots."""
        P, G, _, K = prefix.k[0].shape
        zeros = tuple(jnp.zeros((P * num_samples, G, max_new_tokens, K), self.runtime.kv_cache_jnp)
                      for _ in prefix.k)
        return SuffixCache(k=zeros, v=tuple(jnp.zeros_like(z) for z in zeros))

    def decode_layers(self) -> tuple[dict[str, jax.Array], ...]:
        """Each layer's weights as its own arrays in the compute dtype, for `decode_step(layers=...)`: made once per
        rollout, so that no decode step slices (XLA copies the slices) or casts the stacked parameters again.
        Enabled LoRA adapters are merged into these copies (`lora.Adapters.decode_layer`)."""
        dt = self.runtime.compute_jnp
        stacked = self.layers.stacked()
        layers = [{name: w[i] for name, w in stacked.items()} for i in range(self.config.num_hidden_layers)]
        if self.adapters is not None and self.adapters.enabled:
            layers = [self.adapters.decode_layer(layer, i) for i, layer in enumerate(layers)]
        return tuple({name: w.astype(dt) for name, w in layer.items()} for layer in layers)

    def decode_step(self, tokens_B, prefix: PrefixCache, suffix: SuffixCache, step,
                    layers=None, reads: tuple[int, ...] = ()) -> tuple[jax.Array, SuffixCache]:
        """Feed token `step` of every sample; logits [B, V] (float32) and the suffix with slot `step` written.

        The layer loop is unrolled: each layer's suffix buffer is updated in place and read where it lies.
        `layers`: `decode_layers()`, made once by the caller (default: sliced here from the stacked weights).
        `reads`: the read rungs (attention.decode_attention): the step reads the first r >= step + 1 slots."""
        cfg, rt = self.config, self.runtime
        P, B = prefix.mask.shape[0], tokens_B.shape[0]
        if B % P:
            raise ValueError(f"decode_step: batch {B} is not a multiple of the {P} prompts in the prefix cache")
        positions_Bx1 = (jnp.repeat(prefix.lengths, B // P) + step)[:, None]
        x_Bx1xD = self._rows_sharded(jnp.take(self.embed_tokens[...], tokens_B[:, None], axis=0)
                                     .astype(rt.compute_jnp))
        layers = self.decode_layers() if layers is None else layers
        suf_k, suf_v = list(suffix.k), list(suffix.v)
        for i, p in enumerate(layers):
            q, k_Bx1xGxK, v_Bx1xGxK = _qkv(x_Bx1xD, p, positions_Bx1, cfg)
            suf_k[i] = jax.lax.dynamic_update_slice(
                suf_k[i], k_Bx1xGxK.transpose(0, 2, 1, 3).astype(suf_k[i].dtype), (0, 0, step, 0))
            suf_v[i] = jax.lax.dynamic_update_slice(
                suf_v[i], v_Bx1xGxK.transpose(0, 2, 1, 3).astype(suf_v[i].dtype), (0, 0, step, 0))
            a_BxHxK = attn.decode_attention(q[:, 0], prefix.k[i], prefix.v[i], prefix.mask, suf_k[i], suf_v[i],
                                            step + 1, reads)
            x_Bx1xD = self._rows_sharded(_out_and_mlp(x_Bx1xD, a_BxHxK[:, None], p, cfg))
        h = rms_norm(x_Bx1xD, self.norm[...], cfg.rms_norm_eps)
        return self.logits(h)[:, 0], SuffixCache(k=tuple(suf_k), v=tuple(suf_v))
