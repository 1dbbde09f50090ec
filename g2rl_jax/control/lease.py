"""The lease: what the run lock (control/runlock.py, an object in the run directory) and the rollout processes'
liveness (`KeyLease`, a counter in the run's key-value channel, control/channel.py) both are. A holder renews it
every third of the lease; anyone else watches it and counts it lapsed once it saw no change for a whole lease.

The timing, with L the lease and M = MARGIN_SHARE x L the margin:

    holder   sends renewal i at s_i (its monotonic clock, taken before the request leaves); once the store confirms
             it (its answer, or a later read that finds the record it carried), the lease holds until s_i + L, and
             the holder writes until s_i + L - M. No confirmation by then: it writes nothing (control/fence.py
             refuses every write of run state) and, unless a renewal confirms meanwhile, stops at s_i + L.
    watcher  takes the lease over once it has seen no change for L past the last change it saw (its own monotonic
             clock). It cannot see renewal i before s_i, so it takes over at s_i + L at the earliest.

So the holder stops writing M before any other host could count its lease lapsed, whenever its replies come (a reply
delayed by a retried upload extends nothing: the lease counts from the send). M covers a write that passed the fence
check just before s_i + L - M and is still on its way to the store (a request of the paced gcsfs client is checked
right before it leaves). A renewal is an overwrite conditional on the generation the holder last confirmed, so one
that lands proves no one took the lease meanwhile: a holder frozen past its lease (SIGSTOP, a VM paused) whose lease
nobody took keeps it, with the gap's writes held back until that renewal confirms.

Renewals are sent on schedule even while one is still unanswered. A renewal whose answer was lost (applied, reply
dropped or late) makes the next one fail its precondition; the holder then reads the record, finds its own identity
and the nonce of the renewal that landed (control/holder.py), and counts its lease from that renewal's send.
"""
from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable

from g2rl_jax.control.errors import RunFailure

MARGIN_SHARE = 0.2  # the holder stops writing this share of the lease before the lease it last confirmed ends
RENEWALS_PER_LEASE = 3  # a renewal every third of the lease
MAX_PENDING = 2  # renewals in flight at once (a third is not sent while two are unanswered)
FOLLOWER_READS_PER_LEASE = 8  # a follower's reads of the lease (it needs two within L/3 + M: control/runlock.py)
MIN_LEASE_S = 3.0  # the smallest lease a holder takes (the run lock's own floor is run.lock_lease_seconds')


def warn(message: str) -> None:
    """A warning on stderr on a line of its own (the renewal thread warns while the progress bar is drawn)."""
    from g2rl_jax.control import stop

    stop.print_own_line(f"warning: {message}")


class Renewed:
    """A renewal's outcome: it landed, and the store's version token is now `token`."""

    def __init__(self, token, nonce: str | None = None):
        self.token, self.nonce = token, nonce  # nonce: the renewal that landed, when it was not the one sent


