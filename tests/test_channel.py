"""The run's key-value channel and its values (control/channel.py, control/wire.py) and the one stop path
(control/stop.py).

In this process: values of every kind a run sends (a step's samples: Example, Rollout, RewardResult) cross
JSON plus arrays unchanged, types, dtypes and shapes included; what is not such a value (a pickle, a compressed or
object array, a dataclass the reader did not allow, fields or shapes its class does not declare) is refused in one
line, and nothing in it runs; in a notebook a stop raises Stopped in the main thread instead of ending the kernel.
Between two real jax.distributed processes (CPU, gloo, loopback: tests/channel_worker.py): a few MB in 256 KB
chunks through gets that poll every millisecond, the bound, the kept chunks, the `ended` hook, the trainer's finish;
pickles planted in the store refused, and the sides' read of one stopping both processes with one line, exit 2;
SIGTERM's abandoned step on one process ending the other with its line and exit code 143.

Costs: three launches of two processes that import JAX and compile nothing (the third one barrier program).
"""
import dataclasses
import io
import pickle
import signal
import sys
import threading
import time
import zipfile
from typing import Any

import numpy as np
import pytest

from g2rl_jax import localhost
from g2rl_jax.control import stop, wire
from g2rl_jax.control.exits import Exit
from g2rl_jax.data.datasets import Example
from g2rl_jax.rewards.scoring import RewardResult
from g2rl_jax.rollout.generate import Rollout
from g2rl_jax.train import ahead

from _helpers import TESTS, process_env

HANG_S = 300


class Planted:
    """What an attacker writes: unpickling it creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _sample(rows: int = 4, width: int = 6):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, width, rows)
    rollout = Rollout(completion_ids=[list(range(n)) for n in lengths],
                      logprobs=[rng.standard_normal(n).astype(np.float32) for n in lengths],
                      finish_reasons=["stop", "length"] * (rows // 2), num_samples=2,
                      prompt_ids_BxS=np.arange(rows * 3, dtype=np.int32).reshape(rows, 3),
                      prompt_mask_BxS=np.ones((rows, 3), bool),
                      completion_ids_BxT=np.zeros((rows, width), np.int32),
                      completion_mask_BxT=np.zeros((rows, width), bool),
                      logprobs_BxT=np.zeros((rows, width), np.float32), completion_lengths=lengths.astype(np.int32),
                      decode_steps=int(lengths.max()), segments=(4, 2))
    examples = [Example(id="a", problem="1+1", answer="2", row={"numbers": [1, 2], "target": 3, "note": None}),
                Example(id="b", problem="A or B?", answer="B", kind="choice", choices=("x", "y"))]
    scored = RewardResult(rewards=np.float32([1, -1, 1, -1]), correct=np.array([True, False, True, False]),
                          in_loss=np.ones(rows, bool), truncated=np.zeros(rows, bool))
    return examples, rollout, ["t1", "t2", "t3", "t4"], scored, 1.5, [np.array([True, False])]


def _same(a, b) -> bool:
    """Equal, with the same types throughout (numpy dtypes and scalars, tuples against lists)."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def test_a_step_of_samples_crosses_unchanged_as_bytes_and_as_json():
    value = (_sample(), 3, 2.0, {"next": 5, "parents": [{"i": 1}]}, None, np.float32(0.5), {7: (b"\x00\x01", True)})
    schema = tuple[ahead.Sample, int, float, Any, None, float, dict[int, tuple[bytes, bool]]]
    assert _same(wire.decode(wire.encode(value), ahead.SAMPLE_KINDS, schema), value)
    assert _same(wire.from_json(wire.to_json(value), ahead.SAMPLE_KINDS, schema), value)
    pending = {2: ahead.Drawn(_sample(), 1, 0.25)}
    position, got = ahead.restored(ahead.saved({"next": 9}, pending))  # the data-iterator file's round trip
    assert position == {"next": 9} and list(got) == [2] and _same(got[2], pending[2])


