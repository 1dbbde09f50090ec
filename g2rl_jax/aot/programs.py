"""The programs one training step of a config runs, lowered for a mesh of a Target's devices over abstract inputs.

    programs = step_programs(cfg, model_cfg, mesh, scope="all")   # [Program], in the order a step runs them
    lowered = programs[0].lower()                                 # jax.stages.Lowered; .compile() for the target

Each program is one of the project's own jitted functions (`rollout.engine`, `train.step`, `train.setup`),
lowered over `jax.ShapeDtypeStruct`s that carry the `NamedSharding` the trainer gives the real arrays; nothing is
re-implemented and nothing is allocated. Shapes are the worst case of the config, as the memory planner's: the
largest prompt bucket, every response reaching the budget. What a step compiles:

    optimizer init        once per run (each moment sharded like its parameter)
    rollout               prefill; the first token; the decode weights; a decode segment (the read rungs of
                          engine.read_ladder inside it) at the full batch and at each smaller batch bucket that a
                          compaction can reach (engine.batch_buckets); the first compaction, one layer at a time
    score / reference     one program per (micro-batch rows, response width) of the finest grouped candidate of
                          g2rl_jax/shapes/choice.py (every row count x the 4-per-octave width ladder), which holds
                          every grouped shape any run of the config can take; when the run packs (algorithm.packing,
                          or the run's choice with it null: `packed`), one per packed (rows, width) of the finest
                          packed layout instead, the warm-up's own programs (aot/packed.py)
    update                the gradient of a micro-batch at the same shapes; the optimizer step
    advantages            novelty, shaping and group advantages (one program); the EVOL embedder when configured

scope="all" lists every shape; scope="largest" keeps, of each kind, the shape that holds the most bytes (the widest
response width at the most rows, the segment at the full batch): memory grows with every dimension, so
these bound the peak of the others, and they compile in a fraction of the time.

`Program.resident` counts the bytes per chip of run state that is alive while the program runs but is not among its
arguments (the optimizer state and the reference model during the rollout, the step's arrays during the update,
...), so that a program's compiled bytes + resident is the chip's use at that moment. `build` (a zero-argument
callable returning the policy `nnx.Module`) lets another model construction (LoRA adapters, ...) flow through
unchanged; the default is the Qwen3 the trainer loads, built abstractly.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from g2rl_jax import methods, parallel
from g2rl_jax.config import Config
from g2rl_jax.model import lora
from g2rl_jax.model.config import Qwen3Config
from g2rl_jax.model.qwen3 import LAYER_AXES, PrefixCache, Qwen3, SuffixCache
from g2rl_jax.rollout import engine
from g2rl_jax.rollout.sampling import spec_for
from g2rl_jax.shapes.step import StepShapes, step_shapes
from g2rl_jax.train import optim as train_optim
from g2rl_jax.train import setup
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update

PHASES = ("setup", "rollout", "score", "update")
SCOPES = ("all", "largest")


@dataclasses.dataclass(frozen=True)
class Program:
    name: str  # what a user reads, e.g. "decode segment 256 rows x 8192 slots"
    kind: str  # the function: prefill, segment, score, gradient, ...
    phase: str  # one of PHASES
    lower: Callable[[], Any] = dataclasses.field(repr=False)  # () -> jax.stages.Lowered
    resident: int = 0  # per-chip bytes of run state alive beside it, not among its arguments
    shape: tuple[int, ...] = ()  # a micro-batch program's (rows, width): response tokens, or packed positions


def per_chip_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded arrays or ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class Abstract:
    """Abstract arrays on one mesh: every helper returns ShapeDtypeStructs with the trainer's shardings."""

    mesh: jax.sharding.Mesh

    @property
    def shards(self) -> int:
        return engine.batch_shards(self.mesh)

    def rows(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """[rows, ...] split over the batch axes (kept whole where the rows do not divide them)."""
        spec = parallel.batch_sharding(self.mesh, ndim=len(shape)).spec if shape[0] % self.shards == 0 else ()
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, PartitionSpec(*spec)))

    def scalar(self, dtype, shape=()) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, PartitionSpec()))

    def like(self, tree, dtype=None):
        """Abstract copies of a tree's leaves (with their shardings), optionally in another dtype."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding), tree)

    def batch(self, rows: int, prompt_len: int, width: int, group: int) -> train_step.Batch:
        return train_step.Batch(input_ids=self.rows((rows, prompt_len + width), jnp.int32),
                                attention_mask=self.rows((rows, prompt_len + width), jnp.int32),
                                response_mask=self.rows((rows, width), jnp.float32),
                                rewards=self.rows((rows,), jnp.float32), correct=self.rows((rows,), jnp.bool_),
                                group_size=group)

    def mini(self, rows: int, prompt_len: int, width: int, group: int, sampler: bool,
             terms: tuple[bool, bool] = (False, False)) -> train_step.MiniBatch:
        logp = self.rows((rows, width), jnp.float32)
        return train_step.MiniBatch(self.batch(rows, prompt_len, width, group), old_logp_BxT=logp, ref_logp_BxT=logp,
                                    advantages_B=self.rows((rows,), jnp.float32),
                                    sampler_logp_BxT=logp if sampler else None,
                                    token_weight_BxT=logp if terms[0] else None,
                                    abs_log_ratio_coef_BxT=logp if terms[1] else None)

    def kv(self, rows: int, kv_heads: int, length: int, head_dim: int, dtype, layers: int):
        sharding = engine._kv_sharding(self.mesh, kv_heads)
        one = jax.ShapeDtypeStruct((rows, kv_heads, length, head_dim), dtype, sharding=sharding)
        return (one,) * layers


def lora_policy(model: Qwen3Config, runtime, mesh, model_cfg) -> Callable[[], nnx.Module]:
    """A `build` of the policy with the LoRA adapters of config group `model` (model.lora), as setup.load_model."""
    spec = lora.LoraSpec.from_config(model_cfg.lora)

    def build():
        policy = Qwen3(model, runtime, rngs=nnx.Rngs(0), mesh=mesh)
        policy.adapters = lora.Adapters(model, spec, jnp.dtype(model_cfg.param_dtype), nnx.Rngs(0))
        return policy

    return build


def abstract_policy(model: Qwen3Config, runtime, mesh, build: Callable[[], nnx.Module] | None = None):
    """(graphdef, params as ShapeDtypeStructs with their shardings) of the policy the trainer builds on `mesh`."""
    build = build or (lambda: Qwen3(model, runtime, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = parallel.state_shardings(abstract, mesh)
    return graphdef, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                  shardings)


def step_programs(cfg: Config, model: Qwen3Config, mesh, scope: str = "all",
                  build: Callable[[], nnx.Module] | None = None, packed: bool | None = None) -> list[Program]:
    """Every program one step of `cfg` runs on `mesh` (see the module docstring), in the order a step runs them.
    packed: whether the passes pack; None: algorithm.packing, or with it null the run's choice on `mesh`'s devices
    (shapes.choice.run_choice, the training prompts' lengths where the tokenizer at model.path reads them)."""
    if scope not in SCOPES:
        raise ValueError(f"scope {scope!r}; choose one of {SCOPES}")
    a = Abstract(mesh)
    shapes = step_shapes(cfg, mesh)
    if packed is None and cfg.algorithm.packing is not None:
        packed = cfg.algorithm.packing
    elif packed is None:
        from g2rl_jax.shapes import choice as choice_lib
        from g2rl_jax.shapes.prices import Device

        packed = choice_lib.run_choice(cfg, model, shapes, Device.of(mesh),
                                       choice_lib.training_prompt_lengths(cfg)).packed
    runtime = setup.runtime_config(cfg.model)
    if build is None and cfg.model.lora.rank:
        build = lora_policy(model, runtime, mesh, cfg.model)
    graphdef, params = abstract_policy(model, runtime, mesh, build)
    trainable = lora.trainable(params)  # the adapters with LoRA: the only gradients and moments
    steps = cfg.run.total_steps * cfg.algorithm.ppo_epochs * shapes.step_rows // cfg.algorithm.mini_batch_size
    optimizer = train_optim.make_optimizer(cfg.optim, steps)
    init = train_optim.optimizer_init_fn(optimizer, trainable)
    opt_state = jax.eval_shape(init, trainable)
    # the KL reference: a frozen copy, or with LoRA the same params with the adapters off
    ref = params if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.rank else None
    state_bytes = per_chip_bytes(params) + per_chip_bytes(opt_state) + per_chip_bytes(ref)
    progs = [Program("optimizer init", "init", "setup", functools.partial(init.lower, trainable))]
    progs += _rollout(cfg, model, a, shapes, graphdef, params, resident=state_bytes - per_chip_bytes(params),
                      scope=scope)
    progs += _score_and_update(cfg, a, shapes, graphdef, params, opt_state, optimizer, state_bytes, scope, packed)
    return progs


def _rollout(cfg: Config, model: Qwen3Config, a: Abstract, s: StepShapes, graphdef, params, resident: int,
             scope: str) -> list[Program]:
    """Prefill, first token, decode weights, the decode segments of the batch buckets, and the first compaction."""
    mesh, G, L, K = a.mesh, model.num_key_value_heads, model.num_hidden_layers, model.head_dim
    kv_dtype = jnp.dtype(cfg.model.kv_cache_dtype)
    m, T = s.samples, s.new_tokens
    spec = spec_for(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k or 0, model.vocab_size)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    f32, i32 = a.scalar(jnp.float32), a.scalar(jnp.int32)
    stops = a.scalar(jnp.int32, (2,))
    ids, mask = a.rows((s.prompts, s.prompt_len), jnp.int32), a.rows((s.prompts, s.prompt_len), jnp.bool_)

    def prefix(rows: int) -> PrefixCache:
        kv = a.kv(rows, G, s.prompt_len, K, kv_dtype, L)
        return PrefixCache(k=kv, v=kv, mask=a.rows((rows, s.prompt_len), jnp.bool_), lengths=a.rows((rows,), jnp.int32))

    def suffix(rows: int) -> SuffixCache:
        kv = a.kv(rows, G, T, K, kv_dtype, L)
        return SuffixCache(k=kv, v=kv)

    def decode_state(rows: int) -> engine.DecodeState:
        return engine.DecodeState(last_X=a.rows((rows,), jnp.int32), sample_X=a.rows((rows,), jnp.int32),
                                  stopped_X=a.rows((rows,), jnp.bool_), tokens_BxT=a.rows((s.rows, T), jnp.int32),
                                  logprobs_BxT=a.rows((s.rows, T), jnp.float32), lengths_B=a.rows((s.rows,), jnp.int32))

    layers = decode_layers(graphdef, params, mesh)
    logits = a.rows((s.prompts, model.vocab_size), jnp.float32)
    in_mesh = lambda lower: functools.partial(_in_mesh, mesh, lower)  # noqa: E731
    progs = [
        Program(f"prefill {s.prompts} prompts x {s.prompt_len} tokens", "prefill", "rollout", in_mesh(functools.partial(
            engine.prefill_fn(mesh, G, L).lower, graphdef, params, ids, mask, num_samples=m, capacity=T)),
            resident),
        Program(f"first token of {s.rows} samples", "start", "rollout", in_mesh(functools.partial(
            engine.start_fn(mesh).lower, logits, key, f32, f32, stops, i32, num_samples=m, new_tokens=T, spec=spec)),
            resident + per_chip_bytes((prefix(s.prompts), suffix(s.rows)))),
        Program("decode weights", "decode_layers", "rollout", in_mesh(functools.partial(
            engine.decode_layers_fn(mesh).lower, graphdef, params)),
            resident + per_chip_bytes((prefix(s.prompts), suffix(s.rows), decode_state(s.rows)))),
    ]
    for rows in s.buckets:
        pre = prefix(s.prompts if rows == s.rows else rows)
        lower = functools.partial(engine.segment_fn(mesh, G, L).lower, graphdef, params, layers, pre, suffix(rows),
                                  decode_state(rows), i32, i32, i32, key, f32, f32, stops, spec=spec, reads=s.reads)
        progs.append(Program(f"decode segment {rows} rows x {T} slots", "segment", "rollout", in_mesh(lower),
                             resident))
        if scope == "largest":
            break
    if len(s.buckets) > 1:  # the first compaction, one layer at a time: it peaks at the first layer's move,
        half = s.buckets[1]  # while every other layer still holds its old rows
        pk, sk = a.kv(s.prompts, G, s.prompt_len, K, kv_dtype, 1)[0], a.kv(s.rows, G, T, K, kv_dtype, 1)[0]
        waiting = 2 * (L - 1) * per_chip_bytes((pk, sk))  # k and v of every other layer, not yet moved
        rows_X = a.rows((half,), jnp.int32)
        lower = functools.partial(engine.regroup_fn(mesh, G).lower, pk, pk, sk, sk, rows_X, rows_X, i32)
        progs.append(Program(f"compact the cache {s.rows} -> {half} rows (one layer)", "regroup", "rollout",
                             in_mesh(lower), resident + per_chip_bytes((params, layers, decode_state(s.rows)))
                             + waiting))
    return progs


def decode_layers(graphdef, params, mesh):
    """The abstract result of `engine.decode_layers_fn`: each layer's slice of a stacked [layers, ...] parameter
    keeps that parameter's sharding of its other dimensions (what the compiled program returns)."""
    with jax.set_mesh(mesh):
        layers = jax.eval_shape(functools.partial(engine.decode_layers_fn(mesh), graphdef), params)
    stacked = _stacked_specs(params)
    return tuple({name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(
        *stacked[name][1:]))) for name, x in layer.items()} for layer in layers)


