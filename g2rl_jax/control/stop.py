"""The one stop path of a run: one place publishes "stop with code C and line L", one place watches for it.

A stop is a `Stop` (exit code, one line, the process that stopped, the trainer's last step, and whether every
process ends now) under the key `stop` of the run's key-value channel (control/channel.py), set once: the first
to publish wins. Two ways to end:

- at once, everywhere: `stop_everywhere(line, code, gone)` prints the line, publishes it, gives the other processes
  up to ACK_S to answer under `stopped/P` (`awaited_acks`: not those `gone`, which the line is about), and ends this
  process (os._exit: no cleanup that could wait on a store that no longer answers; the checkpoints already committed
  stand, a save in flight is discarded at the next start). A lost run lock, a storage failure, a process gone from
  a collective, a rollout process's error, and SIGTERM's abandoned step (lifecycle.StopSignal) all end this way.
- after what they do: `finish(step, code)`, the trainer's end (done, a checkpoint after SIGTERM, an error), for the
  processes that wait on it (the rollout processes of a split run, train/sides.py): a get of theirs that waits for
  the trainer raises channel.Ended with the Stop (`ended` is the hook), and the process returns the trainer's code,
  leaving jax.distributed cleanly. A rollout process thus always ends with its trainer's code: 0, 143, 2, ...
  (exits.Exit), never a code of its own.

`Watch`, entered around the training loop (lifecycle.StopSignal) and the rollout process, is the one watcher: a
thread that waits for the stop key; a stop published now by another process closes the fence (control/fence.py:
nothing more of the run is written), is printed (with `(process N)`), answered, and ends this process with its code;
a `finish` is kept for `ended`. In a notebook (ipykernel loaded) no stop ends the kernel: the main thread gets
`Stopped` (code and line) instead of os._exit, from whichever thread stopped. A run of one process has no channel:
the line and the exit are all there is.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import sys
import threading
import time

from g2rl_jax.control import channel, fence, wire
from g2rl_jax.control.exits import Exit

STOP_KEY = "stop"  # a Stop
ACK_KEY = "stopped"  # + "/P": process P has the line and ends now
ACK_S = 5.0  # how long a stopping process waits for the others to have the line
COORDINATOR_LAST_S = 1.0  # process 0 holds the coordination service: it ends this long after the others have the line
_STOPPING = threading.Lock()  # the first stop of this process prints; any other waits for the exit
_seen: Stop | None = None  # the stop the Watch of this process saw
_delivered: Stop | None = None  # the stop a notebook's main thread is being given


@dataclasses.dataclass(frozen=True)
class Stop:
    """Exit code `code` and its one line, published by process `process` (of the trainer's last step `step`, when
    the trainer finished); `now`: every process ends at once, else those waiting on the trainer end after it."""

    code: int
    line: str
    process: int
    step: int | None = None
    now: bool = True


class Stopped(RuntimeError):
    """A stop, raised in a notebook's main thread instead of ending the kernel; `code` is the exit code."""

    def __init__(self, stop: Stop | None = None):
        stop = stop or _delivered or Stop(Exit.BUG, "stopped", -1)
        super().__init__(stop.line)
        self.code = stop.code


def processes() -> tuple[int, int] | None:
    """(this process's index, the process count) in a run of several processes joined by jax.distributed, else
    None."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = distributed.global_state
    if state.client is None or (state.num_processes or 1) < 2:
        return None
    return state.process_id, state.num_processes


def in_notebook() -> bool:
    return "ipykernel" in sys.modules


def print_own_line(line: str) -> None:
    """`line` on stderr on a line of its own: a progress bar still drawn there (tqdm ends its line only when the bar
    closes, and this process ends without closing it) is ended first."""
    bars = sys.modules.get("tqdm")
    if bars is not None and len(getattr(bars.tqdm, "_instances", ())):  # tqdm drops disabled bars from the set
        print(file=sys.stderr)
    print(line, file=sys.stderr, flush=True)


def awaited_acks(me: int, count: int, gone: tuple[int, ...] = ()) -> list[int]:
    """The processes whose answer a stopping process `me` of `count` waits for: process 0 every other; another
    process process 0 alone (it ends COORDINATOR_LAST_S after its answer, and JAX's client then aborts every process
    still there: the rest have the line from their Watch); none of those `gone` (a process whose lease lapsed is
    dead, or too stuck to renew it and so to answer: waiting for it would only cost ACK_S)."""
    return [i for i in (range(count) if me == 0 else [0]) if i != me and i not in gone]


def publish(stop: Stop) -> bool:
    """Set the stop key to `stop`; False when another process published first or the store is gone."""
    try:
        channel.default().put(STOP_KEY, stop)
        return True
    except (channel.Exists, channel.StoreGone):
        return False


def _as_raised(error: BaseException) -> type:
    """A class that PyThreadState_SetAsyncExc can raise (it calls the class with no arguments) whose instances are
    `error` again: its type, arguments and attributes."""
    def init(self, *_):
        Exception.__init__(self, *error.args)
        self.__dict__.update(error.__dict__)

    return type(type(error).__name__, (type(error),), {"__init__": init, "__module__": type(error).__module__})


def _deliver(stop: Stop, error: BaseException | None = None):
    """In a notebook: `error` (a typed failure, control/errors.py), else `Stopped`, in the main thread (raised here
    when this is it; else set pending there, and this thread ends quietly)."""
    global _delivered
    _delivered = stop
    if _STOPPING.locked():
        _STOPPING.release()  # the kernel lives on: a later run may stop again
    if threading.current_thread() is threading.main_thread():
        raise error if error is not None else Stopped(stop)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                               ctypes.py_object(Stopped if error is None else _as_raised(error)))
    raise SystemExit  # ends this thread without a traceback


def _end(stop: Stop, me: int | None, error: BaseException | None = None):
    """os._exit(stop.code) (in a notebook `error`, or Stopped); process 0 of several first waits COORDINATOR_LAST_S,
    since its exit takes jax.distributed's coordination service down and a process still on its way out would be
    aborted by JAX's client (SIGABRT and a stack trace instead of the one line and its exit code)."""
    sys.stdout.flush()
    if in_notebook():
        _deliver(stop, error)
    if me == 0:  # meanwhile this process's own collectives fail (the others are gone): their errors are not the line
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        time.sleep(COORDINATOR_LAST_S)
    os._exit(int(stop.code))


