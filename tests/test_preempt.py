"""SIGTERM within run.preempt_grace_seconds (lifecycle.StopSignal), in real processes: a step that fits the grace
is finished, one that does not (or has no measured time yet) is abandoned at once, an overrunning one is ended at the
deadline; a real trainer abandons its step and is resumed from its last checkpoint. And a multi-host run whose local
run.output_dir the hosts do not share is refused (two jax.distributed processes on CPU, a HOME each)."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from test_train import ROOT, _env, _train_cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax.control.exits import Exit
from g2rl_jax.control.runlock import LOCK_FILE
from g2rl_jax.train.lifecycle import step_fits
from g2rl_jax.train.metrics import read_metrics
from g2rl_jax.train.setup import unshared_message

from _helpers import xla_flags


def test_step_fits():
    assert step_fits(None, None, deadline=100.0, grace=25.0)  # between steps: nothing to abandon
    assert not step_fits(90.0, None, deadline=100.0, grace=25.0)  # no step timed yet
    assert step_fits(90.0, 5.0, deadline=100.0, grace=25.0)  # ends at 95 = 100 - 0.2 * 25
    assert not step_fits(90.0, 5.1, deadline=100.0, grace=25.0)


SCRIPT = """
import sys, time
from g2rl_jax.train.lifecycle import StopSignal
grace, estimate, work = (float(a) for a in sys.argv[1:4])
with StopSignal(grace, on_abandon=lambda: print("abandon: lock released", flush=True)) as stop:
    if estimate >= 0:
        stop.step_seconds = estimate
    stop.begin_step()
    print("in the step", flush=True)
    end = time.monotonic() + work
    while time.monotonic() < end:  # the step's work; the main thread never looks at the signal
        sum(range(10000))
    stop.end_step()
print("step finished, requested", stop.requested, flush=True)
"""


def _sigterm_in_the_step(script: str, *args: str):
    """Run `script` with `args`, SIGTERM it once it is in its step: (exit code, stdout, stderr, seconds after)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "in the step"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    return proc.returncode, stdout, stderr, time.monotonic() - t0


@pytest.mark.parametrize("estimate,work,code,says,within", [
    (1.0, 1.5, 0, "finishing the current step, expected to end in", (1.5, 10)),  # fits 10 s: finished, stops
    (30.0, 30.0, Exit.PREEMPTED, "would not end within the 10 s grace (a step takes 30.0 s)", (0, 8)),  # at once
    (-1.0, 30.0, Exit.PREEMPTED, "would not end within the 10 s grace (no step has been timed yet)", (0, 8)),
    (1.0, 30.0, Exit.PREEMPTED, "the 10 s grace (run.preempt_grace_seconds) is over", (10, 16)),  # the deadline
])
def test_sigterm_grace_in_a_real_process(estimate, work, code, says, within):
    returncode, stdout, stderr, took = _sigterm_in_the_step(SCRIPT, "10", str(estimate), str(work))
    assert returncode == code, stderr
    assert says in stderr and within[0] <= took < within[1], (took, stderr)
    if code == 0:
        assert "step finished, requested True" in stdout and "abandon" not in stdout
    else:
        assert "abandon: lock released" in stdout and "step finished" not in stdout


def test_an_abandon_that_outlasts_the_grace_says_so():
    """The lock's release (on_abandon) still running at the deadline: the process exits then, and says that the
    grace ended first (the lock stays, a dead process's, for the next launch to take over)."""
    script = SCRIPT.replace('lambda: print("abandon: lock released", flush=True)', "lambda: time.sleep(30)")
    returncode, _, stderr, took = _sigterm_in_the_step(script, "0.5", "30", "30")
    assert returncode == Exit.PREEMPTED, stderr
    assert "would not end within the 0.5 s grace" in stderr, stderr
    assert "the 0.5 s grace (run.preempt_grace_seconds) is over before the run lock could be released" in stderr
    assert 0.4 <= took < 10, took