def _stacked_specs(params) -> dict[str, tuple]:
    """The PartitionSpec entries of each stacked decoder-layer parameter (params.layers.<HF name>)."""
    specs = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        names = [k for k in keys if k in LAYER_AXES]
        if "layers" in keys and names:
            spec = tuple(x.sharding.spec)
            specs[names[-1]] = spec + (None,) * (x.ndim - len(spec))
    return specs


def _in_mesh(mesh, lower):
    """Lower inside the mesh's context, as `generate` runs the sampler."""
    with jax.set_mesh(mesh):
        return lower()


def _score_and_update(cfg: Config, a: Abstract, s: StepShapes, graphdef, params, opt_state, optimizer,
                      state_bytes: int, scope: str, packed: bool) -> list[Program]:
    """Score and reference passes and the gradient at every micro-batch shape (or, `packed`, at every packed shape:
    aot/packed.py); the optimizer step; advantages and the EVOL embedder."""
    algo, m, S, T = cfg.algorithm, s.samples, s.prompt_len, s.new_tokens
    temp = train_update.LossSettings.from_config(algo, cfg.rollout.temperature).temperature
    step_batch = a.batch(s.step_rows, S, T, m)
    step_arrays = per_chip_bytes(step_batch) + 3 * per_chip_bytes(a.rows((s.step_rows, T), jnp.float32))
    ref_graphdef = lora.reference_graphdef(graphdef, params) if lora.has_adapters(params) else graphdef
    resident = state_bytes - per_chip_bytes(params) + step_arrays
    if packed:  # the packed passes' programs, as the warm-up compiles them
        from g2rl_jax.aot.packed import packed_programs

        progs, update, acc = packed_programs(cfg, a, s, graphdef, params, ref_graphdef, resident, scope)
    else:
        shapes = [(x, w) for x in s.micro_rows for w in s.widths] if scope == "all" else [(s.micro_rows[0], T)]
        progs = _grouped_scores(cfg, a, s, graphdef, ref_graphdef, params, shapes, resident)
        update, acc = _grouped_gradients(cfg, a, s, graphdef, params, shapes, resident)
    phi = jax.eval_shape(functools.partial(train_step.score_stats, graphdef, temperature=temp,
                                           chunk=train_step.g2rl.DEFAULT_CHUNK), params, step_batch)[2]
    phi = a.rows(phi.shape, phi.dtype)
    embeddings = valid = None
    method = methods.get(algo.exploration)
    if "embeddings" in method.needs:  # the embedding model's pass (evol)
        progs.append(_embedder(cfg, a, s, state_bytes + step_arrays))
        embeddings, valid = a.rows((s.step_rows, _embed_width(cfg)), jnp.float32), a.rows((s.step_rows,), jnp.bool_)
    logp = a.rows((s.step_rows, T), jnp.float32) if "seq_logp" in method.needs else None
    progs.append(Program("advantages (novelty, shaping, groups)", "advantages", "score",
                         functools.partial(train_step.advantages.lower, step_batch, phi, algo, embeddings, valid,
                                           logp), state_bytes))
    if method.tokens is not None:  # the token rule over one mini-batch (Clip-Cov, KL-Cov, forking)
        x = a.rows((algo.mini_batch_size, T), jnp.float32)
        lower = functools.partial(train_update.rule_terms.lower, a.rows((algo.mini_batch_size,), jnp.float32), x,
                                  x, x, x, a.scalar(jax.eval_shape(lambda: jax.random.key(0)).dtype),
                                  a.scalar(jnp.uint32, (2,)), algo=algo, mini_batch_size=algo.mini_batch_size)
        progs.append(Program(f"token rule {algo.mini_batch_size} rows x {T} tokens", "token_terms", "update", lower,
                             state_bytes + step_arrays))
    progs += update
    grads = a.like(lora.trainable(params), jnp.float32)
    diag = {k: a.scalar(v.dtype, v.shape) for k, v in acc[2].items()}
    lower = functools.partial(train_update.apply_gradients.lower, params, opt_state, grads, a.scalar(jnp.float32), diag,
                              optimizer=optimizer)
    ref_bytes = state_bytes - per_chip_bytes(params) - per_chip_bytes(opt_state)
    progs.append(Program("optimizer step", "apply", "update", lower, ref_bytes + step_arrays))
    return progs


