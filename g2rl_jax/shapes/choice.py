"""The layout a run's passes take and the prompt buckets its steps pad to: a small set of shapes, a function of the
config, the devices and the training prompts' lengths, chosen by the whole run's estimated time (compile + compute).

    choice = choose_for(cfg, model, Device.of(mesh), lengths, step=step_shapes(cfg, mesh))
    choice.layout, choice.prompts, choice.packed               # a ShapeSet or a PackShape; the prompt buckets
    choose_for(..., prices=Prices.from_score(measured...))     # `bench tune-shapes` only

The score and reference passes and the update run each micro-batch at one shape of the layout, and each shape is a
program of each of the three kinds to compile. More shapes fit the lengths more tightly (less padding computed),
fewer compile faster. The candidates:
    grouped (train/micro.py): widths layouts.width_ladder with 4, 2 or 1 steps per octave, crossed with the rows:
        "all" every halving of micro (layouts.row_counts); "sparse" every other one (micro, micro/4, ...);
        "tokens" per width w one row count r(w), the most rows with r(w) x (S + w) <= micro x (S + T/8), and
        r(w)/4 (long rows come few at a time, so they get fewer rows per micro-batch); "single" r(w) alone;
        with the prompt buckets: a step's prompts are left-padded to a bucket (a power of two) that holds its
        longest, and each bucket is a copy of all of a step's programs, the rollout's too; the candidates are the
        largest bucket the training prompts reach alone, then with each smaller one in turn, at most
        data.prompt_buckets;
    packed (train/packing.py, unless algorithm.packing is false): rows of W = the largest bucket + the budget at
        every halving of micro ("all") or every other one ("sparse"), and narrower rows at 3, 1 or 0 widths per
        octave over the three octaves below W (layouts.PackShape.of); one set of passes for every prompt bucket,
        each program prices.PACKED_COMPILE times a grouped one to compile.
        Their prompt buckets are those the grouped estimate takes when the passes compile once (the grouped
        passes' prompt padding stands in for the rollout's, which the model does not price).
`choose` takes the candidate of least estimated run time: the compile seconds of its programs spread over the
compile threads, plus run.total_steps times the seconds a step computes, averaged over the buckets steps' longest
prompts fall in (`prompt_shares`, from the training prompts' lengths). A step's compute is each kind's micro_cost
units summed over the plans the passes cut (grouped: layouts.group, prompts padded to their bucket; packed:
packing.plan_micros, prompts as they are, drawn from the training prompts) over response lengths drawn long-tailed
(exponential with mean budget / 4, capped at the budget, the longest at it: `bench update --long-tail`'s), priced
per unit (prices.py). algorithm.packing true or false restricts the choice to that layout; null (the default)
lets the estimate choose. The units count positions, so the attention's share that grows with a row's width is
priced as the rest (a packed row's blocked attention on the xla path scores each sequence's own band; splash and
cuDNN score the whole row).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from g2rl_jax.shapes.layouts import Layout, PackShape, ShapeSet, group, micro_cost, row_counts, width_ladder
from g2rl_jax.shapes.prices import MODEL_THREADS, PACKED_COMPILE, Device, Prices, model_prices, rollout_price
from g2rl_jax.shapes.step import StepShapes, rollout_counts

STEPS_PER_OCTAVE = (4, 2, 1)
ROWS = ("all", "sparse", "tokens", "single")
PACKED_ROWS = ("all", "sparse")
PACKED_STEPS = (3, 1, 0)  # narrower packed rows per octave
TOKENS_SHARE = 8  # "tokens": a micro-batch holds at most micro x (S + T / TOKENS_SHARE) positions at its r(w)
DRAWS = 4  # long-tailed steps the compute estimate averages over


def candidate(micro: int, min_rows: int, prompt_len: int, resp_len: int, steps: int, rows: str) -> ShapeSet:
    """One grouped candidate: widths at `steps` per octave, row counts by the `rows` rule (module docstring)."""
    counts = row_counts(micro, min_rows)
    widths = width_ladder(resp_len, steps)
    name = f"{steps}/octave x {rows}"
    if rows == "all":
        return ShapeSet.of([(r, w) for r in counts for w in widths], name)
    if rows == "sparse":
        return ShapeSet.of([(r, w) for r in counts[::2] for w in widths], name)
    budget = micro * (prompt_len + resp_len / TOKENS_SHARE)
    shapes = []
    for w in widths:
        i = next((i for i, r in enumerate(counts) if r * (prompt_len + w) <= budget), len(counts) - 1)
        shapes.append((counts[i], w))
        if rows == "tokens":
            shapes.append((counts[min(i + 2, len(counts) - 1)], w))
    return ShapeSet.of(shapes, name)


def candidates(micro: int, min_rows: int, prompt_len: int, resp_len: int) -> dict[str, ShapeSet]:
    """Every grouped candidate (STEPS_PER_OCTAVE x ROWS), by name; sets that come out equal are listed once, under
    the first name (the finest)."""
    out: dict[str, ShapeSet] = {}
    for steps in STEPS_PER_OCTAVE:
        for rows in ROWS:
            s = candidate(micro, min_rows, prompt_len, resp_len, steps, rows)
            if all(s.widths != t.widths for t in out.values()):
                out[s.name] = s
    return out


def packed_candidates(micro: int, min_rows: int, prompt_len: int, resp_len: int) -> dict[str, PackShape]:
    """Every packed candidate (PACKED_ROWS x PACKED_STEPS), by name, the finest first; equal layouts once."""
    out: dict[str, PackShape] = {}
    for rows in PACKED_ROWS:
        for steps in PACKED_STEPS:
            p = PackShape.of(micro, min_rows, prompt_len=prompt_len, resp_len=resp_len, rows=rows, steps=steps)
            out.setdefault(p.name, p)
    return out


def long_tailed_lengths(rows: int, budget: int, seed: int) -> np.ndarray:
    """Response lengths [rows]: exponential with mean budget / 4, in [1, budget], the longest at the budget."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.exponential(budget / 4, rows)), 1, budget).astype(int)
    lengths[np.argmax(lengths)] = budget
    return lengths


