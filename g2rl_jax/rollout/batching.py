"""Host-side batching for `generate`: input validation, shape buckets, and left-padding of prompts.

Shapes are bucketed so that a training run compiles a handful of times: the number of prompts and the prompt length
are rounded up to a power of two (with a floor); max_new_tokens (the KV-cache capacity, fixed for a run) is rounded
to a power of two up to NEW_TOKENS_GRANULE and to a multiple of it above, so a 12,288-token budget reserves 12,288
slots, not 16,384. Extra prompt rows are dummies (one token, id 0) whose samples are decoded and thrown away.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

MIN_PROMPT_BUCKET = 16   # prompt length floor
MIN_NEW_TOKENS_BUCKET = 16  # max_new_tokens floor
NEW_TOKENS_GRANULE = 1024  # above this, max_new_tokens is rounded to a multiple of it instead of a power of two


def bucket(n: int, floor: int) -> int:
    """The smallest power of two >= n, at least `floor`."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def new_tokens_bucket(n: int) -> int:
    """KV-cache slots for a budget of n new tokens: a power of two (floor 16) up to 1,024, then a multiple of 1,024."""
    if n <= NEW_TOKENS_GRANULE:
        return bucket(n, MIN_NEW_TOKENS_BUCKET)
    return -(-n // NEW_TOKENS_GRANULE) * NEW_TOKENS_GRANULE


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded sizes of one `generate` call: prompts P, prompt length S, new-token slots T."""

    num_prompts: int
    prompt_len: int
    new_tokens: int


def validate(prompts, *, max_new_tokens, temperature, top_p, top_k, num_samples, stop_token_ids, seed,
             vocab_size: int, max_positions: int) -> list[list[int]]:
    """Check every argument of `generate`; return the prompts as lists of Python ints.

    Raises ValueError naming the argument (and the prompt index) and what to do instead.
    """
    if not _is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(temperature, numbers.Real) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must satisfy 0 < top_p <= 1 (1 = off), got {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"generate: top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not _is_int(num_samples) or num_samples < 1:
        raise ValueError(f"generate: num_samples must be an int >= 1, got {num_samples!r}")
    if not _is_int(seed):
        raise ValueError(f"generate: seed must be an int, got {seed!r}")
    stops = list(stop_token_ids)
    bad_stops = [s for s in stops if not _is_int(s) or not 0 <= s < vocab_size]
    if bad_stops:
        raise ValueError(f"generate: stop_token_ids {bad_stops} are not token ids in [0, {vocab_size})")
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists")
    out = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise ValueError(f"generate: prompts[{i}] is a {type(prompt).__name__}; give a list of token ids")
        ids = np.asarray(prompt)
        if ids.size == 0:
            raise ValueError(f"generate: prompts[{i}] is empty; every prompt needs at least one token")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"generate: prompts[{i}] holds values that are not token ids in [0, {vocab_size})")
        if len(ids) + max_new_tokens > max_positions:
            raise ValueError(
                f"generate: prompts[{i}] has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens} positions, beyond the model's context of {max_positions} "
                f"(max_position_embeddings); shorten the prompt or lower max_new_tokens")
        out.append(ids.tolist())
    return out


def buckets_for(prompts: list[list[int]], max_new_tokens: int, prompt_multiple: int,
                pad_to: tuple[int, int] = (0, 0)) -> Buckets:
    """Bucketed sizes, at least those of pad_to = (prompts, prompt length); the prompt count is also a multiple of
    `prompt_multiple` (the batch shard count)."""
    num = bucket(max(len(prompts), pad_to[0]), 1)
    num = -(-num // prompt_multiple) * prompt_multiple
    return Buckets(num_prompts=num, prompt_len=bucket(max(*map(len, prompts), pad_to[1]), MIN_PROMPT_BUCKET),
                   new_tokens=new_tokens_bucket(max_new_tokens))


def left_pad(prompts: list[list[int]], num_rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [num_rows, width] int32 and mask bool, prompts right-aligned; dummy rows hold one token (id 0)."""
    ids_PxS = np.zeros((num_rows, width), np.int32)
    mask_PxS = np.zeros((num_rows, width), bool)
    for p, prompt in enumerate(prompts):
        ids_PxS[p, width - len(prompt):] = prompt
        mask_PxS[p, width - len(prompt):] = True
    mask_PxS[len(prompts):, -1] = True
    return ids_PxS, mask_PxS


def stop_array(stop_token_ids) -> np.ndarray:
    """Stop ids padded with -1 to a power-of-two length (a stable shape across calls)."""
    stops = [int(s) for s in stop_token_ids]
    out = np.full(bucket(len(stops), 1), -1, np.int32)
    out[:len(stops)] = stops
    return out
