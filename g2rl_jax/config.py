"""Run configuration: frozen, typed dataclasses loaded from YAML with dotted `key=value` overrides.

One dataclass per group (run, model, mesh, data, rollout, reward, algorithm, optim, distributed; defined with
their defaults, help texts and checks in `g2rl_jax.config_groups`, imported from here); `Config` holds them all
and checks what spans groups. A group may hold a subgroup (model.lora), nested in YAML and dotted on the command
line (`model.lora.rank=8`).
A YAML file may name a `base:` file (resolved relative to itself) whose values it overrides. Values from YAML and
from the command line are parsed by the field's declared type, and every mistake (unknown key, bad value, broken
invariant, a YAML syntax error with its file, line and column) raises `ConfigError` naming the dotted key, the nearest
valid key (verl's and TRL's names for a key are known: `g2rl_jax.config_aliases`) or the allowed values, and the
source.

    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["run.total_steps=10", "algorithm.exploration=grpo"])
    save_resolved(cfg, run_dir)            # run_dir/config.yaml; load_config of it gives back an equal Config
    print(format_help())                   # every key with its default and a one-line description
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import textwrap
import types
import typing
from typing import Any, Literal

import yaml

from g2rl_jax import methods, storage
from g2rl_jax.config_aliases import suggestion
from g2rl_jax.config_groups import (
    _REQUIRED,
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    _check,
)

__all__ = ["AlgorithmConfig", "Config", "ConfigError", "DataConfig", "DistributedConfig", "LoraConfig", "MeshConfig",
           "ModelConfig", "OptimConfig", "RESOLVED_NAME", "RewardConfig", "RolloutConfig", "RunConfig", "all_keys",
           "build_config", "format_help", "load_config", "parse_cli", "save_resolved", "to_dict", "to_yaml"]

RESOLVED_NAME = "config.yaml"


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
        _check(self.rollout.max_staleness == 0 or self.mesh.rollout_devices + self.mesh.rollout_processes > 0,
               "rollout.max_staleness", f"={self.rollout.max_staleness} runs the rollout beside the update, on "
               "devices of its own: set mesh.rollout_devices or mesh.rollout_processes too (or max_staleness=0)")
        _check(self.rollout.max_staleness == 0 or self.algorithm.rollout_is_cap is not None, "rollout.max_staleness",
               f"={self.rollout.max_staleness} trains on samples of an older policy: set algorithm.rollout_is_cap "
               "(e.g. 2.0), the truncated importance weight that corrects for it")
        method = methods.get(self.algorithm.exploration)
        problem = method.check(self) if method.check is not None else None  # (key, what is wrong) or None
        _check(problem is None, *(problem or ("", "")))


def _groups() -> dict[str, type]:
    return {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def _field_types(group_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(group_cls)


def _subgroup(tp: Any) -> bool:
    """A field whose type is itself a group of keys (model.lora)."""
    return dataclasses.is_dataclass(tp)


def _leaves(prefix: str, cls: type):
    """(dotted key, field, declared type) of every value key of group `cls` under `prefix`, subgroups flattened."""
    types_ = _field_types(cls)
    for f in dataclasses.fields(cls):
        if _subgroup(types_[f.name]):
            yield from _leaves(f"{prefix}.{f.name}", types_[f.name])
        else:
            yield f"{prefix}.{f.name}", f, types_[f.name]


def all_keys() -> list[str]:
    """Every dotted key `group.field` (`group.sub.field` in a subgroup), in declaration order."""
    return [key for g, cls in _groups().items() for key, _, _ in _leaves(g, cls)]


def _nearest(key: str, candidates: list[str]) -> str:
    """The candidate nearest to `key`: one with the same last component if any, else by difflib ratio."""
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [c for c in candidates if c.rsplit(".", 1)[-1] == leaf]
    return (same_leaf or difflib.get_close_matches(key, candidates, n=1, cutoff=0.0) or candidates)[0]


def _did_you_mean(key: str, candidates: list[str]) -> str:
    """"did you mean 'K'?": verl's or TRL's name for a key first (config_aliases), else the nearest candidate."""
    return suggestion(key) or f"did you mean '{_nearest(key, candidates)}'?"


def _yaml_error(path, err: yaml.YAMLError) -> ConfigError:
    """A YAML syntax error as one line: file:line:column, what the parser expected."""
    mark = getattr(err, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    what = " ".join(str(getattr(err, "problem", None) or err).split())
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and (mark is None or (start.line, start.column) != (mark.line, mark.column)):
        what += f" ({context} started at line {start.line + 1}, column {start.column + 1})"
    return ConfigError(f"{where}: YAML syntax error: {what}")


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


def _read_yaml(path, chain: tuple = ()) -> dict[str, tuple[Any, str]]:
    """Flatten `path` (a local path or a URL, after its `base:` chain) to {dotted key: (raw value, source file)}."""
    if path in chain:
        raise ConfigError(f"{path}: 'base' files form a cycle: {' -> '.join(map(str, chain + (path,)))}")
    if not storage.is_file(path):
        raise ConfigError(f"config file {path} does not exist" + (f" (named as base in {chain[-1]})" if chain else ""))
    try:
        doc = yaml.safe_load(storage.read_text(path)) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save the file as UTF-8") \
            from None
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: top level must be a mapping of groups, got {type(doc).__name__}")
    flat: dict[str, tuple[Any, str]] = {}
    base = doc.pop("base", None)
    if base is not None:
        flat.update(_read_yaml(_resolved(path.parent / str(base)), chain + (path,)))
    groups = _groups()
    for group, body in doc.items():
        if group not in groups:
            raise ConfigError(f"{path}: unknown group '{group}'; {_group_hint(str(group), body, list(groups))}")
        _flatten_body(group, groups[group], body, str(path), flat)
    return flat


def _group_hint(group: str, body: Any, groups: list[str]) -> str:
    """For an unknown top-level YAML name: verl's or TRL's name for a key (`lr: ...`, or a nested `actor: {optim:
    {lr: ...}}`) if one is found under it, else the nearest group."""
    stack = [(group, body)]
    while stack:
        key, value = stack.pop(0)
        if suggestion(key):
            return suggestion(key) if key == group else f"'{key}': {suggestion(key)}"
        if isinstance(value, dict):
            stack += [(f"{key}.{name}", inner) for name, inner in value.items()]
    return f"did you mean '{_nearest(group, groups + ['base'])}'?"


def _flatten_body(prefix: str, cls: type, body: Any, source: str, flat: dict[str, tuple[Any, str]]) -> None:
    """The keys of a YAML group body (a mapping; subgroups nested) into `flat` as dotted keys."""
    if not isinstance(body, dict):
        raise ConfigError(f"{source}: group '{prefix}' must be a mapping of keys, got {body!r}")
    types_ = _field_types(cls)
    for name, value in body.items():
        if name in types_ and _subgroup(types_[name]):
            _flatten_body(f"{prefix}.{name}", types_[name], value, source, flat)
        else:
            flat[f"{prefix}.{name}"] = (value, source)


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
            raise ConfigError(f"{source}: unknown key '{key}'; {_did_you_mean(key, keys)}")
    groups = {group: _build_group(group, cls, flat) for group, cls in _groups().items()}
    return _construct(Config, groups, flat)


def _build_group(prefix: str, cls: type, flat: dict[str, tuple[Any, str]]) -> Any:
    """Group `cls` (its subgroups first) from the dotted keys under `prefix`."""
    kwargs = {}
    for name, tp in _field_types(cls).items():
        key = f"{prefix}.{name}"
        if _subgroup(tp):
            kwargs[name] = _build_group(key, tp, flat)
        elif key in flat:
            value, source = flat[key]
            try:
                kwargs[name] = _parse(value, tp, key)
            except ConfigError as err:
                raise ConfigError(f"{source}: {err}") from None
    missing = [f"{prefix}.{f.name}" for f in dataclasses.fields(cls)
               if f.default is _REQUIRED and f.name not in kwargs]
    if missing:
        raise ConfigError(f"{missing[0]} is required and has no default; set it in the YAML file "
                          f"or on the command line as {missing[0]}=VALUE")
    return _construct(cls, kwargs, flat)


def _construct(cls: type, kwargs: dict[str, Any], flat: dict[str, tuple[Any, str]]) -> Any:
    """cls(**kwargs), naming the source of the offending key when a `__post_init__` check fails."""
    try:
        return cls(**kwargs)
    except ConfigError as err:
        key = str(err).split(":", 1)[0]
        group = key.rsplit(".", 1)[0] + "."
        set_in_group = sorted({src for k, (_, src) in flat.items() if k.startswith(group)})
        related = [flat[key][1]] if key in flat else set_in_group
        raise ConfigError(f"{'; '.join(related) or 'default values'}: {err}") from None


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Load a YAML file (following `base:`), apply dotted `key=value` overrides, parse and check everything."""
    flat = _read_yaml(_resolved(path), ())
    for text in overrides:
        key, value = _split_override(text)
        flat[key] = (value, f"command-line override {text!r}")
    return build_config(flat)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict of the config (tuples as lists, subgroups as nested dicts), as written to YAML."""
    return {g: _plain(dataclasses.asdict(getattr(cfg, g))) for g in _groups()}


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def _resolved(path):
    """A config file's path: a local one made absolute (symlinks resolved), a URL as it is."""
    where = storage.path(path, "--config")
    return where if storage.is_url(where) else where.resolve()


