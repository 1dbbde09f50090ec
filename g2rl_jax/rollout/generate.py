"""`generate`: group sampling from a Qwen3 model, and the `Rollout` it returns.

    rollout = generate(model, prompts, max_new_tokens=512, temperature=1.0, num_samples=16,
                       stop_token_ids=(eos,), seed=step)

Each prompt is prefilled once; its KV cache is shared by its `num_samples` samples (see engine.py). Sharding: pass
`mesh=` or call inside `with jax.set_mesh(mesh):`; the batch is then split over the mesh's ("data", "fsdp") axes
and KV heads over "tensor"; the parameters are placed by `g2rl_jax.parallel`'s rules on that mesh (a zero-copy
no-op when they already are, e.g. after `load_pretrained(..., mesh=mesh)`). Without a mesh everything runs where
the parameters are (the default device). The KV-cache dtype is the model's
`RuntimeConfig.kv_cache_dtype` (e.g. "bfloat16").

Multi-host (a mesh spanning several jax.distributed processes): every process calls `generate` with its own
prompts, block i of the global prompt batch (see `parallel.batch_block`). The prompts are all-gathered, so every
process pads and buckets the same global batch and samples exactly what one process would with all the prompts
(same per-sample keys); the returned `Rollout` holds this process's samples only (rows
`parallel.process_rows(mesh, P*num_samples)` of the global group-major order).
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from g2rl_jax import parallel
from g2rl_jax.model.qwen3 import PrefixCache, SuffixCache
from g2rl_jax.rollout import batching, engine, prewarm, sampling
from g2rl_jax.rollout.sampling import spec_for


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The samples of one `generate` call, group-major: sample b = i*num_samples + j is sample j of prompt i.

    completion_ids[b]: generated token ids, trimmed just after the first stop token (included).
    logprobs[b]: float32 [len(completion_ids[b])], log softmax(logits / T)[token] over the full vocabulary
      (top-k / top-p do not change it); greedy (T = 0) gives log softmax(logits)[token] at T = 1.
    finish_reasons[b]: "stop" (ended on a stop token) or "length" (reached max_new_tokens).
    Padded host arrays for the scoring pass, B = len(prompts) * num_samples; S is the bucketed prompt length (a
    power of two) and T the bucket of the LONGEST completion (`batching.new_tokens_bucket(decode_steps)`, at most
    that of max_new_tokens; with `generate(..., pad_to=...)` that of max_new_tokens, so that every call of a run
    has the same shapes):
      prompt_ids_BxS / prompt_mask_BxS: each sample's prompt, LEFT-padded with 0.
      completion_ids_BxT / completion_mask_BxT / logprobs_BxT: RIGHT-padded with 0.
      completion_lengths: int32 [B].
    decode_steps: length of the longest completion, i.e. how many tokens the decode loop generated before every
      sample had stopped (or max_new_tokens).
    segments: the batch rows of each decode segment, in order: the compiled shapes it ran (engine.decode_schedule
      predicts them from the completion lengths).
    """

    completion_ids: list[list[int]]
    logprobs: list[np.ndarray]
    finish_reasons: list[str]
    num_samples: int
    prompt_ids_BxS: np.ndarray
    prompt_mask_BxS: np.ndarray
    completion_ids_BxT: np.ndarray
    completion_mask_BxT: np.ndarray
    logprobs_BxT: np.ndarray
    completion_lengths: np.ndarray
    decode_steps: int
    segments: tuple[int, ...] = ()


