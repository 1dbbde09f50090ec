"""The run's shape set (train/shapes.py) and its whole-run compile bill (aot/bill.py), against brute force and
hand-written NumPy: the plan over a shape set is the least-cost cut, the prompt buckets' shares are those of
enumerating every step, the choice is the argmin of the estimate written out again, and the bill counts and
prices each program of the set. No program is compiled here."""
import dataclasses
import itertools

import jax
import numpy as np
import pytest

from g2rl_jax import parallel
from g2rl_jax.aot import bill as bill_lib
from g2rl_jax.aot import parse_target
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.aot.report import ESTIMATE_MFU, Result
from g2rl_jax.config import MeshConfig, load_config
from g2rl_jax.plan import model_config
from g2rl_jax.rollout import engine
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import shapes as shapes_lib
from g2rl_jax.train.packing import PackShape


# ------------------------------------------------------------------------------------------------ the candidates
@pytest.mark.parametrize("micro,min_rows,prompt_len,resp_len", [(64, 1, 16, 512), (16, 4, 1024, 8192), (8, 4, 16, 64)])
def test_candidates_stay_within_the_micro_batch_and_reach_the_width(micro, min_rows, prompt_len, resp_len):
    sets = shapes_lib.candidates(micro, min_rows, prompt_len, resp_len)
    assert next(iter(sets.values())).shapes == micro_lib.ShapeSet.full(micro, resp_len, min_rows).shapes
    counts = micro_lib.row_counts(micro, min_rows)
    ladder = set(micro_lib.width_ladder(resp_len))
    for name, s in sets.items():
        assert s.resp_len == resp_len and {r for r, _ in s.shapes} <= set(counts), name
        assert {w for _, w in s.shapes} <= ladder, name  # coarser ladders are subsets of the finest
        assert any(w == resp_len and micro % r == 0 for r, w in s.shapes), name  # every batch has a cut
    assert len({s.shapes for s in sets.values()}) == len(sets)  # no set twice


def _brute_force(lengths, prompt_len, shapes) -> float:
    """Least micro_cost over every cut of the sorted rows into consecutive runs of the set's shapes."""
    order = np.sort(lengths)
    best = np.inf

    def cuts(start, cost):
        nonlocal best
        if start == len(order):
            best = min(best, cost)
        for r, ws in shapes.widths:
            fits = [w for w in ws if w >= order[min(start + r, len(order)) - 1]]
            if start + r <= len(order) and fits:
                cuts(start + r, cost + (r + micro_lib.OVERHEAD_ROWS) * (prompt_len + min(fits)))

    cuts(0, 0.0)
    return best


def test_the_plan_over_each_candidate_is_the_least_cost_cut():
    rng = np.random.default_rng(0)
    sets = shapes_lib.candidates(8, 1, 32, 256)
    for _ in range(6):
        lengths = np.minimum(rng.geometric(1 / rng.uniform(8, 96), 16), 256)
        for name, s in sets.items():
            rows, widths, cost = micro_lib.group(lengths, 32, s)
            assert sorted(np.concatenate(rows).tolist()) == list(range(16)), name
            assert set(zip(map(len, rows), widths)) <= set(s.shapes), name
            assert cost == _brute_force(lengths, 32, s), name


# ------------------------------------------------------------------------------------------------ prompt buckets
def test_prompt_shares_are_those_of_every_step():
    """Steps of 2 prompts drawn (with replacement) from 4 prompts: every one of the 16 steps enumerated."""
    lengths = [10, 20, 40, 70]
    counts: dict[int, int] = {}
    for pair in itertools.product(lengths, repeat=2):
        b = max(16, 1 << (max(pair) - 1).bit_length())
        counts[b] = counts.get(b, 0) + 1
    shares = shapes_lib.prompt_shares(lengths, 2)
    assert shares.keys() == counts.keys() and sum(shares.values()) == pytest.approx(1.0)
    for b, n in counts.items():
        assert shares[b] == pytest.approx(n / 16), b
    assert shapes_lib.prompt_sets(shares) == [(128,), (64, 128), (32, 64, 128), (16, 32, 64, 128)]
    assert [shapes_lib.pad_prompt(b, (32, 128)) for b in (16, 32, 64, 128)] == [32, 32, 128, 128]


