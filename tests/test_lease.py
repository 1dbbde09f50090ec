"""The lease (g2rl_jax/control/lease.py) and its fence (control/fence.py). In one process, with a renewal function
the test controls: the lease counts from a renewal's send, not its reply; writes stop a margin before a watcher could
count it lapsed; a store that stops answering ends it as the storage's failure, a lock taken as lost; a renewal whose
reply was lost is found again by its nonce; a process following the lease (the other processes of a multi-host run)
writes only while a renewal it saw proves the lease held. Between real processes, on the GCS server behind the
strict proxy: a renewal's reply delayed by a whole lease (never two holders: the holder keeps its lease, a second
trainer is refused), a renewal applied whose reply never came (the holder keeps its lease), two trainers with one
hostname in two PID namespaces (the second waits and is refused), and a notebook's kernel, which a lost lease does
not end.
(A holder frozen past its lease and taken over by a trainer on another host: test_preemption.py.)"""
import json
import subprocess
import sys
import threading
import time

import pytest
from test_preemption import LEASE, UNSHARE
from test_train import _env

from g2rl_jax import storage
from g2rl_jax.control.errors import LeaseLost
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.lease import MARGIN_SHARE, Holder, Lost, Renewed
from g2rl_jax.control.runlock import LOCK_FILE


def _holder(lease_s, renew):
    ends = []
    unreachable = lambda seconds, err: LeaseLost(f"not renewed for {seconds:.1f} s", Exit.STORAGE)  # noqa: E731
    return Holder("test", lease_s, "g0", time.monotonic(), "n0", renew, ends.append, unreachable), ends


# ------------------------------------------------------------------------------------------ one process
def test_the_lease_counts_from_the_send_and_writes_stop_a_margin_before_it_ends():
    """Each renewal answers 0.4 s after it was sent: the lease holds from the send. When the store stops answering,
    writes stop at the last confirmed send + lease - margin (a watcher that saw that renewal cannot take over before
    send + lease), and at send + lease the holder ends as the storage's failure (exit 75)."""
    lease, sends, failing = 1.5, [], threading.Event()

    def renew(nonce, token):
        sends.append(time.monotonic())
        if failing.is_set():
            raise ConnectionError("the store is gone")
        time.sleep(0.4)
        return Renewed(f"g{len(sends)}")

    holder, ends = _holder(lease, renew)
    time.sleep(lease * 0.9)  # two renewals answered
    assert len(sends) >= 2 and holder.held() and not ends
    confirmed = holder.confirmed_at
    assert any(abs(confirmed - s) < 0.05 for s in sends), (confirmed, sends)  # a send, not a reply (0.4 s later)
    failing.set()
    while holder.held():
        time.sleep(0.01)
    last = holder.confirmed_at  # the last renewal confirmed (one in flight when the store went may have been)
    assert lease * (1 - MARGIN_SHARE) - 0.01 <= time.monotonic() - last < lease * (1 - MARGIN_SHARE) + 0.2
    with pytest.raises(LeaseLost) as err:
        holder.wait_held()  # a write now waits for the verdict
    assert err.value.code == Exit.STORAGE and time.monotonic() - last >= lease - 0.01
    assert ends == [err.value]
    holder.stop()


def test_a_lock_found_taken_is_lost_at_once():
    def renew(nonce, token):
        raise Lost("run lock lost: taken over by pid 7 on host 'vm-z'")

    holder, ends = _holder(1.5, renew)
    time.sleep(1.5 / 3 + 0.3)
    assert not holder.held() and len(ends) == 1 and ends[0].code == Exit.LEASE_LOST
    assert str(ends[0]).startswith("run lock lost: taken over by pid 7")
    holder.stop()


class _Clock:
    """lease.py's clock, which a test moves forward at once: what the lease thread sees on waking from a freeze."""

    def __init__(self):
        self.skipped = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "not-taken"])
