"""A run survives its users: the run-directory lock between real processes (stale locks included), SIGTERM of a
real trainer process (checkpoint, exit 143, resume), a relaunch that fails a check or changes the config leaves
the run's files alone, validation abandoned after the step's checkpoint, length filtering counted, JAX_PLATFORMS
naming absent hardware. Tiny random Qwen3 and the demo tokenizer, as tests/test_train.py."""
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_train import ROOT, _env, _train_cmd, assets, config, overrides  # noqa: F401 - assets is a fixture

from g2rl_jax.config import ConfigError
from g2rl_jax.control import holder as identity
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.runlock import LOCK_FILE, RunLock
from g2rl_jax.train.command import main
from g2rl_jax.train.lifecycle import HISTORY_FILE, config_changes
from g2rl_jax.train.metrics import read_metrics

from _helpers import lock_held_elsewhere, xla_flags


def _wait_for(condition, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------------------------------ the lock
def test_lock_between_real_processes_and_stale_locks(tmp_path, capsys):
    with lock_held_elsewhere(str(tmp_path), _env()) as holder:
        with pytest.raises(ConfigError, match=rf"in use by another trainer \(pid {holder.pid} on host "
                                              rf"'{socket.gethostname()}'.*delete {tmp_path / LOCK_FILE}"):
            RunLock(tmp_path).acquire()
    lock = RunLock(tmp_path)  # the holder died without releasing: its lock is stale
    lock.acquire()
    assert f"removing the stale lock {tmp_path / LOCK_FILE} of pid {holder.pid}" in capsys.readouterr().err
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.acquire()  # idempotent
    other = RunLock(tmp_path)  # another trainer in this process (a notebook cell run twice) shares the lock
    other.acquire()
    lock.release()
    assert (tmp_path / LOCK_FILE).exists()
    other.release()
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "another-host", "pid": 1, "since": "then",
                                                  "renewed": time.time() - 3600, "lease_seconds": 60}))
    lock = RunLock(tmp_path)
    lock.acquire()  # another host's, renewed an hour ago (two leases and more): stale at once
    assert "of pid 1 on host 'another-host' since then" in capsys.readouterr().err
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    RunLock(tmp_path).release()  # a lock object that never held it releases nothing
    assert (tmp_path / LOCK_FILE).exists()
    lock.release()
    me = identity.mine()
    (tmp_path / LOCK_FILE).write_text(json.dumps({**me, "start": me["start"] - 1, "renewed": time.time()}))
    lock.acquire()  # our pid, this boot and PID namespace, another start time: a restarted container's leftover
    assert f"its process (pid {os.getpid()} on host" in capsys.readouterr().err
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text(json.dumps({**me, "renewed": time.time()}))
    lock.acquire()  # this very process's record, held by no lock of it: its own, taken at once
    assert "it is this process's own record" in capsys.readouterr().err
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


