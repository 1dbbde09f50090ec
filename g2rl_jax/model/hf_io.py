"""Hugging Face interop: load a local Qwen3 directory into `Qwen3`, and save `Qwen3` back as one.

    model = load_pretrained("/ckpt/Qwen3-1.7B", dtype="bfloat16", mesh=mesh)
    save_pretrained(model, "/out/dir")   # transformers.AutoModelForCausalLM.from_pretrained("/out/dir") loads it

Loading reads config.json and model.safetensors (or model.safetensors.index.json + shards). Every tensor is
validated (present, right shape) from the file headers before any array is built. Each parameter is then
created directly in its target sharding with `jax.make_array_from_callback`; the callback reads only the slice a
device needs (`safe_open(...).get_slice`), layer by layer into the stacked [layers, ...] layout, so no host ever
holds the whole model. The layout is read from the tensor names in the headers, not from config.json's
`architectures` (the Qwen3-Embedding releases say Qwen3ForCausalLM but hold a bare Qwen3Model): `model.`-prefixed
keys (Qwen3ForCausalLM) or unprefixed ones (Qwen3Model, e.g. Qwen3-Embedding). An unprefixed checkpoint without
`lm_head.weight` is an encoder: it is loaded with the head tied to the embedding table, so its hidden_states are
right but its logits carry no meaning. A prefixed, untied checkpoint without `lm_head.weight` is an error.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import pathlib

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from g2rl_jax.model.config import Qwen3Config, RuntimeConfig, dtype_from_name
from g2rl_jax.model.qwen3 import Qwen3, layer_shapes
from g2rl_jax.parallel import DEFAULT_RULES, ShardingRules, state_shardings

_LOG = logging.getLogger(__name__)

# Our per-layer parameter -> (HF name under layers.{i}., number of leading "in" dims of our layout or None).
# A linear with in dims I and out dims O is stored by HF as [prod(O), prod(I)] and by us as [*I, *O].
LAYER_HF = {
    "q_proj": ("self_attn.q_proj.weight", 1), "k_proj": ("self_attn.k_proj.weight", 1),
    "v_proj": ("self_attn.v_proj.weight", 1), "o_proj": ("self_attn.o_proj.weight", 2),
    "q_norm": ("self_attn.q_norm.weight", None), "k_norm": ("self_attn.k_norm.weight", None),
    "input_layernorm": ("input_layernorm.weight", None),
    "post_attention_layernorm": ("post_attention_layernorm.weight", None),
    "gate_proj": ("mlp.gate_proj.weight", 1), "up_proj": ("mlp.up_proj.weight", 1),
    "down_proj": ("mlp.down_proj.weight", 1),
}


def _hf_shape(ours: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    """HF shape of a tensor whose layout here is `ours`."""
    if n_in is None:
        return tuple(ours)
    return (math.prod(ours[n_in:]), math.prod(ours[:n_in]))


def _hf_names(cfg: Qwen3Config, prefix: str) -> dict[tuple, tuple[list[str], int | None, tuple]]:
    """Our state path -> (HF tensor names, one per layer for stacked params; n_in; our per-tensor shape)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    names = {("embed_tokens",): ([prefix + "embed_tokens.weight"], None, (V, D)),
             ("norm",): ([prefix + "norm.weight"], None, (D,))}
    if not cfg.tie_word_embeddings:
        names[("lm_head",)] = (["lm_head.weight"], None, (V, D))
    for ours, shape in layer_shapes(cfg).items():
        hf, n_in = LAYER_HF[ours]
        names[("layers", ours)] = ([f"{prefix}layers.{i}.{hf}" for i in range(cfg.num_hidden_layers)], n_in, shape)
    return names


def _group_read(slices: list[slice], dims: tuple[int, ...]):
    """Flattened-range read of a row-major group of dims, and the sub-slices to apply after reshaping."""
    first, rest = slices[0], dims[1:]
    inner = math.prod(rest)
    flat = slice(first.start * inner, first.stop * inner)
    return flat, (first.stop - first.start, *rest), (slice(None), *slices[1:])


def _read_slice(handle, name: str, n_in: int | None, ours: tuple[int, ...], slices: list[slice], dtype):
    """Our-layout slice `slices` of HF tensor `name`, reading only the rows/columns it needs."""
    tensor = handle.get_slice(name)
    if n_in is None:
        return tensor[tuple(slices)].astype(dtype)
    in_flat, in_shape, in_sub = _group_read(slices[:n_in], ours[:n_in])
    out_flat, out_shape, out_sub = _group_read(slices[n_in:], ours[n_in:])
    block = tensor[out_flat, in_flat].reshape(*out_shape, *in_shape)[(*out_sub, *in_sub)]
    n_out = len(ours) - n_in
    return np.transpose(block, (*range(n_out, n_out + n_in), *range(n_out))).astype(dtype)


def _tensor_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
    with safe_open(str(single), framework="numpy") as f:
        return {name: single for name in f.keys()}


def weights_sha256(path) -> str:
    """sha256 of a HF directory's weights: every safetensors file of `_tensor_files`, by name, then its bytes (the
    base model a LoRA checkpoint or adapter was trained on is recorded by this)."""
    path = pathlib.Path(path)
    digest = hashlib.sha256()
    for file in sorted(set(_tensor_files(path).values())):
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def _key_prefix(path: pathlib.Path, tensors: dict[str, pathlib.Path]) -> str:
    """"model." for a Qwen3ForCausalLM layout, "" for a bare Qwen3Model one, from the tensor names present."""
    for prefix in ("model.", ""):
        if prefix + "embed_tokens.weight" in tensors:
            return prefix
    raise ValueError(f"{path}: the safetensors hold neither 'model.embed_tokens.weight' (Qwen3ForCausalLM) nor "
                     f"'embed_tokens.weight' (Qwen3Model), so this is not a Qwen3 checkpoint; point at the directory "
                     f"of a Hugging Face Qwen3 model")