class Lost(Exception):
    """A renewal found the lease held by another, or gone: `line` says by whom."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class _WriteClock:
    """What a Holder and a Follower share: until when this process may write (`writable_until`, from
    `confirmed_at`), and the wait of a write for that (`wait_held`, giving up after `give_up_s` with `not_seen`)."""

    name: str
    lease_s: float
    margin_s: float
    confirmed_at: float
    give_up_s: float
    verdict: RunFailure | None
    _stopped: bool
    _cond: threading.Condition

    def writable_until(self) -> float:
        """Until when (monotonic) this process may write: the confirming send + lease - margin."""
        return self.confirmed_at + self.lease_s - self.margin_s

    def held(self) -> bool:
        return self.verdict is None and time.monotonic() < self.writable_until()

    def wait_held(self) -> None:
        """Return at once while the lease is known held; past the margin, wait for a confirmation (or for the
        verdict, raised; or for `stop`), up to `give_up_s`, then raise `not_seen()`."""
        give_up = time.monotonic() + self.give_up_s
        with self._cond:
            while self.verdict is None and time.monotonic() >= self.writable_until() and not self._stopped:
                if time.monotonic() >= give_up:
                    raise self.not_seen()
                self._cond.wait(0.05)
            if self.verdict is not None:
                raise self.verdict

    def not_seen(self) -> RunFailure:
        from g2rl_jax.control.errors import LeaseLost
        from g2rl_jax.control.exits import Exit

        return LeaseLost(f"no renewal of the lease on {self.name} was seen for {self.give_up_s:g} s: its "
                         "holder, process 0, is stuck or cannot reach the storage; this process writes nothing more",
                         Exit.STORAGE)


class Holder(_WriteClock):
    """This process's hold on one lease: a daemon thread sends `renew(nonce, token)` every third of the lease
    (`Renewed`, or `Lost`, or an exception when the store did not answer) and keeps the time until which the lease
    is known held. When it is lost, or no renewal confirmed for a whole lease, `verdict` is set and `on_end(verdict)`
    runs (the run lock stops the run; see the module docstring for the timing)."""

    def __init__(self, name: str, lease_s: float, token, sent_at: float, nonce: str,
                 renew: Callable[[str, object], Renewed], on_end: Callable[[RunFailure], None],
                 unreachable_line: Callable[[float, BaseException | None], RunFailure]):
        self.name, self.lease_s, self.margin_s = name, float(lease_s), MARGIN_SHARE * float(lease_s)
        self.token, self.confirmed_at = token, sent_at  # the newest renewal known to have landed: its send time
        self._token_sent = sent_at  # the send time of the renewal that wrote `token`
        self._renew, self._on_end, self._unreachable = renew, on_end, unreachable_line
        self._sent: dict[str, float] = {nonce: sent_at}  # nonce -> send time, of the renewals since the start
        self._pending = 0
        self._error: BaseException | None = None  # the last renewal's error while none confirms
        self.verdict: RunFailure | None = None
        self.give_up_s = math.inf  # a wait to write ends with the verdict, which the lease's thread always reaches
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name} lease", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        """Send a renewal every third of the lease (and at once when the lease is past its margin with none in
        flight); past the lease's end, one final renewal decides: landed (the lease goes on), lost (LeaseLost), or
        no answer within the margin (not known held: LeaseLost with the storage's exit code) unless this thread was
        frozen past the lease, when the final renewal's answer decides (`_awaiting`)."""
        every, retry = self.lease_s / RENEWALS_PER_LEASE, max(self.lease_s / 12, 0.25)
        next_send, last_send, final_at = self.confirmed_at + every, self.confirmed_at, None
        wake_at, paused = time.monotonic(), False
        with self._cond:
            while not self._stopped and self.verdict is None:
                now, end = time.monotonic(), self.confirmed_at + self.lease_s
                if final_at is not None and final_at < self.writable_until():  # confirmed since: not final
                    final_at, paused = None, False
                if now >= end and now - wake_at > every:  # this thread did not run for a renewal's period: frozen
                    paused = True
                if now >= end and final_at is None:  # frozen past the lease, or no renewal confirmed: one
                    final_at = next_send = now  # more (or those in flight), then decide
                if final_at is not None and now >= max(end, final_at + self.margin_s) and not self._awaiting(paused):
                    self._end(self._unreachable(now - self.confirmed_at, self._error))
                    return
                behind = now >= self.writable_until() and self._pending == 0 and now - last_send >= retry
                if (now >= next_send or behind) and self._pending < MAX_PENDING:
                    if final_at is None and now >= self.writable_until():
                        final_at = now
                    self._pending += 1
                    next_send, last_send = now + every, now
                    threading.Thread(target=self._one, name=f"{self.name} renewal", daemon=True).start()
                    continue
                wakes = [end if final_at is None else max(end, final_at + self.margin_s)]
                if self._pending < MAX_PENDING:
                    wakes.append(next_send)
                if self._pending == 0:
                    wakes.append(self.writable_until() if now < self.writable_until() else last_send + retry)
                if self._awaiting(paused):  # woken by the answer (or its error); the deadlines passed
                    wakes = [w for w in wakes if w > now] + [now + retry]
                wake_at = max(min(wakes), now + 0.001)
                self._cond.wait(wake_at - now)

    def _awaiting(self, paused: bool) -> bool:
        """(under the condition) After a freeze past the lease, the final renewal's answer decides, however late
        (the store's own timeout bounds it): the lease lapsed because this process did not run, not because the
        store did not answer, and nothing is written meanwhile (the fence is closed past the margin)."""
        return paused and self._error is None and self._pending > 0

    def _one(self) -> None:
        nonce = uuid.uuid4().hex
        sent_at = time.monotonic()
        with self._cond:
            self._sent[nonce] = sent_at
            token = self.token
        try:
            outcome = self._renew(nonce, token)
        except Lost as lost:
            from g2rl_jax.control.errors import LeaseLost

            with self._cond:
                self._pending -= 1
                if not self._stopped and self.verdict is None:  # two renewals in flight may both find it lost
                    self._end(LeaseLost(lost.line))
            return
        except Exception as err:  # noqa: BLE001 - a store that did not answer: the lease's clock decides
            with self._cond:
                self._pending -= 1
                self._error = err
                self._cond.notify_all()
                stopped, left = self._stopped, self.confirmed_at + self.lease_s - time.monotonic()
            if not stopped:
                warn(f"could not renew the lease on {self.name} ({type(err).__name__}: "
                     f"{' '.join(str(err).split())[:200]}); retrying while its lease of {self.lease_s:g} s has "
                     f"{max(left, 0):.0f} s left")
            return
        with self._cond:
            self._pending -= 1
            landed = self._sent.get(outcome.nonce or nonce)  # None: older than a renewal confirmed meanwhile
            if landed is not None and landed >= self._token_sent:  # a late answer never brings an older token back
                self.token, self._token_sent = outcome.token, landed
            if landed is not None and landed > self.confirmed_at:
                self.confirmed_at, self._error = landed, None
                # an older renewal can no longer land (its precondition is an older token)
                self._sent = {n: t for n, t in self._sent.items() if t >= landed}
            self._cond.notify_all()

    def _end(self, verdict: RunFailure) -> None:
        """(under the condition) The lease is over: wake the writers waiting on it, then `on_end` (which may end
        the process) outside the condition."""
        self.verdict = verdict
        self._cond.notify_all()
        threading.Thread(target=self._on_end, args=(verdict,), name=f"{self.name} lease end", daemon=True).start()

    def stop(self) -> None:
        """Stop renewing (a release: the caller deletes or leaves the record)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()


class Follower(_WriteClock):
    """A process that writes under another process's lease without holding one: the run lock's other processes of a
    multi-host run (control/runlock.py's `follow`). A daemon thread sends `read()` (the lease's version token and its
    record; FileNotFoundError when there is none) FOLLOWER_READS_PER_LEASE times a lease, one at a time, and this
    process may write while the lease is known held by the process `owns(record)` names.

    Timing, with the holder's L and M: reads sent at a_1 < a_2 < ... (monotonic, before each leaves). When read k
    returns another token than read k-1, that version was written after read k-1 was served, so no watcher saw it
    before a_{k-1} and no other host can take the lease over before a_{k-1} + L: this process writes until
    a_{k-1} + L - M (the monotonic clock runs on through a freeze, so a thawed follower waits for the next renewal it
    sees made; so does one that just started). A record of another holder, or none, is the verdict (LeaseLost,
    `lost_line(record)`); the holder's own process stops the run, so the verdict ends nothing by itself: this
    process's writes raise it."""

    def __init__(self, name: str, lease_s: float, read: Callable[[], tuple[object, dict | None]],
                 owns: Callable[[dict], bool], lost_line: Callable[[dict | None], str]):
        self.name, self.lease_s, self.margin_s = name, float(lease_s), MARGIN_SHARE * float(lease_s)
        self._read, self._owns, self._lost_line = read, owns, lost_line
        self.give_up_s = 2 * self.lease_s  # the holder ends its run after one lease without a confirmed renewal
        self.confirmed_at = -math.inf  # the send time of the read before the newest change seen
        self.verdict: RunFailure | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name} follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from g2rl_jax.control.errors import LeaseLost

        every = self.lease_s / FOLLOWER_READS_PER_LEASE
        token, last_sent, woke = _UNSEEN, None, -math.inf
        while True:
            with self._cond:
                if self._stopped:
                    return
                self._cond.wait(max(woke + every - time.monotonic(), 0))
                if self._stopped:
                    return
            woke = sent = time.monotonic()
            try:
                current, record = self._read()
            except FileNotFoundError:
                current, record = None, None
            except Exception:  # noqa: BLE001 - a store that did not answer: nothing learnt, the clock decides
                continue
            with self._cond:
                if record is None or not self._owns(record):
                    self.verdict = LeaseLost(self._lost_line(record))
                    self._cond.notify_all()
                    return
                if token is not _UNSEEN and current != token and last_sent is not None:
                    self.confirmed_at = max(self.confirmed_at, last_sent)
                    self._cond.notify_all()
                token, last_sent = current, sent

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()