def save_resolved(cfg: Config, run_dir: str | os.PathLike):
    """Write the fully resolved config to run_dir/config.yaml (whole or not at all) and return its path."""
    target = storage.path(run_dir) / RESOLVED_NAME
    storage.write_text(target, "# Resolved g2rl_jax config; rerun with --config pointing here.\n" + to_yaml(cfg))
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
    """Usage text listing every group and key with its type, default and description (wrapped at 118 columns)."""
    lines = ["usage: python -m g2rl_jax.train --config FILE.yaml [group.key=value ...]", "",
             "A YAML file may name `base: OTHER.yaml` (relative to itself) and override its values.", ""]
    for group, cls in _groups().items():
        lines.append(f"{group}:")
        for key, f, tp in _leaves(group, cls):
            default = "(required)" if f.default is _REQUIRED else yaml.safe_dump(
                list(f.default) if isinstance(f.default, tuple) else f.default,
                default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"  {key} [{_describe(tp)}] = {default}")
            lines.extend(textwrap.wrap(f.metadata["help"], width=118, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6, break_on_hyphens=False))
        lines.append("")
    return "\n".join(lines)


def parse_cli(argv: list[str]) -> Config | None:
    """`--config FILE [key=value ...]` to a Config; None for -h/--help or no arguments (print format_help())."""
    if not argv or "-h" in argv or "--help" in argv:
        return None
    if argv[0] != "--config" or len(argv) < 2:
        raise ConfigError(f"expected '--config FILE.yaml [group.key=value ...]', got {' '.join(argv)!r}")
    return load_config(argv[1], argv[2:])