def _active_mesh(mesh):
    """The given `mesh`, else the one set by `jax.set_mesh`, else None (single device); with Auto axis types.

    The model's ops carry no sharding annotations, so they need GSPMD propagation (Auto axes); an Explicit mesh
    (jax.make_mesh's default) is rebuilt with the same devices and names.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_mesh()
    if mesh.empty:
        return None
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def generate(model, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, num_samples=1,
             stop_token_ids=(), seed=0, mesh=None, compile_threads: int = 0,
             pad_to: tuple[int, int] | None = None, first_capacity: int = 0) -> Rollout:
    """Sample `num_samples` completions of each prompt (a list of token-id lists); see `Rollout`.

    temperature 0 is greedy; top_k 0 and top_p 1 are off. Raises ValueError on bad input (empty prompt,
    prompt + max_new_tokens beyond max_position_embeddings, max_new_tokens <= 0, top_p outside (0, 1],
    negative temperature, ...). compile_threads >= 1: before decoding, compile every program the decode loop can
    reach (rollout/prewarm.py), that many at a time (0: each when the loop first meets it); the samples are the same.
    pad_to=(P, S): at least P prompts (over all processes) of S tokens, and responses at the budget's full width
    (`batching.new_tokens_bucket(max_new_tokens)`), so that every call of a run has the same shapes.
    first_capacity: the first read rung, the KV slots the first decode steps read (engine.read_ladder;
    rollout.first_capacity; 0: engine.FIRST_READ).
    """
    cfg = model.config
    prompts = batching.validate(
        prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        num_samples=num_samples, stop_token_ids=stop_token_ids, seed=seed, vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings)
    mesh = _active_mesh(mesh)
    prompts = _global_prompts(prompts, mesh)
    sizes = batching.buckets_for(prompts, max_new_tokens, engine.batch_shards(mesh), pad_to or (0, 0))
    ids_PxS, mask_PxS = batching.left_pad(prompts, sizes.num_prompts, sizes.prompt_len)
    spec = spec_for(temperature, top_p, top_k, cfg.vocab_size)
    # Inside the (Auto-axes) mesh's context: an Explicit mesh set by the caller would clash with it.
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        outs = _on_device(model, mesh, ids_PxS, mask_PxS, sizes, spec, num_real_prompts=len(prompts),
                          num_samples=num_samples, temperature=temperature, top_p=top_p,
                          stop_token_ids=stop_token_ids, seed=seed, max_new_tokens=max_new_tokens,
                          compile_threads=compile_threads, first_capacity=first_capacity)
    outs, decode_steps, segments = outs  # decode_steps: the longest completion over the global batch (every process)
    B = len(prompts) * num_samples
    rows = slice(0, B) if not _spans_processes(mesh) else parallel.process_rows(mesh, B)
    width = sizes.new_tokens if pad_to else min(batching.new_tokens_bucket(decode_steps), sizes.new_tokens)
    tokens_BxT, logprobs_BxT = (parallel.gather(x)[rows, :width] for x in outs[:2])
    lengths_B = parallel.gather(outs[2])[rows]
    last_B = tokens_BxT[np.arange(len(lengths_B)), lengths_B - 1]
    stopped_B = np.isin(last_B, np.asarray(list(stop_token_ids), np.int64))  # a sample stops on its stop token
    sample_prompt_B = np.repeat(np.arange(len(prompts)), num_samples)[rows]
    rollout = _assemble(num_samples, ids_PxS[sample_prompt_B], mask_PxS[sample_prompt_B], tokens_BxT, logprobs_BxT,
                        lengths_B, stopped_B, decode_steps)
    return dataclasses.replace(rollout, segments=tuple(segments))


def warm(model, *, num_prompts: int, prompt_len: int, max_new_tokens: int, temperature=1.0, top_p=1.0, top_k=0,
         num_samples=1, stop_token_ids=(), mesh=None, compile_threads: int = 1,
         first_capacity: int = 0) -> None:
    """Compile what `generate(..., pad_to=(num_prompts, prompt_len))` with these settings runs (its prefill, first
    token and decode weights, run once on dummy prompts, and every program its decode loop can reach), without
    decoding anything: a run warms up a rollout it will only make later (validation, after a resume)."""
    cfg = model.config
    mesh = _active_mesh(mesh)
    sizes = batching.buckets_for([[0]], max_new_tokens, engine.batch_shards(mesh), (num_prompts, prompt_len))
    ids_PxS, mask_PxS = batching.left_pad([[0]] * sizes.num_prompts, sizes.num_prompts, sizes.prompt_len)
    spec = spec_for(temperature, top_p, top_k, cfg.vocab_size)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        _on_device(model, mesh, ids_PxS, mask_PxS, sizes, spec, num_real_prompts=sizes.num_prompts,
                   num_samples=num_samples, temperature=temperature, top_p=top_p, stop_token_ids=stop_token_ids,
                   seed=0, max_new_tokens=max_new_tokens, compile_threads=compile_threads, warm_only=True,
                   first_capacity=first_capacity)


def _spans_processes(mesh) -> bool:
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def _global_prompts(prompts: list[list[int]], mesh) -> list[list[int]]:
    """All processes' prompts in batch-block order, the same list on every process (`prompts` itself when the
    mesh lives in one process)."""
    if not _spans_processes(mesh):
        return prompts
    info_Ax2 = parallel.allgather(np.array([len(prompts), max(map(len, prompts))]))  # this side's processes
    if len(set(info_Ax2[:, 0].tolist())) != 1:
        raise ValueError(f"generate: the processes passed {info_Ax2[:, 0].tolist()} prompts; every process must "
                         "pass the same number (its equal block of the global batch)")
    ids_PxW = np.zeros((len(prompts), 1 + int(info_Ax2[:, 1].max())), np.int32)  # column 0: the prompt's length
    for p, prompt in enumerate(prompts):
        ids_PxW[p, 0], ids_PxW[p, 1:1 + len(prompt)] = len(prompt), prompt
    return [row[1:1 + row[0]].tolist() for row in parallel.gather_blocks(mesh, ids_PxW)]


def _on_device(model, mesh, ids_PxS, mask_PxS, sizes: batching.Buckets, spec, *, num_real_prompts, num_samples,
               temperature, top_p, stop_token_ids, seed, max_new_tokens, compile_threads, warm_only=False,
               first_capacity: int = 0):
    """Place parameters and prompts on `mesh`, prefill once, compile what the decode loop can reach
    (rollout/prewarm.py), decode segment by segment (see engine.py): (tokens [B, T], log-probs [B, T], lengths [B])
    as device arrays, the decode steps taken and the segments' rows. warm_only: stop before the decode loop
    (None)."""
    cfg = model.config
    G, L, shards = cfg.num_key_value_heads, cfg.num_hidden_layers, engine.batch_shards(mesh)
    graphdef, state = nnx.split(model)
    if mesh is not None:  # a no-op (zero-copy) when the parameters already sit on these shardings
        state = parallel.place(state, parallel.state_shardings(state, mesh))
        ids_PxS, mask_PxS = jax.device_put((ids_PxS, mask_PxS), engine.batch_sharding(mesh, 2))
    reads = engine.read_ladder(sizes.new_tokens, first_capacity)
    logits_PxV, prefix, suffix = engine.prefill_fn(mesh, G, L)(
        graphdef, state, ids_PxS, mask_PxS, num_samples=num_samples, capacity=sizes.new_tokens)
    key, temp, top_p, stops = (sampling.key(seed), np.float32(temperature), np.float32(top_p),
                               batching.stop_array(stop_token_ids))
    ds = engine.start_fn(mesh)(logits_PxV, key, temp, top_p, stops, np.int32(num_real_prompts * num_samples),
                               num_samples=num_samples, new_tokens=sizes.new_tokens, spec=spec)
    layers = engine.decode_layers_fn(mesh)(graphdef, state)
    segment = engine.segment_fn(mesh, G, L)
    if compile_threads >= 1:
        prewarm.rollout(mesh, graphdef, state, layers, prefix, suffix, ds,
                        (np.int32(1), np.int32(1), np.int32(1), key, temp, top_p, stops), spec, reads,
                        engine.batch_buckets(ds.last_X.shape[0], shards, max_new_tokens), num_samples,
                        compile_threads)
    if warm_only:
        return None
    t, per_prefix, segments = 1, num_samples, []
    while True:  # engine.decode_schedule predicts the rows of each segment from the lengths
        rows = ds.last_X.shape[0]
        min_live = engine.min_live_rows(rows, t, max_new_tokens, shards)
        segments.append(rows)
        ds, suffix, t_dev, live_dev = segment(
            graphdef, state, layers, prefix, suffix, ds, np.int32(t), np.int32(max_new_tokens), np.int32(min_live),
            key, temp, top_p, stops, spec=spec, reads=reads)
        t, live = int(t_dev), int(live_dev)  # replicated scalars: the same on every process
        new_rows = engine.next_rows(rows, t, live, min_live, max_new_tokens, shards)
        if new_rows is None:
            return (ds.tokens_BxT, ds.logprobs_BxT, ds.lengths_B), t, segments
        if new_rows < rows:  # compact: the live rows into a smaller bucket, each with its own prompt prefix
            ds, keep_Y, prefix_Y, mask, lengths = engine.compact(mesh, ds, prefix.mask, prefix.lengths, new_rows,
                                                                per_prefix)
            pk, pv, sk, sv = per_layer(engine.regroup_fn(mesh, G), (prefix.k, prefix.v, suffix.k, suffix.v),
                                        prefix_Y, keep_Y, np.int32(t - 1))  # slots 0 .. t-2 are filled
            prefix, suffix, per_prefix = PrefixCache(k=pk, v=pv, mask=mask, lengths=lengths), SuffixCache(sk, sv), 1


def per_layer(fn, caches: tuple, *args) -> tuple:
    """Move each layer's buffers (one tuple per cache, a buffer per layer) with fn(*that layer's buffers, *args),
    one layer at a time, freeing each old buffer at once: the peak holds the new caches plus one old layer, never
    two whole caches."""
    caches = [list(c) for c in caches]
    for i in range(len(caches[0])):
        old = [c[i] for c in caches]
        for c, new in zip(caches, fn(*old, *args)):
            c[i] = new
        for x in old:
            x.delete()
    return tuple(tuple(c) for c in caches)


def _assemble(num_samples, ids_BxS, mask_BxS, tokens_BxT, logprobs_BxT, lengths_B, stopped_B,
              decode_steps: int) -> Rollout:
    """Host-side Rollout from the decode outputs of the real (non-dummy) samples and each one's prompt row."""
    mask_BxT = np.arange(tokens_BxT.shape[1])[None, :] < lengths_B[:, None]
    return Rollout(
        completion_ids=[tokens_BxT[b, :n].tolist() for b, n in enumerate(lengths_B)],
        logprobs=[logprobs_BxT[b, :n].copy() for b, n in enumerate(lengths_B)],
        finish_reasons=["stop" if s else "length" for s in stopped_B],
        num_samples=num_samples,
        prompt_ids_BxS=ids_BxS, prompt_mask_BxS=mask_BxS,
        completion_ids_BxT=np.where(mask_BxT, tokens_BxT, 0).astype(np.int32), completion_mask_BxT=mask_BxT,
        logprobs_BxT=np.where(mask_BxT, logprobs_BxT, 0.0).astype(np.float32),
        completion_lengths=lengths_B.astype(np.int32), decode_steps=decode_steps)