def _read_config(path: pathlib.Path, tensors: dict[str, pathlib.Path]) -> tuple[Qwen3Config, str]:
    """The config and the key prefix; an untied bare Qwen3Model without lm_head (an encoder) is loaded as tied."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found; expected a Hugging Face Qwen3 directory")
    cfg = Qwen3Config.from_hf_dict(json.loads(config_file.read_text()), source=str(config_file))
    prefix = _key_prefix(path, tensors)
    if not cfg.tie_word_embeddings and prefix == "" and "lm_head.weight" not in tensors:
        _LOG.warning("%s: Qwen3Model (encoder) checkpoint has no lm_head; tying the head to the embedding table "
                     "(hidden_states are exact, logits are not meaningful)", path)
        cfg = Qwen3Config(**{**cfg.__dict__, "tie_word_embeddings": True})
    return cfg, prefix


def _check_tensors(names, tensors, handles, path):
    """Every expected tensor exists with the expected shape (checked from headers, before loading)."""
    for hf_names, n_in, ours in names.values():
        want = list(_hf_shape(ours, n_in))
        for name in hf_names:
            if name not in tensors:
                raise ValueError(f"{path}: tensor {name!r} is missing from the checkpoint, which config.json "
                                 f"requires; the download or export is incomplete, fetch or write it again")
            got = handles[tensors[name]].get_slice(name).get_shape()
            if list(got) != want:
                raise ValueError(f"{tensors[name]}: tensor {name!r} has shape {list(got)}, expected {want} "
                                 f"from config.json; config.json and the weights disagree (another model's?)")


def load_pretrained(path, dtype: str = "float32", *, runtime: RuntimeConfig | None = None, mesh=None,
                    rules: ShardingRules = DEFAULT_RULES) -> Qwen3:
    """Load a local HF Qwen3 directory; parameters in `dtype`, placed by `mesh` + `rules` (or on one device).

    `runtime` sets the other run options (default: compute in `dtype`); its param_dtype must equal `dtype`.
    """
    np_dtype = np.dtype(dtype_from_name(dtype, "load_pretrained dtype"))
    runtime = runtime or RuntimeConfig(param_dtype=dtype, compute_dtype=dtype)
    if runtime.param_dtype != dtype:
        raise ValueError(f"load_pretrained: dtype={dtype!r} but runtime.param_dtype={runtime.param_dtype!r}")
    path = pathlib.Path(path)
    tensors = _tensor_files(path)
    cfg, prefix = _read_config(path, tensors)
    names = _hf_names(cfg, prefix)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, runtime, rngs=nnx.Rngs(0), mesh=mesh)))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda v: v.replace(device), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    else:
        shardings = state_shardings(abstract, mesh, rules)

    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="numpy")) for f in set(tensors.values())}
        _check_tensors(names, tensors, handles, path)

        def build(path_, var, sharding):
            key = tuple(str(p.key) for p in path_)
            hf_names, n_in, ours = names[key]
            stacked = key[0] == "layers"

            def callback(index):
                slices = [slice(*s.indices(n)[:2]) for s, n in zip(index, var.shape)]
                if not stacked:
                    return _read_slice(handles[tensors[hf_names[0]]], hf_names[0], n_in, ours, slices, np_dtype)
                layers = range(slices[0].start, slices[0].stop)
                return np.stack([_read_slice(handles[tensors[hf_names[i]]], hf_names[i], n_in, ours, slices[1:],
                                             np_dtype) for i in layers])

            return var.replace(jax.make_array_from_callback(var.shape, sharding.get_value(), callback))

        state = jax.tree.map_with_path(build, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def save_pretrained(model: Qwen3, path, max_shard_bytes: int = 4 * 1024**3) -> pathlib.Path:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`) in HF's layout.

    Parameters are gathered one tensor (one layer) at a time; this needs every shard addressable from this host.
    """
    cfg = model.config
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model)
    tensors = []  # (HF name, getter of our-layout array, n_in, our shape, bytes)
    for key, (hf_names, n_in, ours) in _hf_names(cfg, "model.").items():
        array = state[key[0]][...] if len(key) == 1 else state[key[0]][key[1]][...]
        for i, name in enumerate(hf_names):
            getter = (lambda a=array, i=i: a[i]) if key[0] == "layers" else (lambda a=array: a)
            tensors.append((name, getter, n_in, ours, math.prod(ours) * array.dtype.itemsize))

    shards: list[list] = [[]]
    size = 0
    for entry in tensors:
        if shards[-1] and size + entry[-1] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[-1]
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map = {}
    for file, shard in zip(files, shards):
        out = {}
        for name, getter, n_in, ours, _ in shard:
            x = np.asarray(jax.device_get(getter()))
            if n_in is not None:  # ours [*I, *O] -> HF [prod(O), prod(I)]
                x = np.transpose(x, (*range(n_in, x.ndim), *range(n_in))).reshape(_hf_shape(ours, n_in))
            out[name] = np.ascontiguousarray(x)
            weight_map[name] = file
        save_file(out, str(path / file), metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(entry[-1] for entry in tensors)
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(model.runtime.param_dtype), indent=2))
    return path
