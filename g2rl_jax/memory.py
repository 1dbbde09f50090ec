"""Per-device byte counts of each part of a training run, for the memory planner (`g2rl_jax.plan`, whose
docstring says what each part holds): the mesh and how each logical axis divides over it, then parameters, KV cache,
activations and the rest, from the config and the architecture alone (nothing is allocated).
"""
from __future__ import annotations

import math

import numpy as np

from g2rl_jax.config import Config, ConfigError
from g2rl_jax.g2rl import DEFAULT_CHUNK
from g2rl_jax.model.config import DTYPES, Qwen3Config, RuntimeConfig
from g2rl_jax.parallel import DEFAULT_RULES, mesh_sizes
from g2rl_jax.rollout.batching import MIN_PROMPT_BUCKET, bucket, new_tokens_bucket

F32 = 4
# layer-boundary activations the compiled gradient holds per layer under remat, by platform (see activation_parts)
SAVED_COPIES = {"tpu": 2, "gpu": 1}


class PlanError(ValueError):
    """A config or mesh the planner cannot lay out; the message names both numbers that disagree."""


# ------------------------------------------------------------------------------------------------ the mesh
def resolve_mesh(cfg: Config, devices: int) -> dict[str, int]:
    """Mesh sizes for `devices` devices (parallel.mesh_sizes: -1 fills); PlanError names both numbers."""
    try:
        return mesh_sizes(cfg.mesh, devices)
    except ConfigError as err:
        raise PlanError(str(err)) from err


def shards(logical: str | None, mesh: dict[str, int]) -> int:
    """How many ways DEFAULT_RULES split a dimension with this logical name on `mesh`."""
    return math.prod(mesh[a] for a in DEFAULT_RULES.mesh_axes(logical))


def check_divisible(model: Qwen3Config, mesh: dict[str, int]) -> None:
    """Every sharded model dimension must divide by its mesh axes; the error names both numbers."""
    dims = {"heads": model.num_attention_heads, "kv_heads": model.num_key_value_heads,
            "mlp": model.intermediate_size, "vocab": model.vocab_size, "embed": model.hidden_size}
    for logical, size in dims.items():
        parts = shards(logical, mesh)
        if size % parts:
            axes = DEFAULT_RULES.mesh_axes(logical)
            raise PlanError(f"model {logical} = {size} is not divisible by mesh axes {axes} of size {parts}; "
                            f"choose a mesh whose {'*'.join(axes)} divides {size}")


# ------------------------------------------------------------------------------------------------ components
def param_elements(model: Qwen3Config, runtime: RuntimeConfig, mesh: dict[str, int]) -> int:
    """Parameter elements per device: each Variable's shape divided along its logical axes (DEFAULT_RULES)."""
    from flax import nnx

    from g2rl_jax.model.qwen3 import Qwen3

    return _elements(nnx.state(nnx.eval_shape(lambda: Qwen3(model, runtime, rngs=nnx.Rngs(0)))), mesh)


def adapter_elements(model: Qwen3Config, lora_cfg, mesh: dict[str, int]) -> int:
    """LoRA adapter elements per device (config group model.lora; 0 when its rank is 0), sharded as the factors'
    logical axes say: A like its projection's input dims, B like its output dims, the rank replicated."""
    import jax.numpy as jnp
    from flax import nnx

    from g2rl_jax.model import lora

    spec = lora.LoraSpec.from_config(lora_cfg)
    if spec is None:
        return 0
    return _elements(nnx.state(nnx.eval_shape(lambda: lora.Adapters(model, spec, jnp.float32, nnx.Rngs(0)))), mesh)


