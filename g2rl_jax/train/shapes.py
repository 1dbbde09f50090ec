"""The shapes a run's steps may meet: a small set, a function of the config, the device kind and the training
prompts' lengths, chosen by the whole run's estimated time (compile + compute).

    choice = choose_for(cfg, model, Device.local(), lengths, micro=16, min_rows=4, prompt_len=1024,
                        resp_len=8192, step_rows=256, rollout={"segment": 20, "regroup": 60, ...})
    choice.shapes, choice.prompts                                             # the set and the prompt buckets
    choose_for(..., prices=Prices.from_score(measured...))                    # `bench tune-shapes` only

The score and reference passes and the update run each micro-batch at one (rows, response width) shape, and each
shape is a program of each of the three kinds to compile. More shapes fit the response lengths more tightly (less
padding computed, train/micro.py), fewer compile faster. The candidates cross
    widths: micro.width_ladder with 4, 2 or 1 steps per octave
    rows:   "all" every halving of micro (micro.row_counts); "sparse" every other one (micro, micro/4, ...);
            "tokens" per width w one row count r(w), the most rows with r(w) x (S + w) <= micro x (S + T/8), and
            r(w)/4 (long rows come few at a time, so they get fewer rows per micro-batch); "single" r(w) alone
with the prompt buckets: a step's prompts are left-padded to a bucket (a power of two) that holds its longest, and
each bucket is a copy of all of a step's programs, the rollout's too; the candidates are the largest bucket the
training prompts reach alone, then with each smaller one in turn, at most data.prompt_buckets (with
algorithm.packing the passes' programs are one set for every bucket, the rollout's a copy per bucket). `choose`
takes the pair of least estimated run time: the compile seconds of its programs spread over the compile threads,
plus run.total_steps times the seconds a step computes, averaged over the buckets steps' longest prompts fall in
(`prompt_shares`, from the training prompts' lengths). A step's compute is each kind's cost units (micro.micro_cost
summed over the plans train/micro.py cuts) over response lengths drawn long-tailed (exponential with mean budget /
4, capped at the budget, the longest at it: `bench update --long-tail`'s), priced per unit.

The prices come from a model, never from a clock, so two runs of one config on one kind of device choose the same
set whatever else the machine is doing (`model_prices`): a pass's compute is its FLOPs (bench/update.train_flops)
at the device's effective FLOP/s (`Device.flops`: the chips' bf16 peak at aot/report.ESTIMATE_MFU on TPU and GPU,
CPU_FLOPS for a CPU host); the largest score program compiles in SCORE_COMPILE_S[platform] seconds (the layers are
scanned, so that barely moves with depth), a reference program alike, a gradient program GRADIENT_COMPILE times
it (measured: 4.68 / 1.33 s at the demo size on the 2-core CPU, 65.8 / 19.5 s for Qwen3-1.7B compiled for v5p-8),
a rollout's segments, prefill and first token alike and its moves MOVE_COMPILE of it; the compile threads are
run.compile_threads, or MODEL_THREADS[platform] when that is 0 (the host's core count is not the config's). The
gradient runs 3 times a forward (4 with model.remat). `python -m g2rl_jax.bench tune-shapes` measures the prices
on this machine instead (`Prices.from_score`) and writes a file that run.shapes_file pins.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from g2rl_jax.train import micro as micro_lib

STEPS_PER_OCTAVE = (4, 2, 1)
ROWS = ("all", "sparse", "tokens", "single")
TOKENS_SHARE = 8  # "tokens": a micro-batch holds at most micro x (S + T / TOKENS_SHARE) positions at its r(w)
GRADIENT_COMPILE = 3.5  # a gradient program's compile seconds / its score program's (see the module docstring)
DRAWS = 4  # long-tailed steps the compute estimate averages over
# seconds to compile the largest score program, by platform: the demo-size model's 64 x 528 on the 2-core CPU (3.0 s,
# docs/performance.md), Qwen3-1.7B's on v5p-8 (19.5 s), on an H100 the 1.7B update's 43.9 s / GRADIENT_COMPILE
SCORE_COMPILE_S = {"cpu": 3.0, "gpu": 12.5, "tpu": 19.5}
MOVE_COMPILE = 0.1  # a rollout's cache or row move: this share of a score program's compile seconds
MODEL_THREADS = {"cpu": 4, "gpu": 32, "tpu": 32}  # compile threads assumed when run.compile_threads is 0
# effective FLOP/s of a CPU host: the demo-size score program of 64 x 528 positions (35.8 GFLOP) in 1.394 s on the
# project's 2-core CPU (docs/performance.md)
CPU_FLOPS = 25.6e9
# dense bf16 peak TFLOP/s per chip by jax's device_kind (the longest match wins; Cloud TPU docs, NVIDIA data sheets);
# a kind not listed is priced at DEFAULT_TFLOPS
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v5 lite": 197.0, "TPU v5": 459.0,
                    "TPU v6 lite": 918.0, "TPU v4": 275.0}
DEFAULT_TFLOPS = 275.0


def candidate(micro: int, min_rows: int, prompt_len: int, resp_len: int, steps: int, rows: str) -> micro_lib.ShapeSet:
    """One candidate set: widths at `steps` per octave, row counts by the `rows` rule (module docstring)."""
    counts = micro_lib.row_counts(micro, min_rows)
    widths = micro_lib.width_ladder(resp_len, steps)
    name = f"{steps}/octave x {rows}"
    if rows == "all":
        return micro_lib.ShapeSet.of([(r, w) for r in counts for w in widths], name)
    if rows == "sparse":
        return micro_lib.ShapeSet.of([(r, w) for r in counts[::2] for w in widths], name)
    budget = micro * (prompt_len + resp_len / TOKENS_SHARE)
    shapes = []
    for w in widths:
        i = next((i for i, r in enumerate(counts) if r * (prompt_len + w) <= budget), len(counts) - 1)
        shapes.append((counts[i], w))
        if rows == "tokens":
            shapes.append((counts[min(i + 2, len(counts) - 1)], w))
    return micro_lib.ShapeSet.of(shapes, name)


def candidates(micro: int, min_rows: int, prompt_len: int, resp_len: int) -> dict[str, micro_lib.ShapeSet]:
    """Every candidate (STEPS_PER_OCTAVE x ROWS), by name; sets that come out equal are listed once, under the
    first name (the finest)."""
    out: dict[str, micro_lib.ShapeSet] = {}
    for steps in STEPS_PER_OCTAVE:
        for rows in ROWS:
            s = candidate(micro, min_rows, prompt_len, resp_len, steps, rows)
            if all(s.widths != t.widths for t in out.values()):
                out[s.name] = s
    return out


def long_tailed_lengths(rows: int, budget: int, seed: int) -> np.ndarray:
    """Response lengths [rows]: exponential with mean budget / 4, in [1, budget], the longest at the budget."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.exponential(budget / 4, rows)), 1, budget).astype(int)
    lengths[np.argmax(lengths)] = budget
    return lengths