@pytest.mark.parametrize("tamper, says", [
    (lambda b: pickle.dumps({"a": 1}), "not a value this version writes"),
    (lambda b: b[:-3], "its arrays cannot be read"),
    (lambda b: wire.MAGIC + b"\x00" * 7 + b"\x05{", "shorter than its header says"),
])
def test_bytes_that_are_not_ours_are_refused_in_one_line(tamper, says):
    payload = wire.encode({"x": np.arange(3)})
    with pytest.raises(wire.Refused, match=says) as err:
        wire.decode(tamper(payload), where="key g2rl/k")
    assert str(err.value).startswith("key g2rl/k: ") and "\n" not in str(err.value)


def _npz_with(arrays: dict, compression=zipfile.ZIP_STORED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as zf:
        for name, array in arrays.items():
            data = io.BytesIO()
            np.lib.format.write_array(data, array, allow_pickle=True)
            zf.writestr(name, data.getvalue())
    return out.getvalue()


def _npy_claiming(shape) -> bytes:
    """An .npy entry whose header claims `shape` of float32, followed by 8 bytes."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return out.getvalue() + bytes(8)


def test_a_pickle_inside_the_arrays_is_refused_and_never_run(tmp_path):
    """Objects (a pickle inside the .npz), a compressed entry, and a header claiming more than was sent (an
    allocation of 4 TB) are refused before anything is allocated or run."""
    marker = tmp_path / "ran"
    objects = np.array([Planted(marker)], dtype=object)
    tree = {"a": 0}
    claiming = io.BytesIO()
    with zipfile.ZipFile(claiming, "w") as zf:
        zf.writestr("0.npy", _npy_claiming((10 ** 12,)))
    for npz, says in [(_npz_with({"0.npy": objects}), "cannot be read .*dtype object"),
                      (_npz_with({"0.npy": np.arange(3)}, zipfile.ZIP_DEFLATED), "not the .npz this version writes"),
                      (claiming.getvalue(), r"cannot be read .*shape \(1000000000000,\)")]:
        with pytest.raises(wire.Refused, match=says):
            wire.from_json({"wire": 1, "json": tree, "npz": __import__("base64").b64encode(npz).decode()}, where="f")
    assert not marker.exists()
    with pytest.raises(TypeError, match="cannot be sent"):
        wire.encode(objects)


def test_a_value_not_of_the_readers_schema_is_refused():
    examples, rollout, *rest = _sample()
    cases = [
        (rollout, (), Rollout, "a 'Rollout', which is not one of the kinds read here"),
        (dataclasses.replace(rollout, prompt_mask_BxS=np.ones((4, 5), bool)), (Rollout,), Rollout,
         "prompt_mask_BxS: S = 5, but prompt_ids_BxS has S = 3"),
        (dataclasses.replace(rollout, logprobs_BxT=np.zeros(4, np.float32)), (Rollout,), Rollout,
         "logprobs_BxT: rank 1, not 2"),
        (dataclasses.replace(rollout, completion_ids=[[1, "2"]]), (Rollout,), Rollout,
         r"completion_ids: \[0\]: \[1\]: a str, not int"),
        ((1, "x"), (), tuple[int, int], r"\[1\]: a str, not int"),
        ({"a": 1}, (), dict[str, str], r"\['a'\]: a int, not str"),
        ([1, 2, 3], (), tuple[int, int], "a list, not tuple"),
    ]
    for value, kinds, schema, says in cases:
        with pytest.raises(wire.Refused, match=says):
            wire.decode(wire.encode(value), kinds, schema, where="key k")
    payload = wire.encode(examples[0]).replace(b'"math"', b'"poem"')  # a field its class's own check refuses
    with pytest.raises(wire.Refused, match="kind must be one of|is not one of"):
        wire.decode(payload, (Example,), Example, where="key k")
    fields = wire.to_json(examples[0])
    fields["json"]["f"]["extra"] = 1
    with pytest.raises(wire.Refused, match="not \\['answer'"):
        wire.from_json(fields, (Example,), Example, where="f")


def test_the_old_pickled_data_iterator_state_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    state = {"ahead": __import__("base64").b64encode(pickle.dumps(Planted(marker))).decode()}
    with pytest.raises(wire.Refused, match="pickled .* refused, nothing in it was run"):
        ahead.restored(state)
    assert not marker.exists()


def test_in_a_notebook_a_stop_raises_in_the_main_thread(monkeypatch, capsys):
    """No os._exit: the kernel lives on. From the main thread Stopped is raised there; from another thread (the
    lease's, a watcher) it is raised in the main thread, and that thread ends quietly."""
    monkeypatch.setitem(sys.modules, "ipykernel", type(sys)("ipykernel"))
    with pytest.raises(stop.Stopped, match="the lease is lost") as err:
        stop.stop_everywhere("the lease is lost", Exit.LEASE_LOST)
    assert err.value.code == Exit.LEASE_LOST
    ended = []

    def lease_thread():
        try:
            stop.stop_everywhere("storage gone", Exit.STORAGE)
        except SystemExit:  # what ends this thread quietly (threading's own hook ignores it)
            ended.append(True)

    thread = threading.Thread(target=lease_thread)
    with pytest.raises(stop.Stopped, match="storage gone") as err:
        thread.start()
        for _ in range(1000):
            time.sleep(0.01)
    thread.join()
    assert err.value.code == Exit.STORAGE and ended == [True]
    assert capsys.readouterr().err.splitlines() == ["the lease is lost", "storage gone"]


def _two(mode: str, marker) -> list[tuple[int | None, str]]:
    worker = str(TESTS / "channel_worker.py")
    return localhost.run(lambda i, port: [sys.executable, worker, f"127.0.0.1:{port}", str(i), mode, str(marker)],
                         timeout=HANG_S, processes=2, devices=1, env=process_env(1))


def test_the_channel_between_two_processes(tmp_path):
    ran = _two("channel", tmp_path / "unused")
    for i, (code, log) in enumerate(ran):
        assert code == 0, (i, log[-4000:])
    log = ran[0][1]
    for name in ("chunked:", "bound:", "resumed:", "late:", "ended: the hook", "ended: a key set before", "delete:",
                 "finish:"):
        assert f"ok {name}" in log, (name, log[-4000:])


def test_pickles_planted_in_the_store_are_refused_and_stop_the_run_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    ran = _two("refuse", marker)
    assert not marker.exists(), "a planted pickle was run"
    line = ("run error: key g2rl/sides/start of jax.distributed's key-value store: not a value this version writes "
            "(JSON and arrays: a pickle, or another program's bytes); refused, nothing in it was run")
    for i, (code, log) in enumerate(ran):
        assert code == Exit.BAD_INPUT, (i, log[-4000:])
        assert "Traceback" not in log, (i, log[-4000:])
        said = [x for x in log.splitlines() if x.startswith("run error:")]
        assert said == [line if i == 0 else f"{line} (process 0)"], (i, said)
    assert "ok refused planted/whole" in ran[0][1] and "ok refused planted/chunk" in ran[0][1], ran[0][1][-4000:]


def test_sigterms_abandoned_step_ends_every_process_with_its_line(tmp_path):
    """lifecycle.StopSignal announces an abandon on the stop path: process 0, waiting at a collective for process 1,
    ends at once with process 1's line and exit code 143 (no gloo error, no heartbeat timeout)."""
    worker = str(TESTS / "channel_worker.py")
    with localhost.Processes(lambda i, port: [sys.executable, worker, f"127.0.0.1:{port}", str(i), "sigterm", "-"],
                             devices=1, env=process_env(1)) as procs:
        t0 = time.monotonic()
        while not all("running" in procs.log(i) for i in range(2)):
            assert time.monotonic() - t0 < HANG_S and all(p.poll() is None for p in procs.procs), \
                [procs.log(i)[-3000:] for i in range(2)]
            time.sleep(0.05)
        procs.procs[1].send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
        codes = procs.wait(60)
        seconds = time.monotonic() - t_signal
        logs = [procs.log(i) for i in range(2)]
    line = ("SIGTERM received: the step in progress would not end within the 5 s grace (no step has been timed yet); "
            "abandoning it, the last checkpoint stands")
    assert codes == [Exit.PREEMPTED, Exit.PREEMPTED], (codes, logs)
    assert line in logs[1].splitlines(), logs[1][-3000:]
    assert f"{line} (process 1)" in logs[0].splitlines(), logs[0][-3000:]
    assert "Traceback" not in logs[0] + logs[1], logs
    assert seconds < 30, seconds  # the line through the channel, process 0's second to leave last, a loaded machine
