"""Length-grouped micro-batches: the score pass, the reference pass and the update pay for response tokens.

A step's rows are padded to the response width T of its longest completion. Processing each micro-batch at that
width would spend most of the work on padding when lengths are long-tailed. Instead (verl's "dynamic batch size"):

    plan = plan_micro(response_mask_BxT, micro)   # host: rows sorted by response length, <= `micro` rows each
    # inside one jitted program per shape (train/step.py's score_micro, train/update.py's accumulate):
    mb   = take_micro(batch, plan.rows[u], plan.widths[u])   # micro-batch u: its rows, responses cut to T_u
    ...  run the model on mb ([X_u, S + T_u]) ...
    out  = put_micro(out, rows, part_XxT_u)        # scatter its per-token results back into [B, T]

Each micro-batch takes one shape (X_u rows, T_u response positions) of a ShapeSet (g2rl_jax/shapes/layouts.py): by
default every row count micro, micro/2, micro/4, ... at every width of one ladder (powers of two up to MIN_WIDTH,
then four steps per octave, capped at T); a run uses a smaller set chosen by its whole run's time
(g2rl_jax/shapes/choice.py). The rows, sorted by length, are cut into runs at the shapes of least total cost
(layouts.group over `micro_cost`: a long-tailed batch's few long rows go in small micro-batches instead of padding
micro-1 shorter rows to the longest), each at the narrowest width of its row count that holds its longest row.
So a run compiles the model passes for the shapes of its set, whatever its length distribution. Only how rows are
cut into micro-batches changes: which rows form a mini-batch is the caller's business. Cutting trailing response
padding changes no real token's result: attention is causal and padding keys are masked, so results at positions
< T_u are those of the full-width row (results at positions a micro-batch does not keep come back as 0).

`response_mask` decides a row's length (its last 1), so rows whose mask the caller zeroed (filtered groups) cost
the minimum width. Shape letters: U micro-batches, X rows in one micro-batch (see the legend in `g2rl_jax`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from g2rl_jax import parallel
from g2rl_jax.shapes.layouts import ShapeSet, group


@dataclasses.dataclass(frozen=True)
class MicroPlan:
    """rows: U int32 arrays [X_u], the row indices of micro-batch u (ascending response length; X_u <= micro);
    widths [U]: response positions T_u it keeps; positions / padding: sequence positions the micro-batches process,
    and how many of them are padding (attention mask 0), counted over [X_u, S + T_u] per micro-batch."""

    rows: tuple[np.ndarray, ...]
    widths: tuple[int, ...]
    positions: int
    padding: int


def response_lengths(response_mask_BxT) -> np.ndarray:
    """Host int array [B]: index of each row's last response token + 1 (0 for an all-zero mask)."""
    mask = np.asarray(response_mask_BxT) != 0
    last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), last, 0)


def plan_micro(response_mask_BxT, micro: int, attention_mask_BxL=None, *, padded: bool = False,
               min_rows: int = 1, shapes: ShapeSet | None = None) -> MicroPlan:
    """Cut B rows into micro-batches of at most `micro` rows with similar response lengths (host numpy in, plan out).

    Rows sorted by response length are cut into consecutive runs of micro, micro/2, ... rows (row_counts) so that
    the total micro_cost is least: a long-tailed batch puts its few long rows in small micro-batches instead of
    padding micro-1 shorter rows to the longest. padded=True keeps `micro` rows per micro-batch at the full width T
    with the rows taken by stride (the layout before length grouping; benchmarks use it as the baseline).
    attention_mask_BxL (host) gives the prompt width S (else 0) and counts the padding positions. `shapes`: the
    shapes micro-batches may take (default ShapeSet.full: every row count at every ladder width); its largest
    width must be the batch's T."""
    mask = np.asarray(response_mask_BxT)
    b, t = mask.shape
    if micro < 1 or b % micro:
        raise ValueError(f"a batch of {b} responses is not a multiple of micro_batch_size={micro}; choose a "
                         "micro_batch_size that divides it")
    lengths_B = response_lengths(mask)
    s = 0 if attention_mask_BxL is None else np.shape(attention_mask_BxL)[1] - t
    if padded:
        rows_by_micro = list(np.arange(b).reshape(micro, b // micro).T)
        widths = (t,) * (b // micro)
    else:
        shapes = shapes or ShapeSet.full(micro, t, min_rows)
        if shapes.resp_len != t:
            raise ValueError(f"the micro-batch shapes go up to {shapes.resp_len} response positions but the batch "
                             f"has {t}")
        rows_by_micro, widths, _ = group(lengths_B, s, shapes)
    positions = padding = 0
    if attention_mask_BxL is not None:
        attn = np.asarray(attention_mask_BxL) != 0
        for rows, width in zip(rows_by_micro, widths):
            positions += len(rows) * (s + width)
            padding += len(rows) * (s + width) - int(attn[rows, :s + width].sum())
    return MicroPlan(tuple(np.asarray(r, np.int32) for r in rows_by_micro), widths, positions, padding)


def plan_for(batch, micro: int, *, padded: bool = False, shapes: ShapeSet | None = None) -> MicroPlan:
    """plan_micro for a (global, possibly multi-host) Batch; every process computes the same plan. Micro-batches
    keep at least as many rows as the batch has row shards."""
    return plan_micro(parallel.gather(batch.response_mask), micro, parallel.gather(batch.attention_mask),
                      padded=padded, min_rows=row_shards(batch.rewards), shapes=shapes)


def row_shards(x) -> int:
    """How many shards x's rows are split into (1 without a NamedSharding)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not len(sharding.spec):
        return 1
    return int(np.prod([sharding.mesh.shape[a] for a in np.atleast_1d(sharding.spec[0] or ())], dtype=int))


def _rows_like(x, like):
    """Constrain x's rows to `like`'s row sharding (rows over the batch mesh axes) when both have one."""
    sharding = getattr(like, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.spec == jax.sharding.PartitionSpec():
        return x
    spec = jax.sharding.PartitionSpec(sharding.spec[0], *([None] * (x.ndim - 1)))
    if x.shape[0] % row_shards(like):
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(sharding.mesh, spec))


def take_micro(tree, rows_X, *, width: int, seq_len: int, resp_len: int):
    """Rows `rows_X` of every array of `tree` (a Batch or MiniBatch), cut to `width` response positions:
    [B, L = S+T] arrays keep [:, :S+width], [B, T] arrays [:, :width], [B] arrays stay whole. Traced inside the
    score, reference and gradient programs (train/step.py, train/update.py): no program of its own."""
    def one(x):
        x_X = _rows_like(jnp.take(x, rows_X, axis=0), x)
        if x.ndim == 2 and x.shape[1] == seq_len:
            return x_X[:, :seq_len - resp_len + width]
        if x.ndim == 2 and x.shape[1] == resp_len:
            return x_X[:, :width]
        return x_X

    return jax.tree.map(one, tree)


def put_micro(full_BxT, rows_X, part_XxW):
    """full_BxT with rows `rows_X` set to part_XxW in their first W positions (the rest of those rows: 0). Traced
    inside the score and reference programs, which take full_BxT donated."""
    w = part_XxW.shape[1]
    padded_XxT = jnp.pad(part_XxW, ((0, 0), (0, full_BxT.shape[1] - w)) + ((0, 0),) * (part_XxW.ndim - 2))
    return full_BxT.at[rows_X].set(padded_XxT.astype(full_BxT.dtype))
