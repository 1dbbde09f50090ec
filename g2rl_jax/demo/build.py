"""Build (or reuse) the demo's model directories: the warm-started policy and a Qwen3Model embedder.

    build_demo_model("runs/demo/model")                          # tokenizer + tiny Qwen3 + supervised warm start
    build_demo_embedder("runs/demo/embedder", "runs/demo/model")  # its backbone as a Qwen3Model (for `evol`)
    resolve_demo_paths("demo:runs/demo/model", None)             # the same, driven by config values
    demo_architecture()                                          # the policy's Qwen3Config, nothing built

The schemes ("demo:DIR", ...) are registered with g2rl_jax/registry.py, through which the trainer and `plan` reach
them without importing the demo.

Both are cached: a directory holds `demo_build.json` with the hash of everything that determines its contents
(architecture, warm-start settings, task, tokenizer recipe, `BUILD_VERSION`); a complete directory with the
same hash is reused as is, anything else is rebuilt. A build is written to a temporary sibling directory and
renamed into place, so an interrupted build never leaves a directory that looks complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from g2rl_jax import registry
from g2rl_jax.demo import countdown, sumprod, task
from g2rl_jax.demo import tokenizer as demo_tokenizer
from g2rl_jax.demo.sft import SFTConfig, encode_sft, encode_variants, train_sft
from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig, save_pretrained

BUILD_VERSION = 1  # bump when the build changes in a way the spec below does not capture
MARKER = "demo_build.json"
SCHEME = "demo:"  # the addition demo (configs/demo.yaml)
# model.path prefix -> task (countdown: g2rl_jax/demo/countdown.py's MEMORISE set; countdown_study:
# configs/study_countdown.yaml; sumprod: configs/study_sumprod.yaml, the study's second task)
SCHEMES = {SCHEME: "addition", "countdown:": "countdown", "countdown-study:": "countdown_study",
           "sumprod:": "sumprod"}
TASKS = tuple(SCHEMES.values())
COUNTDOWN_TEACHER_ACCURACY = 0.8
POLICY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)
EMBEDDER_FILES = POLICY_FILES


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """The tiny policy's architecture (vocab_size is the tokenizer's size rounded up to a multiple of 64)."""

    hidden_size: int = 96
    intermediate_size: int = 288
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256

    def qwen3_config(self, tokenizer_size: int) -> Qwen3Config:
        return Qwen3Config(vocab_size=-(-tokenizer_size // 64) * 64, tie_word_embeddings=True,
                           **dataclasses.asdict(self))


def _spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


# the study's warm start: the same tiny policy, a longer warm start on twice the rows per step, and a teacher that
# always writes a correct answer (one drawn at random), on the 5,397 "sft" problems that neither RL nor the held-out
# set uses: what the policy gets right on other problems is a skill, not a memory
STUDY_SFT_STEPS = 5000
STUDY_SFT_BATCH = 128
STUDY_TEACHER_ACCURACY = 1.0
# the second task's warm start (g2rl_jax/demo/sumprod.py): a teacher that works the sum out in a random order, right
# SUMPROD_TEACHER_ACCURACY of the time and with one carry slip otherwise (as the addition demo's teacher: an unreliable
# policy, not an ignorant one; an always-right teacher gave held-out pass@1 0.73 and pass@8 1.0, no room for RL), on
# the 20,000 "sft" problems; rows are ~100 tokens, so fewer of them than the first study's
SUMPROD_SFT_STEPS = 1500
SUMPROD_SFT_BATCH = 64
SUMPROD_TEACHER_ACCURACY = 0.4


def default_sft_steps(task_name: str) -> int:
    return {"countdown_study": STUDY_SFT_STEPS, "sumprod": SUMPROD_SFT_STEPS}.get(task_name, SFTConfig.steps)


def sft_config(seed: int, sft_steps: int, task_name: str) -> SFTConfig:
    if task_name == "countdown_study":
        return SFTConfig(steps=sft_steps, seed=seed, batch_size=STUDY_SFT_BATCH,
                         teacher_accuracy=STUDY_TEACHER_ACCURACY)
    if task_name == "sumprod":
        return SFTConfig(steps=sft_steps, seed=seed, batch_size=SUMPROD_SFT_BATCH,
                         teacher_accuracy=SUMPROD_TEACHER_ACCURACY)
    accuracy = COUNTDOWN_TEACHER_ACCURACY if task_name == "countdown" else SFTConfig.teacher_accuracy
    return SFTConfig(steps=sft_steps, seed=seed, teacher_accuracy=accuracy)


def task_spec(task_name: str) -> dict:
    if task_name == "sumprod":
        return {"name": task_name, "terms": sumprod.TERMS, "digits": [sumprod.DIGITS.start, sumprod.DIGITS.stop],
                "shuffle_seed": sumprod.SHUFFLE_SEED, "splits": [list(x) for x in sumprod.SPLITS],
                "teacher_variants": sumprod.TEACHER_VARIANTS, "slips": list(sumprod.SLIPS)}
    if task_name == "countdown_study":
        return {"name": task_name, **countdown.STUDY.spec(), "teacher_variants": countdown.TEACHER_VARIANTS}
    if task_name == "countdown":
        return {"name": "countdown", "digits": [countdown.DIGITS.start, countdown.DIGITS.stop],
                "numbers": countdown.NUM_NUMBERS, "stride": countdown.MULTISET_STRIDE,
                "targets": [countdown.TARGETS.start, countdown.TARGETS.stop], "min_solutions": countdown.MIN_SOLUTIONS,
                "shuffle_seed": countdown.SHUFFLE_SEED, "test_size": countdown.TEST_SIZE,
                "teacher_variants": countdown.TEACHER_VARIANTS}
    return {"operands": [task.OPERANDS.start, task.OPERANDS.stop], "shuffle_seed": task.SHUFFLE_SEED,
            "test_size": task.TEST_SIZE, "teacher_errors": list(task.TEACHER_ERRORS)}


def policy_spec(seed: int, sft_steps: int, task_name: str = "addition") -> dict:
    """Everything that determines the policy directory's contents."""
    if task_name not in TASKS:
        raise ValueError(f"unknown demo task {task_name!r}; choose one of {TASKS}")
    return {
        "kind": "policy", "version": BUILD_VERSION, "architecture": dataclasses.asdict(PolicySpec()),
        "sft": dataclasses.asdict(sft_config(seed, sft_steps, task_name)), "init_seed": seed,
        "task": task_spec(task_name),
        "tokenizer": {"characters": demo_tokenizer.CHARACTERS, "max_vocab": demo_tokenizer.MAX_VOCAB,
                      "corpus_examples": demo_tokenizer.CORPUS_EXAMPLES},
    }


