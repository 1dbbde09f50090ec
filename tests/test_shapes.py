"""The run's layout (g2rl_jax/shapes) and its whole-run compile bill (aot/bill.py), against brute force and
hand-written NumPy: the plan over a shape set is the least-cost cut, the prompt buckets' shares are those of
enumerating every step, the choice is the argmin of the estimate written out again (grouped and packed), the
devices priced are the training mesh's, and the bill counts and prices each program of the layout. No program is
compiled here."""
import dataclasses
import itertools

import jax
import numpy as np
import pytest

from g2rl_jax import parallel
from g2rl_jax.aot import bill as bill_lib
from g2rl_jax.aot import parse_target
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.aot.report import Result
from g2rl_jax.config import MeshConfig, load_config
from g2rl_jax.plan import model_config
from g2rl_jax.rollout import engine
from g2rl_jax.shapes import choice as shapes_lib
from g2rl_jax.shapes import layouts
from g2rl_jax.shapes import prices as prices_lib
from g2rl_jax.shapes.layouts import PackShape
from g2rl_jax.shapes.prices import ESTIMATE_MFU
from g2rl_jax.shapes.step import step_shapes
from g2rl_jax.train import packing


# ------------------------------------------------------------------------------------------------ the candidates
@pytest.mark.parametrize("micro,min_rows,prompt_len,resp_len", [(64, 1, 16, 512), (16, 4, 1024, 8192), (8, 4, 16, 64)])
def test_candidates_stay_within_the_micro_batch_and_reach_the_width(micro, min_rows, prompt_len, resp_len):
    sets = shapes_lib.candidates(micro, min_rows, prompt_len, resp_len)
    assert next(iter(sets.values())).shapes == layouts.ShapeSet.full(micro, resp_len, min_rows).shapes
    counts = layouts.row_counts(micro, min_rows)
    ladder = set(layouts.width_ladder(resp_len))
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
                cuts(start + r, cost + (r + layouts.OVERHEAD_ROWS) * (prompt_len + min(fits)))

    cuts(0, 0.0)
    return best


def test_the_plan_over_each_candidate_is_the_least_cost_cut():
    rng = np.random.default_rng(0)
    sets = shapes_lib.candidates(8, 1, 32, 256)
    for _ in range(6):
        lengths = np.minimum(rng.geometric(1 / rng.uniform(8, 96), 16), 256)
        for name, s in sets.items():
            rows, widths, cost = layouts.group(lengths, 32, s)
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
    prices = prices_lib.Prices.from_score({"score": 2.0, "reference": 1.5}, {"score": 0.4, "reference": 0.3},
                                          units=17 * 1280, remat=True)
    assert prices.compile_s["gradient"] == prices_lib.GRADIENT_COMPILE * 2.0
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
        assert (choice.layout.name, choice.prompts) == best, (steps, best)
        assert {(e.name, e.prompts): e.run_s for e in choice.table} == pytest.approx(want)
    assert len(choice.layout.shapes) > 1 and choice.prompts == (128, 256)  # 1,000 steps: finer, both buckets


def test_packed_load_is_the_cost_of_the_plans_packing_cuts():
    """packed_load written out again: each draw's prompts (one per group, drawn from the training prompts) and
    long-tailed responses, cut by packing.plan_micros, summed micro_cost over the step and over every mini-batch of
    every epoch, averaged over the draws."""
    pool = np.array([5, 9, 12, 30, 31])
    packs = shapes_lib.packed_candidates(16, 2, 32, 128)
    assert len(packs) == 6 and list(packs)[0] == PackShape.of(16, 2, prompt_len=32, resp_len=128).name  # finest first
    got = shapes_lib.packed_load(packs, pool, group_size=4, step_rows=32, mini_rows=16, epochs=2, budget=128)
    for name, pack in packs.items():
        score = grads = 0.0
        for seed in range(shapes_lib.DRAWS):
            r_B = shapes_lib.long_tailed_lengths(32, 128, seed)
            p_B = np.repeat(np.random.default_rng(seed).choice(pool, 8), 4)
            cost = lambda n, r, pack=pack: sum((rows + layouts.OVERHEAD_ROWS) * width  # noqa: E731
                                               for rows, width, _, _ in packing.plan_micros(n, r, pack))
            score += cost(p_B + r_B, r_B)
            grads += 2 * (cost(p_B[:16] + r_B[:16], r_B[:16]) + cost(p_B[16:] + r_B[16:], r_B[16:]))
        assert got[name] == pytest.approx({"score": score / 4, "gradient": grads / 4}), name
    assert got[list(packs)[0]]["score"] <= min(v["score"] for v in got.values())  # the finest pads least


