"""User reward functions: `reward.function: "package.module:function"` or `"path/to/file.py:function"`.

The function is called as `fn(response: str, example: dict) -> float`, where `example` is the dataset row with
all its fields (see `g2rl_jax.data.Example.row`). It runs in the same bounded worker processes as the verifier
(`bounded.py`), with the same per-call time bound, so a function that hangs or eats memory costs at most the bound.
Its value is clipped to [REWARD_MIN, REWARD_MAX] = [-1, 1], the scale of the verifier's +-1 that G2RL's shaping
r(1 + lam*nu) and the correctness flag (reward > 0) assume.

A call that raises, returns a non-number (or NaN), or times out is an error naming the function and the row
(`on_error="raise"`: control/errors.py's RewardFunctionFailed, which stops a run with exit code 5 and that one
line), or scores REWARD_MIN (`on_error="fail"`).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from g2rl_jax.control.errors import RewardFunctionFailed

REWARD_MIN, REWARD_MAX = -1.0, 1.0
_LOADED: dict[str, object] = {}  # spec -> function, in a worker process


def parse_spec(spec: str) -> tuple[str, str]:
    """(module or file, function name) of "pkg.mod:fn" / "path/file.py:fn"; ValueError saying the format."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    return where, name


def is_file_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def resolve_spec(spec: str) -> str:
    """The spec with a file path made absolute (workers may not share the caller's idea of '.'); ValueError if
    the file does not exist."""
    where, name = parse_spec(spec)
    if not is_file_spec(where):
        return spec
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward function {spec!r}: file {path} does not exist")
    return f"{path}:{name}"


def load_function(spec: str):
    """Import the function named by spec (in the calling process); errors name the spec and what failed."""
    if spec in _LOADED:
        return _LOADED[spec]
    where, name = parse_spec(spec)
    try:
        if is_file_spec(where):
            module_name = f"_g2rl_reward_{abs(hash(where))}"
            loader_spec = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as err:  # noqa: BLE001 -- user code: any import failure is reported
        raise ValueError(f"reward function {spec!r}: importing {where} failed: {type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {where} has no callable {name!r}")
    _LOADED[spec] = fn
    return fn


def call_in_worker(op: str, spec: str, response: str | None = None, example: dict | None = None) -> dict:
    """Worker side of the "load" and "fn" requests: {"value": float | None} or {"error": message}."""
    try:
        fn = load_function(spec)
        if op == "load":
            return {"value": None}
        value = fn(response, example)
    except Exception as err:  # noqa: BLE001 -- user code: reported to the trainer, never a worker crash
        return {"error": f"raised {type(err).__name__}: {err}"}
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(float(value)):
        return {"error": f"returned {value!r} ({type(value).__name__}), not a number"}
    return {"value": float(value)}


def check_function(spec: str, timeout: float) -> None:
    """Import the function once in a worker, so a bad spec fails at start-up; ValueError naming the problem."""
    from g2rl_jax.rewards.bounded import get_pool

    reply = get_pool().request(["load", spec], max(timeout, 30.0))
    result = _decode(reply)
    if "error" in result:
        raise ValueError(f"reward function {spec!r} cannot be used: {result['error']}")


def _decode(reply: bytes | None) -> dict:
    import json

    if reply is None:
        return {"error": "timed out (or its worker process died)"}
    try:
        result = json.loads(reply)
    except ValueError:
        return {"error": f"unreadable worker reply {reply[:80]!r}"}
    return result if isinstance(result, dict) else {"error": f"unreadable worker reply {reply[:80]!r}"}


def custom_rewards(spec: str, responses: list[str], examples: list[dict], *, timeout: float, on_error: str,
                   num_workers: int | None = None) -> np.ndarray:
    """float32 [len(responses)]: fn(response, example) clipped to [REWARD_MIN, REWARD_MAX], each call bounded by
    timeout seconds in a worker process; failures raise RewardFunctionFailed or score REWARD_MIN (on_error)."""
    from g2rl_jax.rewards.bounded import get_pool

    if on_error not in ("raise", "fail"):
        raise ValueError(f"on_error must be 'raise' or 'fail', got {on_error!r}")
    if len(responses) != len(examples):
        raise ValueError(f"custom_rewards: {len(responses)} responses but {len(examples)} examples")
    pool = get_pool()
    with ThreadPoolExecutor(max_workers=max(1, min(num_workers or 64, len(responses)))) as ex:
        replies = list(ex.map(lambda k: pool.request(["fn", spec, responses[k], examples[k]], timeout),
                              range(len(responses))))
    out = np.empty(len(responses), np.float32)
    for k, reply in enumerate(replies):
        result = _decode(reply)
        if "error" in result:
            if reply is None:
                result["error"] = f"timed out after {timeout}s (or its worker process died)"
            if on_error == "raise":
                raise RewardFunctionFailed(spec, examples[k].get("id", f"#{k}"), result["error"],
                                           f" (response {k} of the batch, starting {responses[k][:60]!r})")
            out[k] = REWARD_MIN
        else:
            out[k] = min(REWARD_MAX, max(REWARD_MIN, result["value"]))
    return out
