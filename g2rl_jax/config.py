"""Run configuration: frozen, typed dataclasses loaded from YAML with dotted `key=value` overrides.

One dataclass per group (run, model, mesh, data, rollout, reward, algorithm, optim, distributed); `Config` holds
them all.
A YAML file may name a `base:` file (resolved relative to itself) whose values it overrides. Values from YAML and
from the command line are parsed by the field's declared type, and every mistake (unknown key, bad value, broken
invariant) raises `ConfigError` naming the dotted key, the nearest valid key or the allowed values, and the source.

    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["run.total_steps=10", "algorithm.exploration=grpo"])
    save_resolved(cfg, run_dir)            # run_dir/config.yaml; load_config of it gives back an equal Config
    print(format_help())                   # every key with its default and a one-line description

Defaults follow the paper's appendix table where it gives a value; where the paper is silent the help text says so
and names the choice (mostly verl's defaults, the framework the paper's GRPO setup comes from).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

RESOLVED_NAME = "config.yaml"
_REQUIRED = dataclasses.MISSING


class ConfigError(ValueError):
    """A configuration mistake; the message names the key, the source and what to do."""


def _f(default: Any, help: str) -> Any:
    """A dataclass field with its one-line help text kept next to it (`_REQUIRED` for no default)."""
    return dataclasses.field(default=default, metadata={"help": help})


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str = _f(_REQUIRED, "run directory: checkpoints/, metrics.jsonl, tensorboard/, config.yaml")
    total_steps: int = _f(500, "RL steps (rollout + update) to train; paper silent, 500 chosen")
    checkpoint_every: int = _f(50, "save a checkpoint every this many steps (and always at the end)")
    keep_checkpoints: int = _f(3, "keep only the newest this many checkpoints")
    eval_every: int = _f(50, "evaluate on data.eval_datasets every this many steps (0 = never)")
    seed: int = _f(0, "seed of the sampling and initialisation RNG")

    def __post_init__(self):
        for name in ("total_steps", "checkpoint_every", "keep_checkpoints"):
            _check(getattr(self, name) > 0, f"run.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.eval_every >= 0, "run.eval_every", f"must be >= 0 (0 = never), got {self.eval_every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = _f(_REQUIRED, "local Hugging Face directory of the policy (config.json, *.safetensors, tokenizer)")
    param_dtype: Literal["float32", "bfloat16"] = _f("float32", "dtype of the trained parameters")
    compute_dtype: Literal["float32", "bfloat16"] = _f("bfloat16", "dtype of activations and matmuls")
    remat: Literal["none", "full"] = _f("full", "rematerialise each decoder layer in the backward pass")
    attention: Literal["auto", "xla", "cudnn", "splash"] = _f(
        "auto", "attention kernel: auto (splash on TPU, cudnn on GPU, xla on CPU), xla, cudnn (GPU), splash (TPU)")
    kv_cache_dtype: Literal["float32", "bfloat16"] = _f("bfloat16", "dtype of the rollout KV cache")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    data: int = _f(1, "data-parallel mesh axis size (-1 = all remaining devices)")
    fsdp: int = _f(-1, "fully-sharded data-parallel axis size (-1 = all remaining devices)")
    tensor: int = _f(1, "tensor-parallel axis size (-1 = all remaining devices)")

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            _check(size > 0 or size == -1, f"mesh.{name}", f"must be > 0 or -1 (fill), got {size}")
        fills = [name for name, size in sizes.items() if size == -1]
        _check(len(fills) <= 1, f"mesh.{fills[-1] if fills else 'data'}",
               f"at most one axis may be -1, got -1 for {fills}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_dataset: str = _f("math_train", "registered dataset name or path to a .jsonl file (paper: MATH train)")
    prompt_template: Literal["chat", "plain"] = _f("chat", "prompt format around the question (paper: SimpleRL-Zoo)")
    prompts_per_step: int = _f(16, "prompts per RL step (paper: train batch size 16)")
    max_prompt_tokens: int = _f(1024, "longer prompts are dropped; paper silent, 1024 chosen (verl default)")
    eval_datasets: tuple[str, ...] = _f(("math500", "amc23", "aime24", "aime25"),
                                        "datasets evaluated every run.eval_every steps")
    eval_samples: int = _f(8, "samples per eval prompt (paper's training curves: mean@8)")
    eval_temperature: float = _f(0.8, "sampling temperature for evaluation (paper: 0.8)")
    eval_max_new_tokens: int = _f(8192, "response budget at evaluation (paper: same as training)")
    shuffle_seed: int = _f(0, "seed of the training-set shuffle")

    def __post_init__(self):
        for name in ("prompts_per_step", "max_prompt_tokens", "eval_samples", "eval_max_new_tokens"):
            _check(getattr(self, name) > 0, f"data.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.eval_temperature >= 0, "data.eval_temperature", f"must be >= 0, got {self.eval_temperature}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    num_samples: int = _f(16, "responses sampled per prompt, the group size m (paper: 16 rollouts)")
    max_new_tokens: int = _f(8192, "response budget (paper: 8192 for 1.7B, 12288 for 4B)")
    temperature: float = _f(1.0, "sampling temperature T, also the T of p_t = softmax(z_t/T) (paper: 1.0)")
    top_p: float = _f(1.0, "nucleus sampling mass, 0 < top_p <= 1; paper silent, 1.0 (off) chosen")
    top_k: Optional[int] = _f(None, "keep the top_k most likely tokens (null = off); paper silent, off chosen")

    def __post_init__(self):
        _check(self.num_samples >= 2, "rollout.num_samples", f"group size must be >= 2, got {self.num_samples}")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        _check(self.temperature >= 0, "rollout.temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must satisfy 0 < top_p <= 1, got {self.top_p}")
        _check(self.top_k is None or self.top_k > 0, "rollout.top_k", f"must be > 0 or null, got {self.top_k}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    truncated: Literal["keep", "penalize", "mask"] = _f(
        "penalize", "response at rollout.max_new_tokens without a stop token: keep | penalize (reward -1) | mask "
        "(out of the loss); penalize as scoring it is exploitable (README); the paper's configs: keep")
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    exploration: Literal["grpo", "entropy_bonus", "evol", "g2rl"] = _f("g2rl", "exploration signal added to GRPO")
    lam: float = _f(0.5, "g2rl: novelty strength λ >= 0 in r·(1 + λ·ν̄); paper gives no value, 0.5 chosen")
    reward_clip: float = _f(3.0, "g2rl: shaped rewards are clipped to [-c, c]")
    shaping_mode: Literal["text", "literal"] = _f("text", "g2rl: text = r·(1+λν̄) as the paper's prose; "
                                                  "literal = r + λν̄ as its equation (see README)")
    entropy_coef: float = _f(0.0, "entropy_bonus: coefficient of the entropy bonus (> 0 there, 0 otherwise)")
    embedding_model: Optional[str] = _f(None, "evol: local HF dir of a Qwen3-architecture embedding model")
    filter_equal_groups: bool = _f(False, "drop groups whose BASE correctness is all equal (all right or all "
                                   "wrong), keyed on correctness, not on the shaped reward; off by default")
    kl_coef: float = _f(0.001, "β of the KL-to-reference loss (paper: 0.001; 0 = no reference model)")
    kl_kind: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator (paper: low_var_kl = k3)")
    clip_low: float = _f(0.2, "PPO ratio clip below 1 - clip_low; paper silent, 0.2 chosen (verl default)")
    clip_high: float = _f(0.2, "PPO ratio clip above 1 + clip_high (DAPO-style separate bound); 0.2 chosen")
    dual_clip: Optional[float] = _f(None, "dual-clip bound c > 1 for negative advantages (null = off)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = _f(
        "token-mean", "how per-token losses are averaged (verl's names)")
    ppo_epochs: int = _f(1, "passes over each step's rollouts; paper silent, 1 chosen (verl default)")
    mini_batch_size: int = _f(32, "responses per optimizer update (paper: '1 (effective size of 32)')")
    micro_batch_size: int = _f(16, "responses per forward/backward, global over devices (paper: 2 per GPU)")

    def __post_init__(self):
        _check(self.lam >= 0, "algorithm.lam", f"must be >= 0, got {self.lam}")
        _check(self.reward_clip > 0, "algorithm.reward_clip", f"must be > 0, got {self.reward_clip}")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(self.clip_low > 0 and self.clip_low < 1, "algorithm.clip_low",
               f"must satisfy 0 < clip_low < 1, got {self.clip_low}")
        _check(self.clip_high > 0, "algorithm.clip_high", f"must be > 0, got {self.clip_high}")
        _check(self.dual_clip is None or self.dual_clip > 1, "algorithm.dual_clip",
               f"must be > 1 or null, got {self.dual_clip}")
        for name in ("ppo_epochs", "mini_batch_size", "micro_batch_size"):
            _check(getattr(self, name) > 0, f"algorithm.{name}", f"must be > 0, got {getattr(self, name)}")
        _check(self.mini_batch_size % self.micro_batch_size == 0, "algorithm.micro_batch_size",
               f"must divide algorithm.mini_batch_size={self.mini_batch_size}, got {self.micro_batch_size}")
        bonus = self.exploration == "entropy_bonus"
        _check(self.entropy_coef > 0 if bonus else self.entropy_coef == 0, "algorithm.entropy_coef",
               f"must be > 0 with exploration=entropy_bonus and 0 otherwise (exploration={self.exploration}, "
               f"entropy_coef={self.entropy_coef}); set algorithm.exploration=entropy_bonus for an entropy bonus")
        evol = self.exploration == "evol"
        _check((self.embedding_model is not None) == evol, "algorithm.embedding_model",
               "is required with exploration=evol and must be null otherwise "
               f"(exploration={self.exploration}, embedding_model={self.embedding_model!r})")


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
        _check(self.learning_rate > 0, "optim.learning_rate", f"must be > 0, got {self.learning_rate}")
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

    def __post_init__(self):
        _check(self.num_processes is None or self.num_processes > 0, "distributed.num_processes",
               f"must be > 0 or null, got {self.num_processes}")
        if self.process_id is not None:
            bound = self.num_processes if self.num_processes is not None else float("inf")
            _check(0 <= self.process_id < bound, "distributed.process_id",
                   f"must satisfy 0 <= process_id < num_processes={self.num_processes}, got {self.process_id}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    run: RunConfig
    model: ModelConfig
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        _check(self.reward.overlong_buffer < self.rollout.max_new_tokens, "reward.overlong_buffer",
               f"must be < rollout.max_new_tokens={self.rollout.max_new_tokens}, got {self.reward.overlong_buffer}")
        responses = self.data.prompts_per_step * self.rollout.num_samples
        _check(responses % self.algorithm.mini_batch_size == 0, "algorithm.mini_batch_size",
               f"must divide data.prompts_per_step*rollout.num_samples = {responses}, "
               f"got {self.algorithm.mini_batch_size}")


def _groups() -> dict[str, type]:
    return {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def _field_types(group_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(group_cls)


def all_keys() -> list[str]:
    """Every dotted key `group.field`, in declaration order."""
    return [f"{g}.{f.name}" for g, cls in _groups().items() for f in dataclasses.fields(cls)]


def _nearest(key: str, candidates: list[str]) -> str:
    """The candidate nearest to `key`: one with the same last component if any, else by difflib ratio."""
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [c for c in candidates if c.rsplit(".", 1)[-1] == leaf]
    return (same_leaf or difflib.get_close_matches(key, candidates, n=1, cutoff=0.0) or candidates)[0]


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _parse(value: Any, tp: Any, key: str) -> Any:
    """`value` (from YAML or an override string) as declared type `tp`; ConfigError names `key` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return _parse(value, next(a for a in args if a is not type(None)), key)
    if origin is Literal:
        text = value if isinstance(value, str) else str(value)
        if text not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(str, args))}")
        return text
    if origin is tuple:  # tuple[str, ...]
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise ConfigError(f"{key}: expected a list of strings or 'a,b,c', got {value!r}")
        return tuple(items)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{key}: expected a bool (true/false), got {value!r}")
    if tp in (int, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if tp is int and value != int(value):
                raise ConfigError(f"{key}: expected an int, got {value!r}")
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected {'an int' if tp is int else 'a float'}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r} ({type(value).__name__}); quote it in YAML")
    raise TypeError(f"config field {key} has unsupported type {tp}")