def _grouped_scores(cfg: Config, a: Abstract, s: StepShapes, graphdef, ref_graphdef, params, shapes,
                    resident: int) -> list[Program]:
    """The length-grouped score and reference programs at each (rows, response width) of `shapes`."""
    temp = train_update.LossSettings.from_config(cfg.algorithm, cfg.rollout.temperature).temperature
    T = s.new_tokens
    batch = a.batch(s.step_rows, s.prompt_len, T, s.samples)
    logp = a.rows((s.step_rows, T), jnp.float32)
    phi = jax.eval_shape(functools.partial(train_step.score_stats, graphdef, temperature=temp,
                                           chunk=train_step.g2rl.DEFAULT_CHUNK), params, batch)[2]
    outs = {"score": (logp, logp, a.rows((s.step_rows, phi.shape[1]), phi.dtype)), "reference": logp}
    progs = []
    for label, fn, gd in (("score", train_step.score_micro, graphdef), ("reference", train_step.ref_micro,
                                                                        ref_graphdef)):
        if label == "reference" and cfg.algorithm.kl_coef == 0:
            continue
        for rows, width in shapes:
            lower = functools.partial(fn.lower, gd, params, batch, jax.ShapeDtypeStruct((rows,), jnp.int32),
                                      outs[label], temperature=temp, chunk=train_step.g2rl.DEFAULT_CHUNK, width=width)
            progs.append(Program(f"{label} {rows} rows x {width} tokens", label, "score", lower, resident,
                                 (rows, width)))
    return progs


