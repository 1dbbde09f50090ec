"""grain pipeline of prompt batches whose position is checkpointed with the training state.

`make_prompt_loader(examples, batch_size=..., seed=...)` gives an endless (or `num_epochs`-long) iterator of
`list[Example]` batches: the examples reshuffled every epoch with a seed derived from `seed` and the epoch,
cut into GLOBAL batches of `batch_size` that run across epoch boundaries, of which this process keeps its own
contiguous slice (rows [i*local, (i+1)*local) of each global batch for shard i of n, local = batch_size / n).
Every process walks the same global order, so the global batch of a step does not depend on the process count.

Its position is `it.get_state()` (a small JSON-able dict) and `it.set_state(state)`; the training checkpointer
(g2rl_jax.train.checkpoint.Checkpointer) saves it through Orbax next to the train state, one JSON file per
process. A freshly made iterator over the same examples, seed and shard, given a saved state, yields the batches
the saved iterator would have yielded next.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import jax

from g2rl_jax.data.datasets import Example


def make_prompt_loader(
    examples: Sequence[Example],
    *,
    batch_size: int,
    seed: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = None,
) -> grain.DatasetIterator:
    """Iterator of this shard's `batch_size // shard_count`-long slices (lists of Examples) of global batches.

    `batch_size` is the global batch (prompts per step over all processes); shard `shard_index` of
    `shard_count` (default: this JAX process of all of them) keeps the shard_index-th contiguous slice of each.
    An incomplete last global batch is dropped, so with num_epochs=None the iterator never ends.
    """
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count={shard_count}), got {shard_index}")
    if batch_size < 1 or batch_size % shard_count:
        raise ValueError(f"batch_size (the global batch) must be a positive multiple of shard_count={shard_count}, "
                         f"got {batch_size}; make data.prompts_per_step a multiple of the process count")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if len(examples) < batch_size:
        raise ValueError(f"{len(examples)} examples, fewer than batch_size={batch_size}: lower the batch size or "
                         "use more examples")
    local = batch_size // shard_count
    rows = slice(shard_index * local, (shard_index + 1) * local)
    dataset = grain.MapDataset.source(list(examples)).shuffle(seed=seed).repeat(num_epochs)  # reshuffled per epoch
    read_options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2 * batch_size)
    batches = dataset.to_iter_dataset(read_options).batch(batch_size, drop_remainder=True, batch_fn=list)
    return iter(batches.map(lambda batch: batch[rows]))
