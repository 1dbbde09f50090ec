"""Multi-host training for real: two `python -m g2rl_jax.train` processes on localhost joined by jax.distributed
(CPU, gloo collectives), 4 fake devices each, one (2,2,2) mesh over the 8 global devices; against one process with
8 devices and the same mesh. Tiny random Qwen3 with the demo tokenizer, as in test_train.py.

Checks: the deterministic metrics (and the validation mean@k, on 5 prompts so the last chunk needs padding) of
the 2-process run, which writes to a bucket on a GCS emulator as a pod's hosts would, equal the 1-process run; only
process 0 wrote metrics; rerunning the 2-process command with one more step resumes from its Orbax multi-host
checkpoint in the bucket (both processes' data-iterator states) and its next step equals the 1-process run's. These
runs pack their passes (algorithm.packing, as the 1.7B config does; each packed micro-batch's rows split over both
processes' devices). With LoRA (the grouped passes, the default layout), 2 processes equal one device. Every
2-process run is strict (run.strict_compiles): a compile after its warm-up step fails it. Also: start-up errors for
partial distributed.* settings. The processes are started by tests/_helpers.py (run_processes).
"""
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from g2rl_jax import parallel, storage
from g2rl_jax.config import DistributedConfig, MeshConfig
from g2rl_jax.demo.tokenizer import make_tokenizer
from g2rl_jax.train.metrics import read_metrics

from _helpers import process_env, run_processes, trainer_args
from hf_tiny import make_tiny_qwen3_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 2
HANG_S = 1800  # a hang guard only: on a loaded 2-core machine one run has taken more than 4 minutes
DETERMINISTIC = ("accuracy", "reward", "loss", "kl", "entropy", "response_length", "novelty", "clip_fraction",
                 "approx_kl", "grad_norm", "learning_rate", "groups_kept", "skipped_updates")