def _grouped_gradients(cfg: Config, a: Abstract, s: StepShapes, graphdef, params, shapes,
                       resident: int) -> tuple[list[Program], tuple]:
    """The length-grouped gradient programs at each (rows, response width) of `shapes`; the accumulator's spec."""
    algo, S, m = cfg.algorithm, s.prompt_len, s.samples
    settings = train_update.LossSettings.from_config(algo, cfg.rollout.temperature)
    terms = methods.token_fields(algo)  # the method's per-token loss terms (weight, |log ρ| coefficient)
    mini = a.mini(algo.mini_batch_size, S, s.new_tokens, m, algo.rollout_is_cap is not None, terms)
    grads = a.like(lora.trainable(params), jnp.float32)
    progs, acc = [], None
    for rows, width in shapes:
        mb = a.mini(rows, S, width, m, algo.rollout_is_cap is not None, terms)
        diag = jax.eval_shape(lambda p, b: train_update.policy_loss(p, graphdef, b, settings)[1], params, mb)
        acc = (grads, a.scalar(jnp.float32), {k: a.scalar(d.dtype, d.shape) for k, d in diag.items()})
        lower = functools.partial(train_update.accumulate.lower, graphdef, params, acc, mini,
                                  jax.ShapeDtypeStruct((rows,), jnp.int32), settings=settings,
                                  total_rows=algo.mini_batch_size, width=width)
        progs.append(Program(f"gradient {rows} rows x {width} tokens", "gradient", "update", lower,
                             resident + per_chip_bytes(mini), (rows, width)))
    return progs, acc