def test_a_real_trainer_abandons_a_step_that_does_not_fit(assets, tmp_path):  # noqa: F811
    """run.preempt_grace_seconds=0.05 and SIGTERM just after step 2 is recorded: no step fits, so the trainer
    exits at once with 143, the lock released; the same command resumes from the newest complete checkpoint."""
    out = tmp_path / "run"
    cmd = [*_train_cmd(assets, out, steps=6), "run.preempt_grace_seconds=0.05"]
    env = {**_env(), "XLA_FLAGS": xla_flags(8)}  # the session's compilation cache (tests/conftest.py)
    with open(tmp_path / "trainer.err", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        t0 = time.time()
        while max((r["step"] for r in read_metrics(out)), default=0) < 2:
            assert proc.poll() is None and time.time() - t0 < 900, (tmp_path / "trainer.err").read_text()[-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - sent
    stderr = (tmp_path / "trainer.err").read_text()
    assert proc.returncode == Exit.PREEMPTED, stderr[-3000:]
    assert "abandoning it, the last checkpoint stands" in stderr or "grace (run.preempt_grace_seconds) is over" \
        in stderr, stderr[-3000:]
    assert took < 5.0, took  # the grace and the lock's release; the old rule finished the step and saved first
    # released, unless the grace ran out while a save was still being written: then the lock stays (a dead pid on
    # this host, taken over at once by the rerun below) rather than freeing the run directory mid-save
    assert not (out / LOCK_FILE).exists() or "grace (run.preempt_grace_seconds) is over" in stderr, stderr[-3000:]
    recorded = max(r["step"] for r in read_metrics(out))
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    history = [json.loads(line) for line in (out / "config_history.jsonl").read_text().splitlines()]
    resumed = history[-1]["checkpoint_found"]
    assert resumed is not None and recorded - 1 <= resumed <= recorded  # the newest complete save
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))


# ------------------------------------------------------------------------------------------ multi-host output dir
def test_unshared_message():
    assert unshared_message("runs/x", [True, True]) is None
    assert unshared_message("runs/x", [True, False, True, False]) == (
        "run.output_dir: 'runs/x' is a local directory that process(es) 1, 3 of 4 do not share with process 0, so "
        "each host would write its own copy of the run; use storage every host sees: a bucket "
        "(run.output_dir=gs://BUCKET/DIR) or a shared file system")


TWO = """
import sys
import jax
from g2rl_jax import parallel
from g2rl_jax.config import ConfigError, DistributedConfig
from g2rl_jax.train.setup import check_shared_output_dir
parallel.initialize_distributed(DistributedConfig(coordinator_address=sys.argv[1], num_processes=2,
                                                  process_id=int(sys.argv[2])))
for out in sys.argv[3:]:
    try:
        check_shared_output_dir(out)
        print("accepted", out, flush=True)
    except ConfigError as err:
        print("refused", err, flush=True)
"""


def test_multi_host_run_with_an_unshared_local_output_dir_is_refused(tmp_path):
    """Two processes joined by jax.distributed, each with its own HOME: '~/run' is a different directory on each
    (as each VM's own disk), refused on both in one line; an absolute path both see is accepted, and so is a URL
    (not probed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shared = tmp_path / "shared"
    procs = []
    for i in range(2):
        (tmp_path / f"home{i}").mkdir()
        env = {**_env(), "HOME": str(tmp_path / f"home{i}"), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(TWO), f"127.0.0.1:{port}", str(i),
                                       "~/run", str(shared), "gs://bucket/run"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
        assert [line for line in stdout.splitlines() if line.startswith(("refused", "accepted"))] == [
            "refused run.output_dir: '~/run' is a local directory that process(es) 1 of 2 do not share with process "
            "0, so each host would write its own copy of the run; use storage every host sees: a bucket "
            "(run.output_dir=gs://BUCKET/DIR) or a shared file system",
            f"accepted {shared}", "accepted gs://bucket/run"]
    assert not any(n.startswith(".shared_check") for n in os.listdir(shared))
    assert os.listdir(tmp_path / "home1") == []  # process 1 wrote nothing: only process 0 writes the probe
