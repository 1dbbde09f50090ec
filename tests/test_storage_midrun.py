"""A bucket that fails in the middle of a run (a metrics flush, an asynchronous checkpoint save, the lease renewal, and
a whole trainer), on a real GCS server on loopback (fake-gcs-server behind the strict proxy, tests/conftest.py's
`gcs`): the proxy is told to drop every connection (a server gone away), to refuse every request (503), or to stop
listening (a closed port) while a real trainer, or a real lock holder or checkpoint writer, is at work. Each ends in
bounded time (G2RL_JAX_STORAGE_TIMEOUT=10 here; the whole trainer's stop is bounded by its lease of 12 s, a lock
holder's by its lease of 9 s) with one line naming the URL and the likely cause, no traceback, exit 75 (EX_TEMPFAIL);
the checkpoints already committed stay, and the same command run again against the healthy server resumes from the
newest of them."""
import contextlib
import subprocess
import sys
import time

import pytest
from test_train import _env, _train_cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import storage
from g2rl_jax.bench.gcs_proxy import Faults, GcsProxy
from g2rl_jax.control.exits import Exit

from _helpers import BucketWrites, xla_flags

TIMEOUT_S = "10"
BOUND_S = 100  # gcsfs's 2 attempts of 2 s and its backoff (at 10 s), the reachability check, and a loaded machine
LEASE_S = 12  # the trainer's run.lock_lease_seconds: it stops within it, whatever its main thread waits on (the
# default 60 s proves the same, four times slower; a margin over the smallest, 9 s, for its renewals through the strict
# proxy's seeded faults on a loaded machine)
HOLDER_LEASE_S = 9.0  # a bare lock holder's lease (run.lock_lease_seconds' smallest): its store fails at once


def _committed(out) -> list[int]:
    ckpts = f"{out}/checkpoints"
    return sorted(int(n) for n in storage.names(ckpts)
                  if n.isdigit() and storage.exists(f"{ckpts}/{n}/commit_success.txt"))


@contextlib.contextmanager
def failing(gcs, how: str):
    """Inside the block, the bucket's endpoint fails `how`: "drop" (every connection closed unanswered), "503"
    (every request refused) or "closed" (nothing listens on the port any more); healthy again after it."""
    proxy, healthy = gcs.proxy, gcs.proxy.faults
    if how == "closed":  # kept-alive connections dropped at their next request, new ones refused
        proxy.faults = Faults(rate_drop=1.0)
        proxy.stop()
    else:
        proxy.faults = Faults(rate_drop=1.0) if how == "drop" else Faults(rate_503=1.0)
    try:
        yield
    finally:
        if how == "closed":  # a new proxy on the same port, sharing the old one's state
            port = int(gcs.endpoint.rsplit(":", 1)[1])
            fresh = GcsProxy(gcs.server, faults=healthy, port=port)
            for shared in ("log", "fault_counts", "_last_update", "_uploads", "_lock"):
                setattr(fresh, shared, getattr(proxy, shared))
            gcs.proxy = fresh.start()
        else:
            proxy.faults = healthy


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("I1", "W1", "E1", "I0",
                                                                                          "W0", "E0"))]
    return lines[-1]


ONE_DEVICE = ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1")  # what a failing bucket does needs no mesh
LEASED = (*ONE_DEVICE, f"run.lock_lease_seconds={LEASE_S:g}")


def _env_for(tmp_path) -> dict:
    return dict(_env(), XLA_FLAGS=xla_flags(1), G2RL_JAX_STORAGE_TIMEOUT=TIMEOUT_S, G2RL_JAX_FLUSH_SECONDS="1",
                **{storage.CACHE_ENV: str(tmp_path / "cache")})