def _embed_width(cfg: Config) -> int:
    """The EVOL embedder's width E (its hidden size), from its config.json."""
    return _embedder_config(cfg).hidden_size


def _embedder_config(cfg: Config) -> Qwen3Config:
    import json

    from g2rl_jax import registry, storage

    scheme = registry.architecture(cfg.algorithm.embedding_model)
    if scheme is not None:  # the demo's embedder: the demo policy's backbone
        return scheme
    path = storage.path(cfg.algorithm.embedding_model) / "config.json"  # local or gs://...
    return Qwen3Config.from_hf_dict(json.loads(storage.read_text(path)), str(path))


def _embedder(cfg: Config, a: Abstract, s: StepShapes, resident: int) -> Program:
    """Last-token pooling of the EVOL embedder over all of a step's responses at the widest token width."""
    runtime = setup.runtime_config(cfg.model, remat="none")
    graphdef, state = abstract_policy(_embedder_config(cfg), runtime, a.mesh)
    width = 1 << (cfg.algorithm.embedding_max_tokens - 1).bit_length()
    ids = a.rows((s.step_rows, width), jnp.int32)
    lower = functools.partial(setup._pooled.lower, graphdef, state, ids, ids)
    return Program(f"EVOL embedder {s.step_rows} responses x {width} tokens", "embed", "score", lower, resident)
