"""The failures a run stops for, each a class raised where the failure happens, never chosen from an error's text.

    StorageUnavailable     75  a storage client gave up on a request (g2rl_jax/storage_clients.py's gcsfs client,
                               Orbax's save and restore in train/checkpoint.py, a bounded storage call)
    LeaseLost              3   another trainer holds the run's lease, or this one cannot know that it still does
                               (control/lease.py; a write the fence refused: control/fence.py)
    DeviceOutOfMemory      4   a program ran out of accelerator memory (`device_failure`, at the stage boundary
                               train/stages.py and the host collectives of g2rl_jax/parallel.py), with the planner's
                               hint (control/oom.py)
    RewardFunctionFailed   5   the user's reward.function raised, timed out or returned no number on a row
                               (g2rl_jax/rewards/custom.py)
    PeerLost               76  a process this one ran a collective with is gone (`device_failure`)
    BadInput               2   a value read from a file or another process that fails its checks (control/wire.py's
                               Refused: a planted pickle, another version's bytes; nothing in it ran), a checkpoint
                               that cannot be used (train/checkpoint.py's CheckpointError)

Each is a RunFailure: `code` is its exit code (control/exits.py, the one table) and `line(step)` its one line. The
trainer's top level (train/loop.py, train/command.py) prints that line without a traceback and exits with the code,
on every process of the run (control/stop.py's stop_everywhere); in a notebook it raises instead, so the kernel lives.
`exit_code(err)` is the one mapping from whatever ends the trainer to its exit code (train/command.py, and the code
the rollout processes of a split run end with, train/sides.py).
"""
from __future__ import annotations

import contextlib
import functools
import os

from g2rl_jax.control.exits import Exit


class RunFailure(Exception):
    """A failure classified where it was raised: `code` is what ends the process, `line` what it prints."""

    code: Exit = Exit.BUG

    def line(self, step: int | None = None) -> str:
        """The one line the process ends with (`step`: the last step finished, where the failure names it)."""
        return " ".join(str(self).split())


class StorageUnavailable(RunFailure):
    """A storage client gave up on `url` (its retries spent, its deadline passed, the endpoint gone): `cause` is the
    client's own error. `status` is the HTTP status of the last answer, when there was one (429, 503, ...)."""

    code = Exit.STORAGE

    def __init__(self, url, cause: BaseException, *, client: str = "gcsfs", verb: str = "write",
                 status: int | None = None):
        super().__init__(url, cause)
        self.url, self.cause, self.client, self.verb, self.status = str(url), cause, client, verb, status
        self._said: str | None = None

    def explained(self) -> str:
        """What failed and what to do (storage_clients.explain: a reachability probe, asked once)."""
        if self._said is None:
            from g2rl_jax import storage_clients

            self._said = storage_clients.explain(self.url, self.cause, self.client, self.verb)
        return self._said

    def __str__(self) -> str:
        return f"{self.client} could not {self.verb} {self.url}: {type(self.cause).__name__}: {self.cause}"

    def line(self, step: int | None = None, run_dir=None) -> str:
        after = "" if step is None else f" after step {step}"
        kept = "" if run_dir is None else (f" Kept: the checkpoints already committed in {run_dir}/checkpoints (a "
                                           "save in flight is discarded at the next start) and the metrics flushed "
                                           "before;")
        return (f"train error: run.output_dir: the storage failed{after}: {self.explained()}.{kept} run the same "
                "command again once the storage answers: it resumes from the newest committed checkpoint")


class LeaseLost(RunFailure):
    """This process no longer holds the run's lease (taken over, deleted), or cannot know that it does (no renewal
    confirmed in time, code 75 then): it writes nothing more. The message is the whole line."""

    code = Exit.LEASE_LOST

    def __init__(self, line: str, code: Exit = Exit.LEASE_LOST):
        super().__init__(line)
        self.code = code


