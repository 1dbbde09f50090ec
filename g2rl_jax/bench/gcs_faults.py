"""The faults gcs_proxy.py serves: seeded rates per request (`Faults`), and rules a test or the chaos soak adds while
the proxy runs (`Rule`: a storm, an outage, one renewal's reply delayed, replies dropped after apply for a while).

A fault is drawn per request, before it is forwarded; its kind says what the client meets:

  503      answered 503 Service Unavailable; not forwarded (the server never applied it: a retry is safe)
  429      answered 429 Too Many Requests; not forwarded
  drop     the connection closed with no answer; not forwarded
  slow     forwarded `seconds` late
  late     forwarded and applied; the answer sent `seconds` late (a delayed reply)
  lost     forwarded and applied; then the connection closed with no answer (applied, reply dropped)
  lost503  forwarded and applied; then answered 503 (applied, reply replaced): the client's retry meets the change
           its first attempt made (a compose or a conditional write then fails its precondition: 412)

    proxy.plan.add(Rule("503", rate=0.5), seconds=20)                  # a 503 storm: half the requests, 20 s
    proxy.plan.add(Rule("drop"), seconds=30)                           # an outage: every request, 30 s
    proxy.plan.add(Rule("late", obj="/run.lock", kinds=("upload",), count=1, seconds=20))  # one renewal, 20 s late
    proxy.plan.add(Rule("lost", kinds=UPDATES, rate=0.3), seconds=20)   # replies dropped after apply
"""
from __future__ import annotations

import dataclasses
import math
import random
import threading
import time

FAULTS = ("503", "429", "drop", "slow", "late", "lost", "lost503")
UNSENT = ("503", "429", "drop")  # the server never sees these
APPLIED = ("late", "lost", "lost503")  # the server applies these, the client meets the fault afterwards


@dataclasses.dataclass(frozen=True)
class Faults:
    """Seeded fault rates, each a probability per request, drawn in this order."""

    rate_503: float = 0.0
    rate_slow: float = 0.0
    rate_drop: float = 0.0
    rate_late: float = 0.0
    rate_lost: float = 0.0
    rate_lost503: float = 0.0
    slow_s: float = 0.5
    late_s: float = 0.5
    seed: int = 0

    def rates(self) -> tuple[tuple[str, float, float], ...]:
        """(kind, rate, seconds) of each fault."""
        return (("503", self.rate_503, 0.0), ("drop", self.rate_drop, 0.0), ("slow", self.rate_slow, self.slow_s),
                ("late", self.rate_late, self.late_s), ("lost", self.rate_lost, 0.0),
                ("lost503", self.rate_lost503, 0.0))


STRICT = Faults(rate_503=0.003, rate_slow=0.005, rate_drop=0.002, slow_s=0.3, seed=0)  # what the tests serve


@dataclasses.dataclass
class Rule:
    """`fault` for the requests that match (kind among `kinds`, all when empty; `obj` within the object's name),
    each with probability `rate`, at most `count` times (None: no bound), until the plan's deadline for it;
    `seconds`: the delay of slow and late."""

    fault: str
    rate: float = 1.0
    kinds: tuple[str, ...] = ()
    obj: str = ""
    count: int | None = None
    seconds: float = 0.0
    until: float = math.inf  # monotonic seconds; set by FaultPlan.add
    served: int = 0

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {', '.join(FAULTS)}")

    def matches(self, kind: str, obj: str | None, now: float) -> bool:
        return (now < self.until and (self.count is None or self.served < self.count)
                and (not self.kinds or kind in self.kinds) and (not self.obj or self.obj in (obj or "")))


class FaultPlan:
    """The base `Faults` and the rules in force; `draw` picks a request's fault (the rules first, in order)."""

    def __init__(self, faults: Faults):
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self.rules: list[Rule] = []

    def add(self, rule: Rule, seconds: float | None = None) -> Rule:
        """Put `rule` in force (for `seconds`, else until its count is spent or it is removed)."""
        rule.until = time.monotonic() + seconds if seconds is not None else math.inf
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self.rules:
                self.rules.remove(rule)

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def draw(self, kind: str, obj: str | None) -> tuple[str | None, float]:
        """(the fault for a request of `kind` on `obj`, its seconds); (None, 0) for none."""
        now = time.monotonic()
        with self._lock:
            self.rules = [r for r in self.rules if now < r.until and (r.count is None or r.served < r.count)]
            for rule in self.rules:
                if rule.matches(kind, obj, now) and self._rng.random() < rule.rate:
                    rule.served += 1
                    return rule.fault, rule.seconds
            u = self._rng.random()
        for name, rate, seconds in self.faults.rates():
            if u < rate:
                return name, seconds
            u -= rate
        return None, 0.0