def test_a_server_gone_mid_run_is_one_line_and_the_rerun_resumes(gcs, assets, tmp_path):  # noqa: F811
    out = gcs.url("midrun/trainer")
    # the least budget at which gcsfs keeps its 6 attempts (storage_clients.gcsfs_attempts): the healthy part of the
    # run rides out the strict proxy's seeded faults as at the default; the lease bounds the stop
    env = dict(_env_for(tmp_path), G2RL_JAX_STORAGE_TIMEOUT="48")
    log = tmp_path / "trainer.err"
    with open(log, "w") as err:
        proc = subprocess.Popen([*_train_cmd(assets, out, 1000), *LEASED], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
        seen = BucketWrites(gcs, out)  # the commits from the proxy's log: looking costs the bucket nothing
        while proc.poll() is None and not any(s >= 2 for s in seen.committed()):
            time.sleep(0.005)
        assert proc.poll() is None, log.read_text()[-3000:]
        with failing(gcs, "drop"):
            t0 = time.monotonic()
            try:
                proc.wait(timeout=300)
            finally:
                proc.kill()
            seconds = time.monotonic() - t0
    stderr = log.read_text()
    line = _last_line(stderr)
    assert proc.returncode == Exit.STORAGE, stderr[-3000:]
    assert line.startswith("train error: run.output_dir: ") and out in line, line
    assert f"cannot reach {gcs.endpoint}" in line and "accepts connections and closes them without an answer" in line
    assert "run the same command again" in line and "Traceback" not in stderr, stderr[-3000:]
    assert seconds < LEASE_S + 15, seconds
    print(f"the trainer stopped {seconds:.1f} s after its server went away", file=sys.stderr)
    # the committed checkpoints stand; the same command against the healthy server resumes from the newest
    newest = _committed(out)[-1]
    assert newest >= 2
    done = subprocess.run([*_train_cmd(assets, out, newest + 1), *LEASED], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the checkpoint of step {newest} " in done.stdout, done.stdout[-2000:]
    assert _committed(out)[-1] == newest + 1


def _holder(out: str, lease: float) -> str:
    return ("import sys, time\nfrom g2rl_jax.control.runlock import RunLock\n"
            f"RunLock({out!r}, lease_seconds={lease}).acquire(); print('held', flush=True); time.sleep(300)")


@pytest.mark.parametrize("how", ["closed", "503"])
def test_lease_renewals_that_fail_for_a_lease_stop_the_holder_with_one_line(gcs, tmp_path, how):
    """The lease thread: a holder whose renewals do not land for a whole lease stops with one line (another
    trainer may take the run over from then on), within the lease and one bounded request."""
    out = gcs.url(f"midrun/lease_{how}")
    lease = HOLDER_LEASE_S
    proc = subprocess.Popen([sys.executable, "-c", _holder(out, lease)], env=_env_for(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held", proc.stderr.read()[-3000:]
        with failing(gcs, how):
            t0 = time.monotonic()
            proc.wait(timeout=150)
            seconds = time.monotonic() - t0
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    line = _last_line(stderr)
    assert proc.returncode == Exit.STORAGE, stderr[-3000:]
    assert line.startswith(f"train error: run.output_dir: could not renew the lease on {out}/run.lock"), line
    assert "another trainer may take the run over now" in line and "Traceback" not in stderr, stderr[-3000:]
    cause = "nothing listens on port" if how == "closed" else "answers every request 503"
    assert cause in line, line
    assert lease * 2 / 3 - 1 < seconds < lease + 15, seconds  # renewals every lease/3: the lapse is that late


def _run_until_told(tmp_path, out: str, setup: str, then: str, step: int, how: str, gcs):
    """A process that runs `setup`, prints "ready", waits for a line on stdin and runs `then` as the trainer's loop
    does: a failure classified where it was raised (control/errors.py) ends it with its line and exit code; `then`
    runs while the endpoint fails `how`. Returns (seconds from the failure to the exit, exit code, stderr)."""
    body = "\n".join("    " + line for line in then.splitlines())
    code = (f"import sys\nfrom g2rl_jax.control import errors\n{setup}\nprint('ready', flush=True)\n"
            f"sys.stdin.readline()\ntry:\n{body}\n"
            f"except errors.RunFailure as err:\n    errors.end_run(err, {step}, {out!r})\n"
            "print('no error', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env_for(tmp_path), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        with failing(gcs, how):
            t0 = time.monotonic()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            proc.wait(timeout=150)
            seconds = time.monotonic() - t0
    finally:
        proc.kill()
    return seconds, proc.returncode, proc.stderr.read()


def test_a_metrics_flush_that_fails_is_one_line_and_keeps_what_was_flushed(gcs, tmp_path):
    """The trainer's MetricsWriter (metrics.jsonl and the TensorBoard events through the buffered appends) flushing
    into a bucket that refuses every request: one line, the records flushed before still whole."""
    from g2rl_jax.train.metrics import read_metrics

    out = gcs.url("midrun/metrics")
    setup = ("from g2rl_jax.train.metrics import MetricsWriter\n"
             f"writer = MetricsWriter({out!r}, start_step=0)\n"
             "writer.write(1, {'loss': 1.0}); writer.flush()")
    seconds, code, stderr = _run_until_told(tmp_path, out, setup, "writer.write(2, {'loss': 2.0})\nwriter.flush()", 2,
                                            "503", gcs)
    line = _last_line(stderr)
    assert code == Exit.STORAGE, stderr[-3000:]
    assert line.startswith("train error: run.output_dir: the storage failed after step 2: ") and out in line, line
    assert "answers every request 503" in line and "Traceback" not in stderr, stderr[-3000:]
    assert seconds < BOUND_S, seconds
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_an_async_save_that_fails_is_one_line_and_keeps_the_committed_checkpoint(gcs, tmp_path):
    """Orbax's asynchronous save into a bucket whose server drops every connection: the error surfaces at the next
    wait and becomes the one line, the committed checkpoint stays whole."""
    out = gcs.url("midrun/save")
    setup = ("import jax.numpy as jnp\nfrom g2rl_jax.train.checkpoint import Checkpointer\n"
             "class It:\n    def get_state(self): return {'i': 0}\n    def set_state(self, s): pass\n"
             f"ckpt = Checkpointer({out!r}, every=1, keep=3)\n"
             "state = {'w': jnp.arange(4096.0)}\n"
             "ckpt.save(1, state, It()); ckpt.wait()")
    seconds, code, stderr = _run_until_told(tmp_path, out, setup, "ckpt.save(2, state, It())\nckpt.wait()", 2, "drop",
                                            gcs)
    line = _last_line(stderr)
    assert code == Exit.STORAGE, stderr[-3000:]
    assert line.startswith("train error: run.output_dir: the storage failed after step 2: ") and out in line, line
    assert "accepts connections and closes them without an answer" in line, line
    assert "Traceback" not in stderr and seconds < BOUND_S, (seconds, stderr[-3000:])
    assert _committed(out) == [1]


def test_a_restore_from_a_bucket_that_does_not_answer_sets_nothing_aside(gcs, tmp_path):
    """The newest checkpoint's restore fails because the bucket's server is gone (its port closed): the restore
    probes the store, which does not answer either, so the failure is the storage's (exit 75, one line), not a
    corrupt checkpoint: nothing is moved aside, and with the server back both checkpoints are there."""
    out = gcs.url("midrun/restore")
    setup = ("import jax.numpy as jnp\nfrom g2rl_jax.train.checkpoint import Checkpointer\n"
             "class It:\n    def get_state(self): return {'i': 0}\n    def set_state(self, s): pass\n"
             f"ckpt = Checkpointer({out!r}, every=1, keep=3)\n"
             "state = {'w': jnp.arange(4096.0)}\n"
             "ckpt.save(1, state, It()); ckpt.save(2, state, It()); ckpt.close()\n"
             f"reopened = Checkpointer({out!r}, every=1, keep=3)")
    seconds, code, stderr = _run_until_told(tmp_path, out, setup, "reopened.restore_newest(state, It())", 2,
                                            "closed", gcs)
    line = _last_line(stderr)
    assert code == Exit.STORAGE, stderr[-3000:]
    assert line.startswith("train error: run.output_dir: the storage failed after step 2: ") and out in line, line
    assert "nothing listens on port" in line and "Traceback" not in stderr and seconds < BOUND_S, (seconds, line)
    assert _committed(out) == [1, 2] and not storage.exists(f"{out}/corrupt_checkpoints")
