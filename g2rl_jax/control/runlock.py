"""The run lock: `<run>/run.lock` is a lease on the run directory (control/lease.py), held by one trainer, whose record
names it (control/holder.py: host, boot id, PID namespace, pid, start time), when it started, when it sent its last
renewal (wall clock), its lease and that renewal's nonce.

A start that finds a lock takes it over when its holder is gone (it shares this machine's boot and PID namespace and
its process is not running), when the record is this very process's own, when it was renewed more than two leases
ago by this host's clock (hosts whose clocks disagree by less than a lease cannot take a live lock), or once it has
watched it unchanged for a whole lease (control/lease.py's Watch); a lock that changes while it watches is live: the
start is refused in one line. Every change is conditional on the generation read (GCS: ifGenerationMatch on the
create, the overwrite and the delete; locally the same under an flock, g2rl_jax.storage), so of any number of
starters exactly one wins and a lock renewed meanwhile is never replaced.

The holder renews from a thread (control/lease.py: the timing, the margin) and arms the fence on the run directory
(control/fence.py): every change of run state checks that the lease is held. A renewal that finds another's record,
or none, means the run was taken over: one line, exit 3 (Exit.LEASE_LOST); no renewal confirmed for a whole lease:
one line naming the storage's failure, exit 75. In a multi-host run every process then stops with that line
(control/stop.py); in a notebook the main thread gets the LeaseLost instead, and the kernel lives.

The other processes of a multi-host run hold no lease: each `follow`s process 0's (control/lease.py's Follower),
reading the lock FOLLOWER_READS_PER_LEASE times a lease, and its own writes under the run directory (its share of a
checkpoint's data, control/fence.py) go out only while that lease is known held by process 0 of its own launch (the
identity process 0 sent over the channel once it took the lock). Process 0 renews every third of the lease, so a
follower sees a renewal made within L/3 + L/8 of the last and never waits while process 0 holds the lease; a thawed
follower waits for the next renewal it sees made, and one that finds another's record writes nothing more.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any

from g2rl_jax import storage
from g2rl_jax.control import channel, fence, holder, stop
from g2rl_jax.control.errors import LeaseLost, PeerLost, RunFailure
from g2rl_jax.control.exits import Exit
from g2rl_jax.control.lease import Follower, Holder, Lost, Renewed, Watch, warn
from g2rl_jax.errors import ConfigError

LOCK_FILE = "run.lock"
HOLDER_KEY = "runlock/holder"  # the channel's key (control/channel.py): process 0 names itself there once it holds it


def _parse(data: bytes) -> dict[str, Any]:
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def read_record(path) -> dict[str, Any] | None:
    """The lock's record at `path`, None when there is no lock ({} when it cannot be read)."""
    try:
        return _parse(storage.read_bytes(path))
    except FileNotFoundError:
        return None


def _key(path) -> str:
    """The lock's identity within this process: a local path resolved, a URL as it is."""
    return str(path) if storage.is_url(path) else str(storage.path(path).resolve())


def _age(record: dict[str, Any]) -> float | None:
    """Seconds since the holder sent its last renewal, by this host's clock (None: no time recorded)."""
    renewed = record.get("renewed")
    return time.time() - renewed if isinstance(renewed, (int, float)) else None


def who(record: dict[str, Any] | None) -> str:
    if not record:
        return "an unreadable lock" if record is not None else "nobody: the lock is gone"
    age = _age(record)
    renewed = f", lease renewed {age:.0f} s ago" if age is not None else ""
    return f"{holder.describe(record)} since {record.get('since')}{renewed}"


def lost_line(path, record: dict[str, Any] | None) -> str:
    taken = f"was taken over ({who(record)})" if record else "was deleted"
    return (f"run lock lost: {path} {taken} because this trainer had not renewed its lease in time; stopping now, "
            "writing nothing more")


