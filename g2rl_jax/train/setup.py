"""Run set-up, shared by the trainer and the other commands: cheap checks before anything heavy, the mesh, the
model runtime, placing host rows on the mesh, stop tokens, and the embedding model's last-token pooling."""
from __future__ import annotations

import dataclasses
import functools
import os
import socket

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import parallel, registry, storage
from g2rl_jax.config import Config, ConfigError
from g2rl_jax.data import DataError, dataset_names, encode_prompts, load_dataset
from g2rl_jax.model import load_pretrained, lora
from g2rl_jax.model.config import RuntimeConfig
from g2rl_jax.model.sources import local_model_dir


def check_platforms() -> None:
    """One clear line (ConfigError) when JAX cannot start a backend, e.g. JAX_PLATFORMS names absent hardware."""
    try:
        jax.devices()
    except Exception as err:  # noqa: BLE001 - RuntimeError without libtpu, AssertionError without a CUDA plugin
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        wanted = os.environ.get("JAX_PLATFORMS")
        if wanted:
            raise ConfigError(f"JAX_PLATFORMS={wanted!r} names hardware JAX cannot use on this machine ({detail}); "
                              "unset it (or set it to cpu) to use what this machine has") from None
        raise ConfigError(f"JAX found no usable device ({detail}); check the JAX install for this hardware") from None


def unshared_message(output_dir: str, seen_B: list[bool]) -> str | None:
    """The refusal when some processes do not see process 0's file in run.output_dir (seen_B: one flag per process),
    else None."""
    blind = [i for i, seen in enumerate(seen_B) if not seen]
    if not blind:
        return None
    return (f"run.output_dir: {output_dir!r} is a local directory that process(es) {', '.join(map(str, blind))} of "
            f"{len(seen_B)} do not share with process 0, so each host would write its own copy of the run; use "
            "storage every host sees: a bucket (run.output_dir=gs://BUCKET/DIR) or a shared file system")


def check_shared_output_dir(output_dir: str) -> None:
    """A multi-process run's run.output_dir must be one directory for all: a URL is; a local path is checked by
    process 0 writing a file there that every process must read back (an NFS mount passes, each VM's own disk does
    not). Raises ConfigError (every process, the same line)."""
    if parallel.host_count() == 1 or storage.is_url(output_dir):
        return
    token = int(parallel.broadcast_one_to_all(np.int64(np.random.SeedSequence().entropy % 2**62)))
    probe = storage.path(output_dir) / f".shared_check.{token}"
    if jax.process_index() == 0:
        storage.makedirs(probe.parent)
        probe.write_text(str(token))
    parallel.sync("run.output_dir shared: written")
    seen = probe.is_file() and probe.read_text() == str(token)
    seen_B = np.asarray(parallel.allgather(np.int32(seen))).reshape(-1).astype(bool).tolist()  # this side's
    parallel.sync("run.output_dir shared: read")
    if jax.process_index() == 0:
        storage.remove(probe)
    message = unshared_message(output_dir, seen_B)
    if message:
        raise ConfigError(message)


