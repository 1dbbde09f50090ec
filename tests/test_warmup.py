"""A run compiles once, at its first step (train/warmup.py, rollout/prewarm.py), on the tiny trainer of test_train.py
(CPU, 8 devices, mesh 2 x 2 x 2), with a policy whose responses are long-tailed (lengths 1 to the 64-token budget):
the warm-up compiles every program of the run's shape set on its own threads, later steps compile nothing although
they meet shapes the first step did not, a run resumed from a checkpoint compiles nothing after its own first step,
and the step's numbers are those of a step compiled one program at a time."""
import collections
import dataclasses
import json
import logging
import time

import jax
import numpy as np
import pytest
from test_train import DETERMINISTIC, ROOT, assets, config, overrides  # noqa: F401 - assets is a fixture

from g2rl_jax.config import ConfigError
from g2rl_jax.rollout import prewarm
from g2rl_jax.shapes import choice as choice_lib
from g2rl_jax.shapes import record
from g2rl_jax.shapes.layouts import ShapeSet
from g2rl_jax.shapes.record import CHOICE_FILE
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train.compiles import COMPILE_EVENT
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.metrics import read_metrics
from g2rl_jax.train.sampling_rounds import SamplingRounds

HEAVY = ("score_micro", "ref_micro", "accumulate")
# 16 responses of up to 64 tokens in micro-batches of 8 or 4 rows; decode buckets 16, 8, 4
SHAPES = {"data.prompts_per_step": 4, "rollout.max_new_tokens": 64, "algorithm.mini_batch_size": 8,
          "algorithm.micro_batch_size": 8, "run.checkpoint_every": 1, "run.strict_compiles": True}
EOS_BIAS = 0.3  # with the test policy: lengths from 1 to 64, about 22 on average


