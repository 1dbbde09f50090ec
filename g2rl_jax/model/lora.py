"""LoRA adapters on the Qwen3 projections: a frozen base W and a trained low-rank update, W + (alpha/r)·A·B.

    spec = LoraSpec(rank=64, alpha=64.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", ...))
    attach(model, spec, dtype="float32", seed=0, mesh=mesh)   # model.adapters: A random, B = 0 (policy = base)
    trainable, frozen = split_trainable(nnx.state(model))     # adapters (nnx.LoRAParam) | the frozen base
    ref_graphdef = reference_graphdef(graphdef, state)        # the same weights with the adapters switched off
    plain = merged(model, "float32")                          # a Qwen3 without adapters, W + (alpha/r)·A·B

Layout. A projection W of layer l maps its input dims I to its output dims O (q_proj [D] -> [H, K], o_proj [H, K]
-> [D]; the stacked parameter is [layers, *I, *O]). Its adapter is A [layers, *I, r] and B [layers, r, *O], both
`nnx.LoRAParam`, with W's logical axes on I and O and "lora_rank" (replicated) on r, so g2rl_jax.parallel's rules
shard A like W's input side and B like its output side. The forward adds x·A·(s·B), s = alpha/r, to x·W
(`qwen3.project`), so the base matmul is computed exactly as without adapters; A starts uniform in ±1/sqrt(fan_in)
(PEFT's default) and B at zero, so at step 0 the LoRA policy's logits are the base model's, bit for bit.

Training differentiates and optimizes the `nnx.LoRAParam` leaves only (`split_trainable`): the base goes into the
jitted update as a non-differentiated argument. The KL reference is the same state under `reference_graphdef`, whose
static `Adapters.enabled` is False: no second copy of the weights. The sampler's per-layer decode weights (already
one compute-dtype copy per layer and rollout, `Qwen3.decode_layers`) get the adapters merged in (`decode_layer`),
so a decode step costs what the base model's does (docs/lora.md has the measurements).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from g2rl_jax.model.config import DTYPES
from g2rl_jax.model.hf_io import LAYER_HF
from g2rl_jax.model.qwen3 import LAYER_AXES, LORA_A, LORA_B, PROJECTIONS, Qwen3, layer_shapes
from g2rl_jax.parallel import state_shardings

# config name (model.lora.targets) -> projection
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r > 0, alpha (the update is (alpha/r)·A·B) and the adapted projections (names in PROJECTIONS)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self):
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if self.rank <= 0 or unknown or not self.targets:
            raise ValueError(f"LoraSpec needs rank > 0 and targets among {PROJECTIONS}, got rank {self.rank}, "
                             f"targets {self.targets}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora_cfg) -> LoraSpec | None:
        """The spec of config group model.lora (None when rank is 0: LoRA off)."""
        if lora_cfg.rank == 0:
            return None
        alpha = float(lora_cfg.rank if lora_cfg.alpha is None else lora_cfg.alpha)
        return cls(lora_cfg.rank, alpha, tuple(TARGETS[t] for t in lora_cfg.targets))


def in_dims(name: str) -> int:
    """How many leading dims of projection `name` (without the layers axis) are its input dims."""
    return LAYER_HF[name][1]


def factor_shapes(cfg, spec: LoraSpec, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A, B) shapes of projection `name`'s adapter: [layers, *I, r] and [layers, r, *O]."""
    shape, n = layer_shapes(cfg)[name], in_dims(name)
    return (cfg.num_hidden_layers, *shape[:n], spec.rank), (cfg.num_hidden_layers, spec.rank, *shape[n:])


class Adapters(nnx.Module):
    """The A and B factors of every adapted projection, stacked over layers (attribute NAME_a, NAME_b)."""

    def __init__(self, cfg, spec: LoraSpec, dtype, rngs: nnx.Rngs):
        self.spec = spec
        self.enabled = True  # static (in the graphdef): False is the reference policy, the base alone
        self.merge_for_decode = True  # static: merge into the decode weights (False: x·A·B per step, benchmarks)
        for name in spec.targets:
            a_shape, b_shape = factor_shapes(cfg, spec, name)
            axes, n = LAYER_AXES[name], in_dims(name)
            bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
            a = jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound).astype(dtype)
            setattr(self, f"{name}_a", nnx.LoRAParam(a, out_sharding=("layers", *axes[:n], "lora_rank"),
                                                     eager_sharding=False))
            setattr(self, f"{name}_b", nnx.LoRAParam(jnp.zeros(b_shape, dtype),
                                                     out_sharding=("layers", "lora_rank", *axes[n:]),
                                                     eager_sharding=False))

    def factors(self, name: str) -> tuple[jax.Array, jax.Array]:
        """(A [layers, *I, r], B [layers, r, *O]) of projection `name`, B unscaled."""
        return getattr(self, f"{name}_a")[...], getattr(self, f"{name}_b")[...]

    def stacked(self) -> dict[str, jax.Array]:
        """The factors as entries of the scanned layer dict: NAME + LORA_A = A, NAME + LORA_B = (alpha/r)·B."""
        out = {}
        for name in self.spec.targets:
            a, b = self.factors(name)
            out[name + LORA_A], out[name + LORA_B] = a, self.spec.scale * b
        return out

    def decode_layer(self, layer: dict[str, jax.Array], i: int) -> dict[str, jax.Array]:
        """Layer i's weights for the sampler: each adapted W replaced by W + (alpha/r)·A·B (float32), or, with
        merge_for_decode off, the layer's own factors beside W."""
        out = dict(layer)
        for name in self.spec.targets:
            a, b = self.factors(name)
            if self.merge_for_decode:
                out[name] = merge_weight(layer[name], a[i], b[i], self.spec.scale)
            else:
                out[name + LORA_A], out[name + LORA_B] = a[i], self.spec.scale * b[i]
        return out


