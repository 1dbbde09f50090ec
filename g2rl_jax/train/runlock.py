"""The run lock: `<run>/run.lock` is a lease on the run directory, held by one trainer (host, pid, when it last renewed,
its lease). The holder renews it from a daemon thread every run.lock_lease_seconds / 3, so a long compile or save
does not let it lapse. A lock not renewed for its lease is stale from any host: a start that finds a lock watches it
for up to a lease (a live holder renews it meanwhile: refused in one line), then takes it over; a lock renewed more
than two leases ago by this host's clock is taken over at once, and so is one whose holder's pid is gone on this
host. Every change is conditional on the generation read (GCS: ifGenerationMatch on the create, the overwrite and
the delete; locally the same under an flock, g2rl_jax.storage), so of any number of starters exactly one wins and a
lock renewed meanwhile is never replaced. A holder whose renewal finds the lock changed has been taken over: it
prints one line and ends at once (exit LEASE_LOST_EXIT), writing nothing more; one whose renewals fail for a whole
lease (the store does not answer) ends the same way (exit halt.STORAGE_FAILED_EXIT). In a multi-host run every
process then stops with that line (control/stop.py), none stalls at the next collective.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from g2rl_jax import storage
from g2rl_jax.config import ConfigError
from g2rl_jax.control import stop
from g2rl_jax.train import halt

LOCK_FILE = "run.lock"
LEASE_LOST_EXIT = 3  # a trainer whose run lock another trainer took over


def _warn(message: str) -> None:
    """A warning on stderr on a line of its own (the renewal thread warns while the progress bar is drawn)."""
    stop.print_own_line(f"warning: {message}")


# ------------------------------------------------------------------------------------------------ the lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _parse(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _key(path) -> str:
    """The lock's identity within this process: a local path resolved, a URL as it is."""
    return str(path) if storage.is_url(path) else str(storage.path(path).resolve())


def _age(holder: dict[str, Any]) -> float | None:
    """Seconds since the holder last renewed, by this host's clock (None: no renewal time recorded)."""
    renewed = holder.get("renewed")
    return time.time() - renewed if isinstance(renewed, (int, float)) else None


def verdict(holder: dict[str, Any], watched_s: float, lease_s: float, held_here: bool) -> tuple[str, str]:
    """('live' | 'stale' | 'watch', why) for a lock holding record `holder`, watched unchanged for `watched_s`
    seconds. A lock not renewed for its lease (the holder's own, else `lease_s`) is stale from any host: seen unchanged
    that long on this host's monotonic clock, or renewed more than two leases ago by the wall clock (clocks that
    disagree by less than a lease cannot take a live lock). On the holder's own host its pid says more: gone (or this
    very process's pid while it holds no such lock: a restarted container's leftover) is stale at once, running and
    renewed within the lease is live at once."""
    lease = holder.get("lease_seconds") if isinstance(holder.get("lease_seconds"), (int, float)) else lease_s
    age, pid = _age(holder), holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if pid == os.getpid() and not held_here or pid != os.getpid() and not _pid_alive(pid):
            return "stale", f"its process (pid {pid} on this host) is gone"
        if age is not None and age < lease:
            return "live", "its process runs on this host"
    if watched_s >= lease:
        return "stale", f"its lease of {lease:g} s was not renewed while this start watched it for {watched_s:.0f} s"
    if age is not None and age >= 2 * lease:
        return "stale", f"its lease of {lease:g} s was last renewed {age:.0f} s ago"
    return "watch", ""


def _who(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unreadable lock"
    age = _age(holder)
    renewed = f", lease renewed {age:.0f} s ago" if age is not None else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} since {holder.get('since')}{renewed}"


class _Lease:
    """This process's hold on one lock file: the generation it last wrote, renewed from a daemon thread every
    lease/3 by an overwrite conditional on that generation. A renewal refused because the lock changed means another
    trainer took it over: one line, and the process ends at once (LEASE_LOST_EXIT), writing nothing more."""

    def __init__(self, path, lease_s: float, generation: str, record):
        self.path, self.lease_s, self.generation, self.record = path, lease_s, generation, record
        self.count = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_forever, name="run.lock lease", daemon=True)
        self._thread.start()

    def _renew_forever(self) -> None:
        from g2rl_jax import storage_clients

        renewed_at = time.monotonic()  # the last renewal that landed: the lease holds until a lease after it
        failed = None  # the last renewal's error while renewals fail
        while True:
            left = renewed_at + self.lease_s - time.monotonic()
            if self._stop.wait(self.lease_s / 3 if failed is None else min(self.lease_s / 3, max(left, 0.0))):
                return
            if failed is not None and time.monotonic() - renewed_at >= self.lease_s:  # at the lease's end, not later
                self._unreachable(failed, time.monotonic() - renewed_at)
            left = renewed_at + self.lease_s - time.monotonic()
            try:  # given what the lease has left (a third of it at least: a thawed process learns whether it lost it)
                renewed = storage_clients._within(max(left, self.lease_s / 3), "the renewal", self._renew_once)
            except Exception as err:  # noqa: BLE001 - a store that does not answer: retried until the lease is over
                if self._stop.is_set():
                    return
                failed = err
                if time.monotonic() - renewed_at >= self.lease_s:
                    self._unreachable(err, time.monotonic() - renewed_at)
                _warn(f"could not renew the lease on {self.path} for {time.monotonic() - renewed_at:.0f} s "
                      f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); retrying until the lease of "
                      f"{self.lease_s:g} s is over")
                continue
            if renewed is None:
                if not self._stop.is_set():
                    self._lost()
                return
            self.generation, renewed_at, failed = renewed, time.monotonic(), None

    def _renew_once(self) -> str | None:
        return storage.replace_if_generation(self.path, self.record(), self.generation)

    def _unreachable(self, err: BaseException, seconds: float) -> None:
        """The lease ran out while the store did not answer: another trainer may take the run over now, so this one
        stops (every process of the run), with one line naming the URL and the likely cause."""
        from g2rl_jax import storage_clients

        stop.stop_everywhere(
            f"train error: run.output_dir: could not renew the lease on {self.path} for {seconds:.0f} s, its whole "
            f"lease ({storage_clients.explain(self.path, err, 'gcsfs')}); another trainer may take the run over now, "
            "so this one stops, writing nothing more. Kept: the checkpoints already committed (a save in flight is "
            "discarded at the next start); run the same command again once the storage answers: it resumes from "
            "the newest committed checkpoint", halt.STORAGE_FAILED_EXIT)

    def _lost(self) -> None:
        try:
            holder = _parse(storage.read_versioned(self.path)[0])
        except Exception:  # noqa: BLE001 - only names the new holder in the line below
            holder = {}
        stop.stop_everywhere(f"run lock lost: {self.path} was taken over ({_who(holder) if holder else 'or deleted'}) "
                             f"because this trainer had not renewed its lease of {self.lease_s:g} s in time; stopping "
                             "now, writing nothing more", LEASE_LOST_EXIT)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        storage.remove_if_generation(self.path, self.generation)


