"""Checkpoints: save/restore equality with the grain iterator position, keep-last-N, sharded restore on a (2,2,2)
mesh, and real `kill -9` of a saving process at random moments (mid-save included)."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from g2rl_jax.train.checkpoint import Checkpointer, latest_step


def _iterator():
    """A real grain iterator: a shuffled, mapped MapDataset, as the data pipeline builds them."""
    return iter(grain.MapDataset.range(10_000).shuffle(seed=7).map(lambda i: i * 3 + 1).to_iter_dataset())


def _state(step, size=1024):
    """Deterministic per-step training-state pytree (params, opt state, step, RNG key data)."""
    rng = np.random.default_rng(step)
    return {"params": {"w": jnp.asarray(rng.standard_normal((size // 16, 16), dtype=np.float32)),
                       "b": jnp.asarray(rng.standard_normal(16).astype(jnp.bfloat16))},
            "opt": {"mu": jnp.full((size // 16, 16), float(step), jnp.float32), "count": jnp.int32(step)},
            "step": jnp.int32(step),
            "rng": jax.random.key_data(jax.random.fold_in(jax.random.key(0), step))}


def _abstract(state, sharding_fn=lambda x: None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), state)


def _assert_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert jax.tree.structure(a) == jax.tree.structure(b)


class _BytesIterator:
    """get_state() returning bytes, as grain's DataLoaderIterator does."""

    def __init__(self, position=0):
        self.position = position

    def get_state(self):
        return b'{"pos": %d, "raw": "\xff\x00"}' % self.position

    def set_state(self, state):
        assert state.endswith(b'"\xff\x00"}')
        self.position = int(state.split(b",")[0].split(b":")[1])


def test_save_restore_equality_with_iterator_state(tmp_path):
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    it = _iterator()
    consumed = [next(it) for _ in range(5)]
    state = _state(5)
    assert ckpt.save(5, state, it)
    expected_next = [next(it) for _ in range(4)]  # moving on after save must not change what was saved
    ckpt.save(6, _state(6), _BytesIterator(42))
    ckpt.close()

    reopened = Checkpointer(tmp_path, every=1, keep=3)
    assert reopened.latest_step() == latest_step(tmp_path) == 6
    fresh = _iterator()
    restored = reopened.restore(5, _abstract(state), fresh)
    _assert_equal(restored, state)
    assert restored["params"]["b"].dtype == jnp.bfloat16
    assert [next(fresh) for _ in range(4)] == expected_next and len(consumed) == 5
    other = _BytesIterator()
    _assert_equal(reopened.restore(6, _abstract(state), other), _state(6))
    assert other.position == 42
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 4"):
        reopened.restore(4, _abstract(state), _iterator())
    reopened.close()


def test_interval_keep_last_n_and_forced_final_save(tmp_path):
    assert latest_step(tmp_path) is None
    ckpt = Checkpointer(tmp_path, every=2, keep=2)
    it = _iterator()
    saved = [step for step in range(1, 10) if ckpt.save(step, _state(step, 64), it)]
    assert saved == [2, 4, 6, 8]
    assert ckpt.save(9, _state(9, 64), it, force=True)        # the end of the run
    assert not ckpt.save(9, _state(9, 64), it, force=True)    # already saved: no error, nothing written
    ckpt.close()
    assert Checkpointer(tmp_path, every=2, keep=2).all_steps() == [8, 9]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["8", "9"]


def test_save_survives_donation_of_saved_arrays(tmp_path):
    """save() copies device arrays before returning, so the next jitted step may donate (delete) them."""
    ckpt = Checkpointer(tmp_path, every=1, keep=1)
    state = _state(2, 4096)
    ckpt.save(2, state, _iterator())
    jax.tree.map(lambda x: x.delete(), state)
    ckpt.wait()
    _assert_equal(ckpt.restore(2, _abstract(_state(2, 4096)), _iterator()), _state(2, 4096))
    ckpt.close()


def test_typed_key_rejected_with_advice(tmp_path):
    ckpt = Checkpointer(tmp_path, every=1, keep=1)
    with pytest.raises(TypeError, match=r"\['rng'\].*key_data"):
        ckpt.save(1, {"rng": jax.random.key(0)}, _iterator())
    ckpt.close()