def verdict(record: dict[str, Any], watched_s: float, lease_s: float) -> tuple[str, str]:
    """('live' | 'stale' | 'watch', why) for a lock holding `record`, watched unchanged for `watched_s` seconds by a
    start that holds no lease on it (a change seen while watching is decided by the caller: live). Its holder's
    process judged (control/holder.py) gone: stale at once; running on this host and renewed within its lease: live
    at once (refusing is always safe; a frozen holder is taken over by a later start)."""
    lease = record.get("lease_seconds") if isinstance(record.get("lease_seconds"), (int, float)) else lease_s
    if holder.is_mine(record):
        return "stale", "it is this process's own record"
    state, age = holder.judge(record), _age(record)
    if state == "gone":
        return "stale", f"its process ({holder.describe(record)}) is gone"
    if state == "running" and age is not None and age < lease:
        return "live", "its process runs on this host"
    if watched_s >= lease:
        return "stale", f"its lease of {lease:g} s was not renewed while this start watched it for {watched_s:.0f} s"
    if age is not None and age >= 2 * lease:
        return "stale", f"its lease of {lease:g} s was last renewed {age:.0f} s ago"
    return "watch", ""


def _end_run(verdict: RunFailure) -> None:
    """A lost (or not known held) lease: nothing more is written, and the run stops with the verdict's line."""
    from g2rl_jax.control import errors

    errors.end_run(verdict)  # in a notebook the main thread gets the verdict (control/stop.py), the kernel lives


_LEASES: dict[str, Holder | Follower] = {}  # lock files this process holds (process 0) or follows (the others)
_COUNTS: dict[str, int] = {}