class DeviceOutOfMemory(RunFailure):
    """A program of stage `where` could not allocate accelerator memory; `hint` is the planner's (control/oom.py),
    added by the trainer, which knows the config."""

    code = Exit.DEVICE_OOM

    def __init__(self, where: str, detail: str, hint: str = ""):
        super().__init__(where, detail)
        self.where, self.detail, self.hint = where, detail, hint

    def __str__(self) -> str:
        hint = f"; {self.hint}" if self.hint else ""
        return f"the device ran out of memory in {self.where} ({self.detail}){hint}"

    def line(self, step: int | None = None) -> str:
        return "train error: " + super().line(step)


class RewardFunctionFailed(RunFailure):
    """The user's reward function `function` failed on dataset row `row` (reward.on_error=raise): `what` says how
    (raised X: ..., timed out, returned a non-number)."""

    code = Exit.REWARD_FAILED

    def __init__(self, function: str, row, what: str, detail: str = ""):
        super().__init__(function, row, what)
        self.function, self.row, self.what, self.detail = function, row, what, detail

    def __str__(self) -> str:
        return (f"reward function {self.function!r} {self.what} on row {self.row!r}{self.detail}; fix the function, "
                "or set reward.on_error=fail to score such responses -1 (the least reward)")

    def line(self, step: int | None = None) -> str:
        return "train error: " + super().line(step)


class PeerLost(RunFailure):
    """A process this one ran a collective with is gone (`detail`: what the collective said)."""

    code = Exit.PEER_LOST

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail

    def line(self, step: int | None = None) -> str:
        after = "" if step is None else f" after step {step}"
        return (f"a process of this run is gone{after} ({self.detail}): it died (kill -9, a lost VM) or was ended. "
                "The checkpoints committed stand: end every process that still runs, and relaunch every process "
                "with the same command to resume from the newest")


class BadInput(RunFailure):
    """Input the run refuses, the message naming it and what to do: a value this version did not write, read from a
    file or from another process of the run (control/wire.py's Refused: nothing in it was run), a checkpoint that
    cannot be used (train/checkpoint.py's CheckpointError). `kind` starts its line."""

    code = Exit.BAD_INPUT
    kind = "run"

    def line(self, step: int | None = None) -> str:
        return f"{self.kind} error: " + super().line(step)


def exit_code(err: BaseException | None) -> Exit:
    """The exit code the trainer's process ends with when `err` ends it: DONE for None; a RunFailure's own code; a
    run directory whose store did not answer the start's check, the storage's; a setting, a dataset row or a path
    the trainer refuses (g2rl_jax/cli.py's USER_ERRORS), bad input; anything else a bug (its traceback)."""
    from g2rl_jax import cli
    from g2rl_jax.storage import StorageUnreachable

    if err is None:
        return Exit.DONE
    if isinstance(err, RunFailure):
        return err.code
    if isinstance(err, StorageUnreachable):
        return Exit.STORAGE
    return Exit.BAD_INPUT if isinstance(err, cli.USER_ERRORS) else Exit.BUG


# ------------------------------------------------------------------------------------------------ the device boundary
RESOURCE_EXHAUSTED = 8  # absl::StatusCode: what XLA's allocators answer when device memory runs out
UNAVAILABLE = 14  # absl::StatusCode: jax.distributed's coordination service (in the trainer's process) is gone
# gloo's TCP transport, when the process at the other end of a collective is gone: JAX passes this on only in the
# runtime's message (status UNKNOWN), as a JaxRuntimeError or, from a jitted call, a ValueError carrying that status
# (measured: a gloo AllGather whose peer was killed), so `device_failure` reads that one message, of the error the
# program or host collective raised itself, never an error it was wrapped in
_GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def device_failure(err: BaseException, where: str) -> RunFailure | None:
    """The typed failure of `err`, raised by a jitted program or a host collective of `where` (the call site itself:
    train/stages.py's `stage`, parallel.py's host collectives): DeviceOutOfMemory for the runtime's
    RESOURCE_EXHAUSTED status (its error code, never its text), PeerLost for a gloo connection to another process
    lost; None for anything else. A JaxRuntimeError built from Python (a user's reward function, a test) has status
    UNKNOWN whatever its text."""
    import jax

    runtime = isinstance(err, jax.errors.JaxRuntimeError)
    if not runtime and type(err) is not ValueError:
        return None
    message = str(err).strip()
    first = message.splitlines()[0] if message else ""
    if runtime and err.error_code == RESOURCE_EXHAUSTED:
        return DeviceOutOfMemory(where, first[:300])
    status = runtime or first.startswith("UNKNOWN: ")  # a ValueError only with the runtime's status in front
    if status and "Gloo" in first and any(said in first for said in _GLOO_PEER_GONE):  # the one text test (above)
        return PeerLost(first[first.index("Gloo"):])
    return None