_UNSEEN = object()  # a Follower's token before its first read


class Watch:
    """Someone else's lease as a watcher sees it: a version token looked at now and then; lapsed once it has not
    changed for a whole lease past the last change seen (monotonic clock)."""

    def __init__(self, lease_s: float):
        self.lease_s = float(lease_s)
        self.token, self.since = None, None  # the token last seen, and when it was first seen

    def look(self, token, now: float | None = None) -> bool:
        """Record a look at the lease; True when its token changed since the last look (not at the first)."""
        now = time.monotonic() if now is None else now
        changed = self.since is not None and token != self.token
        if self.since is None or changed:
            self.token, self.since = token, now
        return changed

    def unchanged_for(self, now: float | None = None) -> float:
        return 0.0 if self.since is None else (time.monotonic() if now is None else now) - self.since

    def lapsed(self, now: float | None = None) -> bool:
        return self.since is not None and self.unchanged_for(now) >= self.lease_s


# ---------------------------------------------------------------------------------------------- in the key-value store
class KeyLease:
    """The rollout processes' liveness (mesh.rollout_processes, train/sides.py): rollout process P holds
    `<prefix>/alive/P`, a counter in the run's key-value channel (control/channel.py) that it increments every third
    of `seconds` (a `Holder` whose renewal always lands); the first training process `watch`es every rollout
    process's counter and, when one has not changed for `seconds` (a `Watch`), stops the run with PEER_LOST (the
    process died or hangs)."""

    def __init__(self, prefix: str, seconds: float):
        self.prefix, self.seconds = prefix, float(seconds)
        self._done = threading.Event()
        self._holder: Holder | None = None

    def renew(self) -> KeyLease:
        import jax

        from g2rl_jax.control import channel

        key = f"{self.prefix}/alive/{jax.process_index()}"

        def increment(nonce, token) -> Renewed:
            try:
                return Renewed(channel.default().increment(key, 1))
            except channel.StoreGone:  # the trainer, and its store, are gone: nothing left to renew or to warn of
                if self._holder is not None:  # (from the renewal's own thread, not the lease's: no join of itself)
                    self._holder.stop()
                raise

        sent = time.monotonic()
        first = increment(None, None).token
        self._holder = Holder(key, self.seconds, first, sent, "first", increment, on_end=lambda verdict: None,
                              unreachable_line=lambda seconds, err: _key_store_gone(key, seconds))
        return self

    def watch(self, rollout_processes: list[int]) -> KeyLease:
        def watch_forever():
            from g2rl_jax.control import channel, stop
            from g2rl_jax.control.exits import Exit

            keys = {p: f"{self.prefix}/alive/{p}" for p in rollout_processes}
            seen = {p: Watch(self.seconds) for p in rollout_processes}
            while not self._done.wait(min(1.0, self.seconds / 9)):
                try:
                    now = {p: channel.default().increment(key, 0) for p, key in keys.items()}
                except channel.StoreGone:  # jax.distributed is shutting down: nothing left to watch
                    return
                for p in keys:
                    seen[p].look(now[p])
                late = [p for p in keys if seen[p].lapsed()]
                if late and not self._done.is_set():
                    from g2rl_jax.control import errors, runlock

                    lost = runlock.held_lease_lost()  # both were frozen and the run taken over: the lost lease
                    if lost is not None:
                        errors.end_run(lost)
                    stop.stop_everywhere(f"the rollout process {late[0]} (mesh.rollout_processes) has not renewed "
                                         f"its lease for {self.seconds:g} s (run.lock_lease_seconds): it died or "
                                         "hangs. The checkpoints committed stand: end it if it still runs, and "
                                         "relaunch every process with the same command to resume",
                                         int(Exit.PEER_LOST), gone=(late[0],))

        threading.Thread(target=watch_forever, name="g2rl-sides-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._holder is not None:
            self._holder.stop()


def _key_store_gone(key: str, seconds: float) -> RunFailure:
    """A rollout process whose increments fail: the trainer, and its key-value store, are gone (JAX ends this
    process); the verdict ends nothing by itself."""
    from g2rl_jax.control.errors import PeerLost

    return PeerLost(f"{key} could not be renewed for {seconds:.0f} s: the trainer's key-value store is gone")