def step_load(sets: dict[str, ShapeSet], *, step_rows: int, mini_rows: int, epochs: int, prompt_len: int,
              budget: int) -> dict[str, dict[str, float]]:
    """{set name: {"score": units, "gradient": units}}: micro_cost units of one step's grouped score pass (the
    reference pass is the same) and of its update (every mini-batch, every epoch), averaged over DRAWS long-tailed
    steps, every prompt padded to prompt_len."""
    out = {}
    for name, shapes in sets.items():
        score = grads = 0.0
        for seed in range(DRAWS):
            lengths = long_tailed_lengths(step_rows, budget, seed)
            score += group(lengths, prompt_len, shapes)[2]
            for start in range(0, step_rows, mini_rows):
                grads += epochs * group(lengths[start:start + mini_rows], prompt_len, shapes)[2]
        out[name] = {"score": score / DRAWS, "gradient": grads / DRAWS}
    return out


def packed_load(packs: dict[str, PackShape], prompt_lengths, *, group_size: int, step_rows: int, mini_rows: int,
                epochs: int, budget: int) -> dict[str, dict[str, float]]:
    """step_load of the packed candidates: micro_cost units of the micro-batches packing.plan_micros cuts, each
    step's prompts drawn from the training prompts' lengths (one per group, as a step holds them) and its responses
    long-tailed, averaged over DRAWS steps."""
    pool = tuple(int(n) for n in np.asarray(prompt_lengths).reshape(-1))
    out = {}
    for name, pack in packs.items():
        score, grads = _packed_units(pack, pool, group_size, step_rows, mini_rows, epochs, budget)
        out[name] = {"score": score, "gradient": grads}
    return out


