"""A run whose every path is in a bucket, on a real GCS server on loopback (fake-gcs-server,
g2rl_jax/bench/gcs_emulator.py): model.path and a jsonl training set in the bucket, run.output_dir there; kill -9
mid-save and mid-run, then the same command resumes and gives exactly the uninterrupted local run's metrics
(tests/test_train.py's reference); a second trainer refused by the lock; the corrupt newest checkpoint set aside in the
bucket; eval and export reading the gs:// checkpoint and writing to the bucket; JAX's compilation cache in the bucket.
(The two-process run on a bucket: tests/test_multihost.py.) Tiny random Qwen3 and the demo tokenizer, as
test_train.py."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_checkpoint import _abstract, _assert_equal, _BytesIterator, _state
from test_train import (  # noqa: F401 - assets and reference are fixtures
    DATASET,
    ROOT,
    _assert_same_metrics,
    _env,
    _train_cmd,
    assets,
    reference,
)

from g2rl_jax import storage
from g2rl_jax.control.runlock import LOCK_FILE, RunLock
from g2rl_jax.train.checkpoint import Checkpointer, latest_step
from g2rl_jax.train.metrics import read_metrics

from _helpers import HANG_S, BucketWrites, kill_when, lock_held_elsewhere, xla_flags

STEPS = 3


@pytest.fixture(scope="module")
def bucket(gcs, assets, tmp_path_factory):  # noqa: F811
    """The policy directory and the demo training set (as a jsonl file) uploaded to the bucket."""
    from g2rl_jax.data import load_dataset

    storage.upload_tree(assets["policy"], gcs.url("models/policy"))
    rows = [{"id": ex.id, "problem": ex.problem, "answer": ex.answer} for ex in load_dataset(DATASET)]
    storage.write_text(gcs.url("data/train.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    storage.write_text(gcs.url("data/eval.jsonl"), "".join(json.dumps(r) + "\n" for r in rows[:3]))
    return {"policy": gcs.url("models/policy"), "train": gcs.url("data/train.jsonl"),
            "eval": gcs.url("data/eval.jsonl")}


def _gs_cmd(assets, bucket, out, steps=STEPS):  # noqa: F811
    return [*_train_cmd(assets, out, steps), f"model.path={bucket['policy']}", f"data.train_dataset={bucket['train']}"]


def _committed(out) -> list[int]:
    """Committed checkpoint steps in the bucket (Orbax on GCS: a step directory holding commit_success.txt)."""
    ckpts = f"{out}/checkpoints"
    return sorted(int(n) for n in storage.names(ckpts)
                  if n.isdigit() and storage.exists(f"{ckpts}/{n}/commit_success.txt"))


@pytest.fixture(scope="module")
def killed_run(gcs, assets, bucket, tmp_path_factory):  # noqa: F811
    """The trainer on the bucket killed with -9 mid-save, rerun and killed once step 2 is committed, rerun to the
    end (run.total_steps=STEPS), all with model.path and the training set in the bucket."""
    out = gcs.url("runs/killed")
    env = dict(_env(), XLA_FLAGS=xla_flags(8), **{storage.CACHE_ENV: str(tmp_path_factory.mktemp("cache"))})
    cmd = _gs_cmd(assets, bucket, out)
    log = tmp_path_factory.mktemp("logs") / "trainer.err"
    seen = BucketWrites(gcs, out)  # what the trainer stored, from the proxy's log: the kills cost the bucket nothing
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        mid_save = kill_when(proc, seen.saving, err)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        kill_when(proc, lambda: any(s >= 2 for s in seen.committed()), err)
    committed = _committed(out)  # listed in the bucket itself
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    return {"out": out, "mid_save": mid_save, "committed": committed, "done": done, "log": log.read_text()}


def test_kill_9_on_a_bucket_then_resume_exactly(killed_run, reference):  # noqa: F811
    done, out = killed_run["done"], killed_run["out"]
    assert killed_run["mid_save"], f"no save in progress was seen before the run ended: {killed_run['log'][-3000:]}"
    assert killed_run["committed"], ("the mid-run kill left no committed checkpoint to resume from: "
                                     f"{killed_run['log'][-3000:]}\n{killed_run['done'].stdout[-1500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the checkpoint of step {max(killed_run['committed'])}" in done.stdout, done.stdout[-2000:]
    _assert_same_metrics(read_metrics(out), reference["records"])  # model and data read from the bucket
    names = storage.names(out)
    for name in ("config.yaml", "config_history.jsonl", "metrics.jsonl", "checkpoints", "tensorboard", "summary.json",
                 "curves.png"):
        assert name in names, names
    assert LOCK_FILE not in names and not any(".part." in n for n in names)
    assert not os.path.exists(out.replace("://", ":/")), "a local 'gs:' folder was written"
    history = [json.loads(line) for line in storage.read_text(f"{out}/config_history.jsonl").splitlines()]
    assert len(history) == 3 and history[-1]["checkpoint_found"] == max(killed_run["committed"])


def test_each_launch_probes_the_bucket_once(killed_run, gcs):
    """run.output_dir's write probe (setup.preflight: a write and a delete, about 2 s at the bucket's pace) once
    per launch, before the lock: the three launches above wrote three probes, each once."""
    from collections import Counter

    prefix = killed_run["out"].removeprefix("gs://") + "/.write_test."
    probes = Counter(r.obj for r in list(gcs.proxy.log) if r.kind == "upload" and (r.obj or "").startswith(prefix)
                     and not r.obj.endswith(".tensorstore") and 200 <= r.status < 300)
    assert len(probes) == 3 and set(probes.values()) == {1}, probes


def _records(data: bytes):
    """The records of a TFRecord stream (TensorBoard's events file), each checksum checked."""
    import struct

    from tensorboardX.record_writer import masked_crc32c

    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("Q", header)
        assert struct.unpack("I", data[at + 8:at + 12])[0] == masked_crc32c(header)
        body = data[at + 12:at + 12 + length]
        assert struct.unpack("I", data[at + 12 + length:at + 16 + length])[0] == masked_crc32c(body)
        yield body
        at += 16 + length


def test_tensorboard_events_in_the_bucket_are_whole(killed_run):
    """The events files composed in the bucket are whole TFRecord streams (every checksum holds) that hold every
    step's accuracy; the resumed writer tells TensorBoard to drop what the killed ones wrote past the checkpoint."""
    from tensorboardX.proto.event_pb2 import Event

    out, steps, purged = f"{killed_run['out']}/tensorboard", set(), False
    for name in storage.names(out):
        for record in _records(storage.read_bytes(f"{out}/{name}")):
            event = Event.FromString(record)
            steps |= {event.step for value in event.summary.value if value.tag == "accuracy"}
            purged |= event.session_log.status == event.session_log.START
    assert steps == set(range(1, STEPS + 1)) and purged


def test_second_trainer_is_refused_and_a_stale_lock_taken_over(gcs, assets, bucket, capsys):  # noqa: F811
    from g2rl_jax.train.command import main

    out = gcs.url("runs/locked")
    with lock_held_elsewhere(out, _env()) as holder:
        cmd = _gs_cmd(assets, bucket, out, steps=1)
        assert main(cmd[cmd.index("--config"):]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another trainer (pid {holder.pid} on host '{socket.gethostname()}'" in err, err
        assert f"delete {out}/{LOCK_FILE}" in err
    lock = RunLock(out)  # the holder died without releasing: same host, pid gone, so the lock is stale
    lock.acquire()
    assert f"removing the stale lock {out}/{LOCK_FILE} of pid {holder.pid}" in capsys.readouterr().err
    assert json.loads(storage.read_text(f"{out}/{LOCK_FILE}"))["pid"] == os.getpid()
    lock.release()
    assert not storage.exists(f"{out}/{LOCK_FILE}")
    storage.write_text(f"{out}/{LOCK_FILE}", json.dumps({"host": "another-host", "pid": 1, "since": "then"}))
    lock = RunLock(out, 3)  # a deleted VM's lock, never renewed: taken over once watched for a lease
    lock.acquire()          # (a live one on another host: tests/test_preemption.py)
    assert f"removing the stale lock {out}/{LOCK_FILE} of pid 1 on host 'another-host'" in capsys.readouterr().err
    lock.release()


def test_corrupt_newest_checkpoint_in_the_bucket_falls_back(gcs, capsys):
    run = gcs.url("runs/corrupt")
    ckpt = Checkpointer(run, every=1, keep=3)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), _BytesIterator(step))
    ckpt.close()
    storage.remove(f"{run}/checkpoints/3/state/_METADATA")  # as a partial copy or a stray delete would leave it
    reopened = Checkpointer(run, every=1, keep=3)
    it = _BytesIterator()
    step, state = reopened.restore_newest(_abstract(_state(0)), it)
    assert step == 2 and it.position == 2
    _assert_equal(state, _state(2))
    assert f"checkpoint {run}/checkpoints/3 cannot be restored" in capsys.readouterr().err
    assert storage.names(f"{run}/corrupt_checkpoints") == ["3"]  # set aside in the bucket, not deleted
    assert reopened.all_steps() == [1, 2] and latest_step(run) == 2
    assert reopened.save(3, _state(3), _BytesIterator(3))  # the run can save step 3 again
    reopened.close()
    assert Checkpointer(run, every=1, keep=3).restore_newest(_abstract(_state(0)), it)[0] == 3


def test_a_late_save_request_of_a_frozen_launch_lands_in_no_step(gcs):
    """What tensorstore (Orbax's array writer) sends itself does not pass the fence: a launch frozen mid-save may
    send the rest of it after its thaw, after another launch took the run over (the chaos soak: `manifest.ocdbt` and
    a data file of step 6, 0.1 to 4.5 s after the thaw). Each launch writes a step in a directory of its own on GCS
    (control/commits.py's LaunchCommit), so those requests land where no step is read: the new launch's step 3,
    committed, restores exactly, and the next start deletes the frozen launch's directory. (Written in place, as
    before, the same requests replace step 3's manifest: its restore fails.)"""
    from g2rl_jax.control.commits import fenced_commits
    from g2rl_jax.train.checkpoint import checkpoint_dir

    run = gcs.url("runs/late")
    directory = storage.path(checkpoint_dir(run))
    frozen = fenced_commits(directory, "f0f0f0f0").from_final(directory / "3").get()  # the frozen launch's step 3
    ckpt = Checkpointer(run, every=1, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), _BytesIterator(step))
    ckpt.close()
    assert storage.names(directory) == ["2", "3"], storage.names(directory)  # nothing but the committed steps
    fs, key = storage._fs(directory / "3" / "state")
    names = [name[len(key):] for name in fs.find(key)]  # every object of step 3's arrays: the frozen launch
    assert "/manifest.ocdbt" in names and any("/d/" in name for name in names), names  # sends its manifests
    for name in names:
        storage.write_bytes(f"{frozen}/state{name}", b"what the frozen launch sent after its thaw")
    reopened = Checkpointer(run, every=1, keep=2)
    it = _BytesIterator()
    step, state = reopened.restore_newest(_abstract(_state(0)), it)
    assert step == 3 and it.position == 3
    _assert_equal(state, _state(3))
    reopened.close()
    assert storage.names(directory) == ["2", "3"], storage.names(directory)  # the frozen launch's deleted