class RunLock:
    """`<run_dir>/run.lock`: a lease on the run directory (see the module docstring). Trainers within one process (a
    notebook cell run twice) share it: the file goes when the last releases."""

    def __init__(self, run_dir: str | os.PathLike, lease_seconds: float = 60.0):
        self.path = storage.path(run_dir) / LOCK_FILE
        self.run_dir = storage.path(run_dir)
        self.lease_s = float(lease_seconds)
        self._held = False
        self._since = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def _record(self, nonce: str) -> str:
        """A renewal's record: this process's identity, the renewal's nonce and send time (wall clock)."""
        return json.dumps({**holder.mine(), "since": self._since, "renewed": time.time(),
                           "lease_seconds": self.lease_s, "nonce": nonce}) + "\n"

    def acquire(self) -> None:
        """Take the lock: create it, or take over one that is stale (see the module docstring); ConfigError (one
        line) when another trainer holds it."""
        if self._joined():
            return
        storage.makedirs(self.path.parent)
        watch, t0, absent, said = Watch(self.lease_s), time.monotonic(), False, False
        while True:  # a create only after a look found no lock: a start watching a held lock only reads it (a
            # create is an update of the object, and one within a second of the holder's renewal draws a 429)
            nonce, sent = uuid.uuid4().hex, time.monotonic()
            token = storage.create_exclusive(self.path, self._record(nonce)) if absent else None
            if token is None:
                token, sent, nonce, absent, said = self._take_over(watch, said)
            if token is not None:
                break
            if time.monotonic() - t0 > 3 * self.lease_s + 60:
                raise ConfigError(f"run.output_dir: could not take {self.path} in {time.monotonic() - t0:.0f} s; "
                                  "another trainer keeps starting there")
        lease = Holder(str(self.path), self.lease_s, token, sent, nonce, self._renew, _end_run, self._unreachable)
        key = _key(self.path)
        _LEASES[key], _COUNTS[key], self._held = lease, 1, True
        fence.arm(self.run_dir, self.path, lease, holder.is_mine)
        if stop.processes() is not None:  # the other processes follow this one's lease (`follow`)
            channel.default().put(HOLDER_KEY, holder.of(holder.mine()), overwrite=True)
        atexit.register(self.release)

    def _joined(self) -> bool:
        """Whether this lock is held or followed already: by this RunLock, or by another of this process (a notebook
        cell run twice), which it then shares."""
        if not self._held and _key(self.path) in _LEASES:
            _COUNTS[_key(self.path)] += 1
            self._held = True
        return self._held

    def take(self, process: int) -> None:
        """Process 0 of a run holds the lock (`acquire`), every other process `follow`s it."""
        self.acquire() if process == 0 else self.follow()

    def follow(self) -> None:
        """On a process other than 0 of a run of several: write under process 0's lease (control/lease.py's
        Follower). Waits for process 0 to take the lock and name itself (`acquire`), up to its own bound on that; a
        stop published meanwhile (process 0 refused the run directory) ends this process with that stop's code."""
        if self._joined():
            return
        wait_s = 3 * self.lease_s + 120
        try:
            with stop.Watch():
                leader = channel.default().get(HOLDER_KEY, schema=dict[str, str | int | None], timeout_s=wait_s)
        except channel.Late:
            raise PeerLost(f"process 0 did not take the run lock {self.path} within {wait_s:.0f} s; relaunch every "
                           "process with the same command") from None
        lease = Follower(str(self.path), self.lease_s, self._look, lambda record: holder.of(record) == leader,
                         lambda record: lost_line(self.path, record))
        key = _key(self.path)
        _LEASES[key], _COUNTS[key], self._held = lease, 1, True
        fence.arm(self.run_dir, self.path, lease, lambda record: holder.of(record) == leader)
        atexit.register(self.release)

    def lost(self, err: BaseException) -> RunFailure | None:
        """What ends this process when `err` ended its work: the lease's verdict when the lease it holds (or follows)
        turns out lost, else None. A process frozen past its lease and thawed reads a run directory another trainer
        changed meanwhile (a checkpoint deleted, a step half written): what it then meets is that trainer's doing, and
        the lost lease (exit 3: stop) is what it reports, not the bad input or bug it seems to be. Waits for the lease
        to be known held again (at once while it is; a thawed holder's final renewal decides). Only what looks like bad
        input or a bug is judged: a failure classified otherwise (the storage, the lease, a peer gone, the device,
        the reward function) is its own verdict (None)."""
        if not self._held or not isinstance(err, Exception) or isinstance(err, storage.StorageUnreachable) or (
                isinstance(err, RunFailure) and err.code != Exit.BAD_INPUT):
            return None
        return _verdict(_LEASES[_key(self.path)])

    @contextlib.contextmanager
    def judged(self):
        """Around work under the lease: an error it raises once the lease turned out lost is raised as the lease's
        verdict instead (`lost`)."""
        try:
            yield
        except Exception as err:
            verdict = self.lost(err)
            if verdict is not None:
                raise verdict from err
            raise

    def _look(self) -> tuple[str, dict[str, Any] | None]:
        """A follower's read of the lock: (generation, record); ValueError for bytes that are no record (a partial
        local write: nothing learnt)."""
        data, current = storage.read_versioned(self.path)
        record = _parse(data)
        if not record:
            raise ValueError(f"{self.path}: not a lock record")
        return current, record

    def _take_over(self, watch: Watch, said: bool):
        """One look at the lock: (token, send time, nonce) of this start's record when it replaced a stale lock,
        else (None, ...) to look again; then whether it found none, and whether it said it waits."""
        try:
            data, current = storage.read_versioned(self.path)
        except FileNotFoundError:  # none yet, or released meanwhile: create it
            return None, 0.0, "", True, said
        record = _parse(data)
        if watch.look(current):  # renewed (or taken) while this start watched
            raise ConfigError(self._refusal(record))
        state, why = verdict(record, watch.unchanged_for(), self.lease_s)
        if state == "live":
            raise ConfigError(self._refusal(record))
        if state == "stale":
            # a lock written within the last second is replaced once that second is out: a bucket allows one update
            # per object per second. The record's time is its renewal's send, and a slow store applies it later: the
            # second counts from this start's first look at the generation, which the store had applied by then
            time.sleep(max(storage.UPDATE_INTERVAL_S + 0.05 - watch.unchanged_for(), 0))
            nonce, sent = uuid.uuid4().hex, time.monotonic()
            # conditional on the generation read: of any number of starters exactly one replaces it, and a lock
            # renewed meanwhile is left alone (the next look sees its new generation, and refuses)
            taken = storage.replace_if_generation(self.path, self._record(nonce), current)
            if taken is not None:
                warn(f"removing the stale lock {self.path} of {who(record)} and taking the run over: {why}")
            return taken, sent, nonce, False, said
        if not said:
            lease = record.get("lease_seconds") or self.lease_s
            print(f"run.output_dir: {self.path} is held by {who(record)}; waiting up to {lease:g} s (its lease) "
                  "for it to be renewed, else taking the run over", file=sys.stderr, flush=True)
        time.sleep(min(max(self.lease_s / 12, 0.05), 5.0))
        return None, 0.0, "", False, True

    def _renew(self, nonce: str, token) -> Renewed:
        """One renewal conditional on `token`; when the lock changed meanwhile, whose it is now: this process's own
        (a renewal of ours landed whose answer was lost: Renewed with its nonce), or another's, or none (Lost)."""
        try:
            new = storage.replace_if_generation(self.path, self._record(nonce), token)
        except FileNotFoundError:  # a conditional write to an object that is gone (GCS may answer 404)
            raise Lost(lost_line(self.path, None)) from None
        if new is not None:
            return Renewed(new)
        try:
            data, current = storage.read_versioned(self.path)
        except FileNotFoundError:
            raise Lost(lost_line(self.path, None)) from None
        record = _parse(data)
        if holder.is_mine(record):
            return Renewed(current, nonce=record.get("nonce"))
        raise Lost(lost_line(self.path, record))

    def _unreachable(self, seconds: float, err: BaseException | None) -> RunFailure:
        """No renewal confirmed for a whole lease (the store did not answer): another trainer may take the run over
        now, so this one stops with one line naming the URL and the likely cause."""
        from g2rl_jax import storage_clients

        if err is None:  # renewals still waiting on their answers (a store that drops or stalls each request)
            err = TimeoutError(f"no renewal was answered in {seconds:.0f} s")
        cause = storage_clients.explain(self.path, err, "gcsfs")
        return LeaseLost(f"train error: run.output_dir: could not renew the lease on {self.path} for {seconds:.0f} s,"
                         f" its whole lease ({cause}); another trainer may take the run over now, so this one stops, "
                         "writing nothing more. Kept: the checkpoints already committed (a save in flight is discarded "
                         "at the next start); run the same command again once the storage answers: it resumes from "
                         "the newest committed checkpoint", Exit.STORAGE)

    def _refusal(self, record: dict[str, Any]) -> str:
        return (f"run.output_dir: {str(self.path.parent)!r} is in use by another trainer ({who(record)}); wait for "
                "it to finish or stop it, or choose another run.output_dir. If no trainer runs there any more, "
                f"delete {self.path} (a trainer that is gone loses it once its lease lapses)")

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        key = _key(self.path)
        _COUNTS[key] -= 1
        if _COUNTS[key]:
            return
        lease = _LEASES.pop(key)
        del _COUNTS[key]
        fence.disarm(self.run_dir)
        lease.stop()
        if isinstance(lease, Holder) and lease.verdict is None:  # a lost lease is not ours to delete, nor a followed
            storage.remove_if_generation(self.path, lease.token)


