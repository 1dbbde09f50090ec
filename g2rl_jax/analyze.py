"""Exploration geometry of sampled responses (paper, section "Analysis of Exploration Geometry").

    python -m g2rl_jax.analyze --checkpoint runs/grpo --checkpoint runs/g2rl --dataset aime25 \\
        --problems 30 --samples 8 [--embedding-model DIR] --out runs/geometry

For each model, the same problems are sampled `--samples` times; every response gets its gradient feature Φ
from the trainer's own scoring pass (`g2rl_jax.train.step.score`), and within each problem's group the
pairwise cosines of Φ (and, with `--embedding-model`, of last-token-pooled text embeddings) are collected.
Writes OUT/analysis.json (per model: gradient_cosine_mean, negative_pair_ratio, semantic_cosine_mean,
histograms) and OUT/geometry.png (the paper's three panels, drawn by `g2rl_jax.figures.geometry_figure`).

Pure functions (host NumPy, float64):
    pairwise_cosines(x_PxmxD) -> cos_PxY            upper-triangle cosines per group, Y = m(m-1)/2
    geometry_stats(grad_cos_PxY, sem_cos_PxY=None)  means, negative-pair ratio, histograms
    histogram(values, bins)                         counts over [-1, 1]
Model-backed:
    load_policy(run_or_checkpoint_dir, mesh=)       (model, tokenizer_dir) of a training checkpoint
                                                    (g2rl_jax.train.checkpoint, shared with eval and export)
    sample_group_features(...)                      Φ [P, m, D], texts, correctness of one model
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from g2rl_jax import cli, storage
from g2rl_jax.train.checkpoint import load_policy, resolve_checkpoint, run_config, run_defaults
from g2rl_jax.train.setup import runtime_config

HIST_BINS = 40
NORM_MIN = 1e-30  # a feature below this norm has no direction; reported as an error, never given cosine 0


# ------------------------------------------------------------------------------------------------ pure functions
def pairwise_cosines(x_PxmxD) -> np.ndarray:
    """cos(x_i, x_j) for i < j within each group, row-major upper triangle: [P, m(m-1)/2] float64."""
    x = np.asarray(x_PxmxD, np.float64)
    if x.ndim != 3 or x.shape[1] < 2:
        raise ValueError(f"pairwise_cosines needs x_PxmxD with m >= 2 responses per group, got shape {x.shape}")
    norms_Pxm = np.linalg.norm(x, axis=-1)
    bad = np.argwhere(~np.isfinite(norms_Pxm) | (norms_Pxm < NORM_MIN))
    if len(bad):
        p, j = bad[0]
        raise ValueError(f"pairwise_cosines: feature of group {p}, response {j} has norm {norms_Pxm[p, j]!r} "
                         f"({len(bad)} such rows); a zero or non-finite vector has no direction")
    unit_PxmxD = x / norms_Pxm[..., None]
    s_Pxmxm = np.einsum("pid,pjd->pij", unit_PxmxD, unit_PxmxD)
    i, j = np.triu_indices(x.shape[1], k=1)
    return np.clip(s_Pxmxm[:, i, j], -1.0, 1.0)  # rounding may land a hair outside [-1, 1]


def histogram(values, bins: int = HIST_BINS) -> dict[str, list]:
    """Counts of `values` in `bins` equal bins over [-1, 1] (the last bin includes 1)."""
    counts, edges = np.histogram(np.asarray(values, np.float64).ravel(), bins=bins, range=(-1.0, 1.0))
    return {"edges": edges.tolist(), "counts": counts.astype(int).tolist()}


def geometry_stats(grad_cos_PxY, sem_cos_PxY=None, bins: int = HIST_BINS) -> dict[str, Any]:
    """The figure's numbers: mean gradient cosine, share of negative (cos < 0) gradient pairs, mean semantic
    cosine (None without embeddings), and their histograms; means are over all pairs of all groups."""
    grad = np.asarray(grad_cos_PxY, np.float64).ravel()
    if grad.size == 0:
        raise ValueError("geometry_stats: no gradient cosines (need at least one group of >= 2 responses)")
    stats = {"pairs": int(grad.size), "gradient_cosine_mean": float(grad.mean()),
             "gradient_cosine_std": float(grad.std()), "negative_pair_ratio": float(np.mean(grad < 0.0)),
             "gradient_cosine_histogram": histogram(grad, bins),
             "semantic_cosine_mean": None, "semantic_cosine_histogram": None}
    if sem_cos_PxY is not None:
        sem = np.asarray(sem_cos_PxY, np.float64).ravel()
        if sem.shape != grad.shape:
            raise ValueError(f"geometry_stats: {sem.size} semantic cosines but {grad.size} gradient cosines; "
                             "both must come from the same response pairs")
        stats |= {"semantic_cosine_mean": float(sem.mean()), "semantic_cosine_histogram": histogram(sem, bins)}
    return stats


# ------------------------------------------------------------------------------------------------ models
@dataclasses.dataclass(frozen=True)
class ModelSource:
    """One model to analyse: a HF dir (`kind="model"`) or a training run/checkpoint (`kind="checkpoint"`)."""

    kind: str
    path: str  # local, a URL (gs://...), or for a model a Hugging Face id
    label: str


def load_source(source: ModelSource, mesh):
    """(model, tokenizer_dir, prompt template): a checkpoint keeps its run's template, a HF dir uses chat."""
    from g2rl_jax.config import ModelConfig
    from g2rl_jax.model import load_pretrained

    if source.kind == "checkpoint":
        model, tokenizer_dir = load_policy(source.path, mesh=mesh)
        return model, tokenizer_dir, run_config(resolve_checkpoint(source.path)[0]).data.prompt_template
    from g2rl_jax.model.sources import local_model_dir

    path = local_model_dir(source.path, "--model-path")
    model_cfg = ModelConfig(path=path)
    runtime = runtime_config(model_cfg, remat="none")  # nothing here takes gradients
    return load_pretrained(path, model_cfg.param_dtype, runtime=runtime, mesh=mesh), path, "chat"


