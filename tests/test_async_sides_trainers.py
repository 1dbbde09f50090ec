"""Several processes on each side, the longer scenarios (opt-in: G2RL_SIDES_SLOW=1; the default suite runs the short
two-training-process run of tests/test_async_sides_train.py). Processes on localhost joined by jax.distributed (CPU,
gloo, JAX's socket transfers), one fake device each.

- Two training processes (the training mesh, fsdp 2, over both: the params sharded over the two) and one rollout
  process, stopped and resumed: SIGTERM to the first training process once step 1's checkpoint is committed stops all
  three (the training side agrees on the stop and checkpoints with Orbax on both of its processes, the samples drawn
  ahead with it), and a relaunch finishes the run: the metrics of the same run on one process with its three devices
  split 2 + 1 (mesh.fsdp=2, mesh.rollout_devices=1).
- One training process and two rollout processes with DAPO dynamic sampling (a reward with mixed groups): the
  rollout mesh spans both rollout processes, the rounds go on as the whole batch decides, and the trainer picks the
  groups from the joined rounds: the metrics of the one-process split run with dynamic sampling.

- kill -9 of a process other than the first, each once step 1's checkpoint is committed, then a relaunch of all:
  training process 1 of a 2 + 1 launch, rollout process 2 of a 1 + 2 launch, rollout process 3 of a 2 + 2 launch.
  The processes that ran a collective with it lose their gloo connection, and the first to see it stops every
  process with one line and exit 76 within seconds (not jax.distributed's heartbeat timeout, then SIGABRT); the
  checkpoints committed stand, and the relaunch resumes from the newest and gives the metrics of the one-process
  split run.

Costs: seven three-process launches, two four-process launches and two one-process runs of the tiny model (each
mostly its first step's compiles); 4 min 43 s on the 2-core machine lightly loaded, up to twice that under load. Run
with
`G2RL_SIDES_SLOW=1 python -m pytest -q -n 0 tests/test_async_sides_trainers.py`.

Also here, without a launch: a training process's block of a step's samples, and dynamic sampling's rounds joined.
"""
import os
import signal
import time

import numpy as np
import pytest
from test_async import DETERMINISTIC, LAG, _same
from test_async_sides import assert_fields_equal
from test_async_sides_train import HANG_S, K1, LEASE_S, ONE, _committed
from test_multihost import _cmd, assets  # noqa: F401 - assets is a fixture

from g2rl_jax import localhost
from g2rl_jax.control.exits import Exit
from g2rl_jax.train.metrics import read_metrics

from _helpers import process_env, run_processes, trainer_args

slow = pytest.mark.skipif(os.environ.get("G2RL_SIDES_SLOW") != "1",
                          reason="opt-in (about 5 minutes): G2RL_SIDES_SLOW=1 runs it")
STEPS = 4
TRAINING = ("mesh.fsdp=2",)  # after ONE's mesh.fsdp=1: a training mesh of two devices, the params sharded


def _sides_cmd(assets, out):  # noqa: F811
    return lambda i, port: _cmd(assets, out, STEPS, [*ONE, *TRAINING, *K1, "mesh.rollout_processes=1",
                                                     *trainer_args(i, port, 3, transfers=True)])