def _read_yaml(path: Path, chain: tuple[Path, ...]) -> dict[str, tuple[Any, str]]:
    """Flatten `path` (after its `base:` chain) to {dotted key: (raw value, source file)}."""
    if path in chain:
        raise ConfigError(f"{path}: 'base' files form a cycle: {' -> '.join(map(str, chain + (path,)))}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" + (f" (named as base in {chain[-1]})" if chain else ""))
    with open(path) as fh:
        doc = yaml.safe_load(fh) or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: top level must be a mapping of groups, got {type(doc).__name__}")
    flat: dict[str, tuple[Any, str]] = {}
    base = doc.pop("base", None)
    if base is not None:
        flat.update(_read_yaml((path.parent / str(base)).resolve(), chain + (path,)))
    groups = _groups()
    for group, body in doc.items():
        if group not in groups:
            near = _nearest(str(group), list(groups) + ["base"])
            raise ConfigError(f"{path}: unknown group '{group}'; did you mean '{near}'?")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: group '{group}' must be a mapping of keys, got {body!r}")
        for name, value in body.items():
            flat[f"{group}.{name}"] = (value, str(path))
    return flat


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"command-line override {text!r}: expected group.key=value, e.g. run.total_steps=10")
    return key.strip(), value


def build_config(flat: dict[str, tuple[Any, str]]) -> Config:
    """A Config from {dotted key: (raw value, source)}; unknown keys and bad values raise ConfigError."""
    keys = all_keys()
    for key, (_, source) in flat.items():
        if key not in keys:
            raise ConfigError(f"{source}: unknown key '{key}'; did you mean '{_nearest(key, keys)}'?")
    groups: dict[str, Any] = {}
    for group, cls in _groups().items():
        kwargs = {}
        for name, tp in _field_types(cls).items():
            key = f"{group}.{name}"
            if key in flat:
                value, source = flat[key]
                try:
                    kwargs[name] = _parse(value, tp, key)
                except ConfigError as err:
                    raise ConfigError(f"{source}: {err}") from None
        missing = [f"{group}.{f.name}" for f in dataclasses.fields(cls)
                   if f.default is _REQUIRED and f.name not in kwargs]
        if missing:
            raise ConfigError(f"{missing[0]} is required and has no default; set it in the YAML file "
                              f"or on the command line as {missing[0]}=VALUE")
        groups[group] = _construct(cls, kwargs, flat)
    return _construct(Config, groups, flat)


