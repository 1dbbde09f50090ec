"""A preempted run comes back by itself: the run lock is a lease (control/runlock.py) between real processes, each
as its own host (`unshare -u` gives a process its own hostname), on local disk and on a real GCS server on loopback
(fake-gcs-server). A live holder on another host is refused in one line; racing starters on a stale lock: exactly one
wins; a holder frozen past its lease (SIGSTOP) is taken over, and once thawed stops at once, writing nothing more.
End to end: a trainer as host vm-a on a gs:// run frozen mid-save for two leases, its relaunch as vm-b takes the run
over once the lease has lapsed, with no manual step, and ends with the uninterrupted run's metrics; vm-c meanwhile is
refused in one line; vm-a thawed changes no object and exits with the lease-lost code. A relaunch after a kill
mid-save of a run's first checkpoint, on GCS, where that unfinished step is all there is under checkpoints/ (the
cause of a once-seen failure of test_gcs's kill -9 test). (The 20-kill loop: `python -m g2rl_jax.bench preempt`.)"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
from test_checkpoint import _abstract, _assert_equal, _BytesIterator, _state
from test_gcs import _gs_cmd, bucket  # noqa: F401 - bucket is a fixture
from test_train import STEPS, _assert_same_metrics, _env, _train_cmd, assets, reference  # noqa: F401

from g2rl_jax import storage
from g2rl_jax.config import ConfigError
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.runlock import LOCK_FILE, RunLock
from g2rl_jax.train.checkpoint import Checkpointer, latest_step
from g2rl_jax.train.lifecycle import HISTORY_FILE
from g2rl_jax.train.metrics import read_metrics

from _helpers import HANG_S, BucketWrites, xla_flags

LEASE = 9.0  # the smallest run.lock_lease_seconds: renewed every 3 s (a bucket's 1 update/s leaves others room)
HOLD = ("import sys, time\n"
        "from g2rl_jax.control.runlock import RunLock\n"
        "if len(sys.argv) > 3:\n"  # a racer: ready, then go at once when the go file appears
        "    print('ready', flush=True)\n"
        "    import os\n"
        "    while not os.path.exists(sys.argv[3]): time.sleep(0.001)\n"
        "try:\n"
        "    RunLock(sys.argv[1], float(sys.argv[2])).acquire()\n"
        "except Exception as err:\n"
        "    print('refused', err, flush=True); sys.exit(2)\n"
        "print('held', flush=True); time.sleep(600)\n")


def _unshare_prefix() -> list[str] | None:
    for prefix in (["unshare", "-u"], ["unshare", "-r", "-u"]):  # as root; else in a user namespace
        try:
            if subprocess.run([*prefix, "sh", "-c", "hostname vm-test"], capture_output=True).returncode == 0:
                return prefix
        except FileNotFoundError:
            return None
    return None


UNSHARE = _unshare_prefix()
needs_hosts = pytest.mark.skipif(UNSHARE is None, reason="`unshare -u` cannot give a process its own hostname here")


def as_host(host: str, cmd: list[str]) -> list[str]:
    """`cmd` run as host `host` (its own UTS namespace)."""
    return [*UNSHARE, "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]


def _holder(out, host=None, extra=()):
    cmd = [sys.executable, "-c", HOLD, str(out), str(LEASE), *extra]
    return subprocess.Popen(as_host(host, cmd) if host else cmd, env=_env(), stdout=subprocess.PIPE, text=True)


def _lock(out) -> dict:
    return json.loads(storage.read_text(f"{out}/{LOCK_FILE}"))


@pytest.fixture(params=["local", "gcs"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    gcs = request.getfixturevalue("gcs")
    return gcs.url(f"lease/{request.node.name.replace('[', '_').rstrip(']')}")


# ------------------------------------------------------------------------------------------ the lease
@needs_hosts
def test_live_holder_on_another_host_is_refused_and_a_frozen_one_taken_over(run_dir, capsys):
    holder = _holder(run_dir, host="vm-a")
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"is in use by another trainer \(pid {holder.pid} on host 'vm-a'"):
            RunLock(run_dir, LEASE).acquire()  # it renews within a third of its lease: live
        assert f"waiting up to {LEASE:g} s" in capsys.readouterr().err
        holder.send_signal(signal.SIGSTOP)  # frozen: no renewals, as a VM that stopped answering
        t0 = time.monotonic()
        lock = RunLock(run_dir, LEASE)
        lock.acquire()
        assert time.monotonic() - t0 >= LEASE  # watched a whole lease first
        err = capsys.readouterr().err
        assert f"removing the stale lock {run_dir}/{LOCK_FILE} of pid {holder.pid} on host 'vm-a'" in err, err
        assert _lock(run_dir)["pid"] == os.getpid()
        holder.send_signal(signal.SIGCONT)  # thawed: its next renewal finds the lock taken
        assert holder.wait(timeout=60) == Exit.LEASE_LOST
        assert _lock(run_dir)["pid"] == os.getpid()  # the loser wrote nothing more, deleted nothing
        time.sleep(LEASE / 3 + 0.5)
        assert _lock(run_dir)["pid"] == os.getpid()  # and our renewals go on
        lock.release()
        assert not storage.exists(f"{run_dir}/{LOCK_FILE}")
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_taken_over_stops_at_once_in_one_line(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, run_dir, str(LEASE)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        other = json.dumps({"host": "vm-z", "pid": 7, "since": "now", "renewed": time.time(), "nonce": "x"})
        storage.write_text(f"{run_dir}/{LOCK_FILE}", other)  # as another trainer's takeover would
        assert proc.wait(timeout=60) == Exit.LEASE_LOST
        lines = proc.stderr.read().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("run lock lost: ") and "pid 7 on host 'vm-z'" in lines[0]
        assert storage.read_text(f"{run_dir}/{LOCK_FILE}") == other  # not removed at exit
    finally:
        proc.kill()
        proc.wait()


def test_of_racing_starters_on_a_stale_lock_exactly_one_wins(run_dir, tmp_path):
    storage.makedirs(run_dir)
    stale = {"host": "vm-gone", "pid": 1, "since": "then", "renewed": time.time() - 3600, "lease_seconds": LEASE}
    storage.write_text(f"{run_dir}/{LOCK_FILE}", json.dumps(stale))
    go = tmp_path / "go"
    racers = [_holder(run_dir, extra=[str(go)]) for _ in range(3)]
    try:
        assert all(r.stdout.readline().strip() == "ready" for r in racers)
        go.touch()
        said = [r.stdout.readline().strip() for r in racers]
        assert said.count("held") == 1, said
        winner = racers[said.index("held")]
        assert all(s.startswith("refused run.output_dir:") and "is in use by another trainer" in s
                   for s in said if s != "held"), said
        assert [r.wait(timeout=60) for r in racers if r is not winner] == [2] * 2
        assert _lock(run_dir)["pid"] == winner.pid
    finally:
        for r in racers:
            r.kill()
            r.wait()


TS_WRITER = ("import sys, time\n"
             "import tensorstore as ts\n"
             "from g2rl_jax.control.runlock import RunLock\n"
             "RunLock(sys.argv[1], float(sys.argv[2])).acquire()\n"
             "bucket, path = sys.argv[1].split('://', 1)[1].split('/', 1)\n"
             "kv = ts.KvStore.open({'driver': 'gcs', 'bucket': bucket, 'path': path + '/arrays/'}).result()\n"
             "for i in range(100000):\n"  # a new object each time: no object is updated twice in a second
             "    kv.write(f'a{i:06d}', b'x' * 65536).result()\n"
             "    if i == 2: print('writing', flush=True)\n"
             "    time.sleep(0.01)\n")


def test_a_thawed_holder_s_tensorstore_writes_nothing(gcs):
    """tensorstore (Orbax's array writer, its own HTTP client) goes through the fence too (control/fence_proxy.py):
    a holder writing arrays with it is frozen past its lease and its run taken over; thawed, its tensorstore resumes
    at once, before the lease thread could decide, and yet no object appears in the bucket; it exits with the
    lease-lost code. (Its arrays used to land after the thaw: tensorstore's requests were not fenced.)"""
    run = gcs.url("lease/tensorstore_thawed")
    proc = subprocess.Popen([sys.executable, "-c", TS_WRITER, run, str(LEASE)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(LEASE)  # its lease lapses while it is frozen
        other = json.dumps({"host": "vm-z", "pid": 7, "since": "now", "renewed": time.time(), "nonce": "x"})
        storage.write_text(f"{run}/{LOCK_FILE}", other)  # as another trainer's takeover would
        before = storage.names(f"{run}/arrays")
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=60) == Exit.LEASE_LOST, proc.stderr.read()[-3000:]
        assert storage.names(f"{run}/arrays") == before
        assert storage.read_text(f"{run}/{LOCK_FILE}") == other
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------ a preemption, end to end
UPDATES = ("upload", "compose", "copy", "delete", "patch")


def _objects(url: str) -> dict[str, str]:
    """name -> generation of every object under `url`, as the server lists them."""
    fs, key = storage._fs(url)
    return {name: str(info.get("generation")) for name, info in fs.find(key, detail=True).items()}


@needs_hosts
def test_preempted_vm_is_replaced_without_a_manual_step_and_fenced_out_when_back(gcs, assets, bucket, reference,  # noqa: F811
                                                                                  tmp_path, capsys):
    """A trainer as host vm-a is frozen (SIGSTOP: a VM that stopped answering) once its first checkpoint's save
    began, for two leases at least. A relaunch as vm-b watches the lock for a lease, takes the run over with no
    manual step and finishes it with the uninterrupted run's metrics, each step once; vm-c meanwhile is refused in
    one line. Then vm-a is thawed: from then on it changes no object in the bucket (its buffered metrics, its
    checkpoint's commit, its lock: the fence refuses each) and exits by itself with the lease-lost code and one line.
    (vm-a used to compose its buffered metrics after the takeover, a step twice, print an Orbax traceback, and only
    then say that it lost the lock.)"""
    from g2rl_jax.train.command import main

    out = gcs.url("runs/preempted")
    env = dict(_env(), XLA_FLAGS=xla_flags(8), **{storage.CACHE_ENV: str(tmp_path / "cache")})
    lease = 30.0  # vm-b's start (imports, checks) on a loaded machine stays under two leases: it watches one
    cmd = [*_gs_cmd(assets, bucket, out), f"run.lock_lease_seconds={lease:g}"]
    log, log_a = tmp_path / "trainers.err", tmp_path / "vm_a.err"
    with open(log, "w") as err, open(log_a, "w") as err_a:
        vm_a = subprocess.Popen(as_host("vm-a", cmd), env=env, stdout=subprocess.DEVNULL, stderr=err_a)
        try:
            saving = BucketWrites(gcs, out).saving
            while not saving():
                assert vm_a.poll() is None, f"vm-a ended before a save: {log_a.read_text()[-3000:]}"
                time.sleep(0.005)
            vm_a.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            assert _lock(out)["host"] == "vm-a"
            vm_b = subprocess.Popen(as_host("vm-b", cmd), env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            deadline = time.monotonic() + HANG_S
            while not (storage.exists(f"{out}/{LOCK_FILE}") and _lock(out)["host"] == "vm-b"):
                assert vm_b.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            assert time.monotonic() - frozen >= lease  # watched a whole lease first
            assert main(cmd[cmd.index("--config"):]) == 2  # vm-c, while vm-b runs (this host is neither)
            lines = capsys.readouterr().err.strip().splitlines()
            assert lines[-1].startswith("config error: run.output_dir: ") and \
                f"is in use by another trainer (pid {vm_b.pid} on host 'vm-b'" in lines[-1], lines
            assert vm_b.poll() is None, "vm-b ended before vm-c was refused: the check proves nothing"
            stdout, _ = vm_b.communicate(timeout=HANG_S)
            assert vm_b.returncode == 0, log.read_text()[-3000:]
            time.sleep(max(0.0, frozen + 2 * lease - time.monotonic()))  # frozen for two leases at least
            before, since = _objects(out), len(gcs.proxy.log)
            vm_a.send_signal(signal.SIGCONT)
            assert vm_a.wait(timeout=120) == Exit.LEASE_LOST, log_a.read_text()[-3000:]
        finally:
            vm_a.kill()
            vm_a.wait()
    text = log.read_text()
    assert f"waiting up to {lease:g} s (its lease)" in text and "removing the stale lock" in text, text[-3000:]
    assert f"its lease of {lease:g} s was not renewed while this start watched it for" in text, text[-3000:]
    _assert_same_metrics(read_metrics(out), reference["records"])
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    history = [json.loads(line) for line in storage.read_text(f"{out}/{HISTORY_FILE}").splitlines()]
    assert [h["host"] for h in history] == ["vm-a", "vm-b"]  # vm-c wrote nothing
    assert not storage.exists(f"{out}/{LOCK_FILE}")
    prefix = out.split("://", 1)[1] + "/"
    changed = [(r.kind, r.obj, r.status) for r in gcs.proxy.log[since:]
               if r.kind in UPDATES and r.obj and r.obj.startswith(prefix) and 200 <= r.status < 300]
    assert not changed and _objects(out) == before, changed  # thawed, vm-a changed nothing
    text_a = log_a.read_text()
    lines_a = [line for line in text_a.splitlines() if line.strip() and not line.startswith(("I1", "W1", "E1"))]
    assert lines_a[-1].startswith(f"run lock lost: {out}/{LOCK_FILE} was deleted"), lines_a[-5:]
    assert "Traceback" not in text_a, text_a[-3000:]


# ------------------------------------------------------------------------------------------ a kill mid-first-save
@contextlib.contextmanager
def _listing_held_until_emptied(gcs, url: str):
    """The main thread's listings of directory `url` wait (up to 20 s) until no object is under it: if anything
    deletes the last of them meanwhile (another thread), the listing comes after, as the unlucky interleaving of the
    two would have it. Only the order is forced; the listing and the delete are the real clients' on the real server.
    Yields a list that holds True for each listing that found the directory emptied this way."""
    cls = type(storage.path(url))
    real, key, emptied = cls.iterdir, url.split("://", 1)[1].split("/", 1)[1] + "/", []

    def empty() -> bool:  # asked of the server itself, past gcsfs's cache of listings
        query = urllib.parse.urlencode({"prefix": key})
        with urllib.request.urlopen(f"{gcs.endpoint}/storage/v1/b/{gcs.bucket}/o?{query}", timeout=30) as answer:
            return not json.load(answer).get("items")

    def iterdir(self):
        if str(self).rstrip("/") == url and threading.current_thread() is threading.main_thread():
            deadline = time.monotonic() + 20
            while not empty() and time.monotonic() < deadline:
                time.sleep(0.02)
            emptied.append(empty())
        return real(self)

    cls.iterdir = iterdir
    try:
        yield emptied
    finally:
        cls.iterdir = real


def _unfinished_first_save(run: str) -> str:
    """`run` as a kill -9 at the end of its first save leaves it: step 1 fully written by Orbax but not committed
    (on GCS no commit_success.txt; locally still under its temporary name), and nothing else under checkpoints/.
    Returns the unfinished step's directory."""
    ckpt = Checkpointer(run, every=1, keep=2)
    ckpt.save(1, _state(1), _BytesIterator(1))
    ckpt.close()
    step_dir = f"{run}/checkpoints/1"
    if storage.is_url(run):
        storage.remove(f"{step_dir}/commit_success.txt", missing_ok=False)
        return step_dir
    os.rename(step_dir, f"{step_dir}.orbax-checkpoint-tmp-1795757968")
    return f"{step_dir}.orbax-checkpoint-tmp-1795757968"


def test_relaunch_after_a_kill_mid_first_save_opens_the_run_afresh(run_dir, request):
    """The relaunch's Checkpointer removes the unfinished step before anything lists the steps, opens the run with
    no checkpoint, and saves step 1 again. On GCS that delete leaves no object under checkpoints/, so the prefix is
    gone: a listing of it that ran after an exists() saw it failed with gcsfs's FileNotFoundError (Orbax removed
    unfinished steps from a background thread while its constructor listed them; test_gcs's kill -9 test failed so
    once, "no committed checkpoint", its relaunch having died at once). Such a listing here is made to wait for any
    concurrent delete, so that interleaving happens every time it is possible."""
    unfinished = _unfinished_first_save(run_dir)
    assert latest_step(run_dir) is None and storage.exists(unfinished)
    hold = (_listing_held_until_emptied(request.getfixturevalue("gcs"), f"{run_dir}/checkpoints")
            if storage.is_url(run_dir) else contextlib.nullcontext([]))
    with hold as emptied:
        relaunch = Checkpointer(run_dir, every=1, keep=2)
    assert True not in emptied, "a listing of checkpoints/ ran after the unfinished step was deleted under it"
    assert relaunch.all_steps() == [] and not storage.exists(unfinished) and latest_step(run_dir) is None
    it = _BytesIterator()
    assert relaunch.restore_newest(_abstract(_state(0)), it) == (None, None)
    assert relaunch.save(1, _state(1), _BytesIterator(1))
    relaunch.close()
    assert latest_step(run_dir) == 1
    step, state = Checkpointer(run_dir, every=1, keep=2).restore_newest(_abstract(_state(0)), it)
    assert step == 1 and it.position == 1
    _assert_equal(state, _state(1))


def test_a_storage_error_opening_the_run_is_not_called_a_config_error(assets, tmp_path, capsys):  # noqa: F811
    """A file the trainer does not find while it opens the run (here the policy's weights, missing from a model
    directory whose config.json is there, so every check passed) is one line labelled a storage error and naming the
    error's type (the storage client's message may be only an object's path), and the run lock is released."""
    from g2rl_jax.train.command import main

    model, out = tmp_path / "policy", tmp_path / "run"
    shutil.copytree(assets["policy"], model, ignore=shutil.ignore_patterns("*.safetensors*"))
    cmd = [*_train_cmd(assets, out, 1), f"model.path={model}"]
    assert main(cmd[cmd.index("--config"):]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("storage error: FileNotFoundError: ") and "model.safetensors" in line, line
    assert not (out / LOCK_FILE).exists()


# ------------------------------------------------------------------------------------------ the bucket's write rate
OWN_OBJECTS = ("/lease/", "/runs/preempted/")  # this module's prefixes of the session's bucket
CONTENDED = {  # lock object -> {who: most 429s}: writes that meet another process's write of the lock by design
    # the holder, thawed after the takeover: its renewal follows the takeover's write at once (then 412: lost)
    "test_live_holder_on_another_host_is_refused_and_a_frozen_one_taken_over_gcs": {"other": 1},
    # this process overwrites a live holder's lock (as only a test does), and the holder's next renewal meets it
    "test_a_holder_taken_over_stops_at_once_in_one_line_gcs": {"this": 1, "other": 1},
    # three starters replace one stale lock at once: the two losers' conditional writes
    "test_of_racing_starters_on_a_stale_lock_exactly_one_wins_gcs": {"other": 2},
    # the holder, thawed after the takeover: as the first above
    "tensorstore_thawed": {"other": 1},
}


def test_the_bucket_served_429s_only_to_contended_lock_writes(gcs):
    """Last in this module: through the strict proxy, the 429s served on this module's objects (the proxy names the
    process each went to) all went to the contended lock writes above, none to a start that watched a held lock (it
    only reads it), to a holder's own renewals and release, or to the trainers' files and checkpoints."""
    drawn: dict = {}
    for r in gcs.proxy.log:
        if r.status == 429 and r.obj and any(p in r.obj for p in OWN_OBJECTS):
            name = r.obj.split("/lease/", 1)[-1].rsplit("/", 1)[0] if "/lease/" in r.obj else r.obj
            who = "this" if r.pid == os.getpid() else "unknown" if r.pid is None else "other"
            key = (name, who, r.obj.rsplit("/", 1)[-1])
            drawn[key] = drawn.get(key, 0) + 1
    unexplained = {k: n for k, n in drawn.items()
                   if k[2] != LOCK_FILE or n > CONTENDED.get(k[0], {}).get(k[1], 0)}
    assert not unexplained, unexplained