def sft_data(task_name: str, tokenizer, cfg: SFTConfig):
    """(ids [N,K,L], mask [N,K,L], probs [K]) of the warm start's training rows for the task."""
    if task_name == "sumprod":
        rng = random.Random(cfg.seed)
        train = sumprod.examples("sft")
        ids, mask = encode_variants(train, [sumprod.teacher_responses(ex, rng) for ex in train], tokenizer)
        k = sumprod.TEACHER_VARIANTS
        return ids, mask, np.array([cfg.teacher_accuracy / k] * k + [(1 - cfg.teacher_accuracy) / k] * k)
    if task_name in ("countdown", "countdown_study"):
        rng = random.Random(cfg.seed)
        train = (countdown.examples("sft", countdown.STUDY) if task_name == "countdown_study"
                 else countdown.examples("train"))
        ids, mask = encode_variants(train, [countdown.teacher_responses(ex, rng) for ex in train], tokenizer)
        k = countdown.TEACHER_VARIANTS
        return ids, mask, np.array([cfg.teacher_accuracy / k] * k + [(1 - cfg.teacher_accuracy) / k] * k)
    ids, mask = encode_sft(task.examples("train"), tokenizer)
    return ids, mask, cfg.variant_probs()


def _built_hash(out: Path, files: tuple[str, ...]) -> str | None:
    """The spec hash of the complete build at `out`, or None when `out` is not one."""
    if not all((out / f).is_file() for f in files):
        return None
    return json.loads((out / MARKER).read_text()).get("spec_hash")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished build `tmp` to `out`, replacing an earlier demo build there (never anything else)."""
    if out.exists():
        if not (out / MARKER).is_file() and any(out.iterdir()):
            shutil.rmtree(tmp)
            raise FileExistsError(f"{out} exists and is not a demo build (no {MARKER}); "
                                  "remove it or point the demo at another directory")
        shutil.rmtree(out)
    os.replace(tmp, out)


def _staging_dir(out: Path) -> Path:
    """An empty sibling of `out`, private to this process, for the build to be written into."""
    tmp = out.with_name(f".{out.name}.building-{os.getpid()}")
    if tmp.exists():  # left by a crashed earlier process that had the same pid
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def build_demo_model(out_dir: str | os.PathLike, *, seed: int = 0, sft_steps: int | None = None,
                     task_name: str = "addition") -> Path:
    """The warm-started demo policy for `task_name` (one of TASKS) as an HF directory at `out_dir` (reused when
    already built the same way); sft_steps defaults to the task's (default_sft_steps)."""
    out = Path(out_dir)
    sft_steps = default_sft_steps(task_name) if sft_steps is None else sft_steps
    spec = policy_spec(seed, sft_steps, task_name)
    spec_hash = _spec_hash(spec)
    if _built_hash(out, POLICY_FILES) == spec_hash:
        return out
    start, start_cpu = time.perf_counter(), time.process_time()
    print(f"building the warm-started {task_name} policy in {out} ({sft_steps} supervised steps; built once, reused "
          "afterwards)", file=sys.stderr, flush=True)
    corpus = {"addition": None, "sumprod": sumprod.corpus}.get(task_name, countdown.corpus)
    tokenizer = demo_tokenizer.make_tokenizer(corpus() if corpus else None)
    cfg = PolicySpec().qwen3_config(len(tokenizer))
    model = Qwen3(cfg, RuntimeConfig(), rngs=nnx.Rngs(seed))
    sft = sft_config(seed, sft_steps, task_name)
    ids_BxJxL, mask_BxJxL, probs_J = sft_data(task_name, tokenizer, sft)
    losses = train_sft(model, ids_BxJxL, mask_BxJxL, sft, probs_J, progress=f"warm start ({task_name})")
    tmp = _staging_dir(out)
    save_pretrained(model, tmp)
    tokenizer.save_pretrained(tmp)
    record = {"spec_hash": spec_hash, "spec": spec, "build_seconds": round(time.perf_counter() - start, 1),
              "build_cpu_seconds": round(time.process_time() - start_cpu, 1),
              "sft_losses": [round(x, 4) for x in losses]}
    (tmp / MARKER).write_text(json.dumps(record, indent=2))
    _publish(tmp, out)
    return out