@functools.lru_cache(maxsize=64)
def _packed_units(pack: PackShape, pool: tuple[int, ...], group_size: int, step_rows: int, mini_rows: int,
                  epochs: int, budget: int) -> tuple[float, float]:
    """(score units, gradient units) of one packed layout (packed_load), kept: a run prices it once, the tests and
    the benches several times."""
    from g2rl_jax.train.packing import plan_micros

    def units(n_B, r_B):
        return sum(micro_cost(rows, width) for rows, width, _, _ in plan_micros(n_B, r_B, pack))

    score = grads = 0.0
    for seed in range(DRAWS):
        r_B = long_tailed_lengths(step_rows, budget, seed)
        p_B = np.repeat(np.random.default_rng(seed).choice(np.asarray(pool), step_rows // group_size), group_size)
        n_B = p_B + r_B
        score += units(n_B, r_B)
        for start in range(0, step_rows, mini_rows):
            grads += epochs * units(n_B[start:start + mini_rows], r_B[start:start + mini_rows])
    return score / DRAWS, grads / DRAWS


def prompt_shares(lengths, prompts_per_step: int) -> dict[int, float]:
    """{prompt bucket: share of steps whose longest prompt falls in it}, for steps of `prompts_per_step` prompts
    drawn from prompts of these lengths: P(longest <= x) = F(x)^n."""
    from g2rl_jax.rollout.batching import MIN_PROMPT_BUCKET, bucket

    lengths = np.sort(np.asarray(lengths))
    buckets = sorted({bucket(int(n), MIN_PROMPT_BUCKET) for n in lengths})
    below = [(np.searchsorted(lengths, b, side="right") / len(lengths)) ** prompts_per_step for b in buckets]
    return {b: float(p - q) for b, p, q in zip(buckets, below, [0.0, *below[:-1]]) if p > q}


def prompt_sets(shares: dict[int, float], most: int = 0) -> list[tuple[int, ...]]:
    """Candidate prompt buckets of a run: the largest alone, then with each next smaller bucket steps fall in, at
    most `most` buckets (data.prompt_buckets; 0: no limit)."""
    buckets = sorted(shares, reverse=True)
    return [tuple(sorted(buckets[:i])) for i in range(1, min(len(buckets), most or len(buckets)) + 1)]


def pad_prompt(bucket_: int, prompts: tuple[int, ...]) -> int:
    """The prompt length of a step whose longest prompt is in `bucket_`: the smallest of the run's at least it."""
    return min(p for p in prompts if p >= bucket_)


@dataclasses.dataclass(frozen=True)
class Estimate:
    name: str  # the layout: a grouped shape set's name, or a PackShape's
    prompts: tuple[int, ...]  # the prompt buckets
    shapes: int  # shapes in the layout
    programs: int  # programs to compile: the passes' (per prompt bucket when grouped) + a rollout's per bucket
    compile_s: float  # their compile seconds spread over the threads
    step_s: float  # compute seconds of one long-tailed step's score, reference and update passes
    run_s: float  # compile_s + steps x step_s
    packed: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    layout: Layout  # what the passes run at: a ShapeSet (grouped) or a PackShape (packed)
    prompts: tuple[int, ...]
    table: tuple[Estimate, ...]  # every candidate: the grouped (prompt sets outer, sets inner), then the packed

    @property
    def packed(self) -> bool:
        return isinstance(self.layout, PackShape)

    @property
    def chosen(self) -> Estimate:
        return next(e for e in self.table if e.name == self.layout.name and e.prompts == self.prompts)

    def lines(self, steps: int) -> list[str]:
        """The candidates as the trainer and `plan --compile` print them: every layout at the chosen prompt
        buckets, then every prompt-bucket set of the chosen layout, each with its programs, compile seconds, the
        padding it computes (step compute against the least of any candidate) and the estimated run time."""
        least = min(e.step_s for e in self.table)
        head = (f"{'layout':46s} {'prompt buckets':20s} {'shapes':>6s} {'programs':>8s} {'compile s':>9s} "
                f"{'step s':>8s} {'compute':>8s} {f'{steps} steps s':>12s}")
        rows = [e for e in self.table if e.prompts == self.prompts]
        rows += [e for e in self.table if e.name == self.layout.name and e.prompts != self.prompts]
        out = [head]
        for e in rows:
            mark = "  <- chosen" if e is self.chosen else ""
            out.append(f"{e.name:46s} {','.join(map(str, e.prompts)):20s} {e.shapes:6d} {e.programs:8d} "
                       f"{e.compile_s:9.1f} {e.step_s:8.3f} {e.step_s / least:7.3f}x {e.run_s:12.1f}{mark}")
        return out


def _estimates(layouts: dict, loads, shares, prices: Prices, prompt_sets_: list[tuple[int, ...]], *, rollout,
               steps: int, threads: int, once: bool, packed: bool) -> list[Estimate]:
    """The estimate of every (prompt buckets, layout) pair; once: the passes compile once for every bucket.
    loads: {prompt bucket: step_load} (grouped), or one packed_load (packed: no prompt padding, each program
    PACKED_COMPILE times a grouped one to compile)."""
    kinds = prices.compile_s.keys()
    per_shape = sum(prices.compile_s.values()) * (PACKED_COMPILE if packed else 1.0)
    out = []
    for prompts in prompt_sets_:
        copies = 1 if once else len(prompts)
        for name, layout in layouts.items():
            n = len(layout.shapes)
            compile_s = (copies * n * per_shape + len(prompts) * rollout[1]) / max(threads, 1)
            if packed:
                step_s = sum(loads[name]["gradient" if k == "gradient" else "score"] * prices.unit_s[k] for k in kinds)
            else:
                step_s = sum(share * sum(loads[pad_prompt(b, prompts)][name]["gradient" if k == "gradient" else
                                                                             "score"] * prices.unit_s[k]
                                         for k in kinds) for b, share in shares.items())
            programs = copies * n * len(kinds) + len(prompts) * rollout[0]
            out.append(Estimate(name, prompts, n, programs, compile_s, step_s, compile_s + steps * step_s, packed))
    return out


def choose(sets: dict[str, ShapeSet], loads: dict[int, dict[str, dict[str, float]]], shares: dict[int, float],
           prices: Prices, *, rollout: tuple[int, float], steps: int, threads: int, most_prompts: int = 0,
           packing: bool | None = False, packs: dict[str, PackShape] | None = None,
           packed_loads: dict[str, dict[str, float]] | None = None) -> Choice:
    """The (layout, prompt buckets) of least estimated run time (module docstring); ties go to the fewer programs.
    loads: step_load at each prompt bucket; shares: prompt_shares; rollout: the programs and the compile seconds of
    one prompt bucket's rollout (step.rollout_counts priced by prices.rollout_price); most_prompts:
    data.prompt_buckets; packing: algorithm.packing (true: packed only, false: grouped only, None: either); packs,
    packed_loads: the packed candidates and their packed_load (unless packing is false)."""
    sets_ = prompt_sets(shares, most_prompts)
    kw = dict(rollout=rollout, steps=steps, threads=threads)
    table = _estimates(sets, loads, shares, prices, sets_, once=False, packed=False, **kw)
    if packing is not False:
        once = _estimates(sets, loads, shares, prices, sets_, once=True, packed=False, **kw)
        prompts = min(once, key=lambda e: (e.run_s, e.programs)).prompts
        table += _estimates(packs, packed_loads, shares, prices, [prompts], once=True, packed=True, **kw)
    best = min((e for e in table if packing is None or e.packed == packing), key=lambda e: (e.run_s, e.programs))
    return Choice((packs if best.packed else sets)[best.name], best.prompts, tuple(table))


def choose_for(cfg, model, device: Device, prompt_lengths, *, step: StepShapes,
               prices: Prices | None = None) -> Choice:
    """The run's (layout, prompt buckets): a function of the config `cfg`, the Qwen3 `model`, the `device` (the
    training mesh's: Device.of), the training prompts' lengths and the step's sizes (`step`: step.step_shapes of
    the training mesh; its prompt length is the largest bucket these prompts reach). prices: the model's
    (prices.model_prices) unless given (`bench tune-shapes` measures them)."""
    algo = cfg.algorithm
    kinds = ("score", "reference", "gradient") if algo.kl_coef > 0 else ("score", "gradient")
    shares = prompt_shares(prompt_lengths, cfg.data.prompts_per_step)
    micro, prompt_len, resp_len = algo.micro_batch_size, max(shares), step.new_tokens
    sets = candidates(micro, step.shards, prompt_len, resp_len)
    budget = cfg.rollout.max_new_tokens
    loads = {p: step_load(sets, step_rows=step.step_rows, mini_rows=algo.mini_batch_size, epochs=algo.ppo_epochs,
                          prompt_len=p, budget=budget) for p in shares}
    packs = packed_loads = None
    if algo.packing is not False:
        packs = packed_candidates(micro, step.shards, prompt_len, resp_len)
        packed_loads = packed_load(packs, prompt_lengths, group_size=step.samples, step_rows=step.step_rows,
                                   mini_rows=algo.mini_batch_size, epochs=algo.ppo_epochs, budget=budget)
    if prices is None:
        prices = model_prices(model, device, micro=micro, seq_len=prompt_len + resp_len, kinds=kinds,
                              remat=cfg.model.remat != "none")
    threads = cfg.run.compile_threads or MODEL_THREADS.get(device.platform, MODEL_THREADS["tpu"])
    return choose(sets, loads, shares, prices, rollout=rollout_price(rollout_counts(step.buckets), prices),
                  steps=cfg.run.total_steps, threads=threads, most_prompts=cfg.data.prompt_buckets,
                  packing=algo.packing, packs=packs, packed_loads=packed_loads)


def training_prompt_lengths(cfg) -> np.ndarray | None:
    """The training prompts' token counts (under data.max_prompt_tokens), or None when model.path has no tokenizer
    that renders them (a preset's architecture alone, a directory with config.json only) or the data cannot be read
    here (`plan --compile` then assumes every prompt at data.max_prompt_tokens)."""
    from g2rl_jax.data.tokenizer import load_tokenizer
    from g2rl_jax.train.setup import length_filter, load_examples, prompt_lengths

    try:
        tokenizer = load_tokenizer(cfg.model.path)
        kept, _ = length_filter(load_examples(cfg.data.train_dataset, cfg.data), tokenizer, cfg.data)
    except (OSError, ValueError):  # ValueError: no chat template to render with, or a DataError
        return None
    return prompt_lengths([kept], tokenizer, cfg.data)


def run_choice(cfg, model, step: StepShapes, device: Device, lengths=None) -> Choice:
    """The choice the trainer makes for `cfg` on `device` (train/warmup.py), its prompts' `lengths` (None: the worst
    case, every prompt at data.max_prompt_tokens): what `plan --compile`, its bill and the benches price."""
    lengths = np.array([cfg.data.max_prompt_tokens]) if lengths is None else lengths
    return choose_for(cfg, model, device, lengths, step=step)