def held_lease_lost() -> RunFailure | None:
    """The verdict of the run lease this process holds (process 0), when it turns out lost; None while it is held,
    and on a process that holds none. Waits for it to be known held again (at once while it is; a thawed holder's
    final renewal decides). A thawed trainer's watch of its rollout process (control/lease.py's KeyLease), frozen
    with it, asks first: a peer seen gone after a freeze of both is the lost lease, not a peer lost."""
    verdicts = (_verdict(lease) for lease in list(_LEASES.values()) if isinstance(lease, Holder))
    return next((verdict for verdict in verdicts if verdict is not None), None)


def _verdict(lease: Holder | Follower) -> RunFailure | None:
    """`lease`'s verdict once it is known (at once while it is held; a thawed holder's final renewal decides): the
    failure that ends this process when the lease turned out lost, else None."""
    try:
        lease.wait_held()
    except RunFailure as verdict:
        return verdict
    return None


def release_all() -> None:
    """Release every run lock this process holds, on its way out after a failure that leaves the store and the
    lease sound (a reward function, a device out of memory, a peer gone); a release that fails is left to lapse."""
    for key in list(_LEASES):
        lease = _LEASES.pop(key)
        _COUNTS.pop(key, None)
        lease.stop()
        if isinstance(lease, Holder) and lease.verdict is None:
            try:
                storage.remove_if_generation(lease.name, lease.token)
            except Exception:  # noqa: BLE001 - the lock lapses by itself
                pass