@pytest.fixture(scope="module")
def split(assets, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sides_trainers_split") / "run"
    run_processes(lambda i, port: _cmd(assets, out, STEPS, [*ONE, *TRAINING, *K1, "mesh.rollout_devices=1"]),
                  timeout=HANG_S, processes=1, devices=3)
    return read_metrics(out)


@pytest.fixture(scope="module")
def resumed(assets, tmp_path_factory):  # noqa: F811
    """SIGTERM to training process 0 once step 1's checkpoint is committed, then a relaunch of all three."""
    out = tmp_path_factory.mktemp("sides_trainers") / "run"
    with localhost.Processes(_sides_cmd(assets, out), processes=3, devices=1, env=process_env(1)) as procs:
        t0 = time.monotonic()
        while not _committed(out, 1):
            codes = [p.poll() for p in procs.procs]
            assert codes == [None] * 3 and time.monotonic() - t0 < HANG_S, (codes, procs.log(0)[-3000:])
            time.sleep(0.005)
        procs.procs[0].send_signal(signal.SIGTERM)
        codes = procs.wait(HANG_S)
        logs = [procs.log(i) for i in range(3)]
    stopped = [r["step"] for r in read_metrics(out)]
    run_processes(_sides_cmd(assets, out), timeout=HANG_S, processes=3, devices=1)
    return {"codes": codes, "logs": logs, "stopped": stopped, "records": read_metrics(out)}


@slow
def test_two_training_processes_stop_together_with_a_checkpoint(resumed):
    codes, logs = resumed["codes"], resumed["logs"]
    assert codes[:2] == [Exit.PREEMPTED] * 2, [log[-3000:] for log in logs]
    assert "stopped by SIGTERM after step" in logs[0] and "stopped by SIGTERM after step" in logs[1], logs[1][-3000:]
    # the rollout process ends with the trainer, or has drawn every step (k = 1: the last with version 2) before
    assert codes[2] == Exit.PREEMPTED and "the trainer ended after step" in logs[2] or codes[2] == 0, logs[2][-3000:]
    assert 1 <= len(resumed["stopped"]) < STEPS, resumed["stopped"]  # the relaunch resumed midway


@slow
def test_two_training_processes_resumed_equal_the_one_process_split(resumed, split):
    """Each training process keeps its block of every step's rows; the run, stopped and resumed, gives the
    metrics of the one-process split run."""
    got = resumed["records"]
    assert [r["policy_version"] for r in got] == [0.0, *range(STEPS - 1)]
    assert all(r["weight_sync_bytes"] > 0 for r in got)
    _same(got, split)


GONE = "a process of this run is gone"  # the line of the process that lost its collective's connection


def _killed(assets, out, extra, victim: int, processes: int = 3) -> dict:  # noqa: F811
    """`processes` processes with `extra`; SIGKILL to process `victim` once step 1's checkpoint is committed, a wait
    for the others (at most HANG_S), then a relaunch of all that finishes the run."""
    command = lambda i, port: _cmd(assets, out, STEPS, [*ONE, *K1, *extra,  # noqa: E731
                                                        *trainer_args(i, port, processes, transfers=True)])
    with localhost.Processes(command, processes=processes, devices=1, env=process_env(1)) as procs:
        t0 = time.monotonic()
        while not _committed(out, 1):
            codes = [p.poll() for p in procs.procs]
            assert codes == [None] * processes and time.monotonic() - t0 < HANG_S, (codes, procs.log(0)[-3000:])
            time.sleep(0.005)
        procs.procs[victim].send_signal(signal.SIGKILL)
        t_signal = time.monotonic()
        codes = procs.wait(HANG_S)
        seconds = time.monotonic() - t_signal
        logs = [procs.log(i) for i in range(processes)]
    committed = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    stopped = [r["step"] for r in read_metrics(out)]
    relaunched = run_processes(command, timeout=HANG_S, processes=processes, devices=1)
    return {"codes": codes, "logs": logs, "seconds": seconds, "committed": committed, "stopped": stopped,
            "relaunched": relaunched, "records": read_metrics(out)}


@pytest.fixture(scope="module")
def training_1_killed(assets, tmp_path_factory):  # noqa: F811
    """kill -9 of training process 1 of a 2 + 1 launch (the training mesh, fsdp 2, over processes 0 and 1)."""
    return _killed(assets, tmp_path_factory.mktemp("sides_killed_training") / "run",
                   (*TRAINING, "mesh.rollout_processes=1"), victim=1)


@pytest.fixture(scope="module")
def rollout_2_killed(assets, tmp_path_factory):  # noqa: F811
    """kill -9 of rollout process 2 of a 1 + 2 launch (the rollout mesh, data 2, over processes 1 and 2)."""
    return _killed(assets, tmp_path_factory.mktemp("sides_killed_rollout") / "run", ("mesh.rollout_processes=2",),
                   victim=2)


@pytest.fixture(scope="module")
def rollout_3_killed(assets, tmp_path_factory):  # noqa: F811
    """kill -9 of rollout process 3 of a 2 + 2 launch: rollout process 2 stops the others, two of them training."""
    return _killed(assets, tmp_path_factory.mktemp("sides_killed_two_per_side") / "run",
                   (*TRAINING, "mesh.rollout_processes=2"), victim=3, processes=4)


def _check_stopped_and_resumed(killed, split, victim: int, lines: tuple[str, ...], bound_s: float) -> None:
    codes, logs = killed["codes"], killed["logs"]
    survivors = [i for i in range(len(codes)) if i != victim]
    assert codes[victim] == -signal.SIGKILL
    for i in survivors:  # each ends by itself with the one line, no JAX abort after its heartbeat timeout
        assert codes[i] == Exit.PEER_LOST, (i, codes, logs[i][-3000:])
        assert any(line in logs[i] for line in lines), (i, logs[i][-3000:])
        assert "relaunch every process with the same command" in logs[i], (i, logs[i][-3000:])
        assert "Traceback" not in logs[i] and "Check failure stack trace" not in logs[i], (i, logs[i][-3000:])
    assert killed["seconds"] < bound_s, killed["seconds"]
    assert killed["committed"] and killed["committed"][-1] >= 1, killed["committed"]
    assert 1 <= len(killed["stopped"]) < STEPS, killed["stopped"]  # the relaunch resumed midway, from the newest
    assert f"resumed from the checkpoint of step {killed['committed'][-1]}" in killed["relaunched"][0]
    got = killed["records"]
    assert [r["policy_version"] for r in got] == [0.0, *range(STEPS - 1)]
    _same(got, split)


@slow
def test_a_killed_second_training_process_stops_all_in_one_line_and_the_relaunch_resumes(training_1_killed, split):
    """Training process 0 loses the update's gloo all-reduce with process 1: it stops the rollout process too (its
    stop.Watch), each with the line, within seconds (ACK_S for the dead process's answer, a loaded machine)."""
    _check_stopped_and_resumed(training_1_killed, split, 1, (GONE,), bound_s=60)


@slow
def test_a_killed_rollout_process_of_two_stops_all_in_one_line_and_the_relaunch_resumes(rollout_2_killed, split):
    """Rollout process 1 loses the generate's gloo collective with process 2 (or, waiting elsewhere, the trainer
    sees process 2's lease run out): every process stops with the line; one training device here against two in the
    one-process split run, the same figures up to the order of the sums."""
    lease = "the rollout process 2 (mesh.rollout_processes) has not renewed its lease"
    _check_stopped_and_resumed(rollout_2_killed, split, 2, (GONE, lease), bound_s=LEASE_S + 30)


@slow
def test_a_killed_rollout_process_of_two_per_side_stops_all_four_and_the_relaunch_resumes(rollout_3_killed, split):
    """Two processes a side: the line reaches both training processes and the other rollout process."""
    lease = "the rollout process 3 (mesh.rollout_processes) has not renewed its lease"
    _check_stopped_and_resumed(rollout_3_killed, split, 3, (GONE, lease), bound_s=LEASE_S + 30)


EVEN_LENGTH_REWARD = """
def reward(response, example):
    # correct iff the response has even length: mixed outcomes on a random policy, deterministic
    return 1.0 if len(response) % 2 == 0 else -1.0
"""
DYNAMIC = ("algorithm.filter_equal_groups=true", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3",
           "reward.truncated=keep", "rollout.num_samples=2")  # two samples: half the groups mixed, rounds > 1


@pytest.fixture(scope="module")
def dynamic(assets, tmp_path_factory):  # noqa: F811
    """One training process and two rollout processes with dynamic sampling, and the same run on one process."""
    root = tmp_path_factory.mktemp("sides_dynamic")
    (root / "even_length.py").write_text(EVEN_LENGTH_REWARD)
    extra = (*ONE, *K1, *DYNAMIC, f"reward.function={root / 'even_length.py'}:reward")
    run_processes(lambda i, port: _cmd(assets, root / "sides", STEPS, [*extra, "mesh.rollout_processes=2",
                                                                       *trainer_args(i, port, 3, transfers=True)]),
                  timeout=HANG_S, processes=3, devices=1)
    run_processes(lambda i, port: _cmd(assets, root / "split", STEPS, [*extra, "mesh.rollout_devices=1"]),
                  timeout=HANG_S, processes=1, devices=2)
    return read_metrics(root / "sides"), read_metrics(root / "split")


@slow
def test_two_rollout_processes_with_dynamic_sampling_equal_the_one_process_split(dynamic):
    got, want = dynamic
    assert any(r["sampling_rounds"] > 1 for r in want) and any(r["single_class_fraction"] < 1 for r in want), (
        "every step took one round, or no mixed group: a weak test")
    assert [r["sampling_rounds"] for r in got] == [r["sampling_rounds"] for r in want]
    _same(got, want, keys=(*DETERMINISTIC, *LAG, "sampled_accuracy", "single_class_fraction"))


def _step(rng, prompts: int, m: int, correct_rate: float = 0.5):
    """A whole step's samples of `prompts` groups of `m` (SamplingRounds._sample's tuple), random."""
    from g2rl_jax.rewards.scoring import RewardResult
    from g2rl_jax.rollout.generate import _assemble

    b = prompts * m
    lengths_B = rng.integers(1, 6, b)
    rollout = _assemble(m, rng.integers(1, 50, (b, 4)), rng.integers(0, 2, (b, 4)).astype(bool),
                        rng.integers(1, 50, (b, 8)), rng.normal(size=(b, 8)).astype(np.float32), lengths_B,
                        rng.integers(0, 2, b).astype(bool), decode_steps=int(lengths_B.max()))
    scored = RewardResult(rewards=rng.normal(size=b), correct=rng.random(b) < correct_rate,
                          in_loss=np.ones(b, bool), truncated=np.zeros(b, bool))
    return ([f"prompt {i} {rng.integers(1000)}" for i in range(prompts)], rollout,
            [f"text {i} {rng.integers(1000)}" for i in range(b)], scored, 1.0, [scored.correct])


def _equal(got, want):
    assert got[0] == want[0] and got[2] == want[2]
    for a_, b_ in ((got[1], want[1]), (got[3], want[3])):
        assert_fields_equal(a_, b_)


def test_a_training_block_is_its_rows_of_the_joined_step():
    from g2rl_jax.train.ahead import block_of, joined

    whole = _step(np.random.default_rng(0), prompts=4, m=2)
    assert block_of(whole, 0, 1) is whole
    halves = [block_of(whole, i, 2) for i in range(2)]
    assert len(halves[0][0]) == 2 and len(halves[1][2]) == 4 and halves[1][1].prompt_ids_BxS.shape[0] == 4
    _equal(joined(halves), whole)  # the inverse of joining the rollout blocks
    quarters = [block_of(whole, i, 4) for i in range(4)]
    _equal(joined(quarters), whole)
    assert all(q[5] is whole[5] and q[1].decode_steps == whole[1].decode_steps for q in quarters)


def test_dynamic_sampling_rounds_joined_pick_over_the_whole_batch():
    """Each rollout block sends every round's rows (Rounds); the joined rounds give the groups one process holding
    every row would pick (sampling_rounds.picked with one block), not each block's own pick."""
    from g2rl_jax.train.ahead import Rounds, block_of, whole_step
    from g2rl_jax.train.sampling_rounds import picked

    rng, m = np.random.default_rng(1), 2
    rounds = [_step(rng, prompts=4, m=m) for _ in range(3)]
    # round 0: mixed groups only in the first block's rows, so a pick per block would differ from the whole's
    rounds[0][3].correct[:] = [True, False, False, True, True, True, False, False]
    correct = [r[3].correct.copy() for r in rounds]
    sent = [Rounds([block_of(r, i, 2)[:4] for r in rounds], float(i + 1), correct) for i in range(2)]
    got = whole_step(sent, m)
    want = picked([r[:4] for r in rounds], correct, m, 1, 0)
    _equal(got, want)
    assert got[4] == 2.0 and got[5] is correct
    per_block = [picked([block_of(r, i, 2)[:4] for r in rounds], correct, m, 2, i) for i in range(2)]
    assert per_block[0][0] + per_block[1][0] != want[0]  # the test can tell the two apart


def test_a_lost_gloo_connection_is_a_peer_lost_where_the_collective_is_called():
    """control/errors.py's `device_failure`, at the call site of a program or a host collective: the runtime's gloo
    line of a collective whose peer died is PeerLost (its exit code 76, its one line); the same text anywhere else (a
    StageError wrapping it, a plain Python error saying so) is not looked at; a host collective's call site
    (parallel.py) raises it, and passes other errors as they are."""
    import jax

    from g2rl_jax.control.errors import PeerLost, device_failure, host_collective
    from g2rl_jax.train.step import StageError

    lost = ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
            "[127.0.0.1]:15541: Connection reset by peer")
    gone = device_failure(jax.errors.JaxRuntimeError(lost), "stage 'update'")
    assert isinstance(gone, PeerLost) and gone.code == Exit.PEER_LOST and gone.detail == lost[len("UNKNOWN: "):]
    assert gone.line(3).startswith("a process of this run is gone after step 3 (Gloo all-reduce failed")
    assert device_failure(jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: bad size"), "x") is None
    assert device_failure(ValueError("Gloo: Connection reset by peer"), "x") is None  # not the runtime's status
    assert device_failure(RuntimeError(lost), "x") is None
    jitted = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by "
              "peer [127.0.0.1]:44228")  # what a jitted call raised as a ValueError when its peer was killed
    assert device_failure(ValueError(jitted), "x").detail == jitted[len("UNKNOWN: "):]
    assert device_failure(StageError(lost), "x") is None  # a wrapper's text is never read

    @host_collective
    def collective(err):
        raise err

    with pytest.raises(PeerLost):
        collective(jax.errors.JaxRuntimeError(lost))
    with pytest.raises(ValueError):
        collective(ValueError("another failure"))