def merge_weight(w, a, b, scale: float) -> jax.Array:
    """W + scale·A·B in float32: W [*I, *O], A [*I, r], B [r, *O] (one layer)."""
    return w.astype(jnp.float32) + scale * jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)


def _placed(make, mesh):
    """The nnx.Module `make()` built directly in its shardings on `mesh` (one device without a mesh)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda v: v.replace(device), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    else:
        shardings = state_shardings(abstract, mesh)
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make()), out_shardings=shardings)())


def attach(model: Qwen3, spec: LoraSpec, *, dtype: str, seed: int, mesh=None) -> Qwen3:
    """Give `model` adapters for `spec` in `dtype` (A random from `seed`, B = 0), each created in its sharding on
    `mesh`; returns the model. Every process of a multi-host run draws the same A from the same seed."""
    model.adapters = _placed(lambda: Adapters(model.config, spec, DTYPES[dtype], nnx.Rngs(seed)), mesh)
    return model


def set_factors(model: Qwen3, factors: dict[str, tuple]) -> None:
    """Overwrite adapters with host arrays {projection: (A, B)} of the factor shapes, keeping their shardings."""
    for name, values in factors.items():
        for suffix, value in zip(("_a", "_b"), values):
            var = getattr(model.adapters, name + suffix)
            old = var[...]
            host = jnp.asarray(value, old.dtype)
            var.set_value(jax.make_array_from_callback(old.shape, old.sharding, lambda idx, h=host: h[idx]))


def trainable_filter(state) -> type:
    """What an update trains: the adapters (nnx.LoRAParam) when the state holds any, else every nnx.Param."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.LoRAParam if any(isinstance(v, nnx.LoRAParam) for v in leaves) else nnx.Param


def split_trainable(state) -> tuple[nnx.State, nnx.State]:
    """(trainable, frozen) parts of a model state; frozen is empty for full fine-tuning. nnx.merge_state of the
    two gives the state back."""
    return nnx.split_state(state, trainable_filter(state), ...)


def trainable(state) -> nnx.State:
    return split_trainable(state)[0]


def has_adapters(state) -> bool:
    return trainable_filter(state) is nnx.LoRAParam


def reference_graphdef(graphdef, state):
    """The graphdef of the same model with its adapters switched off (the base model): merged with the very same
    state it computes the reference policy, so the KL reference costs no second copy of the weights."""
    model = nnx.merge(graphdef, state)
    model.adapters.enabled = False
    return nnx.graphdef(model)


def merged(model: Qwen3, dtype: str) -> Qwen3:
    """A Qwen3 without adapters whose adapted projections are W + (alpha/r)·A·B (computed in float32, stored in
    `dtype`, like every other parameter); the export of a LoRA policy as plain weights."""
    adapters, spec = model.adapters, model.adapters.spec
    copy = nnx.merge(*nnx.split(model))  # new modules over the same Variables: only static attributes change
    copy.adapters = None
    copy.runtime = dataclasses.replace(model.runtime, param_dtype=dtype)
    graphdef, state = nnx.split(copy)
    merge_all = jax.jit(jax.vmap(merge_weight, in_axes=(0, 0, 0, None)), static_argnums=3)
    merged_w = {name: merge_all(state["layers"][name][...], *adapters.factors(name), spec.scale)
                for name in spec.targets}

    def value(path, var):  # a new Variable each: the model's own stay as they are
        key = tuple(str(getattr(p, "key", p)) for p in path)
        x = merged_w[key[1]] if key[0] == "layers" and key[1] in merged_w else var[...]
        return var.replace(x.astype(DTYPES[dtype]))

    return nnx.merge(graphdef, jax.tree.map_with_path(value, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