@contextlib.contextmanager
def device_boundary(where: str):
    """Around code that runs programs on the devices: a runtime error raised in it (by the call, or, since JAX
    dispatches asynchronously, by the first use of its results) is typed here (`device_failure`); anything else
    passes as it is. The host collectives of g2rl_jax/parallel.py run in it; train/stages.py's `stage`, the training
    loop (what a step does outside its stages: metrics, the checkpoint's copy, the weight sync) and the rollout
    process (its draws) apply `device_failure` to what they catch the same way."""
    try:
        yield
    except RunFailure:
        raise
    except Exception as err:
        typed = device_failure(err, where)
        if typed is None:
            raise
        raise typed from err


def host_collective(fn):
    """The call site of a host collective (g2rl_jax/parallel.py's allgather, sync, broadcast): a peer process gone
    from it raises PeerLost here (`device_boundary`)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with device_boundary(f"the host collective {fn.__name__}"):
            return fn(*args, **kwargs)

    return call


class _OneLine:
    """A logging filter: the records `whose` picks (a client's report of a failure its caller gets typed and
    reports) keep their one line and lose their traceback."""

    def __init__(self, what: str, whose):
        self.what, self.whose = what, whose

    def filter(self, record) -> bool:
        if record.exc_info and self.whose(record):
            record.exc_info = record.exc_text = None
        return True


def one_line_records(logger: str, what: str, whose) -> None:
    """Once per process: `logger`'s records that `whose(record)` picks (`what` names them) lose their traceback (see
    _OneLine); the storage clients' (g2rl_jax/storage_paced.py) and Orbax's (control/commits.py)."""
    import logging

    log = logging.getLogger(logger)
    if not any(isinstance(f, _OneLine) and f.what == what for f in log.filters):
        log.addFilter(_OneLine(what, whose))


def end_run(err: RunFailure, step: int | None = None, run_dir=None, cfg=None) -> None:
    """End this process, and every other process of the run, with `err`'s line and code (control/stop.py's
    stop_everywhere); in a notebook's main thread re-raise it instead. Nothing of the run is written after this is
    called (control/fence.py closes first). A device out of memory gets the planner's hint for the run's `cfg`
    first."""
    import threading

    from g2rl_jax.control import fence
    from g2rl_jax.control import stop as stopping

    if isinstance(err, DeviceOutOfMemory) and not err.hint and cfg is not None:
        from g2rl_jax.config import RESOLVED_NAME
        from g2rl_jax.control import oom

        err.hint = oom.hint(cfg, f"{run_dir}/{RESOLVED_NAME}" if run_dir is not None else "CONFIG")

    line = err.line(step, run_dir) if isinstance(err, StorageUnavailable) else err.line(step)
    fence.close(line)
    if stopping.in_notebook() and threading.current_thread() is threading.main_thread():
        raise err
    if err.code not in (Exit.STORAGE, Exit.LEASE_LOST):  # the store answers and the lease is ours: let it go, so
        from g2rl_jax.control import runlock  # that the next start need not wait for it to lapse

        runlock.release_all()
    stopping.stop_everywhere(line, int(err.code), error=err)
    os._exit(int(err.code))  # not reached: stop_everywhere ends the process