def stop_everywhere(line: str, code: int, gone: tuple[int, ...] = (), *, say: bool = True, within: float = ACK_S,
                    error: BaseException | None = None):
    """Print `line` on stderr (unless `say` is False: the caller did) and end this process with `code`; in a run of
    several processes the others are told first (their Watch ends them with the same line) and given up to `within`
    seconds to have it, but those known `gone` (the line is about them). Never returns: in a notebook the main
    thread gets `error` (the typed failure the stop is for, control/errors.py's `end_run`) or else Stopped.
    The fence closes first (control/fence.py): nothing of the run is written in the seconds the stop takes."""
    fence.close(line)
    if not _STOPPING.acquire(blocking=False):  # another thread of this process is stopping it already
        if in_notebook():
            if threading.current_thread() is not threading.main_thread():
                raise SystemExit
            raise error if error is not None else Stopped(Stop(int(code), line, -1))
        time.sleep(ACK_S + 10)
        os._exit(int(code))
    if say:
        print_own_line(line)
    where, me = processes(), None
    if where is not None:
        me, count = where
        publish(Stop(int(code), line, me))
        deadline = time.monotonic() + within
        for other in awaited_acks(me, count, gone):
            try:
                channel.default().get(f"{ACK_KEY}/{other}", timeout_s=max(deadline - time.monotonic(), 0.001))
            except (channel.Late, channel.StoreGone, wire.Refused):  # no answer in time: it ends by itself, or has
                break
    _end(Stop(int(code), line, me if me is not None else 0), me, error)


def await_stop() -> None:
    """The main thread's way out of a run: when another thread of this process decided to stop it (the fence is
    closed: a lease thread found the run taken over while the main thread finished its last save), that thread ends
    the process with the stop's code within ACK_S + COORDINATOR_LAST_S; the main thread waits for it instead of
    ending the process with its own (0: done). Returns at once when no stop was decided, and in a notebook."""
    if fence.closed() and not in_notebook():
        time.sleep(ACK_S + COORDINATOR_LAST_S + 10)


def refuse(err: wire.Refused):
    """Stop every process for a value that is not ours (a pickle planted in the store, another version's
    process): a control/errors.py BadInput, its one line and exit 2 (errors.end_run)."""
    from g2rl_jax.control import errors

    errors.end_run(err)


def finish(step: int, code: int) -> None:
    """The trainer has ended after step `step` with exit code `code`: the processes waiting on it end after what
    they do, with that code (see the module docstring). Nothing in a run of one process."""
    where = processes()
    if where is not None:
        publish(Stop(int(code), f"the trainer ended after step {step} (exit code {int(code)})", where[0], step,
                     now=False))


def ended() -> Stop | None:
    """The trainer's `finish` once this process's Watch has seen it, else None: the hook of a channel get that waits
    on the trainer (its Watch must be entered; a stop published now ends the process by itself)."""
    return _seen


class Watch:
    """While entered, a daemon thread of a run of several processes waits for the stop key (see the module
    docstring); nothing in a run of one process."""

    def __init__(self):
        self._done = threading.Event()
        self._thread = None

    def __enter__(self) -> Watch:
        if processes() is not None:
            self._done.clear()
            self._thread = threading.Thread(target=self._watch, name="g2rl-stop-watch", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        global _seen
        ch = channel.default()
        try:
            stop = ch.get(STOP_KEY, kinds=(Stop,), schema=Stop, timeout_s=math.inf,
                          ended=lambda: True if self._done.is_set() else None)
        except (channel.Ended, channel.StoreGone):  # left, or the coordinator is gone (JAX's client ends this one)
            return
        except wire.Refused as err:
            refuse(err)
        if not stop.now:  # the trainer's finish: `ended` has it
            _seen = stop
            return
        fence.close(stop.line)  # another process stops the run: this one writes nothing more of it
        me = processes()[0]
        if stop.process == me or not _STOPPING.acquire(blocking=False):
            return  # this process is stopping by itself
        print_own_line(f"{stop.line} (process {stop.process})")
        try:
            ch.put(f"{ACK_KEY}/{me}", True)
        except (channel.Exists, channel.StoreGone):  # the stopping process may be gone already
            pass
        _end(stop, me)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