def _elements(abstract, mesh: dict[str, int]) -> int:
    import jax
    from flax import nnx

    total = 0
    for var in jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        DEFAULT_RULES.spec(tuple(logical))  # rejects two dims on one mesh axis
        total += math.prod(-(-n // shards(name, mesh)) for n, name in zip(var.shape, logical))
    return total


def nbytes(name: str) -> int:
    return np.dtype(DTYPES[name]).itemsize


def kv_token_bytes(cfg: Config, model: Qwen3Config) -> int:
    """K and V of one token in one layer, all KV heads, in the KV-cache dtype."""
    return 2 * model.num_key_value_heads * model.head_dim * nbytes(cfg.model.kv_cache_dtype)


def kv_cache_bytes(cfg: Config, model: Qwen3Config, mesh: dict[str, int]) -> tuple[int, int, int, int]:
    """(bytes per device, P, S, T): prefix K/V once per prompt + suffix K/V per sample, bucketed as the sampler."""
    batch_shards = shards("batch", mesh)
    p = -(-bucket(cfg.data.prompts_per_step, 1) // batch_shards) * batch_shards
    s = bucket(cfg.data.max_prompt_tokens, MIN_PROMPT_BUCKET)
    t = new_tokens_bucket(cfg.rollout.max_new_tokens)
    rows = p * s + p * cfg.rollout.num_samples * t
    total = model.num_hidden_layers * rows * kv_token_bytes(cfg, model) // (batch_shards * shards("kv_heads", mesh))
    return total, p, s, t


def layer_internal_elements(model: Qwen3Config, b: int, length: int, tp: int) -> tuple[int, int]:
    """(compute-dtype, float32) elements one decoder layer materialises for b rows of `length` tokens."""
    d, f, k = model.hidden_size, model.intermediate_size // tp, model.head_dim
    h, g = model.num_attention_heads // tp, model.num_key_value_heads // tp
    compute = b * length * (3 * d + (2 * h + 2 * g) * k + 3 * f)  # x, norms, q/k/v, attn out, gate/up/act
    f32 = b * length * (2 * d + (h + g) * k)  # rms_norm and rope compute in float32
    return compute, f32


def attention_scores_bytes(runtime: RuntimeConfig, heads: int, b: int, length: int) -> int:
    """The xla backend's [b, H, L, L] scores in the backward pass: scores, softmax and their cotangent in float32,
    the probabilities in the compute dtype and the boolean mask. Fused kernels keep O(L) instead, but cuDNN (GPU)
    takes the padding/segment mask as a [b, 1, L, L] bias in the compute dtype (model.attention.fused)."""
    if runtime.attention == "cudnn":
        return b * length * length * nbytes(runtime.compute_dtype)
    if runtime.attention != "xla":
        return 0
    return b * heads * length * length * (3 * F32 + nbytes(runtime.compute_dtype) + 1)


def micro_rows_per_device(cfg: Config, mesh: dict[str, int]) -> int:
    """Rows of one update micro-batch on each device. train.micro.take_micro spreads each micro-batch's rows over
    all n batch shards (padding rounds up when micro < n)."""
    return -(-cfg.algorithm.micro_batch_size // shards("batch", mesh))


def activation_parts(cfg: Config, model: Qwen3Config, runtime: RuntimeConfig, mesh: dict[str, int], length: int,
                     t: int, platform: str = "tpu") -> dict[str, int]:
    """Bytes of one micro-batch of the update (forward + backward) with the configured rematerialisation, as the
    `platform`'s compiler ("tpu" or "gpu") lays it out. With LoRA the gathered base weights get no gradient (the
    adapters' are negligible)."""
    c = nbytes(cfg.model.compute_dtype)
    b = micro_rows_per_device(cfg, mesh)
    tp = shards("heads", mesh)
    inner_c, inner_f32 = layer_internal_elements(model, b, length, tp)
    internals = inner_c * c + inner_f32 * F32  # one layer's values
    scores = attention_scores_bytes(runtime, model.num_attention_heads // tp, b, length)
    layers = model.num_hidden_layers
    vocab = model.vocab_size // shards("vocab", mesh)
    per_layer_params = sum(math.prod(s) for s in _layer_shapes(model)) // tp
    return {
        # remat: only each layer's input [b, L, D] is kept, and the TPU compiler's gradient holds about twice that
        # (calibrated: at 1.7B/8k on v5p-8 and v6e-16 and 4B/12k on v5p-16 its temporaries exceeded the other terms
        # by 1.0-1.2x this stack; counted once, the update phase was 16-20% low); the GPU compiler's holds it once
        # (8 x H100, 1.7B/8k and 4B/12k: counted twice, the update phase was 22-24% high); none: every layer's
        # internals
        "saved": SAVED_COPIES[platform] * layers * b * length * model.hidden_size * c if cfg.model.remat != "none"
        else (layers - 1) * (internals + scores),
        "layer": internals + scores,
        # one layer's all-gathered weights and their float32 gradient (none for a frozen LoRA base)
        "gathered": per_layer_params * (c + (0 if cfg.model.lora.rank else F32)),
        "logits": 3 * b * min(DEFAULT_CHUNK, t) * vocab * F32,  # logits, softmax, cotangent of one chunk
        "head": vocab * model.hidden_size // shards("embed", mesh) * c,  # lm head cast to the compute dtype
        "hidden": 2 * b * length * model.hidden_size * (c + F32),  # final hidden states and their cotangent
    }


def decode_weight_bytes(cfg: Config, model: Qwen3Config, mesh: dict[str, int]) -> int:
    """The decoder layers' weights in the compute dtype, one array per layer, made once per rollout
    (`Qwen3.decode_layers`), sharded like the parameters."""
    from g2rl_jax.model.qwen3 import LAYER_AXES, layer_shapes

    per_layer = sum(math.prod(-(-n // shards(ax, mesh)) for n, ax in zip(shape, LAYER_AXES[name]))
                    for name, shape in layer_shapes(model).items())
    return model.num_hidden_layers * per_layer * nbytes(cfg.model.compute_dtype)


def gathered_decode_weight_bytes(cfg: Config, model: Qwen3Config, mesh: dict[str, int]) -> int:
    """The decode weights all-gathered over the batch axes (data x fsdp) during a decode segment: the weights are
    the same on every step of its while loop, and the TPU compiler gathers them once, before the loop (seen in the
    compiled decode segment at 1.7B on v6e-16: 3 GiB of temporaries per chip). Split over tensor only; 0 when the
    batch axes do not shard them."""
    if shards("embed", mesh) == 1:
        return 0
    return decode_weight_bytes(cfg, model, dict(mesh, data=1, fsdp=1))


def _layer_shapes(model: Qwen3Config):
    from g2rl_jax.model.qwen3 import layer_shapes

    return layer_shapes(model).values()


# ------------------------------------------------------------------------------------------------ weight sync
WHOLE = {"data": 1, "fsdp": 1, "tensor": 1}  # a mesh of one device: an array's whole size


def trainable_bytes(cfg: Config, model: Qwen3Config) -> int:
    """Bytes of the whole trainable parameters (the adapters with LoRA) in model.param_dtype: one version the weight
    sync moves."""
    from g2rl_jax.model.config import RuntimeConfig

    n = (adapter_elements(model, cfg.model.lora, WHOLE) if cfg.model.lora.rank
         else param_elements(model, RuntimeConfig(), WHOLE))
    return n * nbytes(cfg.model.param_dtype)


def weight_sync_bytes(cfg: Config, model: Qwen3Config, hosts: int) -> dict[str, int]:
    """Per chip, what the weight sync of a split run holds beside the run state (train/weight_sync.py), each a
    multiple of trainable_bytes: "gathered", the whole trainable params every training chip holds while a version is
    pushed (the training mesh's all-gather before the move: always with one process set per side, SideSync; with
    mesh.rollout_devices only when the training mesh spans several hosts, WeightSync.move; none within one process,
    where jax.device_put copies shard by shard); "held", the versions not yet acknowledged by every rollout process,
    which the training side's first chip keeps (SideSync: the rollout lags by at most rollout.max_staleness versions,
    so that many while the next update runs, one more while it pushes); "arrived", the whole version on each rollout
    process's first chip before it is spread over its rollout mesh (SideSync)."""
    whole = trainable_bytes(cfg, model)
    if cfg.mesh.rollout_processes:
        return {"gathered": whole, "held": cfg.rollout.max_staleness * whole, "arrived": whole}
    gathered = whole if cfg.mesh.rollout_devices and hosts > 1 else 0
    return {"gathered": gathered, "held": 0, "arrived": 0}
