"""aot/first_step.py: the programs a step meets are programs the compile check lists (by name), so the time to first
step prices each one at its own compile seconds when `--programs all` compiled it, and the decode segments it counts
are those the sampler's decode loop runs (engine.decode_schedule, checked against generate in
tests/test_rollout_segments.py)."""
import jax
import pytest

from g2rl_jax import parallel
from g2rl_jax.aot import first_step
from g2rl_jax.aot import programs as programs_lib
from g2rl_jax.aot.report import Result
from g2rl_jax.config import MeshConfig, load_config
from g2rl_jax.plan import model_config
from g2rl_jax.rollout import engine, prewarm


@pytest.fixture(scope="module")
def paper_step():
    """The 1.7B config's step on 4 CPU devices (fsdp 4, as on v5p-8): config, shapes, every program's name."""
    cfg = load_config("configs/qwen3_1p7b_g2rl.yaml", ["model.path=unused"])
    model, _ = model_config(cfg, "qwen3-1.7b")
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    progs = programs_lib.step_programs(cfg, model, mesh, scope="all")
    return cfg, programs_lib.step_shapes(cfg, mesh), {p.name: p for p in progs}


def test_every_program_a_step_meets_is_one_the_check_compiles(paper_step):
    cfg, s, names = paper_step
    for seed in range(3):
        lengths = first_step.long_tailed_lengths(s.step_rows, cfg.rollout.max_new_tokens, seed)
        meets = first_step.step_meets(cfg, s, lengths)
        assert meets.names <= names.keys(), sorted(meets.names - names.keys())
        segments = {n for n in meets.names if n.startswith("decode segment")}
        schedule = engine.decode_schedule(lengths, s.rows, cfg.rollout.max_new_tokens, s.shards)
        assert segments == {f"decode segment {r} rows x {c} slots" for r, c in schedule}
        assert lengths.max() == cfg.rollout.max_new_tokens  # the longest response at the budget
        # the steps each segment runs add up to the decode loop's (token 0 comes from the prefill's logits)
        steps = [n for _, _, n in engine.decode_segments(lengths, s.rows, cfg.rollout.max_new_tokens, s.shards)]
        assert min(steps) >= 1 and sum(steps) == lengths.max() - 1, steps


def test_a_higher_first_capacity_runs_fewer_segments(paper_step):
    cfg, s, _ = paper_step
    lengths = first_step.long_tailed_lengths(s.step_rows, cfg.rollout.max_new_tokens, 0)
    runs = {first: engine.decode_segments(lengths, s.rows, cfg.rollout.max_new_tokens, s.shards, first)
            for first in (128, 512)}
    assert runs[512][0][1] == 512 and len(runs[512]) == len(runs[128]) - 2  # 128 and 256 are skipped
    assert [c for _, c, _ in runs[128]] == [c for _, c, _ in engine.decode_segments(
        lengths, s.rows, cfg.rollout.max_new_tokens, s.shards)]  # the default is FIRST_CAPACITY = 128


def test_later_steps_compile_only_new_shapes(paper_step):
    cfg, s, _ = paper_step
    firsts = first_step.first_steps(cfg, s, steps=4)
    seen = set()
    for meets in firsts:
        assert not meets.names & seen
        seen |= meets.names
    union = set().union(*(first_step.step_meets(cfg, s, first_step.long_tailed_lengths(
        s.step_rows, cfg.rollout.max_new_tokens, i)).names for i in range(4)))
    assert seen == union


def test_estimate_prices_each_program_and_the_warm_ups(paper_step):
    """Every program of the step priced at its own seconds (lowering 1 s of each), by hand: one at a time the sum;
    with the warm-ups on n threads the programs neither warm-up compiles one at a time, plus per pool the lowerings
    and the compiles spread over n threads, the segment pool over every reachable segment when it fits."""
    cfg, s, names = paper_step
    meets = first_step.step_meets(cfg, s, first_step.long_tailed_lengths(s.step_rows, cfg.rollout.max_new_tokens, 0))
    seconds = {name: 2.0 + i % 7 for i, name in enumerate(sorted(names))}
    results = [Result(p, seconds[n], 0.0, lower_seconds=1.0) for n, p in names.items()]
    reachable = sum(p.kind == "segment" for p in names.values())
    est = first_step.estimate(meets, results, threads=(8, 32), segments=reachable)
    kind = {n: names[n].kind for n in meets.names}
    small = max(seconds[n] for n, p in names.items() if p.kind == "regroup") * len(meets.small)
    assert est.measured and est.serial_s == pytest.approx(sum(seconds[n] for n in meets.names) + small)
    top_segment = max(seconds[n] for n, p in names.items() if p.kind == "segment")
    for n in (8, 32):
        warmed = [seconds[m] for m in meets.names if kind[m] in first_step.WARMED]
        segs = [seconds[m] for m in meets.names if kind[m] == "segment"]
        rest = est.serial_s - sum(warmed) - sum(segs)
        pool = len(warmed) + max(max(warmed) - 1, (sum(warmed) - len(warmed)) / n)
        if reachable <= prewarm.ROUNDS * n:  # every reachable segment, each at the slowest segment's seconds
            seg = reachable + max(top_segment - 1, reachable * (top_segment - 1) / n)
        else:
            seg = sum(segs)
        assert est.warm_s[n] == pytest.approx(rest + pool + seg), n
        assert est.unwarmed_segments_s[n] == pytest.approx(rest + pool + sum(segs)), n
    assert reachable == 49 and est.warm_s[32] < est.warm_s[8]  # 49 fit in 4 rounds of 32 threads, not of 8