# ------------------------------------------------------------------------------------------------ the choice
def test_choose_takes_the_least_estimated_run_time():
    """The estimate written out again in NumPy for every (prompt buckets, shapes) pair; `choose` takes its argmin."""
    sets = shapes_lib.candidates(16, 4, 256, 1024)
    shares = shapes_lib.prompt_shares(np.r_[np.full(90, 100), np.full(10, 200)], 4)
    loads = {p: shapes_lib.step_load(sets, step_rows=64, mini_rows=32, epochs=2, prompt_len=p, budget=1024)
             for p in shares}
    prices = shapes_lib.Prices.from_score({"score": 2.0, "reference": 1.5}, {"score": 0.4, "reference": 0.3},
                                          units=17 * 1280, remat=True)
    assert prices.compile_s["gradient"] == shapes_lib.GRADIENT_COMPILE * 2.0
    assert prices.unit_s["gradient"] == pytest.approx(4 * 0.4 / (17 * 1280))
    for steps, threads in ((5, 2), (1000, 32)):
        choice = shapes_lib.choose(sets, loads, shares, prices, rollout=(40, 30.0), steps=steps, threads=threads)
        want = {}
        for prompts in shapes_lib.prompt_sets(shares):
            for name, s in sets.items():
                n = len(s.shapes)
                compile_s = len(prompts) * (n * (2.0 + 1.5 + 7.0) + 30.0) / threads
                step = 0.0
                for b, share in shares.items():
                    pad = min(p for p in prompts if p >= b)
                    step += share * (loads[pad][name]["score"] * (prices.unit_s["score"] + prices.unit_s["reference"])
                                     + loads[pad][name]["gradient"] * prices.unit_s["gradient"])
                want[name, prompts] = compile_s + steps * step
        best = min(want, key=want.get)
        assert (choice.shapes.name, choice.prompts) == best, (steps, best)
        assert {(e.name, e.prompts): e.run_s for e in choice.table} == pytest.approx(want)
    assert len(choice.shapes.shapes) > 1 and choice.prompts == (128, 256)  # 1,000 steps: finer, both buckets


# ------------------------------------------------------------------------------------------------ the price model
def test_model_prices_are_the_flop_model_written_out():
    """model_prices against the FLOP count written out in NumPy (float64): a forward's 2 x matmul params x tokens +
    4 x tokens x length x heads x head_dim x layers at the device's effective FLOP/s, per micro_cost unit."""
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    tpu = shapes_lib.Device("tpu", 459.0, 4)
    prices = shapes_lib.model_prices(model, tpu, micro=16, seq_len=2048, kinds=("score", "reference", "gradient"),
                                     remat=True)
    tokens = np.float64(16 * 2048)
    matmul = np.float64(model.num_params()) - (0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size)
    attention = 4 * tokens * 2048 * model.num_attention_heads * model.head_dim * model.num_hidden_layers
    flops = 2 * matmul * tokens + attention
    unit = flops / (4 * 459e12 * ESTIMATE_MFU) / micro_lib.micro_cost(16, 2048)
    assert prices.unit_s == pytest.approx({"score": unit, "reference": unit, "gradient": 4 * unit}, rel=1e-12)
    c = shapes_lib.SCORE_COMPILE_S["tpu"]
    assert prices.compile_s == {"score": c, "reference": c, "gradient": shapes_lib.GRADIENT_COMPILE * c}
    cpu = shapes_lib.Device("cpu", 0.0, 8)  # a CPU host's 8 fake devices share its cores: priced as one host
    assert cpu.flops == shapes_lib.CPU_FLOPS == shapes_lib.Device("cpu", 0.0, 1).flops
    assert shapes_lib.Device.local().platform == "cpu"
    assert shapes_lib.rollout_price({"segment": 4, "prefill": 1, "regroup": 10}, prices) == (
        15, pytest.approx(5 * c + 10 * shapes_lib.MOVE_COMPILE * c))


def test_the_choice_is_a_function_of_the_config_device_and_prompts(monkeypatch):
    """choose_for reads no clock: the same inputs give the same choice with every timer broken; the device kind
    and the run's length move it, as the estimate says they should."""
    import time

    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused", "run.total_steps=10"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    lengths = np.r_[np.full(90, 100), np.full(10, 700)]
    kw = dict(micro=16, min_rows=4, prompt_len=1024, resp_len=8192, step_rows=256,
              rollout={"segment": 49, "prefill": 1, "start": 1, "decode_layers": 1, "regroup": 102})
    tpu = shapes_lib.Device("tpu", 459.0, 4)
    first = shapes_lib.choose_for(cfg, model, tpu, lengths, **kw)
    for clock in ("perf_counter", "time", "monotonic", "process_time"):
        monkeypatch.setattr(time, clock, lambda: (_ for _ in ()).throw(AssertionError("a clock was read")))
    again = shapes_lib.choose_for(cfg, model, tpu, lengths, **kw)
    monkeypatch.undo()
    assert (again.shapes, again.prompts, again.table) == (first.shapes, first.prompts, first.table)
    longer = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, total_steps=100_000))
    long_run = shapes_lib.choose_for(longer, model, tpu, lengths, **kw)
    assert len(long_run.shapes.shapes) * len(long_run.prompts) > len(first.shapes.shapes) * len(first.prompts)
    # the same config pinned to one compile thread: compiling costs more, so the set is no finer
    serial = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, compile_threads=1))
    assert len(shapes_lib.choose_for(serial, model, tpu, lengths, **kw).shapes.shapes) <= len(first.shapes.shapes)