def _construct(cls: type, kwargs: dict[str, Any], flat: dict[str, tuple[Any, str]]) -> Any:
    """cls(**kwargs), naming the source of the offending key when a `__post_init__` check fails."""
    try:
        return cls(**kwargs)
    except ConfigError as err:
        key = str(err).split(":", 1)[0]
        group = key.split(".", 1)[0] + "."
        set_in_group = sorted({src for k, (_, src) in flat.items() if k.startswith(group)})
        related = [flat[key][1]] if key in flat else set_in_group
        raise ConfigError(f"{'; '.join(related) or 'default values'}: {err}") from None


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Load a YAML file (following `base:`), apply dotted `key=value` overrides, parse and check everything."""
    flat = _read_yaml(Path(path).resolve(), ())
    for text in overrides:
        key, value = _split_override(text)
        flat[key] = (value, f"command-line override {text!r}")
    return build_config(flat)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict of the config (tuples as lists), as written to YAML."""
    return {g: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(cfg, g)).items()}
            for g in _groups()}


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_resolved(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the fully resolved config to run_dir/config.yaml (atomically) and return its path."""
    target = Path(run_dir) / RESOLVED_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{RESOLVED_NAME}.{os.getpid()}.tmp")
    tmp.write_text("# Resolved g2rl_jax config; rerun with --config pointing here.\n" + to_yaml(cfg))
    os.replace(tmp, target)
    return target


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return f"{_describe(next(a for a in args if a is not type(None)))} or null"
    if origin is tuple:
        return "list of str"
    return tp.__name__


def format_help() -> str:
    """Usage text listing every group and key with its type, default and one-line description."""
    lines = ["usage: python -m g2rl_jax.train --config FILE.yaml [group.key=value ...]", "",
             "A YAML file may name `base: OTHER.yaml` (relative to itself) and override its values.", ""]
    for group, cls in _groups().items():
        lines.append(f"{group}:")
        types_ = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = "(required)" if f.default is _REQUIRED else yaml.safe_dump(
                list(f.default) if isinstance(f.default, tuple) else f.default,
                default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"  {group}.{f.name} [{_describe(types_[f.name])}] = {default}")
            lines.append(f"      {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def parse_cli(argv: list[str]) -> Config | None:
    """`--config FILE [key=value ...]` to a Config; None for -h/--help or no arguments (print format_help())."""
    if not argv or "-h" in argv or "--help" in argv:
        return None
    if argv[0] != "--config" or len(argv) < 2:
        raise ConfigError(f"expected '--config FILE.yaml [group.key=value ...]', got {' '.join(argv)!r}")
    return load_config(argv[1], argv[2:])
