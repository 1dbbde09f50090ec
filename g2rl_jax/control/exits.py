"""The exit codes of every g2rl_jax process, and what a supervisor does with each: the one table of them.

Standard library only and importable by file path, so that a launcher that has no project installed
(launch/tpu_watch.py, launch/gpu.sh) reads the same table as the trainer that wrote the code.

    from g2rl_jax.control.exits import Exit, action
    action(Exit.STORAGE)     # 'relaunch-backoff'

A code is chosen where the failure is raised (a typed error, g2rl_jax/control), never from an error's text.
"""
from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """What ended the process."""

    DONE = 0            # the run finished (run.total_steps); or a command did what it was asked
    BUG = 1             # an error nobody anticipated: the traceback is in the log
    BAD_INPUT = 2       # a config, a dataset row, a path, a flag: one line says what to fix
    LEASE_LOST = 3      # another trainer holds the run's lease now; this one wrote nothing after losing it
    DEVICE_OOM = 4      # the accelerator ran out of memory; the line gives the planner's hint
    REWARD_FAILED = 5   # the user's reward function (reward.function) raised; the line names it and the row
    STORAGE = 75        # EX_TEMPFAIL (sysexits.h): the storage did not answer; the same command later resumes
    PEER_LOST = 76      # EX_PROTOCOL (sysexits.h): another process of the run is gone; relaunch every process
    PREEMPTED = 143     # 128 + SIGTERM: the machine is being taken away; relaunch when it is back


RELAUNCH = "relaunch"                  # at once (the cause is gone with the process or the machine)
RELAUNCH_BACKOFF = "relaunch-backoff"  # after a growing wait (the cause may still be there)
STOP = "stop"                          # relaunching cannot help: stop and say why in one line
FINISHED = "finished"                  # the run is complete

ACTIONS = {
    Exit.DONE: FINISHED,
    Exit.BUG: STOP,
    Exit.BAD_INPUT: STOP,
    Exit.LEASE_LOST: STOP,
    Exit.DEVICE_OOM: STOP,
    Exit.REWARD_FAILED: STOP,
    Exit.STORAGE: RELAUNCH_BACKOFF,
    Exit.PEER_LOST: RELAUNCH,
    Exit.PREEMPTED: RELAUNCH,
}
KILLED = 137  # 128 + SIGKILL: no code of ours (the kernel's OOM killer, a kill -9, a VM gone): relaunch with backoff


def action(code: int) -> str:
    """What a supervisor does after a process ended with `code`: RELAUNCH, RELAUNCH_BACKOFF, STOP or FINISHED. A
    code outside the table (a signal, a crash in native code) is relaunched with backoff, up to the supervisor's
    limit."""
    try:
        return ACTIONS[Exit(code)]
    except ValueError:
        return RELAUNCH_BACKOFF