# ------------------------------------------------------------------------------------------------ the bill
@pytest.fixture(scope="module")
def paper_run():
    """The 1.7B config for v5p-8 (fsdp 4) on 4 CPU devices: config, model, shapes, the largest programs."""
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused", "run.total_steps=1000",
                                                      "algorithm.packing=false"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    largest = programs_lib.step_programs(cfg, model, mesh, scope="largest")
    return cfg, model, programs_lib.step_shapes(cfg, mesh), largest


def test_the_bill_prices_what_program_counts_counts(paper_run):
    """The bill's programs are program_counts' (the count tests/test_program_count.py checks against a run), each
    priced at its kind's compiled program (the small ones as a move, a kind not compiled by the price model)."""
    cfg, model, s, largest = paper_run
    seconds = {p.kind: 3.0 + i for i, p in enumerate(largest)}
    results = [Result(p, seconds[p.kind], 0.0, lower_seconds=0.5) for p in largest]
    target = parse_target("v5p-8")
    b = bill_lib.bill(cfg, model, s, results, target, lengths=None)
    # the worst case (every prompt at 1,024 tokens): one prompt bucket; the read rungs from rollout.first_capacity
    assert (len(s.buckets), s.reads, b.choice.prompts) == (7, engine.read_ladder(8192, cfg.rollout.first_capacity),
                                                           (1024,))
    want = bill_lib.program_counts(cfg, model, s.shards, b.choice, 1024, bill_lib.param_shapes(cfg, model))
    assert b.counts == want
    eval_buckets = len(engine.batch_buckets(s.prompts * cfg.data.eval_samples, s.shards,
                                            cfg.data.eval_max_new_tokens))
    n = len(b.choice.shapes.shapes)
    assert want["segment"] == len(s.buckets) + eval_buckets
    assert (want["score"], want["reference"], want["gradient"]) == (n, n, n)
    price = {**bill_lib.model_seconds("tpu"), **seconds}
    price["small"] = price["regroup"]
    lower = {k: 0.5 for k in seconds}
    compile_s = sum(k * (price[kind] - lower.get(kind, 0.0)) for kind, k in want.items())
    lower_s = sum(k * lower.get(kind, 0.0) for kind, k in want.items())
    assert (b.compile_s, b.lower_s) == (pytest.approx(compile_s), pytest.approx(lower_s))
    longest = max(price[kind] - lower.get(kind, 0.0) for kind, k in want.items() if k)
    assert b.wall_s == pytest.approx(lower_s + max(longest, compile_s / 32))
    assert b.share == pytest.approx(b.wall_s / (b.wall_s + 1000 * b.step_s)) and 0 < b.share < 1
    # the passes priced by the FLOP model at ESTIMATE_MFU, as the trainer prices them
    assert b.passes_s == pytest.approx(b.choice.chosen.step_s) and b.decode_s > 0
    assert ESTIMATE_MFU > 0 and any("compile share" in line for line in b.lines())


def test_the_bill_prices_the_packed_passes_once(paper_run):
    """With algorithm.packing the passes are a program per packed (rows, width), once for every prompt bucket, and
    no micro-batch moves: the rollouts' moves are the only ones."""
    cfg, model, s, largest = paper_run
    packed = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, packing=True))
    results = [Result(p, 3.0, 0.0) for p in largest]
    b = bill_lib.bill(packed, model, s, results, parse_target("v5p-8"), lengths=np.array([100, 300, 600, 900]))
    rows = len(PackShape.of(cfg.algorithm.micro_batch_size, s.shards, prompt_len=max(b.choice.prompts),
                            resp_len=cfg.rollout.max_new_tokens).micros)
    assert rows == 3 + 9  # micro 16, 8, 4 rows of the full width and 4 rows of 9 narrower widths
    assert 1 <= len(b.choice.prompts) <= 2  # data.prompt_buckets=2 of the three buckets these prompts reach
    assert (b.counts["score"], b.counts["reference"], b.counts["gradient"]) == (rows, rows, rows)
    rollout = bill_lib.rollout_programs(packed, model, s.shards, b.choice.prompts, 1024)
    assert b.counts["regroup"] == rollout["regroup"] and b.counts["segment"] == rollout["segment"]
    assert b.programs < bill_lib.bill(cfg, model, s, results, parse_target("v5p-8"),
                                      lengths=np.array([100, 300, 600, 900])).programs


def test_the_decode_the_bill_prices_is_the_decode_loop(paper_run):
    cfg, _, s, _ = paper_run
    lengths = shapes_lib.long_tailed_lengths(s.step_rows, cfg.rollout.max_new_tokens, 0)
    segments = engine.decode_segments(lengths, s.rows, cfg.rollout.max_new_tokens, s.shards)
    assert lengths.max() == cfg.rollout.max_new_tokens and sum(n for *_, n in segments) == lengths.max() - 1
    assert {r for r, _, _ in segments} <= set(s.buckets)
    assert all(t + n == t_next for (_, t, n), (_, t_next, _) in zip(segments, segments[1:]))  # one after another
    # every halving goes to the next bucket: the moves the set holds
    assert all(b in (a, engine.batch_bucket(a // 2, s.shards)) for (a, _, _), (b, _, _) in zip(segments, segments[1:]))