def step_load(sets: dict[str, micro_lib.ShapeSet], *, step_rows: int, mini_rows: int, epochs: int, prompt_len: int,
              budget: int) -> dict[str, dict[str, float]]:
    """{set name: {"score": units, "gradient": units}}: micro_cost units of one step's score pass (the reference
    pass is the same) and of its update (every mini-batch, every epoch), averaged over DRAWS long-tailed steps."""
    out = {}
    for name, shapes in sets.items():
        score = grads = 0.0
        for seed in range(DRAWS):
            lengths = long_tailed_lengths(step_rows, budget, seed)
            score += micro_lib.group(lengths, prompt_len, shapes)[2]
            for start in range(0, step_rows, mini_rows):
                grads += epochs * micro_lib.group(lengths[start:start + mini_rows], prompt_len, shapes)[2]
        out[name] = {"score": score / DRAWS, "gradient": grads / DRAWS}
    return out


@dataclasses.dataclass(frozen=True)
class Prices:
    """Seconds to compile one program of each kind (score, reference, gradient; reference absent without the KL
    term) and seconds of compute per micro_cost unit of each kind."""

    compile_s: dict[str, float]
    unit_s: dict[str, float]

    @classmethod
    def from_score(cls, compile_s: dict[str, float], run_s: dict[str, float], units: float,
                   remat: bool) -> "Prices":
        """From the compile and run seconds of the largest score (and reference) program, `units` its micro_cost;
        the gradient priced from the score program (module docstring)."""
        unit_s = {k: s / units for k, s in run_s.items()}
        unit_s["gradient"] = (3 + remat) * unit_s["score"]
        return cls({**compile_s, "gradient": GRADIENT_COMPILE * compile_s["score"]}, unit_s)