# ------------------------------------------------------------------------------------------------ sampling
@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    samples: int
    temperature: float
    max_new_tokens: int
    batch_size: int  # prompts per generate/score call
    micro_batch: int  # responses per scoring micro-batch
    seed: int


@dataclasses.dataclass(frozen=True)
class GroupFeatures:
    """One model's responses, group-major: P problems x m samples."""

    phi_PxmxD: np.ndarray
    texts: list[str]
    correct_Pxm: np.ndarray
    lengths_Pxm: np.ndarray


def _padded_chunks(examples: Sequence, size: int):
    """(chunk of exactly `size` examples, number of real ones); the last chunk repeats its final example, so
    every call has the same shape (one compilation) and a row count the mesh divides."""
    for start in range(0, len(examples), size):
        chunk = list(examples[start:start + size])
        yield start, chunk + [chunk[-1]] * (size - len(chunk)), len(chunk)


def sample_group_features(model, tokenizer, examples, template: str, sampling: Sampling, mesh) -> GroupFeatures:
    """Sample m responses per example and score them with the trainer's pass: Φ, texts, correctness, lengths.
    mesh=None runs on the default device; with a mesh, batch_size x samples must split evenly over it."""
    from flax import nnx

    from g2rl_jax.data import encode_prompts
    from g2rl_jax.rewards import score_batch
    from g2rl_jax.rollout import generate
    from g2rl_jax.train import step as train_step
    from g2rl_jax.train.setup import shard_rows, stop_token_ids

    m = sampling.samples
    graphdef, params = nnx.split(model)
    stop_ids = stop_token_ids(tokenizer)
    phis, texts, correct, lengths = [], [], [], []
    for start, chunk, real in _padded_chunks(examples, sampling.batch_size):
        rollout = generate(model, encode_prompts(chunk, tokenizer, template), max_new_tokens=sampling.max_new_tokens,
                           temperature=sampling.temperature, num_samples=m, stop_token_ids=stop_ids,
                           seed=sampling.seed + start, mesh=mesh)
        chunk_texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        rewards = score_batch(chunk_texts, [ex.answer for ex in chunk for _ in range(m)], kind=chunk[0].kind)
        batch = train_step.build_batch(rollout.prompt_ids_BxS, rollout.prompt_mask_BxS, rollout.completion_ids_BxT,
                                       rollout.completion_mask_BxT, rewards, rewards > 0, m)
        batch = batch if mesh is None else shard_rows(batch, mesh)
        phi_BxD = train_step.score(graphdef, params, batch, temperature=sampling.temperature or 1.0,
                                   micro=sampling.micro_batch).phi_BxD  # T = 0 (greedy) scores at T = 1, as the trainer
        rows = real * m
        phis.append(np.asarray(phi_BxD, np.float64)[:rows])
        texts += chunk_texts[:rows]
        correct.append(np.asarray(rewards)[:rows] > 0)
        lengths.append(rollout.completion_lengths[:rows])
    d = phis[0].shape[-1]
    return GroupFeatures(np.concatenate(phis).reshape(-1, m, d), texts, np.concatenate(correct).reshape(-1, m),
                         np.concatenate(lengths).reshape(-1, m))