def test_sharded_restore_on_2x2x2_mesh(tmp_path):
    assert jax.device_count() == 8, "conftest sets 8 CPU devices"
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    saved_sharding = NamedSharding(mesh, P("fsdp", "tensor"))
    state = jax.tree.map(lambda x: jax.device_put(x, saved_sharding) if x.ndim == 2 else x, _state(3, 256))
    ckpt = Checkpointer(tmp_path, every=1, keep=1)
    ckpt.save(3, state, _iterator())
    ckpt.wait()

    target = {2: NamedSharding(mesh, P("tensor", ("data", "fsdp"))), 1: NamedSharding(mesh, P("data")),
              0: NamedSharding(mesh, P())}
    abstract = _abstract(state, lambda x: target[x.ndim])
    restored = ckpt.restore(3, abstract, _iterator())
    ckpt.close()
    _assert_equal(restored, _state(3, 256))
    for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
        assert leaf.sharding == want.sharding
    assert restored["params"]["w"].addressable_shards[0].data.shape == (16 // 2, 16 // 4)


# The child trains "forever": each step advances the grain iterator by one element and saves a fresh 2 x 16 MB
# state (interval 1, asynchronous, so a save is nearly always in flight). On start it resumes from the latest
# checkpoint and checks what it restored, exiting 3 on a mismatch.
CHILD = textwrap.dedent("""
    import sys
    import numpy as np, jax, jax.numpy as jnp
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import _iterator, _state, _abstract, _assert_equal, SIZE
    from g2rl_jax.train.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], every=1, keep=2)
    it = _iterator()
    start = ckpt.latest_step() or 0
    if start:
        try:
            _assert_equal(ckpt.restore(start, _abstract(_state(start, SIZE)), it), _state(start, SIZE))
        except AssertionError as err:
            print(f"restore mismatch at {start}: {err}", file=sys.stderr, flush=True)
            sys.exit(3)
    print(f"resumed {start}", flush=True)
    for step in range(start + 1, 10**6):
        next(it)
        state = _state(step, SIZE)
        print(f"saving {step}", flush=True)
        ckpt.save(step, state, it)
""")
SIZE = 4 * 1024 * 1024  # float32 elements per big array: 16 MB each


def _expected_next(step):
    it = _iterator()
    for _ in range(step):
        next(it)
    return next(it)


def test_kill_minus_9_never_leaves_latest_unreadable(tmp_path):
    run_dir = tmp_path / "run"
    rng = random.Random(1234)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    last, killed_mid_save = 0, 0
    for round_ in range(3):
        log = open(tmp_path / f"child{round_}.err", "w+")
        proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(Path(__file__).parent)],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        first = proc.stdout.readline()
        assert first.startswith(f"resumed {last}"), (first, log.seek(0) or log.read())
        # round 0: kill as the first save starts; later rounds: once "saving last+3" shows (Orbax waits for the
        # previous save before starting the next, so step last+1 is then complete), after a random delay, mid-save.
        wait_for = 1 if round_ == 0 else last + 3
        while (line := proc.stdout.readline()) != f"saving {wait_for}\n":
            assert line.startswith("saving"), (line, log.seek(0) or log.read())
        time.sleep(0.0 if round_ == 0 else rng.uniform(0.0, 1.0))
        if round_:  # then strike as soon as a save is in flight (a temporary step directory exists)
            while not any("tmp" in p.name for p in (run_dir / "checkpoints").iterdir()):
                time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        log.close()
        names = [p.name for p in (run_dir / "checkpoints").iterdir()]
        killed_mid_save += any("tmp" in name for name in names)
        step = latest_step(run_dir)
        if step is None:  # round 0, killed before the first save completed: nothing to check yet
            assert round_ == 0
            continue
        assert step >= (last + 1 if round_ else 0)
        ckpt = Checkpointer(run_dir, every=1, keep=2)
        it = _iterator()
        _assert_equal(ckpt.restore(step, _abstract(_state(step, SIZE)), it), _state(step, SIZE))
        assert next(it) == _expected_next(step)
        ckpt.close()
        last = step
    assert killed_mid_save >= 1, "no kill landed mid-save; the test did not exercise what it claims"