CACHE_MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not worth a file (jax's default: 1 s)


def compilation_cache(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in `directory` (run.compilation_cache_dir; "" leaves it off; a
    URL such as gs://bucket/dir is passed to jax as it is). Process-wide: the first directory set in a process is the
    one jax keeps using.

    Only process 0 of a multi-process run writes entries (jax's rule), so every host reads them back only from
    storage the hosts share (a gs:// bucket on a multi-host TPU slice). Off for a multi-process run on CPU devices:
    there, a process that reads a program back enters its collectives while the other still compiles, and XLA:CPU's
    cross-process rendezvous gives up after 40 s."""
    if not directory or jax.config.jax_compilation_cache_dir:
        return
    if jax.process_count() > 1 and jax.devices()[0].platform == "cpu":
        return
    storage.require_client(directory, "run.compilation_cache_dir")  # jax reads a URL through etils epath too
    if not storage.is_url(directory):
        path = storage.path(directory)
        try:
            storage.makedirs(path)
        except OSError as err:
            raise ConfigError(f"run.compilation_cache_dir: cannot create {str(path)!r} ({err}); choose a writable "
                              "directory, or \"\" to turn the cache off") from err
        directory = str(path)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)


def resolve_model_paths(cfg: Config) -> Config:
    """The config with local model directories: `demo:DIR` built (or reused) at DIR (by its provider, through
    g2rl_jax/registry.py), a bucket's directory copied to the local cache and a Hugging Face id taken from its cache
    (model/sources.py), for model.path, algorithm.embedding_model and model.lora.init_from."""
    try:
        local = local_model_dir(cfg.model.path, "model.path", cfg.model.revision)
        path, embedder = registry.resolve_model_paths(local, cfg.algorithm.embedding_model)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if embedder is not None:
        embedder = local_model_dir(embedder, "algorithm.embedding_model")
    lora_cfg = cfg.model.lora
    if lora_cfg.init_from:
        lora_cfg = dataclasses.replace(lora_cfg, init_from=local_model_dir(lora_cfg.init_from, "model.lora.init_from"))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path, lora=lora_cfg),
                               algorithm=dataclasses.replace(cfg.algorithm, embedding_model=embedder))


def runtime_config(model_cfg, *, remat: str | None = None) -> RuntimeConfig:
    """The model RuntimeConfig of config group `model` (remat overridable: nothing but the update needs it). Its
    param_dtype is that of the base weights: model.lora.base_dtype with LoRA, model.param_dtype otherwise."""
    param_dtype = model_cfg.lora.base_dtype if model_cfg.lora.rank else model_cfg.param_dtype
    return RuntimeConfig(param_dtype=param_dtype, compute_dtype=model_cfg.compute_dtype,
                         remat=model_cfg.remat if remat is None else remat, attention=model_cfg.attention,
                         kv_cache_dtype=model_cfg.kv_cache_dtype)


def load_model(model_cfg, mesh, *, seed: int, remat: str | None = None):
    """The policy of config group `model` on `mesh`: the weights of model.path, plus, with model.lora.rank > 0,
    fresh LoRA adapters in model.param_dtype (A drawn from `seed`, B = 0: the policy equals the base model)."""
    runtime = runtime_config(model_cfg, remat=remat)
    model = load_pretrained(model_cfg.path, runtime.param_dtype, runtime=runtime, mesh=mesh)
    spec = lora.LoraSpec.from_config(model_cfg.lora)
    if spec is not None:
        lora.attach(model, spec, dtype=model_cfg.param_dtype, seed=seed, mesh=mesh)
    return model


def preflight(cfg: Config, *, model_dirs: bool = True, output_dir: bool = True) -> None:
    """Cheap checks before anything heavy: model and embedding dirs (`model_dirs`), datasets, output_dir
    writable (`output_dir`: a probe written and deleted, about 2 s on a bucket at its pace). Raises ConfigError."""
    dirs = (("model.path", cfg.model.path), ("algorithm.embedding_model", cfg.algorithm.embedding_model))
    for key, path in dirs if model_dirs else ():
        if path is not None and not storage.is_file(storage.path(path) / "config.json"):
            raise ConfigError(f"{key}: {path!r} is not a Hugging Face model directory (no config.json there); "
                              "download the checkpoint first and point the key at its directory (or a bucket's "
                              "gs:// copy, or its Hugging Face id)")
    for key, path in (("model.path", cfg.model.path), ("model.lora.init_from", cfg.model.lora.init_from),
                      ("algorithm.embedding_model", cfg.algorithm.embedding_model),
                      ("run.compilation_cache_dir", cfg.run.compilation_cache_dir)):
        if path:
            storage.require_client(path, key)  # a gs:// path without the gcs extra: one line, before anything loads
    if output_dir:
        probe_output_dir(cfg)
    known = dataset_names()
    datasets = (("data.train_dataset", (cfg.data.train_dataset,)), ("data.eval_datasets", cfg.data.eval_datasets))
    for key, names in datasets:
        for name in names:
            if name not in known and not (storage.require_client(name, key) or storage.is_file(name)):
                raise ConfigError(f"{key}: {name!r} is neither a registered dataset ({', '.join(known)}) nor a "
                                  ".jsonl file (local or a URL such as gs://bucket/data.jsonl)")


def probe_output_dir(cfg: Config) -> None:
    """run.output_dir written and read back through both storage clients, before any other request (an endpoint
    that cannot be reached is one line in bounded time): process 0 before it takes the run lock, the others once
    they follow its lease, so that their probes pass its fence. One probe name per process (hosts, and a refused
    second trainer, may share the directory: two writers of one name would update one object twice a second)."""
    storage.check_writable(cfg.run.output_dir, "run.output_dir",
                           f".write_test.{jax.process_index()}.{socket.gethostname()}.{os.getpid()}")


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence ids (eos, and the chat turn end `<|im_end|>` where the vocab has it)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return tuple(sorted(ids))


def load_examples(name: str, data_cfg) -> list:
    """Dataset `name` (registered, or a jsonl file read with data.fields); a file that cannot be read is a
    ConfigError naming the key that names it, the file and the line."""
    fields = data_cfg.field_map() if name not in dataset_names() else None
    try:
        return load_dataset(name, fields=fields or None)
    except DataError as err:
        key = "data.train_dataset" if name == data_cfg.train_dataset else "data.eval_datasets"
        raise ConfigError(f"{key}: {err}") from None


def length_filter(examples: list, tokenizer, data_cfg) -> tuple[list, int]:
    """(the examples whose prompt fits data.max_prompt_tokens, how many were dropped)."""
    lengths = [len(p) for p in encode_prompts(examples, tokenizer, data_cfg.prompt_template)]
    kept = [ex for ex, n in zip(examples, lengths) if n <= data_cfg.max_prompt_tokens]
    return kept, len(examples) - len(kept)


def prompt_lengths(example_sets, tokenizer, data_cfg) -> np.ndarray:
    """The token counts of the prompts of these examples (lists of them: the training set, or every evaluation
    set), as the rollout encodes them: a run pads each step's prompts to one of a few buckets of these lengths."""
    return np.array([len(p) for examples in example_sets
                     for p in encode_prompts(examples, tokenizer, data_cfg.prompt_template)], dtype=np.int64)


def _report_dropped(key: str, name: str, total: int, dropped: int, limit: int) -> None:
    if dropped and jax.process_index() == 0:
        print(f"{key}: {dropped} of {total} prompts of {name!r} are longer than data.max_prompt_tokens={limit} "
              "tokens and are left out", flush=True)


def load_rows(cfg: Config) -> tuple[list, dict[str, list]]:
    """(the rows of data.train_dataset, {name: rows} of data.eval_datasets when the run validates), each row read and
    checked: a bad one is a ConfigError naming the key, the file and the line. The trainer reads them first, before
    any model resolves or downloads, so a bad row costs seconds."""
    evals = {name: load_examples(name, cfg.data) for name in cfg.data.eval_datasets} if cfg.run.eval_every else {}
    return load_examples(cfg.data.train_dataset, cfg.data), evals


def usable_examples(cfg: Config, tokenizer, examples: list | None = None) -> tuple[list, int]:
    """(the training examples whose prompt fits data.max_prompt_tokens, the number dropped); a clear error when
    too few fit. The number dropped is printed. `examples`: the rows load_rows read (None: read them now)."""
    examples = load_examples(cfg.data.train_dataset, cfg.data) if examples is None else examples
    kept, dropped = length_filter(examples, tokenizer, cfg.data)
    _report_dropped("data.train_dataset", cfg.data.train_dataset, len(examples), dropped, cfg.data.max_prompt_tokens)
    if len(kept) < cfg.data.prompts_per_step:
        raise ConfigError(f"data.train_dataset: {cfg.data.train_dataset!r} has {len(kept)} usable rows (prompt ≤ "
                          f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}) but data.prompts_per_step="
                          f"{cfg.data.prompts_per_step}; use more data or raise max_prompt_tokens")
    return kept, dropped


def eval_examples(cfg: Config, tokenizer, rows: dict[str, list] | None = None) -> tuple[dict[str, list],
                                                                                         dict[str, int]]:
    """({name: examples}, {name: dropped}) of data.eval_datasets under the training length filter; `rows`: the
    rows load_rows read (None: read them now)."""
    sets, dropped = {}, {}
    for name in cfg.data.eval_datasets if cfg.run.eval_every else ():
        examples = load_examples(name, cfg.data) if rows is None else rows[name]
        sets[name], dropped[name] = length_filter(examples, tokenizer, cfg.data)
        _report_dropped("data.eval_datasets", name, len(examples), dropped[name], cfg.data.max_prompt_tokens)
        if not sets[name]:
            raise ConfigError(f"data.eval_datasets: no prompt of {name!r} fits data.max_prompt_tokens="
                              f"{cfg.data.max_prompt_tokens}; raise it or drop the dataset from data.eval_datasets")
    return sets, dropped


def embedding_token_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    """The ids the embedder pools over: `text` encoded with the tokenizer's own special tokens, ending in an end
    token, at most `max_tokens` long (algorithm.embedding_max_tokens; the tail kept, so the end token stays).

    Rule: encode with add_special_tokens=True; append eos (pad where there is no eos) only when the result does not
    already end with the eos or pad token. Why: the pooled token must be the one the encoder was trained to pool
    on, and the tokenizer knows it. Qwen3-Embedding's post-processor appends `<|endoftext|>` (151643, its pad),
    while its eos_token is `<|im_end|>` (151645): encoding without special tokens and appending eos pooled on the
    wrong token (QwenLM/Qwen3-Embedding#122). A tokenizer without such a post-processor (the demo's, Qwen3 base)
    gets eos appended, the paper's recipe.
    """
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    if not ends:
        raise ValueError("embedding tokenizer has neither eos_token nor pad_token, so last-token pooling has no end "
                         "token; use the tokenizer saved with the embedding model (Qwen3-Embedding has both)")
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids or ids[-1] not in ends:
        ids.append(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id)
    return ids[-max_tokens:]


def embed_texts(embedder, tokenizer, texts: list[str], mesh, max_tokens: int) -> jax.Array:
    """Last-token pooling of a Qwen3-Embedding-architecture encoder: L2-normalised hidden state of the final token
    of `embedding_token_ids`. `texts` are this process's rows; the result is the global [B, E] array."""
    ids = [embedding_token_ids(tokenizer, t, max_tokens) for t in texts]
    width = 1 << (max_tokens - 1).bit_length()  # one width for every step: the embedder compiles once
    ids_BxL = np.zeros((len(ids), width), np.int32)
    mask_BxL = np.zeros((len(ids), width), np.int32)
    for row, x in enumerate(ids):  # left padding: the last position is every row's final token
        ids_BxL[row, width - len(x):] = x
        mask_BxL[row, width - len(x):] = 1
    graphdef, state = nnx.split(embedder)
    return _pooled(graphdef, state, shard_rows(ids_BxL, mesh), shard_rows(mask_BxL, mesh))


@functools.partial(jax.jit, static_argnames="graphdef")
def _pooled(graphdef, state, ids_BxL, mask_BxL):
    """L2-normalised final-position hidden state (last-token pooling), float32 [B, E]."""
    h_BxE = nnx.merge(graphdef, state).hidden_states(ids_BxL, mask_BxL)[:, -1].astype(jnp.float32)
    return h_BxE / jnp.maximum(jnp.linalg.norm(h_BxE, axis=-1, keepdims=True), 1e-8)


def shard_rows(tree, mesh):
    """Global arrays, rows split over the data-parallel mesh axes, from every leaf's rows held by this process
    (all of its rows in a one-process run)."""
    _, blocks = parallel.batch_block(mesh)
    return jax.tree.map(lambda x: parallel.global_rows(mesh, np.asarray(x), blocks * np.shape(x)[0]), tree)


def on_mesh(tree, mesh):
    """Replicate over the mesh every array not already placed on it (scalars such as optimizer counts), so all
    of the training state lives on one mesh and restores onto it. A process's own array goes as its host value
    (every process holds the same): device_put of a device array onto a mesh over several processes would take
    JAX's cross-host transfer path when it is on (mesh.rollout_processes), whose result Orbax cannot save."""
    def place(x):
        if isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh:
            return x
        return jax.device_put(np.asarray(x) if x.is_fully_addressable else x,
                              jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    return jax.tree.map(place, tree)


def copy_tree(tree):
    """A copy of every array of a tree in buffers of its own, placed as the original: shard by shard, device to
    device, on every process its own shards (no program)."""
    def copy(x):
        shards = [jax.device_put(s.data, s.device, may_alias=False) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

    return jax.tree.map(copy, tree)