# ------------------------------------------------------------------------------------------ SIGTERM, real process
@pytest.fixture(scope="module")
def preempted_run(assets, tmp_path_factory):  # noqa: F811
    """A real trainer process (a long run, checkpoint_every beyond it) sent SIGTERM once step 1 is recorded, after
    a second trainer has tried the same run directory; then the same command, run.total_steps lowered to end one
    step later, rerun to the end. Both processes share the session's compilation cache (tests/conftest.py), so the
    rerun does not compile again, nor the first what other modules' trainers compiled already."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    cmd = [*_train_cmd(assets, out, steps=1000), "run.checkpoint_every=500"]
    env = _env()
    env["XLA_FLAGS"] = xla_flags(8)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: len(read_metrics(out)) >= 1, proc), "the trainer recorded no step"
        second = io.StringIO()
        with contextlib.redirect_stderr(second):  # a second trainer, in this process, while the first runs
            second_code = main(cmd[cmd.index("--config"):])
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    first = {"returncode": proc.returncode, "stderr": stderr, "records": read_metrics(out),
             "steps": sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()),
             "lock_left": (out / LOCK_FILE).exists()}
    total = first["records"][-1]["step"] + 1
    rerun = subprocess.run([*cmd, f"run.total_steps={total}"], env=env, capture_output=True, text=True, timeout=600)
    return {"out": out, "first": first, "second": (second_code, second.getvalue()), "rerun": rerun, "total": total}


def test_second_trainer_on_the_same_run_is_refused(preempted_run):
    code, stderr = preempted_run["second"]
    assert code == 2, stderr[-2000:]
    assert "run.output_dir" in stderr and "is in use by another trainer (pid" in stderr


def test_sigterm_saves_a_checkpoint_and_exits_with_how_to_resume(preempted_run):
    first, out = preempted_run["first"], preempted_run["out"]
    assert first["returncode"] == Exit.PREEMPTED, first["stderr"][-3000:]
    stopped = first["records"][-1]["step"]
    assert [r["step"] for r in first["records"]] == list(range(1, stopped + 1))
    assert first["steps"] == [stopped]  # saved because of the SIGTERM: checkpoint_every=100
    assert f"stopped by SIGTERM after step {stopped}" in first["stderr"]
    assert f"python -m g2rl_jax.train --config {out / 'config.yaml'}" in first["stderr"]
    assert not first["lock_left"], "the stopped trainer kept its lock"


def test_rerun_after_sigterm_resumes_and_finishes(preempted_run):
    rerun, out = preempted_run["rerun"], preempted_run["out"]
    stopped = preempted_run["first"]["steps"][-1]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from the checkpoint of step {stopped}" in rerun.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, preempted_run["total"] + 1))
    history = [json.loads(line) for line in (out / HISTORY_FILE).read_text().splitlines()]
    assert [h["checkpoint_found"] for h in history] == [None, stopped]  # the refused start wrote nothing
    assert history[0]["config"]["run"]["total_steps"] == 1000
    assert history[1]["config"]["run"]["total_steps"] == preempted_run["total"]  # free under a constant lr
    assert history[1]["config"]["rollout"] == history[0]["config"]["rollout"]
    assert history[1]["train_dropped_for_length"] == 0


# ------------------------------------------------------------------------------------------ relaunches
def test_relaunch_that_fails_a_check_leaves_the_run_alone(assets, preempted_run):  # noqa: F811
    from g2rl_jax.train.loop import Trainer

    out = preempted_run["out"]
    files = {name: (out / name).read_text() for name in ("config.yaml", HISTORY_FILE, "metrics.jsonl")}
    with pytest.raises(ConfigError, match=r"changes what the run computes \(rollout\.num_samples: 4 -> 8; "
                                          r"algorithm\.lam: 0\.5 -> 0\.25\).*run\.allow_config_change=true"):
        Trainer(config(assets, out, steps=9, **{"rollout.num_samples": 8, "algorithm.lam": 0.25}))
    with pytest.raises(ConfigError, match="model.path"):  # allowed to change, but the new model is not there
        Trainer(config(assets, out, steps=9, **{"model.path": str(out / "nowhere"), "run.allow_config_change": "true"}))
    assert {name: (out / name).read_text() for name in files} == files
    assert not (out / LOCK_FILE).exists(), "a refused start kept the lock"


def test_which_changes_change_what_the_run_computes(assets, tmp_path):  # noqa: F811
    base = config(assets, tmp_path, steps=4)
    same = config(assets, tmp_path / "moved", steps=8, **{"run.eval_every": 2, "run.checkpoint_every": 3,
                                                         "mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1})
    assert config_changes(base, same) == []
    cosine = {"optim.min_lr_ratio": 0.1}  # a decaying schedule's length depends on run.total_steps
    assert config_changes(config(assets, tmp_path, steps=4, **cosine), config(assets, tmp_path, steps=8, **cosine)) \
        == ["run.total_steps: 4 -> 8"]
    assert config_changes(base, config(assets, tmp_path, steps=4, **{"run.seed": 1, "data.max_prompt_tokens": 64})) \
        == ["run.seed: 0 -> 1", "data.max_prompt_tokens: 1024 -> 64"]


# ------------------------------------------------------------------------------------------ validation
def test_sigterm_during_validation_keeps_the_step(assets, tmp_path):  # noqa: F811
    """A real SIGTERM to this process from inside the step-1 validation: the step's checkpoint and metrics are
    kept, the validation is abandoned."""
    from g2rl_jax.demo.task import examples
    from g2rl_jax.train.loop import Trainer

    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"problem": e.problem, "answer": e.answer}) + "\n"
                               for e in examples("test")[:2]))

    class SignalledTrainer(Trainer):
        def validate(self):
            if self.step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().validate()

    out = tmp_path / "run"
    trainer = SignalledTrainer(config(assets, out, steps=3, **{
        "run.eval_every": 1, "run.checkpoint_every": 100, "data.eval_datasets": str(evalset),
        "data.eval_samples": 4, "data.eval_max_new_tokens": 8, "data.eval_temperature": 1.0}))  # as the rollout
    trainer.resume()
    trainer.run()
    assert trainer.preempted and trainer.step == 1
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert any(k.startswith("val/") for k in records[0]) and not any(k.startswith("val/") for k in records[1])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is only there while training


# ------------------------------------------------------------------------------------------ data and platform
def test_prompts_dropped_for_length_are_counted(assets, tmp_path, capsys):  # noqa: F811
    """Training and evaluation sets go through the same filter; what it drops is counted and printed."""
    import dataclasses

    from g2rl_jax.data import Example, encode_prompts
    from g2rl_jax.demo.tokenizer import make_tokenizer
    from g2rl_jax.train.setup import eval_examples, length_filter

    tok = make_tokenizer()
    rows = [Example(id=str(i), problem="1+1" * (1 if i % 2 == 0 else 21), answer="2") for i in range(6)]
    evalset = tmp_path / "eval.jsonl"
    evalset.write_text("".join(json.dumps({"id": r.id, "problem": r.problem, "answer": r.answer}) + "\n"
                               for r in rows))
    cfg = config(assets, tmp_path / "run", **{"run.eval_every": 1, "data.eval_datasets": str(evalset)})
    short, long_ = (len(p) for p in encode_prompts(rows[:2], tok, cfg.data.prompt_template))
    assert short < long_
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=short))
    kept, dropped = length_filter(rows, tok, cfg.data)
    assert [e.id for e in kept] == ["0", "2", "4"] and dropped == 3
    sets, dropped = eval_examples(cfg, tok)
    assert [e.id for e in sets[str(evalset)]] == ["0", "2", "4"] and dropped == {str(evalset): 3}
    printed = capsys.readouterr().out
    assert f"3 of 6 prompts of {str(evalset)!r} are longer than data.max_prompt_tokens={short}" in printed
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=short - 1))
    with pytest.raises(ConfigError, match=r"data\.eval_datasets: no prompt of .* fits data\.max_prompt_tokens"):
        eval_examples(cfg, tok)


def test_jax_platforms_naming_absent_hardware_is_one_line(tmp_path):
    env = _env()
    env["JAX_PLATFORMS"] = "tpu"
    done = subprocess.run([sys.executable, "-m", "g2rl_jax.train", "--config", str(ROOT / "configs" / "demo.yaml"),
                           f"run.output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "JAX_PLATFORMS='tpu' names hardware JAX cannot use on this machine" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "config.yaml").exists()


def test_failures_are_classified_where_raised_never_by_their_text():
    """control/errors.py: an error merely saying what a device or storage failure says (a reward function's
    RESOURCE_EXHAUSTED, a ConnectionRefusedError in user code) is neither; a device's RESOURCE_EXHAUSTED is known by
    its status code, not by its message. (A gcsfs request the store did not serve: test_storage_midrun.py.)"""
    import jax

    from g2rl_jax.control.errors import DeviceOutOfMemory, device_failure

    said_so = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8 bytes")
    assert device_failure(said_so, "stage 'update'") is None  # built from Python: status UNKNOWN, whatever it says
    assert device_failure(ConnectionRefusedError(111, "Connection refused"), "stage 'update'") is None
    try:
        jax.numpy.ones((1 << 44,), jax.numpy.float32)  # 64 TiB: XLA's allocator refuses it
    except jax.errors.JaxRuntimeError as real:
        oom = device_failure(real, "stage 'update'")
    assert isinstance(oom, DeviceOutOfMemory) and oom.code == Exit.DEVICE_OOM
    assert oom.line().startswith("train error: the device ran out of memory in stage 'update' (RESOURCE_EXHAUSTED")


def test_what_ends_the_trainer_maps_to_its_code_in_one_place():
    """control/errors.py's exit_code, the one mapping (train/command.py's setup failures, and the code the rollout
    processes of a split run end with): a value that fails the wire's checks (a planted pickle) is a typed bad input,
    exit 2 with its one line, as an unusable checkpoint is; a RunFailure keeps its own code; a start whose store does
    not answer is the storage's; a config, dataset or path error is bad input; anything else a bug."""
    from g2rl_jax.control import wire
    from g2rl_jax.control.errors import BadInput, DeviceOutOfMemory, LeaseLost, StorageUnavailable, exit_code
    from g2rl_jax.data import DataError
    from g2rl_jax.storage import StorageUnreachable
    from g2rl_jax.train.checkpoint import CheckpointError

    refused = wire.Refused("key g2rl/sides/start: not a value this version writes; refused, nothing in it was run")
    assert isinstance(refused, BadInput) and isinstance(refused, ValueError) and refused.code == Exit.BAD_INPUT
    assert refused.line() == f"run error: {refused}"
    with pytest.raises(wire.Refused) as err:
        wire.decode(b"\x80\x04K\x01.", where="a planted pickle")
    assert exit_code(err.value) == Exit.BAD_INPUT and "\n" not in err.value.line()
    unusable = CheckpointError("no checkpoint in /r/checkpoints can be restored;\n delete it")
    assert exit_code(unusable) == Exit.BAD_INPUT and unusable.line().startswith("checkpoint error: no checkpoint")
    assert exit_code(None) == Exit.DONE
    assert exit_code(LeaseLost("run lock lost")) == Exit.LEASE_LOST
    assert exit_code(DeviceOutOfMemory("stage 'update'", "RESOURCE_EXHAUSTED")) == Exit.DEVICE_OOM
    assert exit_code(StorageUnavailable("gs://b/r", ConnectionError("refused"))) == Exit.STORAGE
    assert exit_code(StorageUnreachable("gs://b/r: no answer")) == Exit.STORAGE
    for bad in (ConfigError("algorithm.lr: not a number"), DataError("rows.jsonl:3: no answer"), FileNotFoundError()):
        assert exit_code(bad) == Exit.BAD_INPUT, bad
    assert exit_code(KeyError("a bug")) == exit_code(RuntimeError("a bug")) == Exit.BUG
