"""grain pipeline of prompt batches, with its iterator state checkpointed through Orbax.

`make_prompt_loader(examples, batch_size=..., seed=...)` gives an endless (or `num_epochs`-long) iterator of
`list[Example]` batches: this process's shard of the examples, reshuffled every epoch with a seed derived from
`seed` and the epoch, batches running across epoch boundaries. Same seed and shard, same batches.

Checkpointing, next to the train state in one Orbax CheckpointManager step:

    manager.save(step, args=ocp.args.Composite(state=..., data=iterator_save_args(it)))
    manager.restore(step, args=ocp.args.Composite(state=..., data=iterator_restore_args(it)))

Restore sets the state of `it` (a freshly made iterator over the same examples, seed and shard) in place, so its
next batches are those the saved iterator would have produced. grain writes one small JSON file per process.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import grain.checkpoint
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


def iterator_save_args(iterator: grain.DatasetIterator) -> grain.checkpoint.CheckpointSave:
    """Orbax save args for the iterator's state (an item of ocp.args.Composite)."""
    return grain.checkpoint.CheckpointSave(iterator)


def iterator_restore_args(iterator: grain.DatasetIterator) -> grain.checkpoint.CheckpointRestore:
    """Orbax restore args that set the saved state into `iterator` (made with the same examples/seed/shard)."""
    return grain.checkpoint.CheckpointRestore(iterator)
