"""What a run spends compiling, step by step: the programs XLA compiled and the seconds the process spent on it.

    clock = CompileClock()          # from now on, every thread of the process
    ...                             # a step
    window = clock.take()           # since the previous take: programs, seconds, what each program was
    clock.step_figures(step, after_warmup=True)   # or: a take as a step's metrics, one stderr line if any
    clock.step_figures(step, after_warmup=True, strict=True)   # ... or LateCompile naming them
    clock.close()

`programs` counts backend compiles (jax.monitoring's `/jax/core/compile/backend_compile_duration`, one per XLA
executable built or read back from the persistent cache); `seconds` is the wall time during which the process was
tracing, lowering or compiling anything (jax's three compile events; compiles running at once on the warm-up's
threads are counted once, so it is at most the window's wall time). Each program is named by its jitted function
and the shapes of its last few arguments (where the data are; the parameters come first), taken from jax's own
lowering record ("Compiling jit(f) with global shapes and types ...") in the thread that compiled it.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
EVENTS = (COMPILE_EVENT, "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
LOWERING_LOGGER = "jax._src.interpreters.pxla"  # logs "Compiling %s with global shapes and types %s" (DEBUG)
SHOWN_SHAPES = 5  # distinct argument shapes a program's name shows, from the last argument back


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def describe(name: str, avals) -> str:
    """'accumulate int32[64,528] float32[64,512] float32[]': the function and its last SHOWN_SHAPES distinct
    argument shapes, in argument order."""
    shapes: list[str] = []
    for aval in reversed(list(avals)):
        text = str(aval)
        if text not in shapes:
            shapes.append(text)
        if len(shapes) == SHOWN_SHAPES:
            break
    kind = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
    return " ".join([kind, *reversed(shapes)])


@dataclasses.dataclass(frozen=True)
class Window:
    """Compiles between two `take`s: how many programs, the seconds spent compiling, and each program's name."""

    programs: int
    seconds: float
    names: tuple[str, ...]


class _Lowerings(logging.Filter):
    """Keeps, per thread, the argument shapes of the program jax last lowered; lets through only the records the
    logger would have emitted without it."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Compiling %s with global shapes") and record.args:
            self.local.last = (record.args[0], record.args[1])
        return record.levelno >= self.level

    def program(self, module: str) -> str:
        last = getattr(self.local, "last", None)
        return describe(module, last[1]) if last and last[0] == module else describe(module, ())


class _SharedLowerings:
    """One filter on jax's lowering logger for every open clock: a logger stops at its first filter that rejects a
    record, so a second filter of its own would never see the records the first one hides."""

    def __init__(self):
        self.lock, self.users, self.filter, self.old_level = threading.Lock(), 0, None, logging.NOTSET

    def attach(self) -> _Lowerings:
        with self.lock:
            logger = logging.getLogger(LOWERING_LOGGER)
            if self.users == 0:
                self.filter, self.old_level = _Lowerings(logger.getEffectiveLevel()), logger.level
                logger.addFilter(self.filter)
                logger.setLevel(min(logging.DEBUG, logger.getEffectiveLevel()))
            self.users += 1
            return self.filter

    def detach(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                logger = logging.getLogger(LOWERING_LOGGER)
                logger.removeFilter(self.filter)
                logger.setLevel(self.old_level)


_SHARED = _SharedLowerings()


class LateCompile(RuntimeError):
    """A step after the warm-up compiled a program under run.strict_compiles; the message names each one."""


class CompileClock:
    """Counts the programs compiled and the seconds spent compiling, from its creation to `close` (see the module
    docstring); `take()` returns and resets what happened since the previous take."""

    def __init__(self):
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._names: list[str] = []
        self.started = self._since = time.perf_counter()
        self._lowerings: _Lowerings | None = None
        self._open = False
        self.open()

    def open(self) -> None:
        """Listen (again, after `close`)."""
        if self._open:
            return
        self._open = True
        self._lowerings = _SHARED.attach()
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kw) -> None:
        if event not in EVENTS or self._lowerings is None:
            return
        end = time.perf_counter()
        name = self._lowerings.program(str(kw.get("fun_name", "?"))) if event == COMPILE_EVENT else None
        with self._lock:
            self._intervals.append((end - duration, end))
            if name is not None:
                self._names.append(name)

    def take(self) -> Window:
        """The compiles since the previous take (or the clock's start)."""
        now = time.perf_counter()
        with self._lock:
            intervals, names = self._intervals, self._names
            self._intervals, self._names = [], []
            since, self._since = self._since, now
        clipped = [(max(start, since), min(end, now)) for start, end in intervals]
        return Window(len(names), union_seconds([(a, b) for a, b in clipped if b > a]), tuple(names))

    def step_figures(self, step: int, *, after_warmup: bool, strict: bool = False) -> dict[str, float]:
        """`take()` as the step's compile_seconds and programs_compiled; a step after the warm-up that compiled
        anything says so in one line on stderr (process 0), or, `strict` (run.strict_compiles), raises LateCompile."""
        window = self.take()
        if after_warmup and window.programs:
            line = (f"step {step} compiled {window.programs} program(s) after the warm-up step "
                    f"({window.seconds:.1f} s): {'; '.join(window.names)}")
            if strict:
                raise LateCompile(line)
            if jax.process_index() == 0:
                print(line, file=sys.stderr, flush=True)
        return {"compile_seconds": window.seconds, "programs_compiled": window.programs}

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        jax.monitoring.unregister_event_duration_listener(self._listen)
        _SHARED.detach()