def test_after_a_freeze_past_the_lease_the_final_renewals_answer_decides(monkeypatch, taken):
    """The holder's thread wakes two leases late (a SIGSTOP, a paused VM), and the store takes longer than the
    margin to answer its final renewal: that answer decides, not the margin. Taken over: lost (exit 3, not the
    storage's 75). Not taken: the lease goes on."""
    from g2rl_jax.control import lease as lease_module

    clock, lease, frozen = _Clock(), 1.5, threading.Event()
    monkeypatch.setattr(lease_module, "time", clock)

    def renew(nonce, token):
        if not frozen.is_set():
            return Renewed(token)
        time.sleep(lease * MARGIN_SHARE * 3)  # the store answers after more than the margin
        if taken:
            raise Lost("run lock lost: taken over by pid 7 on host 'vm-b'")
        return Renewed("g-after")

    holder, ends = _holder(lease, renew)
    time.sleep(lease / 3 + 0.1)  # a renewal answered
    assert holder.held() and not ends
    frozen.set()
    clock.skipped = 2 * lease  # the thread's next look at the clock is two leases later
    time.sleep(lease * MARGIN_SHARE * 3 + 1.0)
    if taken:
        assert len(ends) == 1 and ends[0].code == Exit.LEASE_LOST, [(e.code, str(e)) for e in ends]
    else:
        assert not ends and holder.held() and holder.token == "g-after"
    holder.stop()


def test_a_renewal_whose_reply_was_lost_is_found_by_its_nonce():
    """The first renewal lands and its reply does not come (the call hangs); the next fails its precondition, finds
    the record with this holder's identity and the first renewal's nonce, and counts the lease from that renewal's
    send: the holder keeps its lease through several leases. The first one's reply, arriving at last, brings no
    older token back: the renewals after it stay conditional on the newest."""
    lease, calls, hung = 1.2, [], threading.Event()

    def renew(nonce, token):
        calls.append((nonce, time.monotonic(), token))
        number = len(calls)
        if number == 1:
            hung.wait()  # applied by the store, its reply late
        return Renewed(f"g{number}", nonce=calls[0][0] if number == 2 else None)

    holder, ends = _holder(lease, renew)
    time.sleep(3 * lease)
    assert holder.held() and not ends, ends
    assert calls[1][2] == "g0" and calls[2][2] == "g2"  # conditional on the start's token, then the record read back
    hung.set()  # the first renewal's reply, "g1", three leases late
    time.sleep(lease)
    assert holder.held() and not ends and calls[-1][2] == f"g{len(calls) - 1}", calls
    holder.stop()


def test_a_follower_writes_only_after_a_renewal_it_saw_made_and_never_past_what_that_proves():
    """A process that follows the holder's lease (control/lease.py's Follower) reads the lock 8 times a lease. It may
    not write before it saw the lock change (at its start it cannot know how old the version it read is); once it saw
    a change at time c, it writes until at most c + L - M (the read before the change was sent before c); a record of
    another holder is the verdict (exit 3), and a lease not seen renewed for two leases ends a wait with the
    storage's code."""
    from g2rl_jax.control.lease import Follower

    lease, state = 1.6, {"token": 0, "changed": [], "owner": "p0"}

    def read():
        return state["token"], {"owner": state["owner"]}

    def renew_once():
        state["token"] += 1
        state["changed"].append(time.monotonic())

    follower = Follower("test", lease, read, lambda record: record["owner"] == "p0", lambda record: "taken")
    try:
        time.sleep(lease / 4)
        assert not follower.held()  # no change seen yet
        renew_once()
        while not follower.held():
            time.sleep(0.005)
        assert follower.writable_until() <= state["changed"][-1] + lease * (1 - MARGIN_SHARE)
        for _ in range(3):  # the holder renews every third of the lease: held throughout
            time.sleep(lease / 3)
            renew_once()
            assert follower.held()
        while follower.held():  # no more renewals
            time.sleep(0.005)
        assert time.monotonic() <= state["changed"][-1] + lease * (1 - MARGIN_SHARE) + 0.05
        follower.give_up_s = lease / 2
        with pytest.raises(LeaseLost) as err:
            follower.wait_held()
        assert err.value.code == Exit.STORAGE and "was seen for" in str(err.value)
        state["owner"] = "another"
        time.sleep(lease / 4)
        with pytest.raises(LeaseLost) as err:
            follower.wait_held()
        assert err.value.code == Exit.LEASE_LOST and str(err.value) == "taken"
    finally:
        follower.stop()