class Compiles(logging.Handler):
    """XLA compiles per (jitted function, thread) while attached (jax_log_compiles's records)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.by = collections.Counter()

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of jit("):
            self.by[msg.split("jit(", 1)[1].split(")", 1)[0], record.threadName.startswith("compile")] += 1

    def __enter__(self):
        self.old = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("jax").removeHandler(self)
        jax.config.update("jax_log_compiles", self.old)


class BackendCompiles:
    """Backend compiles (jax.monitoring's event, any thread) while entered, with when each ended: the count the
    issue asks to be 0 after the warm-up step."""

    def __enter__(self):
        self.events = []
        self._listen = lambda event, _, **kw: (self.events.append((time.perf_counter(), kw.get("fun_name")))
                                               if event == COMPILE_EVENT else None)
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    @property
    def names(self) -> list:
        return [name for _, name in self.events]

    def after(self, start: float) -> list:
        return [name for t, name in self.events if t > start]


def step_starts(trainer) -> list[float]:
    """When each step the trainer runs from now on starts (its step_stages call)."""
    starts, real = [], trainer.step_stages
    trainer.step_stages = lambda step: starts.append(time.perf_counter()) or real(step)
    return starts


@pytest.fixture(scope="module")
def policy(assets):  # noqa: F811
    """test_train's tiny policy, every token embedding given +1 on dimension 0 and end-of-text EOS_BIAS more, so
    that each step draws some short and some long responses."""
    import safetensors.torch as st
    from test_train import VOCAB

    from g2rl_jax.demo.tokenizer import make_tokenizer

    from hf_tiny import make_tiny_qwen3_dir

    tok = make_tokenizer()
    path = make_tiny_qwen3_dir(assets["root"] / "long_tailed", vocab_size=VOCAB, max_position_embeddings=128,
                               num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=16,
                               num_attention_heads=2, num_key_value_heads=2)
    weights = st.load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["model.embed_tokens.weight"][tok.eos_token_id, 0] = 1.0 + EOS_BIAS
    weights["model.norm.weight"][0] = 1.0
    st.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(path)
    return path


def fresh_process(monkeypatch):
    """What a new process starts with: nothing compiled in memory (the persistent cache stays, as on a relaunch)."""
    jax.clear_caches()
    monkeypatch.setattr(prewarm, "WARMED", set())
    monkeypatch.setattr(prewarm, "_ROWS", {})


def _config(assets, policy, out, threads, steps):  # noqa: F811
    return config(assets, out, steps=steps, **{"model.path": str(policy), "run.compile_threads": threads, **SHAPES})


def _shapes_met(trainer, result) -> set:
    """The micro-batch shapes and decode segments a step ran."""
    algo = trainer.cfg.algorithm
    plans = [micro_lib.plan_for(result.batch, algo.micro_batch_size, shapes=trainer.warmup.layout)]
    for start in range(0, result.batch.rewards.shape[0], algo.mini_batch_size):
        mini = result.batch.response_mask[start:start + algo.mini_batch_size]
        plans.append(micro_lib.plan_micro(np.asarray(mini), algo.micro_batch_size, shapes=trainer.warmup.layout,
                                          min_rows=micro_lib.row_shards(result.batch.rewards)))
    micro = {(len(rows), w) for plan in plans for rows, w in zip(plan.rows, plan.widths)}
    return micro | {("segment", rows) for rows in result.rollout.segments}


@pytest.fixture(scope="module")
def steps(assets, policy, tmp_path_factory):  # noqa: F811
    """Three steps stage by stage, with every micro-batch shape (the set a previous launch left in the run
    directory: 8 or 4 rows x 16, 32 or 64 tokens): the first under jax_log_compiles (who compiled what, on which
    thread), the next two under a backend-compile counter."""
    out = tmp_path_factory.mktemp("steps") / "run"
    with pytest.MonkeyPatch.context() as mp:
        fresh_process(mp)
        trainer = Trainer(_config(assets, policy, out, threads=2, steps=3))
        key = {"micro": 8, "min_rows": 4, "resp_len": 64, "prompts": sorted(trainer.warmup.shares)}
        trainer.warmup.choice_file.write_text(json.dumps({"key": key, "name": "4/octave x all",
                                                          "prompts": [max(trainer.warmup.shares)]}))
        with Compiles() as first:
            results = [trainer.step_stages(0)]
        with BackendCompiles() as later:
            results += [trainer.step_stages(1), trainer.step_stages(2)]
        trainer.close()
    return trainer, results, first.by, later.names


def test_the_first_step_compiles_the_whole_set_on_the_pool(steps):
    trainer, _, first, _ = steps
    assert trainer.warmup.layout.shapes == ShapeSet.full(8, 64, 4).shapes  # as the file said
    assert trainer.warmup.choice is None
    in_pool = {fn: first[fn, True] for fn in HEAVY}
    assert in_pool == dict.fromkeys(HEAVY, 6), in_pool  # every shape of the set, once each
    assert first["apply_gradients", True] == 1 and first["_segment", True] >= 3
    in_step = {fn: first[fn, False] for fn in (*HEAVY, "apply_gradients", "_segment",
                                               "_regroup", "_live_rows")}
    assert in_step == dict.fromkeys(in_step, 0), in_step  # the step's own calls compiled none of them again
    assert all(t.error is None for t in trainer.warmup.timings)


def test_later_steps_compile_nothing_though_they_meet_new_shapes(steps):
    trainer, results, _, later = steps
    first, rest = _shapes_met(trainer, results[0]), set().union(*(_shapes_met(trainer, r) for r in results[1:]))
    lengths = [np.asarray(r.rollout.completion_lengths) for r in results]
    assert all(x.min() < 16 and x.max() > 32 for x in lengths), lengths  # long-tailed, every step
    assert rest - first, (first, rest)  # without the warm-up these would have compiled
    assert later == [], later


@pytest.fixture(scope="module")
def resumed(assets, policy, tmp_path_factory):  # noqa: F811
    """A 4-step run stopped after step 2 (its checkpoint), then resumed in a fresh process state for steps 3 and 4,
    each launch under a backend-compile counter that knows when each step started."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    with pytest.MonkeyPatch.context() as mp:
        fresh_process(mp)
        first = Trainer(_config(assets, policy, out, threads=2, steps=4))
        first_starts = step_starts(first)
        with BackendCompiles() as first_compiles:
            first.run(stop_after=2)
        fresh_process(mp)
        again = Trainer(_config(assets, policy, out, threads=2, steps=4))
        assert again.resume() == 2
        again_starts = step_starts(again)
        with BackendCompiles() as again_compiles:
            again.run()
    return (read_metrics(out), first_compiles.after(first_starts[1]), again_compiles.after(again_starts[1]), first,
            again)


def test_a_resumed_run_compiles_nothing_after_its_first_step(resumed):
    records, after_first, after_resumed, first, again = resumed
    compiled = {r["step"]: r["programs_compiled"] for r in records}
    assert compiled[1] > 0 and compiled[2] == 0 and after_first == [], after_first  # first launch: step 1 compiles
    assert compiled[3] > 0 and compiled[4] == 0 and after_resumed == [], after_resumed  # the resumed one: step 3
    assert all(r["compile_seconds"] >= 0 for r in records) and records[0]["compile_seconds"] > 0
    # the first launch measured and chose the set; the resumed one read it back (train/warmup.py CHOICE_FILE)
    assert first.warmup.choice is not None and again.warmup.choice is None
    assert again.warmup.layout == first.warmup.layout


def test_warmup_changes_no_number(steps, assets, policy, tmp_path):  # noqa: F811
    """One thread (every program compiled in turn) against the pool: the same set, the same numbers."""
    trainer, results, _, _ = steps
    with pytest.MonkeyPatch.context() as mp:
        fresh_process(mp)
        cfg = _config(assets, policy, tmp_path / "run", threads=1, steps=3)
        pinned = dataclasses.replace(cfg.run, shapes_file=str(trainer.warmup.choice_file))  # the pool run's set
        serial = Trainer(dataclasses.replace(cfg, run=pinned))
        plain = serial.step_stages(0)
        serial.close()
    assert serial.warmup.layout == trainer.warmup.layout and serial.warmup.source == "pinned"
    recorded = json.loads(serial.warmup.choice_file.read_text())
    assert (recorded["name"], recorded["source"]) == (trainer.warmup.layout.name, "pinned")  # the run records it
    key = json.loads(trainer.warmup.choice_file.read_text())["key"]
    names, buckets = [trainer.warmup.layout.name], sorted(trainer.warmup.shares)
    with pytest.raises(ConfigError, match=r"run.shapes_file=.* holds .* tune it again"):
        record.read_record(trainer.warmup.choice_file, {**key, "micro": 4}, names, buckets, pinned=True)
    with pytest.raises(ConfigError, match="no such file"):
        record.read_record(tmp_path / "absent.json", key, names, buckets, pinned=True)
    for key in DETERMINISTIC:
        if key in results[0].metrics:
            assert results[0].metrics[key] == plain.metrics[key], key


def _untimed(path) -> list[str]:
    """metrics.jsonl's lines without their timing fields (seconds, throughput), each re-written as sorted JSON."""
    out = []
    for line in path.read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items() if "second" not in k}
        out.append(json.dumps(record, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def twice(assets, policy, tmp_path_factory):  # noqa: F811
    """Two fresh 2-step runs of one config, the second beside two busy Python loops and with each step's rewards
    computed before its passes, not beside them (train/sampling_rounds.PendingRewards): their run directories."""
    import subprocess
    import sys

    dirs = []
    for busy in (0, 2):
        out = tmp_path_factory.mktemp(f"fresh_busy{busy}") / "run"
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            with pytest.MonkeyPatch.context() as mp:
                fresh_process(mp)
                if busy:  # the order before the overlap: the rewards, then the passes
                    mp.setattr(Trainer, "_sample", lambda self, step, overlap=False: SamplingRounds._sample(self, step))
                cfg = _config(assets, policy, out, threads=2, steps=2)
                Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, eval_every=0))).run()
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        dirs.append(out)
    return dirs