# ------------------------------------------------------------------------------------------ corrupt checkpoints
def _corrupt(step_dir: Path, how: str) -> None:
    """Damage a committed checkpoint on disk, as a bad disk, a partial copy or a stray edit would."""
    data_files = sorted((step_dir / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    if how == "array_bytes":  # the array data overwritten with garbage
        for path in data_files:
            path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(path.stat().st_size)))
    elif how == "truncated":  # the largest data file cut short
        data_files[-1].write_bytes(data_files[-1].read_bytes()[: data_files[-1].stat().st_size // 2])
    elif how == "metadata_gone":
        (step_dir / "state" / "_METADATA").unlink()
    elif how == "iterator_garbage":
        next((step_dir / "data").glob("process_*.json")).write_text('{"encoding": "json", "sta')
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["array_bytes", "truncated", "metadata_gone", "iterator_garbage"])
def test_corrupt_newest_falls_back_to_the_previous_one(tmp_path, capsys, how):
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), _BytesIterator(step))
    ckpt.close()
    _corrupt(tmp_path / "checkpoints" / "3", how)

    reopened = Checkpointer(tmp_path, every=1, keep=3)
    it = _BytesIterator()
    step, state = reopened.restore_newest(_abstract(_state(0)), it)
    assert step == 2 and it.position == 2
    _assert_equal(state, _state(2))
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'checkpoints' / '3'} cannot be restored" in err
    assert (tmp_path / "corrupt_checkpoints" / "3").is_dir()  # set aside, not deleted
    assert reopened.all_steps() == [1, 2]
    assert reopened.save(3, _state(3), _BytesIterator(3))  # the run can save step 3 again
    reopened.close()
    assert Checkpointer(tmp_path, every=1, keep=3).restore_newest(_abstract(_state(0)), it)[0] == 3


def test_no_readable_checkpoint_names_the_directory(tmp_path):
    from g2rl_jax.train.checkpoint import CheckpointError

    ckpt = Checkpointer(tmp_path, every=1, keep=2)
    for step in (1, 2):
        ckpt.save(step, _state(step), _BytesIterator(step))
    ckpt.close()
    for step in (1, 2):
        _corrupt(tmp_path / "checkpoints" / str(step), "metadata_gone")
    with pytest.raises(CheckpointError, match=rf"no checkpoint in {tmp_path / 'checkpoints'} can be restored "
                                              rf"\(step 2: .*; step 1: .*\); delete {tmp_path / 'checkpoints'}"):
        Checkpointer(tmp_path, every=1, keep=2).restore_newest(_abstract(_state(0)), _BytesIterator())
    assert Checkpointer(tmp_path / "fresh", every=1, keep=2).restore_newest({}, _BytesIterator()) == (None, None)


def test_an_error_that_says_unavailable_is_no_storage_failure(tmp_path, monkeypatch):
    """A failure is classified where it is raised, not by its text: a restore of a local run that raises an error
    saying what tensorstore says of a store that stopped answering is an unreadable checkpoint, set aside, and the
    previous one restores. (A bucket that does not answer a restore: test_storage_midrun.py.)"""
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    for step in (1, 2):
        ckpt.save(step, _state(step), _BytesIterator(step))
    ckpt.close()
    reopened = Checkpointer(tmp_path, every=1, keep=3)
    restore = reopened.restore

    def says_unavailable(step, *args):
        if step == 2:
            raise ValueError("UNAVAILABLE: CURL error Couldn't connect to server [source locations='tensorstore']")
        return restore(step, *args)

    monkeypatch.setattr(reopened, "restore", says_unavailable)
    it = _BytesIterator()
    step, state = reopened.restore_newest(_abstract(_state(0)), it)
    assert step == 1 and it.position == 1 and reopened.all_steps() == [1]
    assert (tmp_path / "corrupt_checkpoints" / "2").is_dir()
    _assert_equal(state, _state(1))
    reopened.close()