_LEASES: dict[str, _Lease] = {}  # lock files this process holds


class RunLock:
    """`<run_dir>/run.lock`: a lease on the run directory (see the module docstring). Trainers within one process (a
    notebook cell run twice) share it: the file goes when the last releases."""

    def __init__(self, run_dir: str | os.PathLike, lease_seconds: float = 60.0):
        self.path = storage.path(run_dir) / LOCK_FILE
        self.lease_s = float(lease_seconds)
        self._held = False
        self._since = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def _record(self) -> str:
        """A fresh record (every write distinct: the nonce), so a renewal changes the generation."""
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": self._since,
                           "renewed": time.time(), "lease_seconds": self.lease_s, "nonce": uuid.uuid4().hex}) + "\n"

    def acquire(self) -> None:
        """Take the lock: create it, or take over one not renewed for its lease (watching it up to a lease to see
        whether its holder renews it); ConfigError (one line) when another trainer holds it."""
        key = _key(self.path)
        if self._held:
            return
        if key in _LEASES:
            _LEASES[key].count += 1
            self._held = True
            return
        storage.makedirs(self.path.parent)
        watch = {"t0": time.monotonic(), "seen": None, "said": False, "absent": False}
        generation = None
        while generation is None:  # a create only after a look found no lock: a start watching a held lock only
            # reads it (a create is an update of the object, and one within a second of the holder's renewal draws
            # a 429 on a bucket)
            created = storage.create_exclusive(self.path, self._record()) if watch["absent"] else None
            generation = created or self._take_over(watch)
        _LEASES[key], self._held = _Lease(self.path, self.lease_s, generation, self._record), True
        atexit.register(self.release)

    def _take_over(self, watch: dict[str, Any]) -> str | None:
        """One look at the lock that exists: its replacement's generation when it is stale and this start replaced
        it; None to look again (watched, released, or replaced by another meanwhile); ConfigError when it is live.
        `watch` carries the generation first seen and when, across looks."""
        try:
            data, current = storage.read_versioned(self.path)
        except FileNotFoundError:  # none yet, or released meanwhile: create it
            watch["absent"] = True
            return None
        watch["absent"] = False
        holder, seen = _parse(data), watch["seen"]
        if seen is not None and current != seen[0]:  # renewed (or taken) while this start watched
            raise ConfigError(self._refusal(holder))
        seen = watch["seen"] = seen or (current, time.monotonic())
        state, why = verdict(holder, time.monotonic() - seen[1], self.lease_s, _key(self.path) in _LEASES)
        if state == "live":
            raise ConfigError(self._refusal(holder))
        if state == "stale":
            # a lock written within the last second (a holder on this host whose pid is gone, killed right after a
            # renewal) is replaced once that second is out: a bucket allows one update per object per second
            age = _age(holder)
            if age is not None and 0 <= age < storage.UPDATE_INTERVAL_S:
                time.sleep(storage.UPDATE_INTERVAL_S + 0.05 - age)
            # conditional on the generation read: of any number of starters exactly one replaces it, and a lock
            # renewed meanwhile is left alone (the next look sees its new generation, and refuses)
            taken = storage.replace_if_generation(self.path, self._record(), current)
            if taken is not None:
                _warn(f"removing the stale lock {self.path} of {_who(holder)} and taking the run over: {why}")
            return taken
        if not watch["said"]:
            lease = holder.get("lease_seconds") or self.lease_s
            print(f"run.output_dir: {self.path} is held by {_who(holder)}; waiting up to {lease:g} s (its lease) "
                  "for it to be renewed, else taking the run over", file=sys.stderr, flush=True)
            watch["said"] = True
        if time.monotonic() - watch["t0"] > 3 * self.lease_s + 60:
            raise ConfigError(f"run.output_dir: could not take {self.path} in {time.monotonic() - watch['t0']:.0f} s;"
                              " another trainer keeps starting there")
        time.sleep(min(max(self.lease_s / 12, 0.05), 5.0))
        return None

    def _refusal(self, holder: dict[str, Any]) -> str:
        return (f"run.output_dir: {str(self.path.parent)!r} is in use by another trainer ({_who(holder)}); wait for "
                "it to finish or stop it, or choose another run.output_dir. If no trainer runs there any more, "
                f"delete {self.path} (a trainer that is gone loses it once its lease lapses)")

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        key = _key(self.path)
        lease = _LEASES[key]
        lease.count -= 1
        if lease.count:
            return
        del _LEASES[key]
        lease.release()
