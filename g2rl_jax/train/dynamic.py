"""DAPO dynamic sampling (algorithm.dynamic_sampling): draw more prompts until a step holds enough groups with
signal, i.e. groups whose base correctness is mixed (the groups algorithm.filter_equal_groups keeps).

A step runs rollout rounds of data.prompts_per_step prompts each. After every round the decision to stop is
taken on the GLOBAL correctness (gathered from all processes), so every process runs the same number of rounds:
stop once every process block holds its share (P/n of the P = data.prompts_per_step groups) of mixed groups, or
after algorithm.max_sampling_rounds rounds. Each block then keeps, in order of (round, group), its first P/n
mixed groups, topped up with its earliest single-class groups when short (the filter masks those, so they move
nothing); each process assembles its own rows from its own rounds, so no response crosses hosts. With one process
this is DAPO's rule: the first P mixed groups in sampling order. Rounds draw from the checkpointed data iterator
and round r > 0 samples with its own seed, so a resumed run draws exactly what an uninterrupted one would.

    picks, done = choose_groups(mixed_per_round, blocks=n, block=i)   # (round, local group) pairs, or None
    rollout = merge_rollouts(rollouts, picks)                         # one Rollout over the picked groups
"""
from __future__ import annotations

import numpy as np

from g2rl_jax.rollout import Rollout


def mixed_groups(correct_B, group_size: int) -> np.ndarray:
    """[P] bool: groups whose base correctness is mixed (some right, some wrong), the groups with signal."""
    c_Pxm = np.asarray(correct_B, bool).reshape(-1, group_size)
    return c_Pxm.any(axis=1) & ~c_Pxm.all(axis=1)


def enough(mixed_per_round: list[np.ndarray], blocks: int) -> bool:
    """Whether every one of the `blocks` process blocks holds its share of mixed groups over the rounds so far;
    mixed_per_round[r] is round r's GLOBAL [P] mask (the same on every process)."""
    per_block = sum(m.reshape(blocks, -1).sum(axis=1) for m in mixed_per_round)
    return bool(np.all(per_block >= mixed_per_round[0].size // blocks))


def choose_groups(mixed_per_round: list[np.ndarray], blocks: int, block: int) -> list[tuple[int, int]]:
    """This block's groups for the step, as (round, group index within the block's rows of that round): its
    first P/n mixed groups in (round, group) order, then its earliest single-class groups if it is short."""
    share = mixed_per_round[0].size // blocks
    local = [m.reshape(blocks, -1)[block] for m in mixed_per_round]
    order = [(r, g) for r, mask in enumerate(local) for g in range(mask.size)]
    mixed = [(r, g) for r, g in order if local[r][g]]
    single = [(r, g) for r, g in order if not local[r][g]]
    return (mixed + single)[:share]


def _pad_to(x_BxW: np.ndarray, width: int, left: bool) -> np.ndarray:
    pad = width - x_BxW.shape[1]
    return np.pad(x_BxW, [(0, 0), (pad, 0) if left else (0, pad)])


def merge_rollouts(rollouts: list[Rollout], picks: list[tuple[int, int]]) -> Rollout:
    """One Rollout holding the groups `picks` = [(round, group)] of this process's per-round rollouts, in that
    order; prompts are re-left-padded and completions re-right-padded to the widest round (widths are global,
    so every process gets the same shapes)."""
    m = rollouts[0].num_samples
    rows = [(r, g * m + j) for r, g in picks for j in range(m)]
    s = max(x.prompt_ids_BxS.shape[1] for x in rollouts)
    t = max(x.completion_ids_BxT.shape[1] for x in rollouts)

    def stack(name: str, width: int, left: bool) -> np.ndarray:
        return np.stack([_pad_to(getattr(rollouts[r], name)[b][None], width, left)[0] for r, b in rows])

    return Rollout(
        completion_ids=[rollouts[r].completion_ids[b] for r, b in rows],
        logprobs=[rollouts[r].logprobs[b] for r, b in rows],
        finish_reasons=[rollouts[r].finish_reasons[b] for r, b in rows],
        num_samples=m,
        prompt_ids_BxS=stack("prompt_ids_BxS", s, True), prompt_mask_BxS=stack("prompt_mask_BxS", s, True),
        completion_ids_BxT=stack("completion_ids_BxT", t, False),
        completion_mask_BxT=stack("completion_mask_BxT", t, False), logprobs_BxT=stack("logprobs_BxT", t, False),
        completion_lengths=np.array([rollouts[r].completion_lengths[b] for r, b in rows], np.int32),
        decode_steps=max(x.decode_steps for x in rollouts))
