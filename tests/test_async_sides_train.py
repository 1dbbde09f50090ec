"""One process per side in the trainer (mesh.rollout_processes=1, train/sides.py): two `python -m g2rl_jax.train`
processes on localhost joined by jax.distributed (CPU, gloo, JAX's socket transfers), one fake device each;
process 0 holds the training mesh, process 1 the rollout mesh. The weights cross by cross-host jax.device_put,
the samples by jax.distributed's key-value store. Launched by g2rl_jax/localhost.py.

Checks: one-step-off (k = 1) gives the metrics of the same run on one process with its two devices split 1 + 1
(mesh.rollout_devices=1), and the lag metrics say version max(0, s - 1) drew step s; k = 0 gives the colocated
run's metrics (one process, one device). Stops and resumes, all in one run directory, one launch after the other:
SIGTERM to the trainer (both processes stop, the trainer with a checkpoint of its step), kill -9 of the trainer
(JAX ends the rollout process at once), kill -9 of the rollout process (the trainer stops with one line within its
lease), each followed by a relaunch of both; the finished run's metrics equal the uninterrupted run's, every field
but the timings and the compile counts.

Each side as two processes, two training processes (the training mesh, fsdp 2, over the two) and two rollout
processes (the rollout mesh, data 2, over the two): four one-step-off steps give the metrics of the one-process
split run's first four.

Costs: 6 two-process launches, 1 four-process launch and 2 one-process runs of the tiny model (each mostly its
first step's compiles), and a two-process launch refused at once.
"""
import pathlib
import signal
import time

import pytest
from test_async import _same
from test_multihost import _cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import localhost
from g2rl_jax.control import stop
from g2rl_jax.control.exits import Exit
from g2rl_jax.train.metrics import read_metrics

from _helpers import process_env, run_processes, trainer_args

SHORT = 4  # the four-process run: steps enough for the lag's steady state
STEPS = 10  # steps after the first take milliseconds: enough of them that each stop below lands mid-run
HANG_S = 600  # a hang guard only
LEASE_S = 9  # run.lock_lease_seconds (its smallest): a trainer hears of a dead rollout process within it
ONE = ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "run.eval_every=0", f"run.lock_lease_seconds={LEASE_S}")
K1 = ("rollout.max_staleness=1", "algorithm.rollout_is_cap=2.0")
TRAINER, ROLLOUT = 0, 1


def _sides_cmd(assets, out, extra, rollout_processes=1, steps=STEPS, processes=None):  # noqa: F811
    processes = processes or 1 + rollout_processes
    return lambda i, port: _cmd(assets, out, steps, [*ONE, *extra, f"mesh.rollout_processes={rollout_processes}",
                                                     *trainer_args(i, port, processes, transfers=True)])


def _sides(assets, out, extra):  # noqa: F811
    run_processes(_sides_cmd(assets, out, extra), timeout=HANG_S, devices=1)
    return read_metrics(out)


def _one_process(assets, out, extra, devices):  # noqa: F811
    run_processes(lambda i, port: _cmd(assets, out, STEPS, [*ONE, *extra]), timeout=HANG_S, processes=1,
                  devices=devices)
    return read_metrics(out)


def _committed(out: pathlib.Path, step: int) -> bool:
    ckpts = out / "checkpoints"
    return ckpts.is_dir() and any(p.name == str(step) for p in ckpts.iterdir())


def _stop_at(assets, out, victim: int, sig: int, step: int) -> tuple[list[int | None], list[str], float]:  # noqa: F811
    """Launch both processes, send `sig` to process `victim` the moment step `step`'s checkpoint is committed, and
    wait for both (at most HANG_S): their exit codes, logs, and the survivor's seconds from the signal to its end."""
    with localhost.Processes(_sides_cmd(assets, out, K1), devices=1, env=process_env(1)) as procs:
        t0 = time.monotonic()
        while not _committed(out, step):
            codes = [p.poll() for p in procs.procs]
            assert codes == [None, None] and time.monotonic() - t0 < HANG_S, (codes, procs.log(0)[-3000:],
                                                                     procs.log(1)[-3000:])
            time.sleep(0.005)
        assert procs.procs[victim].poll() is None, f"process {victim} ended before step {step}'s checkpoint"
        procs.procs[victim].send_signal(sig)
        t_signal = time.monotonic()
        procs.wait(HANG_S, which=[victim])
        codes = procs.wait(HANG_S)
        return codes, [procs.log(0), procs.log(1)], time.monotonic() - t_signal


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("async_sides_train")
    return {"sides_k1": _sides(assets, tmp / "sides_k1", K1),
            "split_k1": _one_process(assets, tmp / "split_k1", (*K1, "mesh.rollout_devices=1"), devices=2),
            "sides_k0": _sides(assets, tmp / "sides_k0", ()),
            "colocated": _one_process(assets, tmp / "colocated", (), devices=1)}


@pytest.fixture(scope="module")
def stopped(assets, tmp_path_factory):  # noqa: F811
    """One run directory, four launches: SIGTERM to the trainer after step 1's checkpoint, kill -9 of the trainer
    after step 3's, kill -9 of the rollout process after step 5's, then a launch that finishes the run."""
    out = tmp_path_factory.mktemp("async_sides_stopped") / "run"
    stops = {"sigterm": _stop_at(assets, out, TRAINER, signal.SIGTERM, 1),
             "trainer_killed": _stop_at(assets, out, TRAINER, signal.SIGKILL, 3),
             "rollout_killed": _stop_at(assets, out, ROLLOUT, signal.SIGKILL, 5)}
    run_processes(_sides_cmd(assets, out, K1), timeout=HANG_S, devices=1)
    return {"stops": stops, "records": read_metrics(out)}