def test_two_fresh_runs_give_the_same_numbers_under_any_load_with_the_rewards_beside_the_passes_or_not(twice):
    quiet, busy = twice
    assert (quiet / CHOICE_FILE).read_bytes() == (busy / CHOICE_FILE).read_bytes()
    assert json.loads((quiet / CHOICE_FILE).read_text())["source"] == "model"
    assert _untimed(quiet / "metrics.jsonl") == _untimed(busy / "metrics.jsonl")
    assert len(_untimed(quiet / "metrics.jsonl")) == 2


def test_tune_shapes_writes_a_file_a_run_can_pin(steps, assets, policy, tmp_path):  # noqa: F811
    """`bench tune-shapes` measures on this machine and writes a shape file for the run's sizes (the only place a
    clock enters the choice)."""
    from g2rl_jax.bench import tune_shapes

    trainer = steps[0]
    out = tmp_path / "shapes.json"
    args = overrides(assets, tmp_path / "unused", steps=3, **{"model.path": str(policy), **SHAPES})
    assert tune_shapes.main(["--config", str(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml"), "--out", str(out),
                             "--repeats", "1", *args]) == 0
    saved = json.loads(out.read_text())
    assert saved["source"] == "tuned" and saved["key"] == json.loads(trainer.warmup.choice_file.read_text())["key"]
    layouts = trainer.warmup.layouts()
    assert set(layouts) == set(choice_lib.candidates(8, 4, max(trainer.warmup.shares), 64))  # packing off: grouped
    assert record.read_record(out, saved["key"], list(layouts), sorted(trainer.warmup.shares),
                              pinned=True) == (saved["name"], tuple(saved["prompts"]))
    assert [tuple(x) for x in saved["shapes"]] == list(layouts[saved["name"]].shapes)