def test_choose_weighs_the_packed_layouts_against_the_grouped_ones():
    """algorithm.packing null: the least estimate of any layout, grouped (passes per prompt bucket) or packed (passes
    once, at the prompt buckets the grouped estimate takes when its passes compile once); true or false: that
    layout's least. The packed rows' estimate written out again."""
    sets = shapes_lib.candidates(16, 4, 256, 1024)
    lengths = np.r_[np.full(90, 100), np.full(10, 200)]
    shares = shapes_lib.prompt_shares(lengths, 4)
    loads = {p: shapes_lib.step_load(sets, step_rows=64, mini_rows=32, epochs=2, prompt_len=p, budget=1024)
             for p in shares}
    packs = shapes_lib.packed_candidates(16, 4, 256, 1024)
    packed_loads = shapes_lib.packed_load(packs, lengths, group_size=16, step_rows=64, mini_rows=32, epochs=2,
                                          budget=1024)
    prices = prices_lib.Prices({"score": 2.0, "gradient": 7.0}, {"score": 1e-5, "gradient": 3e-5})
    kw = dict(rollout=(40, 30.0), threads=4, packs=packs, packed_loads=packed_loads)
    for steps in (3, 300, 30_000):
        grouped = shapes_lib.choose(sets, loads, shares, prices, steps=steps, packing=False, **kw)
        either = shapes_lib.choose(sets, loads, shares, prices, steps=steps, packing=None, **kw)
        packed = shapes_lib.choose(sets, loads, shares, prices, steps=steps, packing=True, **kw)
        assert not grouped.packed and packed.packed
        once = {}  # the grouped estimate with the passes compiled once: it picks the packed layouts' buckets
        for prompts in shapes_lib.prompt_sets(shares):
            for name, s in sets.items():
                step = sum(share * (loads[min(p for p in prompts if p >= b)][name]["score"] * 1e-5
                                    + loads[min(p for p in prompts if p >= b)][name]["gradient"] * 3e-5)
                           for b, share in shares.items())
                once[name, prompts] = ((len(s.shapes) * 9.0 + len(prompts) * 30.0) / 4 + steps * step,
                                       len(s.shapes) * 2 + len(prompts) * 40)
        prompts = min(once, key=once.get)[1]
        assert packed.prompts == prompts
        want = {}
        for name, pack in packs.items():
            n = len(pack.micros)
            compile_s = (n * 9.0 * prices_lib.PACKED_COMPILE + len(prompts) * 30.0) / 4
            step = packed_loads[name]["score"] * 1e-5 + packed_loads[name]["gradient"] * 3e-5
            want[name] = compile_s + steps * step
        assert {e.name: e.run_s for e in packed.table if e.packed} == pytest.approx(want)
        assert packed.layout.name == min(want, key=want.get)
        assert either.chosen.run_s == min(grouped.chosen.run_s, packed.chosen.run_s)
        assert either.layout in (grouped.layout, packed.layout)
    assert len(packed.layout.micros) >= len(shapes_lib.choose(sets, loads, shares, prices, steps=3, packing=True,
                                                              **kw).layout.micros)  # longer runs: no coarser


def test_the_devices_priced_are_the_training_meshs(tmp_path):
    """Device.of counts the training mesh's chips (platform and peak by jax's device kind), not every device of
    the process: with mesh.rollout_devices the rollout's devices run no pass. The trainer's warm-up prices with
    it."""
    from g2rl_jax.train.warmup import RunWarmup

    v5p = parse_target("v5p-8").devices()  # 4 compile-only TPU chips
    three = prices_lib.Device.of(jax.sharding.Mesh(np.array(v5p[:3]), ("fsdp",)))  # the 4th samples
    assert three == prices_lib.Device("tpu", 459.0, 3)
    cfg = load_config("configs/demo.yaml", ["mesh.rollout_devices=2"])
    train_mesh, rollout_mesh = parallel.split_meshes(cfg.mesh)
    assert train_mesh.devices.size == 6 and rollout_mesh.devices.size == 2
    model, _ = model_config(cfg, None)
    warm = RunWarmup.for_run(cfg, model, train_mesh, tmp_path, [8, 9, 10])
    assert warm.device == prices_lib.Device("cpu", 0.0, 6)