def build_demo_embedder(out_dir: str | os.PathLike, policy_dir: str | os.PathLike) -> Path:
    """The backbone of the demo policy at `policy_dir` as a Qwen3Model directory (architectures ["Qwen3Model"],
    unprefixed tensor names, no LM head, same tokenizer), for `algorithm.exploration: evol`. Reused when built
    from the same policy build."""
    out, policy = Path(out_dir), Path(policy_dir)
    policy_hash = _built_hash(policy, POLICY_FILES)
    if policy_hash is None:
        raise ValueError(f"{policy} is not a complete demo policy build; run build_demo_model({str(policy)!r}) first")
    spec_hash = _spec_hash({"kind": "embedder", "version": BUILD_VERSION, "policy": policy_hash})
    if _built_hash(out, EMBEDDER_FILES) == spec_hash:
        return out
    tmp = _staging_dir(out)
    tensors = load_file(str(policy / "model.safetensors"))
    backbone = {name.removeprefix("model."): np.ascontiguousarray(x) for name, x in tensors.items()
                if name.startswith("model.")}
    save_file(backbone, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((policy / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(policy / name, tmp / name)
    (tmp / MARKER).write_text(json.dumps({"spec_hash": spec_hash, "policy": str(policy)}, indent=2))
    _publish(tmp, out)
    return out


def resolve_demo_paths(model_path: str, embedding_model: str | None) -> tuple[str, str | None]:
    """`model.path` and `algorithm.embedding_model` config values with "demo:DIR" built (or reused) at DIR.

    "demo:DIR" as model.path is the warm-started addition demo policy, "countdown:DIR" the Countdown one,
    "countdown-study:DIR" the study's (see SCHEMES); as
    embedding_model, either names that policy's backbone (which needs model.path to be a demo policy too). Any
    other value is returned unchanged.
    """
    def scheme_of(value: str) -> str | None:
        return next((s for s in SCHEMES if value.startswith(s)), None)

    def target(value: str, key: str) -> str:
        scheme = scheme_of(value)
        directory = value[len(scheme):]
        if not directory:
            raise ValueError(f"{key}: {value!r} names no directory; write e.g. '{scheme}runs/demo/model'")
        return directory

    if scheme_of(model_path):
        model_path = str(build_demo_model(target(model_path, "model.path"), task_name=SCHEMES[scheme_of(model_path)]))
    if embedding_model is not None and scheme_of(embedding_model):
        directory = target(embedding_model, "algorithm.embedding_model")
        if _built_hash(Path(model_path), POLICY_FILES) is None:
            raise ValueError(f"algorithm.embedding_model: {embedding_model!r} is the demo policy's backbone, so "
                             f"model.path must be a demo policy ('{SCHEME}DIR'), got {model_path!r}")
        embedding_model = str(build_demo_embedder(directory, model_path))
    return model_path, embedding_model


def demo_architecture() -> Qwen3Config:
    """The architecture `demo:DIR` builds (the addition demo's tokenizer), without building it."""
    return PolicySpec().qwen3_config(len(demo_tokenizer.make_tokenizer()))


for _prefix in SCHEMES:  # the trainer and `plan` reach these through the registry, never by importing the demo
    registry.register_model_scheme(registry.ModelScheme(_prefix, resolve_demo_paths,
                                                        demo_architecture if _prefix == SCHEME else None))