def embed_groups(embedder, tokenizer, texts: list[str], m: int, rows_per_call: int, mesh,
                 max_tokens: int) -> np.ndarray:
    """Last-token-pooled, L2-normalised embeddings [P, m, E] of the texts (the trainer's EVOL-RL encoder path:
    left padding, the tokenizer's eos appended, the final position's hidden state, each text's last `max_tokens`
    tokens), `rows_per_call` at a time."""
    from g2rl_jax.train.setup import embed_texts

    out = []
    for start in range(0, len(texts), rows_per_call):
        chunk = texts[start:start + rows_per_call]
        padded = chunk + [chunk[-1]] * (rows_per_call - len(chunk))
        out.append(np.asarray(embed_texts(embedder, tokenizer, padded, mesh, max_tokens), np.float64)[:len(chunk)])
    e = np.concatenate(out)
    return e.reshape(-1, m, e.shape[-1])


# ------------------------------------------------------------------------------------------------ the command
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.analyze", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", dest="models", action="append", default=[], type=lambda v: ("model", v),
                   help="Hugging Face model dir to analyse (repeatable)")
    p.add_argument("--checkpoint", dest="models", action="append", type=lambda v: ("checkpoint", v),
                   help="training run dir (its newest checkpoint) or <run>/checkpoints/<step> dir (repeatable)")
    p.add_argument("--label", action="append", default=[],
                   help="legend label per model, in command-line order (default: the dir name; a checkpoint "
                        "step dir gives RUN@STEP)")
    p.add_argument("--dataset", default="aime25", help="registered dataset name or a .jsonl path")
    p.add_argument("--problems", type=int, default=30, help="problems drawn at random (seeded) from the dataset")
    p.add_argument("--samples", type=int, default=8, help="responses per problem (the group size m)")
    p.add_argument("--temperature", type=float, help="sampling temperature, also Φ's T (0 = greedy); default: the "
                   "checkpoints' rollout.temperature (the T training scored Φ at), else 1.0")
    p.add_argument("--max-new-tokens", type=int, help="default: the checkpoints' rollout.max_new_tokens, else 8192")
    p.add_argument("--template", choices=("chat", "plain"),
                   help="prompt template (default: a checkpoint's data.prompt_template, chat for --model-path)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate/score call")
    p.add_argument("--micro-batch", type=int, default=8, help="responses per scoring micro-batch")
    p.add_argument("--embedding-model", help="Qwen3-Embedding-architecture HF dir for semantic cosines")
    p.add_argument("--embedding-max-tokens", type=int, default=1024,
                   help="tokens embedded per response, the tail kept (as algorithm.embedding_max_tokens)")
    p.add_argument("--bins", type=int, default=HIST_BINS, help="histogram bins over [-1, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the problem draw and of sampling")
    p.add_argument("--out", default="runs/analysis", help="output directory (local or gs://...)")
    args = p.parse_args(argv)
    if not args.models:
        p.error("give at least one --model-path or --checkpoint")
    if args.label and len(args.label) != len(args.models):
        p.error(f"{len(args.label)} --label for {len(args.models)} models; give one per model, in order, or none")
    try:  # unset flags from the runs' config.yaml (--model-path dirs have none)
        for kind, path in args.models:  # a server gone away: one line within a bounded time, not a hang
            storage.check_readable(path, "--checkpoint" if kind == "checkpoint" else "--model-path")
        run = run_defaults([path for kind, path in args.models if kind == "checkpoint"],
                           lambda c: {"temperature": c.rollout.temperature, "max_new_tokens": c.rollout.max_new_tokens},
                           args)
    except (FileNotFoundError, ValueError) as err:
        p.error(str(err))
    for flag, fallback in (("temperature", 1.0), ("max_new_tokens", 8192)):
        if getattr(args, flag) is None:
            setattr(args, flag, run.get(flag, fallback))
    if args.samples < 2:
        p.error("--samples must be >= 2: cosines are taken between responses of the same problem")
    for name in ("problems", "batch_size", "micro_batch", "max_new_tokens", "bins"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if (args.batch_size * args.samples) % args.micro_batch:
        p.error(f"--micro-batch {args.micro_batch} must divide --batch-size x --samples = "
                f"{args.batch_size * args.samples} responses per call")
    return args


def default_label(kind: str, path: str) -> str:
    """The dir's name; RUN@STEP for one checkpoint step dir of a run."""
    def name(where) -> str:
        return (where if storage.is_url(where) else storage.path(where).resolve()).name

    if kind == "checkpoint":
        run_dir, step_dir = resolve_checkpoint(path)
        return name(run_dir) if str(run_dir) == str(storage.path(path)) else f"{name(run_dir)}@{step_dir.name}"
    return name(path)


def model_sources(args: argparse.Namespace) -> list[ModelSource]:
    """The models in command-line order, each with its --label or default label; labels must be distinct."""
    labels = args.label or [default_label(kind, path) for kind, path in args.models]
    sources = [ModelSource(kind, path, label) for (kind, path), label in zip(args.models, labels)]
    labels = [s.label for s in sources]
    if len(set(labels)) != len(labels):
        raise ValueError(f"models share a label ({labels}); pass --label once per model to tell them apart")
    return sources


def draw_problems(dataset: str, count: int, seed: int) -> list:
    """`count` problems drawn without replacement (all of them if fewer), in dataset order; same for every model."""
    from g2rl_jax.data import load_dataset

    examples = load_dataset(dataset)
    if count >= len(examples):
        return examples
    keep = np.sort(np.random.default_rng(seed).choice(len(examples), size=count, replace=False))
    return [examples[i] for i in keep]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return analyze(args)
    except cli.USER_ERRORS as err:  # a dataset, checkpoint or model dir that cannot be read
        return cli.fail("analyze", err)


def analyze(args: argparse.Namespace) -> int:
    """The command after its flags are parsed: sample, score, write analysis.json and geometry.png."""
    from g2rl_jax.config import MeshConfig, ModelConfig
    from g2rl_jax.data.tokenizer import load_tokenizer
    from g2rl_jax.figures import geometry_figure
    from g2rl_jax.model import load_pretrained
    from g2rl_jax.parallel import make_mesh

    try:
        sources = model_sources(args)
        storage.check_writable(args.out, "--out")  # a missing bucket, no credentials: one line before any model loads
    except ValueError as err:
        return cli.fail("analyze", err)
    examples = draw_problems(args.dataset, args.problems, args.seed)
    mesh = make_mesh(MeshConfig())  # all devices, fsdp-sharded params, batch split over them (as the trainer)
    rows_per_call = args.batch_size * args.samples
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows_per_call % shards:
        return cli.fail("analyze", f"--batch-size x --samples = {rows_per_call} responses per call must be a "
                        f"multiple of the {shards} devices the batch is split over; raise --batch-size")
    sampling = Sampling(samples=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, micro_batch=args.micro_batch, seed=args.seed)
    embedder = embed_tokenizer = None
    if args.embedding_model is not None:
        from g2rl_jax.model.sources import local_model_dir

        emb_cfg = ModelConfig(path=local_model_dir(args.embedding_model, "--embedding-model"))
        embedder = load_pretrained(emb_cfg.path, emb_cfg.param_dtype,
                                   runtime=runtime_config(emb_cfg, remat="none"), mesh=mesh)
        embed_tokenizer = load_tokenizer(emb_cfg.path)
    models = {}
    for source in sources:
        model, tokenizer_dir, template = load_source(source, mesh)
        tokenizer = load_tokenizer(tokenizer_dir)
        features = sample_group_features(model, tokenizer, examples, args.template or template, sampling, mesh)
        del model
        sem_cos = None
        if embedder is not None:
            emb = embed_groups(embedder, embed_tokenizer, features.texts, args.samples, rows_per_call, mesh,
                               args.embedding_max_tokens)
            sem_cos = pairwise_cosines(emb)
        stats = geometry_stats(pairwise_cosines(features.phi_PxmxD), sem_cos, args.bins)
        models[source.label] = {"source": str(source.path), "kind": source.kind,
                                "accuracy": float(features.correct_Pxm.mean()),
                                "mean_response_length": float(features.lengths_Pxm.mean()), **stats}
        print(f"{source.label}: gradient cosine {stats['gradient_cosine_mean']:.3f}, negative pairs "
              f"{100 * stats['negative_pair_ratio']:.2f}%" + ("" if sem_cos is None else
                                                              f", semantic cosine {stats['semantic_cosine_mean']:.3f}"))
    out = storage.path(args.out, "--out")
    settings = {"dataset": args.dataset, "problem_ids": [ex.id for ex in examples], "samples": args.samples,
                "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                "template": args.template, "embedding_model": None if embedder is None else str(args.embedding_model)}
    storage.write_text(out / "analysis.json", json.dumps({"settings": settings, "models": models}, indent=1))
    geometry_figure(models, out / "geometry.png", title=f"{args.dataset}: {len(examples)} problems x "
                                                               f"{args.samples} samples")
    print(f"wrote {out / 'analysis.json'} and {out / 'geometry.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