def test_eval_and_export_from_the_bucket_checkpoint(killed_run, gcs, tmp_path, monkeypatch, capsys):
    from g2rl_jax.eval import main as eval_main
    from g2rl_jax.export import main as export_main
    from g2rl_jax.model import load_pretrained
    from g2rl_jax.train.checkpoint import load_policy

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    run, out = killed_run["out"], gcs.url("eval/killed")
    assert eval_main(["--checkpoint", run, "--datasets", gcs.url("data/eval.jsonl"), "--samples", "2",
                      "--max-new-tokens", "8", "--batch-size", "3", "--out", out]) == 0, capsys.readouterr().err
    results = json.loads(storage.read_text(f"{out}/results.json"))
    assert results["settings"]["checkpoint_step"] == STEPS
    assert results["metrics"][gcs.url("data/eval.jsonl")]["problems"] == 3  # datasets are named as given
    assert results["settings"]["model"] == f"{run}/checkpoints/{STEPS}"
    exported = gcs.url("exported/killed")
    assert export_main(["--checkpoint", run, "--out", exported]) == 0, capsys.readouterr().err
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(storage.names(exported))
    model = load_pretrained(storage.local_copy(exported, "--model-path"))
    policy, _ = load_policy(run)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 jax.tree.leaves(model), jax.tree.leaves(policy))
    assert export_main(["--checkpoint", run, "--out", exported]) == 2  # not empty: refused without --overwrite
    assert "is not empty" in capsys.readouterr().err