def test_a_rollout_processs_lease_ends_quietly_once_the_trainers_store_is_gone(monkeypatch, capsys):
    """A rollout process's KeyLease whose increments find jax.distributed's store gone (the trainer ended first)
    stops renewing without a warning: JAX's client ends the process; "could not renew" lines were noise there."""
    import jax

    from g2rl_jax.control import channel
    from g2rl_jax.control.lease import KeyLease

    calls = []

    class Gone:
        def increment(self, key, by):
            calls.append(key)
            if len(calls) > 2:
                raise channel.StoreGone("the coordinator is gone")
            return len(calls)

    monkeypatch.setattr(channel, "default", lambda: Gone())
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    lease = KeyLease("sides", 1.2).renew()
    time.sleep(1.2 * 2)
    assert len(calls) == 3, calls  # the first, one renewal, then the one that found the store gone: no more
    assert "could not renew" not in capsys.readouterr().err
    lease.stop()


# ------------------------------------------------------------------------------------------ real processes
HOLD_AND_WRITE = ("import sys, time\n"
                  "from g2rl_jax import storage\n"
                  "from g2rl_jax.control.runlock import RunLock\n"
                  "RunLock(sys.argv[1], float(sys.argv[2])).acquire()\n"
                  "print('held', flush=True)\n"
                  "i = 0\n"
                  "while True:\n"
                  "    storage.write_text(sys.argv[1] + '/' + sys.argv[3], str(i)); i += 1\n"
                  "    time.sleep(0.3)\n")
TRY_TO_TAKE = ("import sys, time\n"
               "from g2rl_jax.config import ConfigError\n"
               "from g2rl_jax.control.runlock import RunLock\n"
               "end = time.monotonic() + float(sys.argv[3])\n"
               "while time.monotonic() < end:\n"
               "    try:\n"
               "        RunLock(sys.argv[1], float(sys.argv[2])).acquire()\n"
               "    except ConfigError:\n"
               "        print('refused', flush=True); continue\n"
               "    print('held', flush=True); break\n")


