"""Metrics: metrics.jsonl content, truncation on resume, TensorBoard events, process-0-only, progress bar."""
import json
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from g2rl_jax.config import ConfigError
from g2rl_jax.train import metrics as M


def _scalars(step):
    return {"accuracy": 0.25 * (step % 4), "reward": np.float32(step) / 2, "kl": jnp.float32(1e-3 * step),
            "tokens": step * 100, "entropy": np.float64(0.5)}


def _run(run_dir, steps, start_step):
    writer = M.MetricsWriter(run_dir, start_step=start_step)
    for step in steps:
        writer.write(step, _scalars(step))
    writer.close()


def _tb_events(run_dir):
    """(tag, step, value) of every scalar in the TFRecord event files, read with the Event proto."""
    out = []
    for path in sorted((run_dir / M.TENSORBOARD_DIR).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
            if event.session_log.status == event_pb2.SessionLog.START:
                out.append(("purge", event.step, path.name))
    return out


def test_jsonl_content(tmp_path):
    writer = M.MetricsWriter(tmp_path, start_step=0)
    writer.write(1, {"step": 1, "accuracy": 0.5, "reward": np.float32(-0.25), "kl": jnp.float32(0.125), "tokens": 1234,
                     "done": np.int64(3), "bad": float("nan")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # flushed before close
    assert json.loads(lines[0]) == {"step": 1, "accuracy": 0.5, "reward": -0.25, "kl": 0.125, "tokens": 1234,
                                    "done": 3, "bad": None}
    assert isinstance(json.loads(lines[0])["tokens"], int)
    with pytest.raises(TypeError, match="metric 'vec' must be a real scalar.*shape \\(2,\\)"):
        writer.write(2, {"vec": np.zeros(2)})
    with pytest.raises(ValueError, match="step=3 but are written for step 2"):
        writer.write(2, {"step": 3})
    writer.close()


def test_truncation_on_resume_equals_uninterrupted_run(tmp_path):
    _run(tmp_path / "straight", range(1, 9), start_step=0)
    resumed = tmp_path / "resumed"
    _run(resumed, range(1, 7), start_step=0)
    with open(resumed / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "accur')  # torn line from a kill mid-write
    assert [r["step"] for r in M.read_metrics(resumed)] == [1, 2, 3, 4, 5, 6]
    _run(resumed, range(5, 9), start_step=4)  # restored from the checkpoint of step 4
    assert (resumed / "metrics.jsonl").read_text() == (tmp_path / "straight" / "metrics.jsonl").read_text()
    before = (resumed / "metrics.jsonl").read_text()
    _run(resumed, [], start_step=0)  # a fresh start in the same directory begins a new file, the old one kept
    assert M.read_metrics(resumed) == []
    assert (resumed / "metrics.jsonl.1").read_text() == before
    _run(resumed, [1], start_step=0)  # an empty file is not kept; a non-empty one goes to the next free name
    _run(resumed, [], start_step=0)
    assert (resumed / "metrics.jsonl.1").read_text() == before
    assert json.loads((resumed / "metrics.jsonl.2").read_text())["step"] == 1


def test_restart_before_first_checkpoint_keeps_one_step_0_record(tmp_path):
    """A run killed before its first checkpoint restarts from step 0 and validates step 0 again: one record."""
    _run(tmp_path, [0, 1, 2], start_step=0)  # step 0 = the validation before the first update
    _run(tmp_path, [0, 1], start_step=0)
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [0, 1]
    _run(tmp_path, [2], start_step=1)  # a resume at step 1 keeps the step-0 record
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [0, 1, 2]


def test_corrupt_middle_line_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not valid JSON"):
        M.MetricsWriter(tmp_path, start_step=2)


def test_tensorboard_events_and_purge(tmp_path):
    _run(tmp_path, range(1, 4), start_step=0)
    events = _tb_events(tmp_path)
    assert ("reward", 2, 1.0) in events and ("tokens", 3, 300.0) in events
    assert {tag for tag, _, _ in events} == set(_scalars(1)) | {"purge"}
    kl = [v for tag, step, v in events if tag == "kl" and step == 3]
    assert kl == [pytest.approx(3e-3)]
    _run(tmp_path, [3], start_step=2)  # resume at once: a second event file that starts with a purge at step 3
    assert len(list((tmp_path / M.TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2
    purges = [step for tag, step, _ in _tb_events(tmp_path) if tag == "purge"]
    assert purges == [0, 3]  # a run from step 0 purges everything, step-0 validation included
    assert len([1 for tag, step, _ in _tb_events(tmp_path) if tag == "reward" and step == 3]) == 2


def test_only_process_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(M.jax, "process_index", lambda: 1)
    _run(tmp_path / "p1", range(1, 3), start_step=0)
    assert not (tmp_path / "p1").exists()


def test_progress_bar_shows_headline(capsys):
    bar = M.ProgressBar(total_steps=10, start_step=2)
    bar.update(3, {"accuracy": 0.5, "reward": 0.25, "kl": 1e-3, "entropy": 0.75, "tokens_per_second": 1234.5,
                   "other": 9})
    bar.update(5, {"accuracy": 0.625})
    bar.close()
    err = capsys.readouterr().err
    assert "5/10" in err and "acc=0.625" in err and "other" not in err


def test_loggers_choose_the_backends(tmp_path):
    writer = M.MetricsWriter(tmp_path, start_step=0, loggers=("jsonl",))
    writer.write(1, _scalars(1))
    writer.close()
    assert M.read_metrics(tmp_path)[0]["tokens"] == 100 and not (tmp_path / M.TENSORBOARD_DIR).exists()


def _wandb_history(run_dir):
    """{step: {key: value}} of the history records of the offline run's transaction log (W&B's LevelDB-style
    log: a 7-byte header, 32 KiB blocks of [crc u32, length u16, type u8] chunks, each record a protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, chunk, out, kinds = path.read_bytes(), 7, b"", {}, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a FULL chunk or the LAST of a split record
            record = pb.Record.FromString(chunk)
            chunk = b""
            kinds.append(record.WhichOneof("record_type"))
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                out[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out, f"{path.name}: {len(data)} bytes, records {kinds}"


def test_wandb_offline(tmp_path, monkeypatch):
    """run.loggers with wandb, in W&B's offline mode (no network): the scalars land in the run's local log, and
    a resumed writer continues the same W&B run id."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"run": {"output_dir": str(tmp_path)}, "algorithm": {"lam": 0.5}}
    writer = M.MetricsWriter(tmp_path, start_step=0, loggers=("jsonl", "wandb"), config=config)
    for step in (1, 2):
        writer.write(step, _scalars(step) | {"bad": float("nan")})
    writer.close()
    wandb.teardown()  # what the end of a training process does (atexit): W&B's service has written all it got
    history, seen = _wandb_history(tmp_path)
    assert sorted(history) == [1, 2], seen
    assert history[2] == pytest.approx({k: float(v) for k, v in _scalars(2).items()})  # NaN left out
    run_id = (tmp_path / M.WANDB_ID_FILE).read_text().strip()
    writer = M.MetricsWriter(tmp_path, start_step=2, loggers=("jsonl", "wandb"), config=config)
    writer.close()
    wandb.teardown()
    assert (tmp_path / M.WANDB_ID_FILE).read_text().strip() == run_id
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1


def test_missing_wandb_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError,
                       match=r'wandb package is not installed; pip install -e "\.\[wandb\]"'):
        M.check_loggers(("jsonl", "wandb"))
    M.check_loggers(("jsonl", "tensorboard"))


def test_tensorboard_writer_leaves_torch_unimported_and_importable(tmp_path):
    """tensorboardX imports torch (seconds of every trainer start) where it is installed; the writer avoids that,
    and `import torch` still works afterwards (a reward may use it). A fresh process: this one imported both."""
    code = ("import sys; from g2rl_jax.train import metrics as M\n"
            f"w = M.MetricsWriter({str(tmp_path)!r}, start_step=0); w.write(1, {{'reward': 0.5}}); w.close()\n"
            "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
            "import torch; print(torch.ones(2).sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr[-2000:]
    assert len(list((tmp_path / M.TENSORBOARD_DIR).iterdir())) == 1


def test_logprob_drift_matches_numpy():
    """The step record's sampler-vs-scorer drift (rollout_logprob_diff_mean / _max), computed in its one program."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 9)), rng.normal(size=(6, 9))
    mask = rng.random((6, 9)) < 0.6
    b[~mask] += 100.0  # differences outside the response must not count
    diff = np.abs(a - b)[mask]
    mean, largest = M._reductions({}, {}, drift=(a.astype(np.float32), b.astype(np.float32),
                                                 mask.astype(np.float32)))["drift"]
    np.testing.assert_allclose([float(mean), float(largest)], [diff.mean(), diff.max()], rtol=1e-5)
    none = M._reductions({}, {}, drift=(a, a, np.zeros_like(a)))["drift"]
    assert [float(x) for x in none] == [0.0, 0.0]


def test_a_resumable_uploads_last_reply_lost_is_answered_on_its_retry_as_gcs_does(gcs):
    """A rewrite of metrics.jsonl (a resumable upload) whose final request was applied and its reply lost: gcsfs
    retries that request, and the proxy answers it as GCS answers a finished session (the object), where the
    emulator alone answers 404."""
    from g2rl_jax import storage
    from g2rl_jax.bench.gcs_faults import Rule

    path = gcs.url("metrics/resumable/metrics.jsonl")
    rule = gcs.proxy.plan.add(Rule("lost", count=1, kinds=("upload",), obj=path.removeprefix("gs://")))
    try:
        storage.write_text(path, '{"step": 1}\n')
    finally:
        gcs.proxy.plan.remove(rule)
    assert storage.read_text(path) == '{"step": 1}\n'


def test_each_record_once_when_replies_are_lost_after_apply(gcs, monkeypatch):
    """On the emulator, the updates of metrics.jsonl, the TensorBoard events and eval's records meet 'applied, reply
    dropped' (gcs_faults.py: the server applies the request, then the client's answer is a dropped connection or a
    503, so its retry meets what the first attempt did) at a seeded rate of 15%: a writer, then a second one resuming
    from step 2 (as a resumed trainer), leave each step's training and validation record in metrics.jsonl once, each
    (tag, step) once in TensorBoard's reading of the events, and each eval record once."""
    from g2rl_jax import storage
    from g2rl_jax.bench.chaos_checks import event_counts, line_counts
    from g2rl_jax.bench.gcs_faults import Rule

    monkeypatch.setenv(storage.FLUSH_ENV, "1")
    run = gcs.url("metrics/lost")
    where = run.removeprefix("gs://")
    rules = [gcs.proxy.plan.add(Rule("lost", rate=0.1, kinds=("upload", "compose"), obj=where)),
             gcs.proxy.plan.add(Rule("lost503", rate=0.05 / 0.9, kinds=("upload", "compose"), obj=where))]
    try:
        for start, steps in ((0, range(1, 5)), (2, range(3, 7))):
            writer = M.MetricsWriter(run, start_step=start)
            for step in steps:
                writer.write(step, _scalars(step))
                if step % 2 == 0:
                    writer.write(step, {"val/d/mean@2": 0.1 * step})
                writer.flush()  # as at every checkpoint
            writer.close()
        with storage.Appender(f"{run}/records/key.jsonl", interval=1.0) as records:
            for i in range(6):
                records.write(json.dumps({"dataset": "d", "id": i}) + "\n")
                records.flush()
    finally:
        for rule in rules:
            gcs.proxy.plan.remove(rule)
    assert sum(rule.served for rule in rules) >= 3, [rule.served for rule in rules]
    want = {(s, "training"): 1 for s in range(1, 7)} | {(s, "validation"): 1 for s in (2, 4, 6)}
    assert line_counts(M.metric_lines(run)) == want
    events = event_counts(f"{run}/tensorboard")
    assert set(events.values()) == {1}, {k: n for k, n in events.items() if n > 1}
    assert {step for tag, step in events if tag == "reward"} == set(range(1, 7))
    assert {step for tag, step in events if tag.startswith("val/d/mean")} == {2, 4, 6}  # TensorBoard's tag: mean_2
    assert [json.loads(line)["id"] for line in storage.read_text(f"{run}/records/key.jsonl").splitlines()] == \
        list(range(6))