def test_one_process_per_side_one_step_off_equals_the_one_process_split(runs):
    got = runs["sides_k1"]
    assert [r["policy_version"] for r in got] == [0.0, *range(STEPS - 1)]
    assert [r["staleness_max"] for r in got] == [0.0, *[1.0] * (STEPS - 1)]
    assert all(r["weight_sync_bytes"] > 0 for r in got)
    _same(got, runs["split_k1"])


@pytest.fixture(scope="module")
def two_processes_per_side(assets, tmp_path_factory):  # noqa: F811
    """A short one-step-off run on four processes: two training processes (the training mesh, fsdp 2, over both:
    each holds half of every sharded parameter, and its block of the rows) and two rollout processes (the rollout
    mesh, data 2, over both)."""
    out = tmp_path_factory.mktemp("async_sides_two_per_side") / "run"
    run_processes(_sides_cmd(assets, out, (*K1, "mesh.fsdp=2"), rollout_processes=2, steps=SHORT, processes=4),
                  timeout=HANG_S, processes=4, devices=1)
    return read_metrics(out)


def test_two_processes_per_side_equal_the_one_process_split(runs, two_processes_per_side):
    """Each rollout process samples its block of the step's prompts in one generate over the mesh of both; every
    training process reads the joined blocks and keeps its block of the rows (the batch split over the training
    mesh's fsdp axis); each side's host collectives span its two processes, and the weight sync all-gathers the
    sharded params first: the metrics of the one-process split run's first steps (one training device there: the
    same figures up to the order of the sums)."""
    got = two_processes_per_side
    assert [r["policy_version"] for r in got] == [0.0, *range(SHORT - 1)]
    assert all(r["weight_sync_bytes"] > 0 for r in got)
    _same(got, runs["split_k1"][:SHORT])


def test_no_training_process_is_refused_in_one_line(assets, tmp_path):  # noqa: F811
    ran = localhost.run(_sides_cmd(assets, tmp_path / "run", K1, rollout_processes=2, processes=2), timeout=HANG_S,
                        processes=2, devices=1, env=process_env(1))
    for code, log in ran:
        assert code == Exit.BAD_INPUT, log[-3000:]
        lines = [line for line in log.splitlines() if "mesh.rollout_processes=2 of 2 processes" in line]
        assert len(lines) == 1 and "each side needs at least one process" in lines[0], log[-3000:]
        assert "Traceback" not in log, log[-3000:]


def test_one_process_per_side_serial_equals_colocated(runs):
    _same(runs["sides_k0"], runs["colocated"])


def test_sigterm_to_the_trainer_stops_both_with_a_checkpoint(stopped):
    codes, logs, _ = stopped["stops"]["sigterm"]
    assert codes == [Exit.PREEMPTED, Exit.PREEMPTED], logs
    assert "stopped by SIGTERM after step" in logs[TRAINER], logs[TRAINER][-3000:]
    assert "the trainer ended after step" in logs[ROLLOUT], logs[ROLLOUT][-3000:]


def test_a_killed_trainer_ends_the_rollout_process_at_once(stopped):
    codes, logs, seconds = stopped["stops"]["trainer_killed"]
    assert codes[TRAINER] == -signal.SIGKILL
    # JAX's coordination client ends it (SIGABRT), or it notices first and ends in its own line
    assert codes[ROLLOUT] in (-signal.SIGABRT, Exit.PEER_LOST), logs[ROLLOUT][-3000:]
    assert ("JAX distributed service detected fatal errors" in logs[ROLLOUT]
            or "the trainer process is gone" in logs[ROLLOUT]), logs[ROLLOUT][-3000:]
    assert seconds < 60, seconds


def test_a_killed_rollout_process_ends_the_trainer_in_one_line_within_its_lease(stopped):
    codes, logs, seconds = stopped["stops"]["rollout_killed"]
    assert codes == [Exit.PEER_LOST, -signal.SIGKILL], logs[TRAINER][-3000:]
    assert "the rollout process 1 (mesh.rollout_processes) has not renewed its lease" in logs[TRAINER]
    assert "Traceback" not in logs[TRAINER], logs[TRAINER][-3000:]
    assert seconds < LEASE_S + 30, seconds  # the lease, the other processes' 5 s to take the line, a loaded machine


def test_a_stop_waits_for_no_answer_from_the_process_it_is_about():
    """The trainer that ends the run for a rollout process's lapsed lease waits for the others' answers, not that
    process's (none would come: it cost the stop ACK_S); any other process waits for process 0 alone."""
    assert stop.awaited_acks(0, 2, gone=(1,)) == []
    assert stop.awaited_acks(0, 4, gone=(2,)) == [1, 3]
    assert stop.awaited_acks(0, 4) == [1, 2, 3]
    assert stop.awaited_acks(2, 4) == [0] and stop.awaited_acks(1, 2, gone=(1,)) == [0]


def test_stops_and_relaunches_give_the_uninterrupted_run(runs, stopped):
    """Every field of every step equal, but the timings and the compile counts (a relaunch compiles anew)."""
    got, want = stopped["records"], runs["sides_k1"]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))

    def kept(record):
        return {k: v for k, v in record.items() if "second" not in k and k != "programs_compiled"}

    for rg, rw in zip(got, want, strict=True):
        assert kept(rg) == kept(rw), rw["step"]