def _start(code: str, *args, env=None, prefix=()):
    return subprocess.Popen([*prefix, sys.executable, "-c", code, *map(str, args)], env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _record(run: str) -> dict:
    return json.loads(storage.read_text(f"{run}/{LOCK_FILE}"))


def _writes(gcs, obj: str, since: int) -> list:
    return [r for r in gcs.proxy.log[since:] if r.obj == obj and r.kind == "upload" and 200 <= r.status < 300]


def test_a_renewal_reply_delayed_by_a_lease_never_makes_two_holders(gcs):
    """The proxy holds one renewal's reply (the store applied it) for a whole lease while a second trainer keeps
    trying to start: the holder counts its lease from that renewal's send and confirms it by the next renewal (its own
    record, that renewal's nonce), so it keeps the lease and writes on; the second trainer sees the renewals and is
    refused every time. (The lease used to run from the reply: the holder stopped with exit 75.)"""
    run = gcs.url("lease/delayed_reply")
    holder = _start(HOLD_AND_WRITE, run, LEASE, "a.txt")
    other = None
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()[-3000:]
        before, late = len(gcs.proxy.log), gcs.proxy.fault_counts["late"]  # the session's proxy: other tests' too
        gcs.proxy.after_apply(f"{run.split('://', 1)[1]}/{LOCK_FILE}", delay_s=LEASE)
        other = _start(TRY_TO_TAKE, run, LEASE, 3 * LEASE)
        out, err = other.communicate(timeout=3 * LEASE + 120)
        assert "held" not in out.split() and "refused" in out.split(), (out, err[-3000:])
        assert holder.poll() is None, holder.stderr.read()[-3000:]
        assert _record(run)["pid"] == holder.pid and gcs.proxy.fault_counts["late"] == late + 1
        heartbeats = [r.t for r in _writes(gcs, f"{run.split('://', 1)[1]}/a.txt", before)]
        assert max(b - a for a, b in zip(heartbeats, heartbeats[1:])) < LEASE * MARGIN_SHARE + 2, heartbeats
    finally:
        for proc in (holder, other):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_a_renewal_applied_whose_reply_never_came_keeps_the_lease(gcs):
    """The proxy drops the replies of a renewal and of gcsfs's retry of it (the store applied the first): the holder
    cannot tell whether it landed; its next renewal fails its precondition, finds the holder's own record with that
    renewal's nonce, and the holder goes on holding. (It used to exit 3, naming itself as the new holder.)"""
    run = gcs.url("lease/reply_dropped")
    env = dict(_env(), G2RL_JAX_STORAGE_TIMEOUT="10")  # gcsfs's 2 attempts: both replies dropped
    holder = _start(HOLD_AND_WRITE, run, LEASE, "a.txt", env=env)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()[-3000:]
        lost = gcs.proxy.fault_counts["lost"]  # the session's proxy: other tests' faults too
        gcs.proxy.after_apply(f"{run.split('://', 1)[1]}/{LOCK_FILE}", drop=True, count=2)
        time.sleep(2.5 * LEASE)
        assert holder.poll() is None, holder.stderr.read()[-3000:]
        assert gcs.proxy.fault_counts["lost"] == lost + 2
        assert _record(run)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


needs_pid_namespaces = pytest.mark.skipif(
    UNSHARE != ["unshare", "-u"] or subprocess.run(["unshare", "-u", "-p", "-f", "--mount-proc", "true"],
                                                   capture_output=True).returncode != 0,
    reason="needs root's `unshare -u -p -f --mount-proc` (a UTS and a PID namespace)")


@needs_pid_namespaces
def test_one_hostname_two_pid_namespaces_the_second_waits(tmp_path):
    """Two trainers in two containers that share a hostname (host networking), each its own PID namespace, where
    both are pid 1: the second cannot judge the first's pid (another namespace), so it watches the lock, sees it
    renewed, and is refused in one line naming the holder's namespace. (Same hostname used to mean same pid space:
    pid 1 = its own pid, "gone", and the second took the lock at once.)"""
    from test_preemption import HOLD

    run = str(tmp_path / "run")
    box = ["unshare", "-u", "-p", "-f", "--mount-proc", "--kill-child", "sh", "-c",
           'hostname vm-same && exec "$@"', "sh"]
    first = _start(HOLD, run, LEASE, prefix=box)
    second = None
    try:
        assert first.stdout.readline().strip() == "held", first.stderr.read()[-3000:]
        assert _record(run)["pid"] == 1 and _record(run)["host"] == "vm-same"
        second = _start(HOLD, run, LEASE, prefix=box)
        out, err = second.communicate(timeout=120)
        assert second.returncode == Exit.BAD_INPUT, (out, err[-3000:])
        assert out.startswith("refused run.output_dir:") and "pid 1 on host 'vm-same', PID namespace pid:[" in out
        assert f"waiting up to {LEASE:g} s (its lease)" in err and first.poll() is None
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


NOTEBOOK = ("import sys, time, types\n"
            "sys.modules['ipykernel'] = types.ModuleType('ipykernel')  # as in a notebook's kernel\n"
            "from g2rl_jax import storage\n"
            "from g2rl_jax.control.errors import LeaseLost\n"
            "from g2rl_jax.control.runlock import RunLock\n"
            "RunLock(sys.argv[1], 3.0).acquire()\n"
            "print('held', flush=True)\n"
            "try:\n"
            "    while True: time.sleep(0.02)\n"
            "except LeaseLost as err:\n"
            "    print('raised', int(err.code), err, flush=True)\n"
            "try:\n"
            "    storage.write_text(sys.argv[1] + '/metrics.jsonl', 'x')\n"
            "except LeaseLost as err:\n"
            "    print('refused', int(err.code), flush=True)\n"
            "print('alive', flush=True)\n")


def test_in_a_notebook_a_lost_lease_raises_in_the_main_thread(tmp_path):
    run = str(tmp_path / "run")
    kernel = _start(NOTEBOOK, run)
    try:
        assert kernel.stdout.readline().strip() == "held", kernel.stderr.read()[-3000:]
        storage.write_text(f"{run}/{LOCK_FILE}", json.dumps({"host": "vm-z", "pid": 7, "renewed": time.time()}))
        out, err = kernel.communicate(timeout=60)
    finally:
        kernel.kill()
    lines = out.splitlines()
    assert kernel.returncode == 0 and lines[-1] == "alive", (out, err[-3000:])
    assert lines[0].startswith("raised 3 run lock lost: ") and "pid 7 on host 'vm-z'" in lines[0], lines
    assert lines[1] == "refused 3" and not (tmp_path / "run" / "metrics.jsonl").exists()



THAWED = ("import os, sys\n"
          "from g2rl_jax import cli, storage  # noqa: F401 - loaded, as in a trainer\n"
          "from g2rl_jax.control import errors\n"
          "from g2rl_jax.control.runlock import RunLock\n"
          "lock = RunLock(sys.argv[1], 3.0)\n"
          "lock.take(0)\n"
          "print('held', flush=True)\n"
          "sys.stdin.readline()\n"  # written while this process is frozen: read at once when thawed
          "try:\n"
          "    with lock.judged():\n"  # as the trainer's setup, restore and steps are (train/loop.py)
          "        open(sys.argv[1] + '/checkpoint').read()\n"
          "except Exception as err:\n"
          "    code = int(errors.exit_code(err))\n"
          "    print('ended', code, type(err).__name__, flush=True)\n"
          "    os._exit(code)\n")


def test_a_thawed_holder_that_meets_what_the_new_holder_changed_stops_as_the_lease_lost(tmp_path):
    """A holder frozen past its lease is taken over and the new holder deletes a file it reads next (a checkpoint it
    no longer keeps). Thawed, the holder's read fails before its lease's thread has sent its final renewal: that
    failure is judged by the lease (control/runlock.py's `lost`), so the process stops with the lease lost (exit 3:
    stop), not as bad input (a missing file, exit 2), which a supervisor would read as a config to fix. (Seen in the
    small chaos soak under load: a thawed holder exited 2.)"""
    import os
    import signal

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").write_text("step 2")
    worker = subprocess.Popen([sys.executable, "-c", THAWED, str(run)], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "held", worker.stderr.read()[-3000:]
        os.kill(worker.pid, signal.SIGSTOP)
        time.sleep(2 * 3.0)
        storage.write_text(f"{run}/{LOCK_FILE}", json.dumps({"host": "vm-z", "pid": 7, "renewed": time.time()}))
        (run / "checkpoint").unlink()
        worker.stdin.write("go\n")
        worker.stdin.flush()
        os.kill(worker.pid, signal.SIGCONT)
        out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == Exit.LEASE_LOST and "ended 2" not in out, (out, err[-3000:])
    assert "run lock lost" in out + err and "pid 7 on host 'vm-z'" in out + err, (out, err[-3000:])



WATCHING = ("import os, sys, time\n"
            "from g2rl_jax.control import errors, runlock\n"
            "runlock.RunLock(sys.argv[1], 3.0).take(0)\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n"  # written while this process is frozen: read at once when thawed
            "t0 = time.monotonic()\n"
            "lost = runlock.held_lease_lost()\n"  # as the watch of the rollout processes asks (control/lease.py)
            "print('verdict', None if lost is None else int(lost.code), round(time.monotonic() - t0, 1), flush=True)\n"
            "if lost is not None:\n"
            "    errors.end_run(lost)\n"
            "os._exit(76)\n")  # the watch's peer-lost stop


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "held"])
def test_a_thawed_trainer_that_sees_its_rollout_process_lapsed_asks_its_lease_first(tmp_path, taken):
    """One process per side, both frozen past the lease: thawed, the trainer's watch of the rollout process sees its
    lease lapsed (it was frozen too) and used to stop the run as a peer lost (76: relaunch; the sides soak, twice)
    before the trainer's own lease decided. It asks the run lease first (control/runlock.py's `held_lease_lost`):
    taken over, the process stops with the lease lost (3); still held, at once, the peer-lost stop goes on."""
    import os
    import signal

    run = tmp_path / "run"
    worker = subprocess.Popen([sys.executable, "-c", WATCHING, str(run)], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "held", worker.stderr.read()[-3000:]
        if taken:
            os.kill(worker.pid, signal.SIGSTOP)
            time.sleep(2 * 3.0)
            storage.write_text(f"{run}/{LOCK_FILE}", json.dumps({"host": "vm-z", "pid": 7, "renewed": time.time()}))
        worker.stdin.write("go\n")
        worker.stdin.flush()
        if taken:
            os.kill(worker.pid, signal.SIGCONT)
        out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    if taken:
        assert worker.returncode == Exit.LEASE_LOST and "run lock lost" in err, (worker.returncode, out, err[-3000:])
    else:
        said = out.split()
        assert worker.returncode == Exit.PEER_LOST and said[:2] == ["verdict", "None"], (out, err[-3000:])
        assert float(said[2]) < 0.5, out  # a held lease answers at once