@dataclasses.dataclass(frozen=True)
class Device:
    """What the price model knows of the devices a run trains on: the platform, the chips' bf16 peak and how many."""

    platform: str  # "cpu", "gpu" or "tpu"
    peak_tflops: float  # per chip (0 on CPU: CPU_FLOPS prices the host)
    chips: int

    @classmethod
    def local(cls) -> "Device":
        """The devices of this run, by jax's platform and device_kind (every process sees the same)."""
        import jax

        first = jax.devices()[0]
        matches = [k for k in PEAK_BF16_TFLOPS if k in first.device_kind]
        peak = PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else DEFAULT_TFLOPS
        return cls(first.platform, 0.0 if first.platform == "cpu" else peak, jax.device_count())

    @property
    def flops(self) -> float:
        """Effective FLOP/s of a pass over all the chips (module docstring)."""
        from g2rl_jax.aot.report import ESTIMATE_MFU

        return CPU_FLOPS if self.platform == "cpu" else self.chips * self.peak_tflops * 1e12 * ESTIMATE_MFU

    def describe(self) -> str:
        if self.platform == "cpu":
            return f"cpu at {CPU_FLOPS / 1e9:.1f} GFLOP/s"
        return f"{self.chips} x {self.platform} at {self.peak_tflops:.0f} TFLOP/s peak"


def model_prices(model, device: Device, *, micro: int, seq_len: int, kinds: tuple[str, ...],
                 remat: bool) -> Prices:
    """The model's prices (module docstring) of a run of Qwen3 `model` on `device`, micro-batches of up to `micro`
    rows x seq_len positions; kinds: ("score", "gradient"), with "reference" under the KL term."""
    from g2rl_jax.bench.update import train_flops

    forward_s = train_flops(model, micro, seq_len) / 3 / device.flops
    unit_s = forward_s / micro_lib.micro_cost(micro, seq_len)
    score = SCORE_COMPILE_S.get(device.platform, SCORE_COMPILE_S["tpu"])
    compile_s = {k: score * (GRADIENT_COMPILE if k == "gradient" else 1.0) for k in kinds}
    return Prices(compile_s, {k: unit_s * ((3 + remat) if k == "gradient" else 1) for k in kinds})


def rollout_price(counts: dict[str, int], prices: Prices) -> tuple[int, float]:
    """(programs, compile seconds) of one prompt bucket's rollout, its programs by kind (aot/bill.rollout_counts):
    each priced as a score program, its moves ("regroup") at MOVE_COMPILE of one."""
    score = prices.compile_s["score"]
    return sum(counts.values()), sum(n * score * (MOVE_COMPILE if k == "regroup" else 1.0) for k, n in counts.items())


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
    name: str  # the micro-batch shape set
    prompts: tuple[int, ...]  # the prompt buckets
    shapes: int  # (rows, width) shapes in the set
    programs: int  # programs to compile: prompt buckets x (shapes x kinds + a rollout's)
    compile_s: float  # their compile seconds spread over the threads
    step_s: float  # compute seconds of one long-tailed step's score, reference and update passes
    run_s: float  # compile_s + steps x step_s


