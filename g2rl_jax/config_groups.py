"""The groups of the run configuration (`g2rl_jax.config`): one frozen dataclass per YAML group, each field with
its default, its help text and its validation in `__post_init__`. Import them from `g2rl_jax.config`.

Defaults follow the paper ("Can LLMs Guide Their Own Exploration? Gradient-Guided Reinforcement Learning for LLM
Reasoning", arXiv 2512.15687), appendix table, where it gives a value; where the paper is silent the help text says
so and names the choice (mostly verl's defaults, the framework the paper's GRPO setup comes from).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional

from g2rl_jax import methods
from g2rl_jax.errors import ConfigError
from g2rl_jax.methods import NAMES as EXPLORATION_METHODS

LOGGERS = ("jsonl", "tensorboard", "wandb")
_REQUIRED = dataclasses.MISSING


def _f(default: Any, help: str) -> Any:
    """A dataclass field with its one-line help text kept next to it (`_REQUIRED` for no default)."""
    return dataclasses.field(default=default, metadata={"help": help})


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


SEED_LIMIT = 2**32  # seeds are unsigned 32-bit (the data shuffle's and the RNG key's range)


def _check_seed(seed: int, key: str) -> None:
    _check(0 <= seed < SEED_LIMIT, key, f"must satisfy 0 <= seed < 2**32, got {seed}")


FIELD_NAMES = ("id", "problem", "answer", "choices")  # Example fields a jsonl file's keys can be mapped to


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str = _f(_REQUIRED, "run directory, local or a URL (gs://BUCKET/DIR: what a multi-host "
                               "slice's hosts share): checkpoints/, metrics.jsonl, tensorboard/, config.yaml")
    total_steps: int = _f(500, "RL steps (rollout + update) to train; paper silent, 500 chosen")
    checkpoint_every: int = _f(50, "save a checkpoint every this many steps (and always at the end)")
    keep_checkpoints: int = _f(3, "keep only the newest this many checkpoints")
    eval_every: int = _f(50, "evaluate on data.eval_datasets every this many steps (0 = never)")
    seed: int = _f(0, "seed of the sampling and initialisation RNG, 0 <= seed < 2**32")
    allow_config_change: bool = _f(False, "resume even if keys that change what the run computes (model, data, "
                                   "rollout, algorithm, optim) differ")
    preempt_grace_seconds: float = _f(25.0, "after SIGTERM (a spot VM's 30 s preemption notice) the run ends within "
                                      "this many seconds: the step in progress is finished and checkpointed when its "
                                      "measured time fits, else abandoned (the last checkpoint stands)")
    compilation_cache_dir: str = _f("~/.cache/g2rl_jax/jax",
                                    "JAX's persistent compilation cache: a relaunch (a resume after a preemption) "
                                    "reads the compiled programs back instead of compiling them again; several hosts "
                                    "need a directory they share, e.g. gs://BUCKET/DIR; \"\" = off")
    compile_threads: int = _f(0, "compile this many programs at a time: the run compiles every program its steps can "
                              "meet at its first step (rollout/prewarm.py: the decode segments and cache moves; "
                              "train/warmup.py: the score, reference and update programs of its layout and prompt "
                              "buckets) and none after; results unchanged; 0 = one per CPU core up to 32, "
                              "1 = one at a time")
    shapes_file: str = _f("", "a shape file (python -m g2rl_jax.bench tune-shapes --out FILE writes one, measured on "
                          "this machine) whose layout and prompt buckets the run uses; \"\" = those "
                          "g2rl_jax/shapes/choice.py derives from the config, the device kind and the prompts' lengths "
                          "(the same on every machine, whatever its load); a resume keeps what the run recorded in "
                          "its micro_shapes.json")
    strict_compiles: bool = _f(False, "raise when a step after the warm-up step compiles a program, naming each by "
                               "its function and argument shapes (the test suite's mode); false = one line on stderr")
    loggers: tuple[str, ...] = _f(("jsonl", "tensorboard"),
                                  "where step metrics go: jsonl (always; summaries, plots and resume read it), "
                                  "tensorboard, wandb (pip install -e \".[wandb]\"; WANDB_MODE=offline works)")
    lock_lease_seconds: float = _f(60.0, "the trainer holding run.output_dir renews its run.lock every this / 3 "
                                   "seconds; a lock not renewed this long is stale from any host, so a preempted "
                                   "run's relaunch (another VM) takes the run over after at most this wait; >= 9 "
                                   "(GCS takes about one update per second per object: renewals every 3 s or more "
                                   "leave room for a takeover or a release); with mesh.rollout_processes each "
                                   "rollout process renews a lease as often, and the trainer stops in one line when "
                                   "one has no renewal this long (docs/async.md)")

    def __post_init__(self):
        _check(self.output_dir.strip() != "", "run.output_dir",
               "is empty; name the run directory, e.g. run.output_dir=runs/my_run")
        for name in ("total_steps", "checkpoint_every", "keep_checkpoints"):
            _check(getattr(self, name) > 0, f"run.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.lock_lease_seconds >= 9, "run.lock_lease_seconds",
               f"must be >= 9 (renewed every third of it, so a bucket's one update a second per object leaves room "
               f"for a takeover or a release), got {self.lock_lease_seconds}")
        _check(self.preempt_grace_seconds > 0, "run.preempt_grace_seconds",
               f"must be > 0 seconds, got {self.preempt_grace_seconds}")
        _check(self.eval_every >= 0, "run.eval_every", f"must be >= 0 (0 = never), got {self.eval_every}")
        _check(self.compile_threads >= 0, "run.compile_threads",
               f"must be >= 0 (0 = one per CPU core, 1 = one at a time), got {self.compile_threads}")
        _check_seed(self.seed, "run.seed")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        _check(not unknown, "run.loggers", f"unknown logger(s) {unknown}; choose from {', '.join(LOGGERS)}")
        _check("jsonl" in self.loggers, "run.loggers", f"must include jsonl (the run summary, plots and resume read "
               f"metrics.jsonl), got {list(self.loggers)}")
        _check(len(set(self.loggers)) == len(self.loggers), "run.loggers",
               f"lists a logger twice: {list(self.loggers)}")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # attention q/k/v/o and MLP gate/up/down projections


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = _f(0, "LoRA rank r of the adapters (0 = off: every weight is trained); the base weights are then "
                   "frozen, and only the adapters get gradients and AdamW moments (docs/lora.md)")
    alpha: Optional[float] = _f(None, "the adapters add (alpha/rank)·x·A·B; null = rank (scale 1, as Tunix's Qwen3 "
                                "GRPO example: rank 64, alpha 64)")
    targets: tuple[str, ...] = _f(LORA_TARGETS, "projections that get adapters: q, k, v, o (attention), gate, up, "
                                  "down (MLP); the default is all seven, as Tunix's Qwen3 GRPO example")
    base_dtype: Literal["float32", "bfloat16"] = _f("bfloat16", "dtype of the frozen base weights (the adapters "
                                                    "train in model.param_dtype)")
    init_from: Optional[str] = _f(None, "a PEFT LoRA adapter directory, local or gs://... (adapter_config.json + "
                                  "adapter_model.safetensors, e.g. from export --adapter) to start from; null = A "
                                  "random, B zero, so step 0's policy is the base model")

    def __post_init__(self):
        _check(self.rank >= 0, "model.lora.rank", f"must be >= 0 (0 = LoRA off), got {self.rank}")
        if self.rank == 0:
            set_keys = [f.name for f in dataclasses.fields(self) if f.name != "rank"
                        and getattr(self, f.name) != f.default]
            _check(not set_keys, f"model.lora.{set_keys[0] if set_keys else 'rank'}",
                   "is set but model.lora.rank is 0 (LoRA off); set model.lora.rank > 0 (e.g. 64) to train "
                   f"adapters, or drop model.lora.{', model.lora.'.join(set_keys)}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        _check(not unknown, "model.lora.targets", f"unknown target(s) {unknown}; choose from {', '.join(LORA_TARGETS)}")
        _check(len(self.targets) > 0, "model.lora.targets", f"is empty; name at least one of {', '.join(LORA_TARGETS)}")
        _check(len(set(self.targets)) == len(self.targets), "model.lora.targets",
               f"names a projection twice: {list(self.targets)}")
        _check(self.alpha is None or (math.isfinite(self.alpha) and self.alpha > 0), "model.lora.alpha",
               f"must be a finite number > 0 or null (= rank), got {self.alpha}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = _f(_REQUIRED, "Hugging Face model of the policy (config.json, *.safetensors, tokenizer): a "
                         "local directory, gs://BUCKET/DIR (copied once to the local cache), or a Hugging Face id "
                         "such as Qwen/Qwen3-1.7B-Base (read from its cache, downloaded there if missing)")
    revision: str = _f("", "the Hugging Face commit (or branch or tag) to load model.path at, when it is a Hugging "
                       "Face id; \"\" = what the hub (or, offline, the cache) serves as main at the run's first "
                       "start, whose commit is then written here in the run's config.yaml so that every resume "
                       "loads the same weights and tokenizer")
    param_dtype: Literal["float32", "bfloat16"] = _f("float32", "dtype of the trained parameters (with LoRA: the "
                                                     "adapters; the frozen base is in model.lora.base_dtype)")
    compute_dtype: Literal["float32", "bfloat16"] = _f("bfloat16", "dtype of activations and matmuls")
    remat: Literal["none", "full", "dots"] = _f(
        "full", "rematerialise each decoder layer in the backward pass: none, full (recompute all), dots (keep "
        "matmul outputs, recompute the rest)")
    attention: Literal["auto", "xla", "cudnn", "splash"] = _f(
        "auto", "attention kernel: auto (splash on TPU, cudnn on GPU with bfloat16 compute, else xla), xla, cudnn "
        "(GPU, bfloat16), splash (TPU); a kernel whose hardware is absent falls back to xla with a warning")
    kv_cache_dtype: Literal["float32", "bfloat16"] = _f("bfloat16", "dtype of the rollout KV cache")
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig, metadata={"help": "LoRA adapters"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    data: int = _f(1, "data-parallel mesh axis size (-1 = all remaining devices)")
    fsdp: int = _f(-1, "fully-sharded data-parallel axis size (-1 = all remaining devices)")
    tensor: int = _f(1, "tensor-parallel axis size (-1 = all remaining devices)")
    rollout_devices: int = _f(0, "devices of each process given to a separate rollout mesh (0 = one mesh for "
                              "both); data/fsdp/tensor then shape the training mesh on the rest (docs/async.md)")
    rollout_tensor: int = _f(1, "tensor-parallel axis of the rollout mesh; its data axis takes the rest of its "
                             "devices (weights replicated over it, as decoding wants)")
    rollout_processes: int = _f(0, "one process set per side: every device of the last N processes forms the "
                                "rollout mesh, data/fsdp/tensor shape the training mesh on the devices of the "
                                "other processes (one or more; 0 = off; excludes rollout_devices; docs/async.md)")

    def __post_init__(self):
        _check(self.rollout_devices >= 0, "mesh.rollout_devices", f"must be >= 0, got {self.rollout_devices}")
        _check(self.rollout_tensor >= 1, "mesh.rollout_tensor", f"must be >= 1, got {self.rollout_tensor}")
        _check(self.rollout_processes >= 0, "mesh.rollout_processes", f"must be >= 0, got {self.rollout_processes}")
        _check(self.rollout_processes == 0 or self.rollout_devices == 0, "mesh.rollout_processes",
               f"={self.rollout_processes} gives the rollout whole processes: leave mesh.rollout_devices at 0 "
               f"(got {self.rollout_devices})")
        _check(self.rollout_devices == 0 or self.rollout_devices % self.rollout_tensor == 0, "mesh.rollout_tensor",
               f"must divide mesh.rollout_devices={self.rollout_devices}, got {self.rollout_tensor}")
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            _check(size > 0 or size == -1, f"mesh.{name}", f"must be > 0 or -1 (fill), got {size}")
        fills = [name for name, size in sizes.items() if size == -1]
        _check(len(fills) <= 1, f"mesh.{fills[-1] if fills else 'data'}",
               f"at most one axis may be -1, got -1 for {fills}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_dataset: str = _f("math_train", "registered dataset name or a .jsonl file, local or gs://... (paper: "
                                                  "MATH train)")
    prompt_template: Literal["chat", "plain"] = _f("chat", "prompt format around the question (paper: SimpleRL-Zoo)")
    prompts_per_step: int = _f(16, "prompts per RL step (paper: train batch size 16)")
    max_prompt_tokens: int = _f(1024, "longer prompts are dropped; paper silent, 1024 chosen (verl default)")
    prompt_buckets: int = _f(0, "at most this many prompt lengths a step's prompts are padded to (the largest "
                             "bucket the training prompts reach, then smaller ones as the price model chooses, "
                             "g2rl_jax/shapes/choice.py); each is a copy of the rollout's programs (and, with "
                             "length-grouped passes, of the passes'); 0: no limit")
    eval_datasets: tuple[str, ...] = _f(("math500", "amc23", "aime24", "aime25"),
                                        "datasets evaluated every run.eval_every steps")
    eval_samples: int = _f(8, "samples per eval prompt (paper's training curves: AIME25 mean@8)")
    eval_temperature: float = _f(0.8, "sampling temperature for evaluation (paper: 0.8)")
    eval_max_new_tokens: int = _f(8192, "response budget at evaluation; paper silent, the training budget chosen")
    shuffle_seed: int = _f(0, "seed of the training-set shuffle, 0 <= seed < 2**32")
    fields: tuple[str, ...] = _f((), "jsonl files only: FIELD=KEY pairs naming the file's keys, e.g. "
                                 "problem=question,answer=gold")

    def __post_init__(self):
        for name in ("prompts_per_step", "max_prompt_tokens", "eval_samples", "eval_max_new_tokens"):
            _check(getattr(self, name) > 0, f"data.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.prompt_buckets >= 0, "data.prompt_buckets", f"must be >= 0 (0: no limit), got "
               f"{self.prompt_buckets}")
        _check(self.eval_temperature >= 0, "data.eval_temperature", f"must be >= 0, got {self.eval_temperature}")
        _check_seed(self.shuffle_seed, "data.shuffle_seed")
        for pair in self.fields:
            name, sep, key = pair.partition("=")
            _check(bool(sep) and name.strip() in FIELD_NAMES and key.strip() != "", "data.fields",
                   f"entry {pair!r} must be FIELD=KEY with FIELD one of {', '.join(FIELD_NAMES)} and KEY the "
                   "file's key, e.g. data.fields=problem=question,answer=gold")

    def field_map(self) -> dict[str, str]:
        """data.fields as {Example field: the jsonl file's key}."""
        return {name.strip(): key.strip() for name, _, key in (p.partition("=") for p in self.fields)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    num_samples: int = _f(16, "responses sampled per prompt, the group size m (paper: 16 rollouts)")
    max_new_tokens: int = _f(8192, "response budget (paper: 8192 for 1.7B, 12288 for 4B)")
    temperature: float = _f(1.0, "sampling temperature T, also the T of p_t = softmax(z_t/T) (paper: 1.0)")
    top_p: float = _f(1.0, "nucleus sampling mass, 0 < top_p <= 1; paper silent, 1.0 (off) chosen")
    top_k: Optional[int] = _f(None, "keep the top_k most likely tokens (null = off); paper silent, off chosen")
    first_capacity: int = _f(128, "KV slots the first decode steps read (the first read rung); the rungs then "
                             "double up to the budget, a step reading the smallest that holds its position; the "
                             "rungs are branches of one program, so higher only reads more slots early "
                             "(`python -m g2rl_jax.bench ladder`)")
    max_staleness: int = _f(0, "policy versions a step's samples lag the update: 0 = on-policy (serial), 1 = "
                            "one-step-off, k = the rollout runs k steps ahead; > 0 needs mesh.rollout_devices (or "
                            "mesh.rollout_processes) and algorithm.rollout_is_cap (docs/async.md)")

    def __post_init__(self):
        _check(self.num_samples >= 2, "rollout.num_samples", f"group size must be >= 2, got {self.num_samples}")
        _check(self.first_capacity >= 1, "rollout.first_capacity", f"must be >= 1, got {self.first_capacity}")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        _check(self.temperature > 0, "rollout.temperature", f"must be > 0 for training, got {self.temperature}: "
               "greedy decoding gives a group identical responses, whose advantages are all zero (no signal)")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must satisfy 0 < top_p <= 1, got {self.top_p}")
        _check(self.top_k is None or self.top_k > 0, "rollout.top_k", f"must be > 0 or null, got {self.top_k}")
        _check(self.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {self.max_staleness}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    truncated: Literal["keep", "penalize", "mask"] = _f(
        "penalize", "response at rollout.max_new_tokens without a stop token: keep | penalize (reward -1) | mask "
        "(out of the loss); penalize as scoring it is exploitable (docs/rewards.md); the paper's configs: keep")
    overlong_buffer: int = _f(0, "DAPO overlong penalty: last tokens of the budget where it applies (0 = off; "
                              "the paper uses none)")
    overlong_penalty: float = _f(1.0, "DAPO overlong penalty at the full budget, linear from 0 at max_new_tokens "
                                 "- overlong_buffer (DAPO: 1.0)")
    function: Optional[str] = _f(None, "custom reward 'pkg.mod:fn' or 'file.py:fn', fn(response, example_row) in "
                                 "the verifier workers, clipped to [-1, 1] (null = verifier)")
    on_error: Literal["raise", "fail"] = _f("raise", "custom reward that raises, returns a non-number or times out: "
                                            "raise (error naming the row) or fail (-1)")
    timeout: float = _f(2.0, "seconds one verifier check or reward-function call may take (then: not verified)")

    def __post_init__(self):
        _check(self.overlong_buffer >= 0, "reward.overlong_buffer",
               f"must be >= 0 (0 = off), got {self.overlong_buffer}")
        _check(self.overlong_penalty >= 0, "reward.overlong_penalty", f"must be >= 0, got {self.overlong_penalty}")
        _check(self.timeout > 0, "reward.timeout", f"must be > 0 seconds, got {self.timeout}")
        if self.function is not None:
            from g2rl_jax.rewards.custom import parse_spec, resolve_spec
            try:
                parse_spec(self.function)
                resolve_spec(self.function)
            except ValueError as err:
                raise ConfigError(f"reward.function: {err}") from None


Exploration = Literal[EXPLORATION_METHODS]  # the registered methods' names (g2rl_jax/methods/)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    exploration: Exploration = _f("g2rl", "exploration method (g2rl_jax/methods/, one file each): g2rl = the "
                                  "paper; grpo, entropy_bonus, evol = its baselines; the others are off by "
                                  "default (docs/peers.md)")
    lam: float = _f(0.5, "g2rl: novelty strength λ >= 0 in r·(1 + λ·ν̄); paper gives no value, 0.5 chosen")
    reward_clip: float = _f(3.0, "g2rl: shaped rewards are clipped to [-c, c]")
    shaping_mode: Literal["text", "literal"] = _f("text", "g2rl: text = r·(1+λν̄) as the paper's prose; "
                                                  "literal = r + λν̄ as its equation (see docs/paper.md)")
    novelty_placement: Literal["reward", "advantage"] = _f(
        "reward", "g2rl: where novelty enters; reward = the paper's r̃ before the group standardisation, advantage = "
        "GRPO's standardised r plus r̃ − r after it (ExTra's placement, a study variant; docs/peers.md)")
    entropy_coef: float = _f(0.0, "entropy_bonus: coefficient of the entropy bonus (> 0 there, 0 otherwise)")
    embedding_model: Optional[str] = _f(None, "evol: a Qwen3-architecture embedding model (a local HF dir, "
                                           "gs://..., or a Hugging Face id)")
    embedding_max_tokens: int = _f(1024, "evol: tokens embedded per response, end token included; a longer response "
                                   "keeps its tail (EVOL-RL's code embeds whole responses, up to 16,384 tokens)")
    filter_equal_groups: bool = _f(False, "drop groups whose BASE correctness is all equal (all right or all "
                                   "wrong), keyed on correctness, not on the shaped reward; off by default")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling (needs filter_equal_groups): draw more prompts until "
                                "the step holds data.prompts_per_step mixed groups, at most max_sampling_rounds")
    max_sampling_rounds: int = _f(4, "dynamic_sampling: rollout rounds per step at most; short of mixed groups, the "
                                  "step is topped up with single-class groups, which the filter masks; 4 chosen")
    clip_cov_ratio: float = _f(2e-4, "clip_cov: share r of a mini-batch's response tokens detached (paper: 2e-4)")
    clip_cov_low: float = _f(1.0, "clip_cov: ω_low, the detached tokens' covariance exceeds it (paper: 1)")
    clip_cov_high: float = _f(5.0, "clip_cov: ω_high, the detached tokens' covariance stays below it (paper: 5)")
    kl_cov_ratio: float = _f(2e-3, "kl_cov: share k of a mini-batch's response tokens penalised (paper: 2e-3 for "
                             "its 7B model, 2e-4 for 32B)")
    kl_cov_coef: float = _f(1.0, "kl_cov: β of the |log ρ| penalty on the chosen tokens (paper: 1)")
    passk_k: int = _f(4, "passk: k of the pass@k objective, <= rollout.num_samples; paper varies k, 4 chosen")
    unlikeliness_penalty: float = _f(0.25, "unlikeliness: β_rank, a correct response's reward falls by "
                                     "β_rank·rank/G on the paper's 0/1 scale (paper: 0.25)")
    positive_weight: float = _f(0.1, "w_reinforce: λ, the weight of the positive responses' REINFORCE term "
                                "(paper: 0.1)")
    forking_ratio: float = _f(0.2, "forking: share of a mini-batch's response tokens, by entropy, that keep their "
                              "policy gradient (paper: 0.2)")
    miner_gamma: float = _f(2.0, "miner: γ of the focal token credit (1 − p)^γ on all-correct groups (the authors' "
                            "code: 2)")
    miner_calibration: Optional[float] = _f(0.0015, "miner: κ, the intrinsic advantages' total is at most κ times the "
                                            "verifiable ones' in each step (the authors' README: 0.0015; null = off)")
    single_class_groups: Literal["shaped", "zero"] = _f(
        "shaped", "groups whose base rewards are all equal: shaped = the paper's equations (G2RL/EVOL give them "
        "unit-scale advantages from novelty alone), zero = zero advantage as in GRPO (see docs/paper.md)")
    kl_coef: float = _f(0.001, "β of the KL-to-reference loss (paper: 0.001; 0 = no reference model)")
    kl_kind: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator; paper silent ('KL loss 0.001'), k3 = verl's "
                                            "low_var_kl chosen")
    clip_low: float = _f(0.2, "PPO ratio clip below 1 - clip_low; paper silent, 0.2 chosen (verl default)")
    clip_high: float = _f(0.2, "PPO ratio clip above 1 + clip_high (DAPO-style separate bound); 0.2 chosen")
    dual_clip: Optional[float] = _f(None, "dual-clip bound c > 1 for negative advantages (null = off)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = _f(
        "token-mean", "how per-token losses are averaged (verl's names); the paper's eq. grpo-obj averages per "
        "response (seq-mean-token-mean with ratio_level=sequence); token-mean chosen (verl default)")
    ratio_level: Literal["token", "sequence"] = _f(
        "token", "importance ratio: token (per token, verl default) or sequence (GSPO: exp of the mean token "
        "log-ratio of each response, clipped per response; the length-normalised form of the paper's ρ)")
    rollout_is_cap: Optional[float] = _f(None, "truncated importance sampling against the sampler: weight each "
                                         "token's loss by min(π_old/π_sampler, cap), cap >= 1 (null = off)")
    ppo_epochs: int = _f(1, "passes over each step's rollouts; paper silent, 1 chosen (verl default)")
    mini_batch_size: int = _f(32, "responses per optimizer update; paper '1 (effective size of 32)', read as 32 "
                              "(16 = the other reading, 1 prompt x 16 rollouts, 16 updates per step; "
                              "see docs/paper.md)")
    micro_batch_size: int = _f(16, "responses per forward/backward, global over devices (paper: "
                               "'micro-batch size 2', read as 2 per GPU x 8 GPUs)")
    packing: Optional[bool] = _f(None, "true: pack whole (prompt + response) sequences into rows (largest prompt "
                                 "bucket + response budget wide, and narrower widths for a pass's last tokens) for "
                                 "the score, reference and gradient passes, one program per packed (rows, width); "
                                 "false: length-grouped micro-batches, one program per (rows, width) shape and prompt "
                                 "bucket; null: whichever the run's estimated time (compile + compute, from the "
                                 "config's numbers) favours, g2rl_jax/shapes/choice.py (docs/performance.md)")

    def __post_init__(self):
        _check(self.lam >= 0, "algorithm.lam", f"must be >= 0, got {self.lam}")
        _check(self.reward_clip > 0, "algorithm.reward_clip", f"must be > 0, got {self.reward_clip}")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.clip_low > 0 and self.clip_low < 1, "algorithm.clip_low",
               f"must satisfy 0 < clip_low < 1, got {self.clip_low}")
        _check(self.clip_high > 0, "algorithm.clip_high", f"must be > 0, got {self.clip_high}")
        _check(self.dual_clip is None or self.dual_clip > 1, "algorithm.dual_clip",
               f"must be > 1 or null, got {self.dual_clip}")
        _check(self.rollout_is_cap is None or self.rollout_is_cap >= 1, "algorithm.rollout_is_cap",
               f"must be >= 1 or null (a cap below 1 would down-weight tokens the sampler and trainer agree on), "
               f"got {self.rollout_is_cap}")
        _check(not self.dynamic_sampling or self.filter_equal_groups, "algorithm.dynamic_sampling",
               "needs algorithm.filter_equal_groups=true (it draws more prompts to replace the groups that filter "
               "drops); set both")
        _check(self.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds",
               f"must be >= 1, got {self.max_sampling_rounds}")
        _check(self.embedding_max_tokens >= 2, "algorithm.embedding_max_tokens",
               f"must be >= 2 (some text and the end token pooled on), got {self.embedding_max_tokens}")
        for name in ("ppo_epochs", "mini_batch_size", "micro_batch_size"):
            _check(getattr(self, name) > 0, f"algorithm.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.mini_batch_size % self.micro_batch_size == 0, "algorithm.micro_batch_size",
               f"must divide algorithm.mini_batch_size={self.mini_batch_size}, got {self.micro_batch_size}")
        self._check_method_keys()
        for name in ("clip_cov_ratio", "kl_cov_ratio", "forking_ratio"):
            value = getattr(self, name)
            _check(0 < value <= 1, f"algorithm.{name}", f"must be a share of tokens in (0, 1], got {value}")
        _check(self.clip_cov_low < self.clip_cov_high, "algorithm.clip_cov_high",
               f"must exceed algorithm.clip_cov_low={self.clip_cov_low}, got {self.clip_cov_high}")
        _check(self.kl_cov_coef >= 0, "algorithm.kl_cov_coef", f"must be >= 0, got {self.kl_cov_coef}")
        _check(self.passk_k >= 1, "algorithm.passk_k", f"must be >= 1, got {self.passk_k}")
        _check(0 <= self.unlikeliness_penalty <= 1, "algorithm.unlikeliness_penalty",
               f"must be in [0, 1] (a reward factor 1 - β·rank/G stays >= 0), got {self.unlikeliness_penalty}")
        _check(self.positive_weight >= 0, "algorithm.positive_weight", f"must be >= 0, got {self.positive_weight}")
        _check(self.miner_gamma >= 0, "algorithm.miner_gamma", f"must be >= 0, got {self.miner_gamma}")
        _check(self.miner_calibration is None or self.miner_calibration > 0, "algorithm.miner_calibration",
               f"must be > 0 or null (no calibration), got {self.miner_calibration}")

    def _check_method_keys(self) -> None:
        """A key only the methods with some need read (methods.NEED_KEYS) keeps its off value under any other
        method; the methods that read it say in their own `check` what they need of it."""
        method = methods.get(self.exploration)
        for need, (name, off) in methods.NEED_KEYS.items():
            value = dataclasses.asdict(self)[name]
            readers = [n for n in EXPLORATION_METHODS if need in methods.get(n).needs]
            _check(need in method.needs or value == off, f"algorithm.{name}",
                   f"is read only by exploration={' or '.join(readers)}, so it must be "
                   f"{'null' if off is None else off} with exploration={self.exploration} (got {value!r}); set "
                   f"algorithm.exploration={readers[0]} to use it")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    learning_rate: float = _f(5e-7, "peak AdamW learning rate (paper: 5e-7)")
    warmup_steps: int = _f(0, "linear warmup updates; paper silent, 0 chosen (verl default)")
    weight_decay: float = _f(0.01, "AdamW decoupled weight decay; paper silent, 0.01 chosen (verl default)")
    b1: float = _f(0.9, "AdamW β1")
    b2: float = _f(0.999, "AdamW β2")
    eps: float = _f(1e-8, "AdamW ε")
    max_grad_norm: float = _f(1.0, "global gradient-norm clip; paper silent, 1.0 chosen (verl default)")
    min_lr_ratio: float = _f(1.0, "cosine decay to this fraction of the peak (1.0 = constant, verl default)")

    def __post_init__(self):
        _check(math.isfinite(self.learning_rate) and self.learning_rate > 0, "optim.learning_rate",
               f"must be a finite number > 0, got {self.learning_rate}")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _check(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(0 <= self.b1 < 1, "optim.b1", f"must satisfy 0 <= b1 < 1, got {self.b1}")
        _check(0 <= self.b2 < 1, "optim.b2", f"must satisfy 0 <= b2 < 1, got {self.b2}")
        _check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        _check(self.max_grad_norm > 0, "optim.max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    coordinator_address: Optional[str] = _f(None, "host:port of process 0 for jax.distributed (null = auto)")
    num_processes: Optional[int] = _f(None, "number of processes (hosts) in the job (null = auto)")
    process_id: Optional[int] = _f(None, "this process's index, 0 <= process_id < num_processes (null = auto)")
    transfer_address: Optional[str] = _f(None, "host:port where this process serves JAX's socket transfers "
                                         "across processes: needed on CPU and GPU with mesh.rollout_processes "
                                         "(null = off; the TPU runtime moves arrays across hosts itself)")
    join_timeout_seconds: int = _f(300, "how long the start waits for every process to join jax.distributed; "
                                        "past it JAX aborts the processes that came (exit 134: relaunch with "
                                        "backoff), e.g. when one was killed before it joined")

    def __post_init__(self):
        _check(self.join_timeout_seconds > 0, "distributed.join_timeout_seconds",
               f"must be > 0, got {self.join_timeout_seconds}")
        _check(self.num_processes is None or self.num_processes > 0, "distributed.num_processes",
               f"must be > 0 or null, got {self.num_processes}")
        if self.process_id is not None:
            bound = self.num_processes if self.num_processes is not None else float("inf")
            _check(0 <= self.process_id < bound, "distributed.process_id",
                   f"must satisfy 0 <= process_id < num_processes={self.num_processes}, got {self.process_id}")
