"""The two layouts a pass's micro-batches take, and the ladders their shapes come from.

    ShapeSet   length-grouped micro-batches (train/micro.py): one (rows, response width) shape per micro-batch, the
               widths from one ladder (MIN_WIDTH, 32, 64, then `steps` per octave), the rows micro, micro/2, ...
    PackShape  packed micro-batches (train/packing.py): whole sequences one after the other in rows of the full
               width W (largest prompt bucket + response budget) or of narrower widths for a pass's last tokens
    group      the least-cost cut of a batch's rows (sorted by length) into a ShapeSet's shapes

A pass compiles one program per shape of its layout; which layout and which shapes a run uses is chosen in
g2rl_jax/shapes/choice.py. `micro_cost` is the cost both minimise and the price model prices: (rows + OVERHEAD_ROWS)
x positions of one micro-batch.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools

import numpy as np

from g2rl_jax.model import packed_attention

MIN_WIDTH = 16  # narrowest response width of a micro-batch
OVERHEAD_ROWS = 1  # a micro-batch costs as if it held one row more (2-core CPU, 9.8M model: 0.78 rows under
#                   load, about 1.5 idle; see micro_cost and docs/performance.md)
STEPS_PER_OCTAVE = 4  # widths between 2^j and 2^(j+1): at most 25% of a micro-batch's width is bucket rounding
SLOTS = 16  # K: sequences one packed row holds at most (Φ's per-sequence sums carry a [R, K, V] accumulator)
NARROW_STEPS, NARROW_OCTAVES = 3, 3  # packed rows narrower than W: 3 per octave over the 3 octaves below it


def width_bucket(n: int, steps: int = STEPS_PER_OCTAVE) -> int:
    """The smallest ladder width >= n: MIN_WIDTH, 32, 64, ... up to 64, then `steps` per octave (with 4: 80, 96,
    112, 128, 160, ..., 1024, 1280, ...)."""
    n = int(n)
    if n <= MIN_WIDTH:
        return MIN_WIDTH
    octave = 1 << (n - 1).bit_length()  # 2^j >= n > 2^(j-1)
    if octave <= 4 * MIN_WIDTH or steps == 1:
        return octave
    step = octave // (2 * steps)
    return -(-n // step) * step


@functools.lru_cache(maxsize=None)
def width_ladder(resp_len: int, steps: int = STEPS_PER_OCTAVE) -> tuple[int, ...]:
    """Every response width a micro-batch can have: width_bucket's ladder (`steps` per octave), capped at
    resp_len (the batch's response width T), ascending."""
    widths, n = [], 1
    while True:
        widths.append(min(width_bucket(n, steps), resp_len))
        if widths[-1] >= resp_len:
            return tuple(widths)
        n = widths[-1] + 1


def row_counts(micro: int, min_rows: int = 1) -> tuple[int, ...]:
    """Rows a micro-batch may hold: micro, micro/2, micro/4, ... while the halving is exact and >= min_rows (the
    batch's shards, so a micro-batch still splits evenly over the devices); always at least (micro,)."""
    counts = [micro]
    while counts[-1] % 2 == 0 and counts[-1] // 2 >= max(min_rows, 1):
        counts.append(counts[-1] // 2)
    return tuple(counts)


def micro_cost(rows: int, positions: int) -> int:
    """The cost a plan minimises and the price model prices: (rows + OVERHEAD_ROWS) x positions of one micro-batch
    (S + T_u grouped, the row width packed). The extra row stands for what a micro-batch pays whatever its rows
    (weights read forward and backward, launches, the fused pass's sequential chunks); fitted on CPU under load,
    t(X, L) = 0.32 ms X L + 0.25 ms L: 0.78 rows."""
    return (rows + OVERHEAD_ROWS) * positions


@dataclasses.dataclass(frozen=True)
class ShapeSet:
    """The (rows, response width) shapes a length-grouped micro-batch may take: for each row count (descending), its
    widths (ascending, the last the batch's response width T). `name` says how it was built (choice.candidates)."""

    widths: tuple[tuple[int, tuple[int, ...]], ...]
    name: str = "full"

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((rows, w) for rows, ws in self.widths for w in ws)

    @property
    def resp_len(self) -> int:
        return max(ws[-1] for _, ws in self.widths)

    @classmethod
    def of(cls, shapes, name: str) -> "ShapeSet":
        """From (rows, width) pairs."""
        by_rows: dict[int, set] = {}
        for rows, w in shapes:
            by_rows.setdefault(int(rows), set()).add(int(w))
        return cls(tuple((r, tuple(sorted(by_rows[r]))) for r in sorted(by_rows, reverse=True)), name)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def full(cls, micro: int, resp_len: int, min_rows: int = 1) -> "ShapeSet":
        """Every row count (row_counts) at every width of the ladder: the default of micro.plan_micro."""
        return cls(tuple((r, width_ladder(resp_len)) for r in row_counts(micro, min_rows)), "full")


def group(lengths_B: np.ndarray, prompt_len: int, shapes: ShapeSet):
    """(rows_by_micro, widths, cost): B rows in ascending length cut into consecutive runs, each run at a shape of
    `shapes` (its rows, and the smallest of that row count's widths that holds its longest row), the cut of least
    total micro_cost (dynamic programming over the sorted rows)."""
    order = np.argsort(lengths_B, kind="stable")
    sorted_B = np.asarray(lengths_B)[order]
    b = len(order)
    best = [(0, 0, 0)] + [None] * b  # best[i]: least cost of the first i sorted rows, its last run's rows and width
    for i in range(1, b + 1):
        for r, ws in shapes.widths:
            if r > i or best[i - r] is None:
                continue
            j = bisect.bisect_left(ws, int(sorted_B[i - 1]))
            if j == len(ws):
                continue
            cost = best[i - r][0] + micro_cost(r, prompt_len + ws[j])
            if best[i] is None or cost < best[i][0]:
                best[i] = (cost, r, ws[j])
    if best[b] is None:
        raise ValueError(f"no cut of {b} rows into the micro-batch shapes {shapes.shapes}")
    runs, widths, i = [], [], b
    while i:
        _, r, w = best[i]
        runs.append(order[i - r:i])
        widths.append(w)
        i -= r
    return runs[::-1], tuple(widths[::-1]), best[b][0]


def narrow_widths(width: int, steps: int = NARROW_STEPS) -> tuple[int, ...]:
    """The packed rows' widths below `width`, descending: width x 2^(-k/steps) for k = 1 .. steps x NARROW_OCTAVES
    (down to width / 8), each rounded up to a multiple of 8; none with steps 0."""
    ks = range(1, steps * NARROW_OCTAVES + 1)
    return tuple(sorted({-(-int(np.ceil(width * 2 ** (-k / steps))) // 8) * 8 for k in ks} - {width},
                        reverse=True))


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The packed layout of a run: micro-batches at one of the (rows, row width) `micros`, the widest rows `width`
    positions, at most `slots` sequences a row; each pass compiles one program per entry of micros."""

    width: int
    micros: tuple[tuple[int, int], ...]
    slots: int = SLOTS
    head: int = 0  # a row's output columns (those whose next-token outputs the passes compute): min(head, its width)
    block: int = packed_attention.BLOCK  # attention block of the xla path (model.packed_attention); 0: dense mask

    @classmethod
    def of(cls, micro: int, min_rows: int, *, prompt_len: int, resp_len: int, block: int = packed_attention.BLOCK,
           rows: str = "all", steps: int = NARROW_STEPS) -> "PackShape":
        """Rows of W = prompt_len + resp_len (the longest sequence fits) at micro, micro/2, ... down to min_rows, the
        batch's row shards (row_counts: a micro-batch's token budget is the unpacked pass's largest, micro x
        (S + T); rows="sparse": every other count, the last kept), and min_rows rows at each narrower width
        (narrow_widths, `steps` per octave), so that a pass's last micro-batches hold about the tokens left
        (packing.plan_micros). A row's output columns: as many as its width (a row of W positions holding few
        sequences has more than T response tokens; limiting them to T left a quarter of the rows' tails empty at
        Qwen3-1.7B's lengths, bench update --padding-only), gathered to the front of the row."""
        width = prompt_len + resp_len
        counts = row_counts(micro, min_rows)
        if rows == "sparse":
            counts = tuple(sorted(set(counts[::2]) | {counts[-1]}, reverse=True))
        full = tuple((r, width) for r in counts)
        narrow = tuple((counts[-1], w) for w in narrow_widths(width, steps))
        return cls(width, full + narrow, head=width, block=block)

    def outputs(self, width: int) -> int:
        """C: the output columns of a row of `width`."""
        return min(self.head, width) if self.head else width

    @property
    def name(self) -> str:
        full = [r for r, w in self.micros if w == self.width]
        narrow = [w for _, w in self.micros if w < self.width]
        extra = f" and {self.micros[-1][0]} x {narrow[0]}..{narrow[-1]} ({len(narrow)} widths)" if narrow else ""
        return f"packed {'/'.join(map(str, full))} x {self.width}{extra}"

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Its (rows, width) shapes: one program per pass each."""
        return self.micros


Layout = ShapeSet | PackShape  # what the score, reference and gradient passes of a run run at