@dataclasses.dataclass(frozen=True)
class Choice:
    shapes: micro_lib.ShapeSet
    prompts: tuple[int, ...]
    table: tuple[Estimate, ...]  # every candidate pair, prompt sets outer, micro sets inner (candidates() order)

    @property
    def chosen(self) -> Estimate:
        return next(e for e in self.table if e.name == self.shapes.name and e.prompts == self.prompts)

    def lines(self, steps: int) -> list[str]:
        """The candidates as the trainer and `plan --compile` print them: every micro-batch shape set at the chosen
        prompt buckets, then every prompt-bucket set at the chosen shapes, each with its programs, compile seconds,
        the padding it computes (step compute against the finest candidate's) and the estimated run time."""
        finest = min(e.step_s for e in self.table)
        head = (f"{'micro-batch shapes':22s} {'prompt buckets':20s} {'shapes':>6s} {'programs':>8s} {'compile s':>9s} "
                f"{'step s':>8s} {'compute':>8s} {f'{steps} steps s':>12s}")
        rows = [e for e in self.table if e.prompts == self.prompts]
        rows += [e for e in self.table if e.name == self.shapes.name and e.prompts != self.prompts]
        out = [head]
        for e in rows:
            mark = "  <- chosen" if e is self.chosen else ""
            out.append(f"{e.name:22s} {','.join(map(str, e.prompts)):20s} {e.shapes:6d} {e.programs:8d} "
                       f"{e.compile_s:9.1f} {e.step_s:8.3f} {e.step_s / finest:7.3f}x {e.run_s:12.1f}{mark}")
        return out


def choose(sets: dict[str, micro_lib.ShapeSet], loads: dict[int, dict[str, dict[str, float]]],
           shares: dict[int, float], prices: Prices, *, rollout: tuple[int, float], steps: int,
           threads: int, most_prompts: int = 0, packed: bool = False) -> Choice:
    """The (micro-batch shape set, prompt buckets) of least estimated run time (module docstring); ties go to the
    fewer programs. loads: step_load at each prompt bucket; shares: prompt_shares; rollout: the programs and the
    compile seconds of one prompt bucket's rollout (aot/bill.rollout_counts priced by rollout_price);
    most_prompts: data.prompt_buckets; packed: the passes' programs are compiled once, not per prompt bucket
    (algorithm.packing)."""
    kinds = prices.compile_s.keys()
    table = []
    for prompts in prompt_sets(shares, most_prompts):
        copies = 1 if packed else len(prompts)
        for name, shapes in sets.items():
            n = len(shapes.shapes)
            compile_s = (copies * n * sum(prices.compile_s.values()) + len(prompts) * rollout[1]) / max(threads, 1)
            step_s = sum(share * sum(loads[pad_prompt(b, prompts)][name]["gradient" if k == "gradient" else "score"]
                                     * prices.unit_s[k] for k in kinds) for b, share in shares.items())
            programs = copies * n * len(kinds) + len(prompts) * rollout[0]
            table.append(Estimate(name, prompts, n, programs, compile_s, step_s, compile_s + steps * step_s))
    best = min(table, key=lambda e: (e.run_s, e.programs))
    return Choice(sets[best.name], best.prompts, tuple(table))


def choose_for(cfg, model, device: Device, prompt_lengths, *, micro: int, min_rows: int, prompt_len: int,
               resp_len: int, step_rows: int, rollout: dict[str, int], prices: Prices | None = None) -> Choice:
    """The run's (micro-batch shape set, prompt buckets): a function of the config `cfg`, the Qwen3 `model`, the
    `device`, the training prompts' lengths and the step's sizes (prompt_len: the largest prompt bucket; resp_len:
    the responses' width; rollout: one prompt bucket's rollout programs by kind). prices: the model's
    (model_prices) unless given (`bench tune-shapes` measures them)."""
    algo = cfg.algorithm
    kinds = ("score", "reference", "gradient") if algo.kl_coef > 0 else ("score", "gradient")
    shares = prompt_shares(prompt_lengths, cfg.data.prompts_per_step)
    sets = candidates(micro, min_rows, prompt_len, resp_len)
    loads = {p: step_load(sets, step_rows=step_rows, mini_rows=algo.mini_batch_size, epochs=algo.ppo_epochs,
                          prompt_len=p, budget=cfg.rollout.max_new_tokens) for p in shares}
    if prices is None:
        prices = model_prices(model, device, micro=micro, seq_len=prompt_len + resp_len, kinds=kinds,
                              remat=cfg.model.remat != "none")
    threads = cfg.run.compile_threads or MODEL_THREADS.get(device.platform, MODEL_THREADS["tpu"])
    return choose(sets, loads, shares, prices, rollout=rollout_price(rollout, prices), steps=cfg.run.total_steps,
                  threads=threads, most_prompts=cfg.data.prompt_buckets, packed=algo.packing)
