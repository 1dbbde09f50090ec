"""The rewards of one batch of sampled responses under the `reward` config group: the base reward (the verifier's
+-1, or a user function), the truncation policy, and DAPO's soft overlong penalty.

    result = compute_rewards(texts, examples, completion_ids, reward_cfg, max_new_tokens=..., stop_ids=...)
    result.rewards   float32 [B]  base reward after the truncation policy, plus the overlong penalty
    result.correct   bool [B]     base reward > 0 after the truncation policy (accuracy, group filtering)
    result.in_loss   bool [B]     False for responses that leave the loss (reward.truncated=mask)
    result.truncated bool [B]     the response hit max_new_tokens without a stop token

Truncation policies (a truncated response is one of max_new_tokens tokens whose last token is not a stop token):
  keep      score the text as it is (what the paper's verl GRPO setup does);
  penalize  give it the wrong-answer reward (-1) and count it incorrect;
  mask      score it as it is, but drop it from the loss (zero response mask in the update), as TRL's
            `mask_truncated_completions` and DAPO's overlong filtering do. It still counts in the group statistics
            with the reward it scored: in the group mean and std of the advantages and in G2RL's novelty nu (its
            gradient features Phi are in the group's Gram matrix), so its group-mates' advantages are the same as
            under `keep`; only its own gradient is gone.
Overlong penalty (DAPO's "soft overlong punishment", arXiv 2503.14476): with budget L = max_new_tokens, buffer b
and length l, a response gets penalty * min(0, (L - b - l) / b): 0 up to L - b tokens, falling linearly to
-penalty at l = L. It is added after the truncation policy, to every response in the buffer (truncated or not).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from g2rl_jax.rewards.custom import REWARD_MIN, custom_rewards

TRUNCATION_POLICIES = ("keep", "penalize", "mask")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    rewards: np.ndarray
    correct: np.ndarray
    in_loss: np.ndarray
    truncated: np.ndarray


def truncated_mask(completion_ids: Sequence[Sequence[int]], max_new_tokens: int, stop_ids) -> np.ndarray:
    """bool [B]: completion b has max_new_tokens tokens and its last token is not a stop token."""
    stops = set(int(t) for t in stop_ids)
    return np.array([len(ids) >= max_new_tokens and (not len(ids) or int(ids[-1]) not in stops)
                     for ids in completion_ids], dtype=bool)


def overlong_penalty(lengths_B, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """float32 [B]: DAPO's soft overlong punishment, penalty * min(0, (L - buffer - l) / buffer);
    zeros when buffer is 0."""
    lengths_B = np.asarray(lengths_B, np.float64)
    if buffer <= 0:
        return np.zeros(lengths_B.shape, np.float32)
    return (penalty * np.minimum(0.0, (max_new_tokens - buffer - lengths_B) / buffer)).astype(np.float32)


def base_rewards(texts: list[str], rows: list[dict], cfg, kind: str) -> np.ndarray:
    """float32 [B]: the user function's value (reward.function) or the verifier's +-1 against row["answer"]."""
    from g2rl_jax.rewards import score_batch

    if cfg.function:
        return custom_rewards(cfg.function, texts, rows, timeout=cfg.timeout, on_error=cfg.on_error)
    return score_batch(texts, [row["answer"] for row in rows], kind=kind, timeout=cfg.timeout)


def compute_rewards(texts: list[str], rows: list[dict], completion_ids, cfg, *, kind: str, max_new_tokens: int,
                    stop_ids) -> RewardResult:
    """Rewards of one batch under RewardConfig cfg (module docstring); rows[b] is the dataset row of texts[b]."""
    if len(texts) != len(rows) or len(texts) != len(completion_ids):
        raise ValueError(f"compute_rewards: {len(texts)} texts, {len(rows)} rows and {len(completion_ids)} "
                         "completions; pass one row and one completion per text")
    truncated = truncated_mask(completion_ids, max_new_tokens, stop_ids)
    rewards = base_rewards(texts, rows, cfg, kind).astype(np.float32)
    in_loss = np.ones(len(texts), bool)
    if cfg.truncated == "penalize":
        rewards = np.where(truncated, np.float32(REWARD_MIN), rewards)
    elif cfg.truncated == "mask":
        in_loss = ~truncated
    correct = rewards > 0
    lengths = np.array([len(ids) for ids in completion_ids])
    rewards = rewards + overlong_penalty(lengths, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    return RewardResult(rewards=rewards.astype(np.float32), correct=correct, in_loss=in_loss, truncated=truncated)
