"""Names that packages outside the training path provide: datasets and model-path schemes, each registered by the
module that provides it and imported by name only when a config names one.

    registry.resolve_model_paths("demo:runs/demo/model", None)   # (built model dir, embedder) by the scheme's owner
    registry.architecture("demo:runs/demo/model")                # its Qwen3Config without building it, or None
    registry.DATASETS["demo"]                                    # the module that registers dataset "demo"

The trainer, the rollout, the model, the rewards and the data code import neither the demos nor the benchmarks
(tests/test_imports.py walks their imports): a config that names `demo:DIR`, `countdown:DIR`, ... as model.path, or
`demo`, `countdown`, ... as a dataset, reaches the demo through this table, whose module registers the scheme
(`register_model_scheme`) or the datasets (data.register_dataset) when it is imported.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

# dataset name -> the module whose import registers it (data.register_dataset)
DATASETS = {name: "g2rl_jax.demo.task" for name in ("demo", "demo_test", "countdown", "countdown_test",
                                                    "countdown_study", "countdown_study_test", "sumprod",
                                                    "sumprod_test")}
# model.path prefix -> the module whose import registers it (register_model_scheme)
MODEL_SCHEMES = {prefix: "g2rl_jax.demo.build" for prefix in ("demo:", "countdown:", "countdown-study:", "sumprod:")}


@dataclasses.dataclass(frozen=True)
class ModelScheme:
    """A model.path prefix and what its provider does with it. resolve(model_path, embedding_model): both config
    values with the scheme's directories built (or reused), any other value unchanged; ValueError names the key.
    architecture(): its Qwen3Config without building it (None: none known before the build)."""

    prefix: str
    resolve: Callable[[str, str | None], tuple[str, str | None]]
    architecture: Callable[[], Any] | None = None


_SCHEMES: dict[str, ModelScheme] = {}


def register_model_scheme(scheme: ModelScheme) -> None:
    """Make model.path (and algorithm.embedding_model) values starting with scheme.prefix the provider's."""
    _SCHEMES[scheme.prefix] = scheme


def model_scheme(value: str | None) -> ModelScheme | None:
    """The scheme a config value names (its provider imported on first use), or None for any other value."""
    if not value:
        return None
    prefix = next((p for p in {**MODEL_SCHEMES, **_SCHEMES} if value.startswith(p)), None)
    if prefix is None:
        return None
    if prefix not in _SCHEMES:
        importlib.import_module(MODEL_SCHEMES[prefix])  # registers it
    return _SCHEMES[prefix]


def resolve_model_paths(model_path: str, embedding_model: str | None) -> tuple[str, str | None]:
    """model.path and algorithm.embedding_model with a scheme's directories built (or reused) by its provider;
    values no scheme names come back unchanged."""
    scheme = model_scheme(model_path) or model_scheme(embedding_model)
    return (model_path, embedding_model) if scheme is None else scheme.resolve(model_path, embedding_model)


def architecture(model_path: str):
    """The Qwen3Config a scheme's model.path will have, without building it; None when no scheme names it or its
    provider cannot say before the build."""
    scheme = model_scheme(model_path)
    return None if scheme is None or scheme.architecture is None else scheme.architecture()