# ------------------------------------------------------------------------------------------------ the price model
def test_model_prices_are_the_flop_model_written_out():
    """model_prices against the FLOP count written out in NumPy (float64): a forward's 2 x matmul params x tokens +
    4 x tokens x length x heads x head_dim x layers at the device's effective FLOP/s, per micro_cost unit."""
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    tpu = prices_lib.Device("tpu", 459.0, 4)
    prices = prices_lib.model_prices(model, tpu, micro=16, seq_len=2048, kinds=("score", "reference", "gradient"),
                                     remat=True)
    tokens = np.float64(16 * 2048)
    matmul = np.float64(model.num_params()) - (0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size)
    attention = 4 * tokens * 2048 * model.num_attention_heads * model.head_dim * model.num_hidden_layers
    flops = 2 * matmul * tokens + attention
    unit = flops / (4 * 459e12 * ESTIMATE_MFU) / layouts.micro_cost(16, 2048)
    assert prices.unit_s == pytest.approx({"score": unit, "reference": unit, "gradient": 4 * unit}, rel=1e-12)
    c = prices_lib.SCORE_COMPILE_S["tpu"]
    assert prices.compile_s == {"score": c, "reference": c, "gradient": prices_lib.GRADIENT_COMPILE * c}
    cpu = prices_lib.Device("cpu", 0.0, 8)  # a CPU host's 8 fake devices share its cores: priced as one host
    assert cpu.flops == prices_lib.CPU_FLOPS == prices_lib.Device("cpu", 0.0, 1).flops
    assert prices_lib.rollout_price({"segment": 4, "prefill": 1, "regroup": 10}, prices) == (
        15, pytest.approx(5 * c + 10 * prices_lib.MOVE_COMPILE * c))


def test_the_choice_is_a_function_of_the_config_device_and_prompts(monkeypatch):
    """choose_for reads no clock: the same inputs give the same choice with every timer broken; the device kind
    and the run's length move it, as the estimate says they should."""
    import time

    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused", "run.total_steps=10"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    lengths = np.r_[np.full(90, 100), np.full(10, 700)]
    kw = dict(step=step_shapes(cfg, parallel.make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])))
    tpu = prices_lib.Device("tpu", 459.0, 4)
    first = shapes_lib.choose_for(cfg, model, tpu, lengths, **kw)
    for clock in ("perf_counter", "time", "monotonic", "process_time"):
        monkeypatch.setattr(time, clock, lambda: (_ for _ in ()).throw(AssertionError("a clock was read")))
    again = shapes_lib.choose_for(cfg, model, tpu, lengths, **kw)
    monkeypatch.undo()
    assert (again.layout, again.prompts, again.table) == (first.layout, first.prompts, first.table)
    longer = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, total_steps=100_000))
    long_run = shapes_lib.choose_for(longer, model, tpu, lengths, **kw)
    assert len(long_run.layout.shapes) * len(long_run.prompts) > len(first.layout.shapes) * len(first.prompts)
    # the same config pinned to one compile thread: compiling costs more, so the set is no finer
    serial = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, compile_threads=1))
    assert len(shapes_lib.choose_for(serial, model, tpu, lengths, **kw).layout.shapes) <= len(first.layout.shapes)


# ------------------------------------------------------------------------------------------------ the bill
@pytest.fixture(scope="module")
def paper_run():
    """The 1.7B config for v5p-8 (fsdp 4) on 4 CPU devices: config, model, shapes, the largest programs."""
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused", "run.total_steps=1000",
                                                      "algorithm.packing=false"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    largest = programs_lib.step_programs(cfg, model, mesh, scope="largest")
    return cfg, model, step_shapes(cfg, mesh), largest


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
    n = len(b.choice.layout.shapes)
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
    assert b.choice.layout == PackShape.of(cfg.algorithm.micro_batch_size, s.shards,
                                           prompt_len=max(b.choice.prompts), resp_len=cfg.rollout.max_new_tokens)
    rows = len(b.choice.layout.micros)
    assert rows == 3 + 9  # 1,000 steps, the finest: 16, 8, 4 rows of the full width and 4 rows of 9 narrower ones
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
