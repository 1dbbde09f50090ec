"""The bill's moves of the score passes' results (aot/bill.micro_counts) against what jax compiles: put_micro of a
per-token part compiles once per (rows, width), of a per-row part once per row count, so a shape set with several
widths for one row count compiles fewer result moves than one per shape and part (the demo-size long-tailed run's
`2/octave x single` set: 9 shapes on 4 row counts, 13 moves). The trainer-level count of the same rule on a real
run: `python -m g2rl_jax.bench programs` (docs/performance.md)."""
import jax.numpy as jnp
import numpy as np

from g2rl_jax.aot.bill import micro_counts
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train.compiles import CompileClock

B, T, D = 8, 8, 3


def test_result_moves_compile_per_shape_and_per_row_count():
    shapes = micro_lib.ShapeSet(widths=((4, (2, 4, 8)), (2, (6, 8))), name="two widths per row count")
    clock = CompileClock()
    for rows, width in shapes.shapes:  # the score pass's per-token and per-row parts into their [B, ...] arrays
        rows_X = np.arange(rows, dtype=np.int32)
        micro_lib.put_micro(jnp.zeros((B, T)), rows_X, jnp.ones((rows, width))).block_until_ready()
        micro_lib.put_micro(jnp.zeros((B, D)), rows_X, jnp.ones((rows, D))).block_until_ready()  # e.g. Φ
    compiled = [n for n in clock.take().names if n.startswith("put_micro")]
    clock.close()
    takes = 2 * len(shapes.shapes)  # the rows in: take_micro from the step's batch and from a mini-batch
    assert micro_counts(shapes, kl=False)["regroup"] - takes == len(compiled) == 5 + 2, compiled