STRICT = ("run.strict_compiles=true",)  # the two-process runs: a compile after the warm-up step raises
# The packed passes, as the 1.7B config runs them on a pod's hosts; micro-batches of 4 rows, the mesh's 4 row shards
# (data x fsdp), so that every packed micro-batch's rows split over both processes' devices (2 rows: replicated).
PACKED = ("algorithm.packing=true", "algorithm.micro_batch_size=4")
PACKS = "pack whole sequences"  # process 0's line naming the packed layout (train/warmup.py)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost_assets")
    tok = make_tokenizer()
    vocab = -(-len(tok) // 64) * 64
    policy = make_tiny_qwen3_dir(root / "policy", vocab_size=vocab, max_position_embeddings=128,
                                 num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=16,
                                 num_attention_heads=2, num_key_value_heads=2)
    tok.save_pretrained(policy)
    evalset = root / "eval.jsonl"  # 5 prompts: the last validation chunk is padded to split over the 2 hosts
    evalset.write_text("".join(json.dumps({"problem": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                               for a, b in ((12, 30), (7, 8), (55, 21), (3, 96), (40, 40))))
    return {"policy": policy, "eval": evalset}


def _cmd(assets, out, steps, extra=()):
    ov = {"run.output_dir": out, "run.total_steps": steps, "run.checkpoint_every": 1, "run.eval_every": STEPS,
          "run.keep_checkpoints": 2, "model.path": assets["policy"], "model.compute_dtype": "float32",
          "model.kv_cache_dtype": "float32", "model.remat": "none", "data.train_dataset": "demo",
          "data.prompt_template": "plain", "data.prompts_per_step": 4, "rollout.num_samples": 4,
          "rollout.max_new_tokens": 8, "algorithm.mini_batch_size": 8, "algorithm.micro_batch_size": 2,
          "algorithm.exploration": "g2rl", "optim.learning_rate": 1e-3, "mesh.data": 2, "mesh.fsdp": 2,
          "mesh.tensor": 2, "data.eval_datasets": assets["eval"], "data.eval_samples": 2,
          "data.eval_max_new_tokens": 8, "data.eval_temperature": 1.0,
          "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0,  # a constant LR: total_steps changes nothing
          "algorithm.packing": False}  # the grouped passes; the `runs` fixture's runs pack (PACKED)
    return [sys.executable, "-m", "g2rl_jax.train", "--config", str(ROOT / "configs" / "qwen3_1p7b_g2rl.yaml"),
            *[f"{k}={v}" for k, v in ov.items()], *extra]




def _run_two_processes(assets, out, steps, extra=()) -> list[str]:
    """The 2-process run, strict (run.strict_compiles): a compile after its warm-up step fails it, naming the
    program (both processes run the same steps, so each would raise). Its processes' logs."""
    return run_processes(lambda i, port: _cmd(assets, out, steps, [*extra, *STRICT, *trainer_args(i, port)]),
                         timeout=HANG_S)


@pytest.fixture(scope="module")
def runs(assets, gcs, tmp_path_factory):
    """The 2-process run writes to a bucket (a pod's hosts share no disk: run.output_dir=gs://...), on a real GCS
    server on loopback (g2rl_jax/bench/gcs_emulator.py); the 1-process run to a local directory. Both pack
    (PACKED): the 2-process run's tests are also those of the packed passes on several processes."""
    root = tmp_path_factory.mktemp("multihost_runs")
    start = len(gcs.proxy.log)
    logs = _run_two_processes(assets, gcs.url("multihost/two"), STEPS, PACKED)
    requests = gcs.proxy.log[start:]
    assert PACKS in logs[0], logs[0][-4000:]
    assert PACKS in _run_one_process(assets, root / "one", STEPS + 1, PACKED)
    return {"two": gcs.url("multihost/two"), "one": root / "one", "requests": requests}


def test_process_1_probes_the_bucket_under_process_0s_lease(runs):
    """Process 1 writes its probe of run.output_dir (both clients) only once process 0 took the run lock, so that
    the probe passes the lease's fence: a launch frozen while process 1 started, thawed after another launch took
    the run over, writes nothing (the chaos soak once counted such a probe). Process 0 probes before the lock."""
    run = runs["two"].split("://", 1)[1]
    done = [r for r in runs["requests"] if r.kind in ("upload", "delete") and 200 <= r.status < 300]
    lock = min(r.t for r in done if r.obj == f"{run}/run.lock")
    probes = {i: [r.t for r in done if (r.obj or "").startswith(f"{run}/.write_test.{i}.")] for i in (0, 1)}
    assert len(probes[0]) == len(probes[1]) == 4, probes  # each: an object per client, written and deleted
    assert max(probes[0]) < lock < min(probes[1]), (probes, lock)


def _run_one_process(assets, out, steps, extra=(), devices=8) -> str:
    """The 1-process run; its stderr."""
    one = subprocess.run(_cmd(assets, out, steps, extra), env=process_env(devices), capture_output=True, text=True,
                         timeout=HANG_S)
    assert one.returncode == 0, one.stderr[-4000:]
    return one.stderr


def _assert_same(got, want, keys):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for rg, rw in zip(got, want):
        for key in keys:
            assert (key in rg) == (key in rw), key
            if key in rw:
                np.testing.assert_allclose(rg[key], rw[key], rtol=1e-5, atol=1e-5, err_msg=f"step {rw['step']} {key}")


def test_two_processes_equal_one_process(runs):
    two, one = read_metrics(runs["two"]), read_metrics(runs["one"])[:STEPS + 1]
    assert [r["step"] for r in two] == list(range(STEPS + 1))  # step 0: the validation before any update
    val = sorted(k for k in one[-1] if k.startswith("val/"))  # mean@2 and the response shares of the validation
    assert [k.rsplit("/", 1)[-1] for k in val] == ["format_fraction", "junk_fraction", "mean@2",
                                                   "truncated_fraction"], one[-1].keys()
    _assert_same(two, one, DETERMINISTIC + tuple(val))


def test_only_process_0_writes_and_both_checkpoint(runs):
    """In the bucket: one metrics file and one events file (process 0's), both processes' iterator states, no lock
    and no write probe left."""
    names = storage.names(runs["two"])
    assert [n for n in names if n.startswith("metrics")] == ["metrics.jsonl"]
    assert not any(n.startswith((".write_test", "run.lock")) for n in names), names
    assert len(storage.names(f"{runs['two']}/tensorboard")) == 1
    data = f"{runs['two']}/checkpoints/{STEPS}/data"
    assert [n for n in storage.names(data) if n.startswith("process_")] == ["process_0-of-2.json",
                                                                            "process_1-of-2.json"]


def test_two_processes_resume_from_the_bucket(assets, runs):
    """The 2-process run continues from its step-STEPS checkpoint in the bucket (each process its own iterator
    state); with a constant LR its next step, the last, and that step's validation must equal step STEPS + 1 of the
    uninterrupted 1-process run."""
    _run_two_processes(assets, runs["two"], STEPS + 1, PACKED)
    two, one = read_metrics(runs["two"]), read_metrics(runs["one"])
    assert [r["step"] for r in two] == list(range(STEPS + 2))
    val = tuple(k for k in one[STEPS + 1] if k.startswith("val/"))  # a run's last step validates
    assert len(val) == 4, one[STEPS + 1].keys()
    _assert_same(two[STEPS + 1:], one[STEPS + 1:], DETERMINISTIC + val)


LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.base_dtype=float32")


def test_lora_two_processes_equal_one_device(assets, tmp_path):
    """LoRA (adapters only trained, the reference = the base with adapters off) on 2 processes x 4 devices, the
    (2,2,2) mesh, gives the numbers of one process on one device. (One process with the 8-device mesh against one
    device: tests/test_lora_train.py.)"""
    one_device = (*LORA, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1")
    _run_two_processes(assets, tmp_path / "two", STEPS, LORA)
    _run_one_process(assets, tmp_path / "one", STEPS, one_device, devices=1)
    one = read_metrics(tmp_path / "one")
    assert one[-1]["kl"] > 0
    _assert_same(read_metrics(tmp_path / "two"), one, DETERMINISTIC)


def test_a_peer_killed_before_the_first_collective_ends_process_0_in_one_line(assets, tmp_path):
    """Process 0 waits out a stale lock (another host's, renewed just now) while process 1 waits for it; process 1 is
    killed meanwhile. Process 0 takes the run over and meets the dead peer at the setup's first host collective: it
    stops at once with the peer-lost line and exit 76 (relaunch), no traceback. (The chaos soak's one human step:
    an untyped gloo error in the setup, a traceback, then jax.distributed's shutdown barrier waiting out the peer's
    heartbeat and an abort: 88 s here, more than 180 s in the soak.)"""
    import time

    from g2rl_jax import localhost
    from g2rl_jax.control.exits import Exit
    from g2rl_jax.control.runlock import LOCK_FILE

    out = tmp_path / "run"
    storage.write_text(out / LOCK_FILE, json.dumps({"host": "vm-old", "pid": 7, "since": "then", "lease_seconds": 9,
                                                    "renewed": time.time()}) + "\n")
    cmd = lambda i, port: _cmd(assets, out, 1, ["run.lock_lease_seconds=9", *trainer_args(i, port)])  # noqa: E731
    with localhost.Processes(cmd, devices=4, env=process_env(4)) as procs:
        deadline = time.monotonic() + 300
        while "waiting up to 9 s (its lease)" not in procs.log(0) and time.monotonic() < deadline:
            assert procs.procs[0].poll() is None, procs.log(0)[-3000:]
            time.sleep(0.2)
        procs.procs[1].kill()
        killed = time.monotonic()
        code = procs.wait(180, [0])[0]
        log, seconds = procs.log(0), time.monotonic() - killed
    assert code == Exit.PEER_LOST, (code, log[-4000:])
    assert "a process of this run is gone (Gloo" in log and "Traceback" not in log, log[-4000:]
    assert seconds < 9 + 60, seconds  # the lease it waits out, and the stop's wait for the other process


def test_a_process_whose_peer_never_joins_ends_after_the_join_timeout(assets, tmp_path):
    """Process 1 of 2 never starts (killed before it joined): process 0 waits distributed.join_timeout_seconds for
    it, then JAX aborts it (134: a supervisor relaunches with backoff), instead of JAX's default 300 s."""
    import time

    from g2rl_jax import localhost

    cmd = _cmd(assets, tmp_path / "run", 1, ["distributed.join_timeout_seconds=5",
                                             *trainer_args(0, localhost.free_port())])
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=process_env(4), capture_output=True, text=True, timeout=240)
    seconds = time.monotonic() - t0
    assert done.returncode == -6, (done.returncode, done.stderr[-3000:])  # SIGABRT: 134 in a shell
    assert "DEADLINE_EXCEEDED" in done.stderr and seconds < 5 + 60, (seconds, done.stderr[-3000:])


@pytest.mark.parametrize("kwargs,match", [
    ({"num_processes": 2}, r"distributed.num_processes set but distributed.coordinator_address, "
                           r"distributed.process_id not"),
    ({"coordinator_address": "127.0.0.1:1", "process_id": 0}, "distributed.num_processes not"),
])
def test_partial_distributed_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        parallel.initialize_distributed(DistributedConfig(**kwargs))


def test_no_settings_off_tpu_is_one_process():
    assert not parallel.on_tpu_vm()
    assert parallel.initialize_distributed(DistributedConfig()) is False


def test_start_up_dispatch(monkeypatch):
    """Which jax.distributed.initialize call each setting makes (the explicit one runs for real above)."""
    calls = []
    monkeypatch.setattr(parallel.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")  # GKE TPU workers: auto-detected, only the join's bound
    assert parallel.on_tpu_vm() and parallel.initialize_distributed(DistributedConfig()) is True
    assert calls == [{"initialization_timeout": 300}]
    monkeypatch.setattr(parallel.jax.config, "update", lambda name, value: calls.append({name: value}))
    explicit = DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3,
                                 join_timeout_seconds=60)
    assert parallel.initialize_distributed(explicit) is True
    assert calls[1:] == [{"jax_cpu_collectives_implementation": "gloo"},
                         {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                          "initialization_timeout": 60}]


def test_place_keeps_arrays_on_an_equivalent_sharding():
    """What kept the 2-process run from compiling at step 2: its update returned P(None, 'fsdp', 'tensor') (jax's
    canonical spec, trailing None dropped) for a parameter placed as P(None, 'fsdp', 'tensor', None); the next
    rollout's device_put took that for another sharding and copied it (across processes, by a compiled reshard
    program). parallel.place leaves it as it is and moves only what really sits elsewhere."""
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    named = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    placed_as = named(None, "fsdp", "tensor", None)  # parallel.state_shardings' spec of a [L, D, H, hd] weight
    x = jax.device_put(np.ones((1, 4, 2, 3), np.float32), named(None, "fsdp", "tensor"))  # as the update returned it
    assert x.sharding.is_equivalent_to(placed_as, x.ndim) and x.sharding != placed_as
    y = np.arange(8, dtype=np.float32)  # on the host: must move
    target = {"x": placed_as, "y": named("fsdp")}
    assert jax.device_put(x, target["x"]) is not x  # a copy
    placed = parallel.place({"x": x, "y": y}, target)
    assert placed["x"] is x and placed["y"].sharding == target["y"]
    np.testing.assert_array_equal(np.asarray(placed["y"]), y)