def test_lora_init_from_analyze_and_plot_on_the_bucket(killed_run, gcs, bucket, assets, tmp_path, monkeypatch,  # noqa: F811
                                                      capsys):
    """model.lora.init_from in the bucket (copied to the local cache, then loaded: the same adapter factors),
    analyze's --checkpoint and --out and plot's run directory and --out, each a gs:// path."""
    from g2rl_jax import analyze, plot
    from g2rl_jax.config import load_config
    from g2rl_jax.model import load_pretrained, lora, peft_io
    from g2rl_jax.train.setup import resolve_model_paths

    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    spec = lora.LoraSpec(4, 8.0, ("q_proj", "v_proj"))
    trained = lora.attach(load_pretrained(assets["policy"]), spec, dtype="float32", seed=3)
    storage.upload_tree(peft_io.save_adapter(trained, tmp_path / "adapter", base_model=bucket["policy"]),
                        gcs.url("adapters/a"))
    cfg = resolve_model_paths(load_config(str(ROOT / "configs" / "demo.yaml"), [
        f"model.path={bucket['policy']}", "model.lora.rank=4", "model.lora.alpha=8.0", "model.lora.targets=q,v",
        f"model.lora.init_from={gcs.url('adapters/a')}"]))
    assert not storage.is_url(cfg.model.lora.init_from) and not storage.is_url(cfg.model.path)
    fresh = lora.attach(load_pretrained(cfg.model.path), spec, dtype="float32", seed=0)
    peft_io.load_adapter(fresh, cfg.model.lora.init_from)
    for name in spec.targets:
        for x, y in zip(fresh.adapters.factors(name), trained.adapters.factors(name)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    run, out = killed_run["out"], gcs.url("analysis/killed")
    assert analyze.main(["--checkpoint", run, "--dataset", bucket["eval"], "--problems", "2", "--samples", "4",
                         "--max-new-tokens", "8", "--batch-size", "2", "--out", out]) == 0, capsys.readouterr().err
    models = json.loads(storage.read_text(f"{out}/analysis.json"))["models"]
    assert len(models) == 1 and {"geometry.png", "analysis.json"} <= set(storage.names(out))
    assert plot.main([run, "--out", gcs.url("plots/killed.png")]) == 0, capsys.readouterr().err
    assert storage.read_bytes(gcs.url("plots/killed.png"))[:8] == b"\x89PNG\r\n\x1a\n"


def test_compilation_cache_in_the_bucket(gcs):
    """run.compilation_cache_dir=gs://...: JAX writes its compiled programs to the bucket (through etils epath and
    gcsfs, as the rest of the run's files)."""
    url = gcs.url("xla_cache")
    code = ("import jax, jax.numpy as jnp\n"
            "from g2rl_jax.train.setup import compilation_cache\n"
            f"compilation_cache({url!r})\n"
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)  # this program compiles fast\n"
            "print(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).sum())\n")
    env = {k: v for k, v in _env().items() if not k.startswith("JAX_COMPILATION_CACHE") and
           k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    env["XLA_FLAGS"] = xla_flags(1)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert storage.names(url), "no compiled program was written to the bucket"


def _one_line_failure(done, *needles):
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and all(n in lines[-1] for n in needles), done.stderr[-3000:]


def test_gs_path_without_the_gcs_extra_is_one_line(assets, tmp_path):  # noqa: F811
    """As if `pip install -e .` had left out the gcs extra: one line naming it, before any model loads."""
    cmd = _train_cmd(assets, "gs://my-bucket/runs/demo", steps=1)
    code = ("import sys; sys.modules['gcsfs'] = None\n"
            "from g2rl_jax.train.command import main\n"
            f"sys.exit(main({cmd[cmd.index('--config'):]!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    _one_line_failure(done, "config error: run.output_dir: 'gs://my-bucket/runs/demo' is a gs:// path",
                      'pip install -e ".[gcs]"')
    assert not (tmp_path / "gs:").exists()


def test_missing_bucket_is_one_line_before_any_model_loads(assets, gcs):  # noqa: F811
    cmd = _train_cmd(assets, "gs://no-such-bucket/runs/demo", steps=1)
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    _one_line_failure(done, "run.output_dir: the bucket gs://no-such-bucket does not exist",
                      "gcloud storage buckets create gs://no-such-bucket")


def _hub_cache(home, repo_id: str, model_dir) -> None:
    """A Hugging Face cache (HF_HOME) holding `model_dir` as repository `repo_id`, laid out as huggingface_hub lays
    out a download: blobs by hash, a snapshot of links to them, refs/main naming the snapshot."""
    import hashlib

    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(p for p in model_dir.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_hugging_face_id_from_the_cache_and_one_line_when_absent(assets, tmp_path):  # noqa: F811
    """model.path / --model-path `org/name`: read from the Hugging Face cache (HF_HUB_OFFLINE=1: the cache only);
    an id neither cached nor downloadable is one line naming the cache and the download command."""
    _hub_cache(tmp_path / "hf", "tiny-org/tiny-qwen3", assets["policy"])
    env = dict(_env(), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", XLA_FLAGS=xla_flags(1))
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"problem": "1+2", "answer": "3"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "g2rl_jax.eval", "--model-path", "tiny-org/tiny-qwen3", "--datasets",
                           str(data), "--samples", "2", "--max-new-tokens", "4", "--template", "plain", "--out",
                           str(tmp_path / "eval")], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["model"] == "tiny-qwen3" and results["settings"]["model"] == "tiny-org/tiny-qwen3"
    cmd = [*_train_cmd(assets, tmp_path / "run", steps=1), "model.path=tiny-org/not-cached"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    _one_line_failure(done, "model.path: 'tiny-org/not-cached' is not a local directory, and as a Hugging Face id",
                      "HF_HUB_OFFLINE=1", "The hub said: LocalEntryNotFoundError: ",
                      "set 'HF_HUB_OFFLINE=0' as environment variable.", "hf download tiny-org/not-cached",
                      "huggingface_hub.snapshot_download('tiny-org/not-cached')")


def test_the_bucket_served_no_429(gcs):
    """Last in this module: through the strict proxy (tests/conftest.py's `gcs`), everything the runs above wrote
    stayed within GCS's one update per object per second, so the proxy served no 429: the files the project writes
    itself are paced, and each checkpoint's OCDBT manifest.ocdbt is written once a save (one tensorstore transaction
    per process). test_preemption.py's contended lock writes, when this process ran that module too, are under its
    own prefixes, and that module checks them itself."""
    elsewhere = ("/lease/", "/runs/preempted/")  # test_preemption.OWN_OBJECTS
    throttled = {obj: n for obj, n in gcs.proxy.throttled().items()
                 if not any(prefix in (obj or "") for prefix in elsewhere)}
    assert not throttled, throttled
