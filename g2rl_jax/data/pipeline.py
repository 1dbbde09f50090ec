"""grain pipeline of prompt batches whose position is checkpointed with the training state.

`make_prompt_loader(examples, batch_size=..., seed=...)` gives an endless (or `num_epochs`-long) iterator of
`list[Example]` batches: this process's shard of the examples, reshuffled every epoch with a seed derived from
`seed` and the epoch, batches running across epoch boundaries. Same seed and shard, same batches.

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
    """Iterator of `batch_size`-long lists of Examples from shard `shard_index` of `shard_count`.

    `batch_size` counts prompts per process per step (the global batch is batch_size * shard_count).
    Shards (default: this JAX process of all of them) are the strided slices examples[shard_index::shard_count],
    disjoint and together covering the examples; each is shuffled on its own, reshuffled every epoch.
    An incomplete last batch is dropped, so with num_epochs=None the iterator never ends.
    """
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count={shard_count}), got {shard_index}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    shard = grain.MapDataset.source(list(examples))[shard_index::shard_count]
    if len(shard) < batch_size:
        raise ValueError(
            f"shard {shard_index}/{shard_count} holds {len(shard)} examples, fewer than batch_size={batch_size}: "
            "lower the batch size or use more examples"
        )
    dataset = shard.shuffle(seed=seed).repeat(num_epochs)  # grain reseeds the shuffle each epoch (seed + epoch)
    read_options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2 * batch_size)
    batches = dataset.to_iter_dataset(read_options).batch(batch_size, drop_remainder=True, batch_fn=list)
    return iter(batches)
