"""What `watch` (launch/tpu_watch.py) decides from: the queued resource's states (TABLE's rows), the trainer's
states as its workers report them (TABLE's columns, `trainer_state`), and the action for each pair (TABLE, printed
in docs/tpu_vm.md by `table_markdown`).

A trainer's exit code is read through the run-control table, g2rl_jax/control/exits.py, loaded by its path relative
to this file: the launcher runs with python3 and gcloud only, without the project installed, and the table has one
home. Standard library only, like tpu.py.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path


def _load_exits():
    """g2rl_jax/control/exits.py of this checkout, by its path (stdlib only, so no project install is needed)."""
    path = Path(__file__).resolve().parents[1] / "g2rl_jax" / "control" / "exits.py"
    spec = importlib.util.spec_from_file_location("g2rl_jax_exits", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


exits = _load_exits()

ACTIVE = "ACTIVE"
GONE = "NOT_FOUND"  # describe failed with NOT_FOUND: deleted, or never created
# the queued resource's states (gcloud's names) -> TABLE's rows; any other answer (gcloud failed) is "unknown"
ROW_OF = {GONE: "gone", "ACCEPTED": "waiting", "WAITING_FOR_RESOURCES": "waiting", "PROVISIONING": "waiting",
          "CREATING": "waiting", ACTIVE: "active", "SUSPENDING": "stopping", "DELETING": "stopping",
          "SUSPENDED": "preempted", "FAILED": "preempted"}
ROWS = {"gone": "NOT_FOUND", "waiting": "ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, CREATING", "active": "ACTIVE",
        "stopping": "SUSPENDING, DELETING", "preempted": "SUSPENDED, FAILED", "unknown": "no answer (gcloud failed)"}
# the trainer's states, as the workers report them (`trainer_state`)
COLUMNS = {"unread": "not readable", "bare": "never started, no setup", "ready": "never started, set up",
           "running": "running", "finished": "exited 0", "stopped": "exited 1-5", "ended": "exited 76, 143",
           "failed": "exited 75, 137, other; or gone without a code"}
COLUMN_OF = {exits.FINISHED: "finished", exits.STOP: "stopped", exits.RELAUNCH: "ended",
             exits.RELAUNCH_BACKOFF: "failed"}  # an exit code's action -> its column
# what each row does whatever the trainer (it cannot be read unless the VM is ACTIVE), and ACTIVE's per column
ROW_ACTION = {"gone": "create", "waiting": "wait", "stopping": "wait", "preempted": "recreate", "unknown": "wait"}
ACTIVE_ACTION = {"unread": "wait", "bare": "setup", "ready": "train", "running": "watch", "finished": "finish",
                 "stopped": "stop", "ended": "relaunch", "failed": "relaunch-backoff"}
TABLE = {(row, col): ACTIVE_ACTION[col] if row == "active" else ROW_ACTION[row] for row in ROWS for col in COLUMNS}
SAY_ACTION = {"create": "create", "wait": "wait", "recreate": "delete, create", "setup": "setup, train",
              "train": "train", "watch": "watch", "finish": "end: done", "stop": "end: stop",
              "relaunch": "train", "relaunch-backoff": "train after a backoff"}
PRIORITY = (exits.STOP, exits.RELAUNCH_BACKOFF, exits.RELAUNCH, exits.FINISHED)  # which worker's code speaks


def table_markdown() -> str:
    """TABLE as docs/tpu_vm.md prints it."""
    head = "| queued resource \\ trainer | " + " | ".join(COLUMNS.values()) + " |\n"
    rule = "|---" * (len(COLUMNS) + 1) + "|\n"
    body = "".join(f"| {ROWS[row]} | " + " | ".join(SAY_ACTION[TABLE[row, col]] for col in COLUMNS) + " |\n"
                   for row in ROWS)
    return head + rule + body


# ----------------------------------------------------------------------------------------------- the trainer
@dataclasses.dataclass(frozen=True)
class Trainer:
    """The trainer's state on the slice: its column in TABLE, the exit code that decided it (None unless it
    exited), each worker's report (`{worker: (set up, state)}`, state never / running / exited:N / lost) and the
    exited workers' codes while others still run (a straggling slice)."""

    column: str
    code: int | None = None
    workers: tuple = ()
    straggling: tuple = ()


def worker_reports(text: str) -> dict[int, tuple[bool, str]]:
    """{worker: (set up, state)} from the probe's lines, `g2rl-worker ID setup=ok|none trainer=STATE`."""
    reports = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 4 and words[0] == "g2rl-worker" and words[1].isdigit():
            reports[int(words[1])] = (words[2] == "setup=ok", words[3].removeprefix("trainer="))
    return reports


def worker_code(state: str) -> int | None:
    """A worker's exit code: its exit file's, KILLED for a trainer gone without one; None while it runs."""
    if state.startswith("exited:"):
        code = state.removeprefix("exited:")
        return int(code) if code.lstrip("-").isdigit() else exits.KILLED
    return None if state == "running" else exits.KILLED  # lost, or never started beside workers that did


def deciding_code(codes: list[int]) -> int:
    """Of the workers' exit codes, the one whose action comes first in PRIORITY (a stop over a relaunch: the process
    that failed speaks, not the peers that stopped with it), the first such worker's."""
    return min(codes, key=lambda code: PRIORITY.index(exits.action(code)))


def trainer_state(text: str | None) -> Trainer:
    """The slice's trainer from the probe's output (None: the workers could not be read)."""
    reports = worker_reports(text or "")
    if not reports:
        return Trainer("unread")
    workers = tuple(sorted(reports.items()))
    states = [state for _, (_, state) in workers]
    if all(state == "never" for state in states):
        return Trainer("ready" if all(ok for _, (ok, _) in workers) else "bare", workers=workers)
    codes = [worker_code(state) for state in states if state != "running"]
    if "running" in states:
        return Trainer("running", workers=workers, straggling=tuple(codes))
    code = deciding_code(codes)
    return Trainer(COLUMN_OF[exits.action(code)], code, workers)


def exit_summary(trainer: Trainer) -> str:
    """`exit 4 (worker 0); exit 76 (workers 1, 2, 3)`: what each worker's trainer did, grouped."""
    groups: dict[str, list[int]] = {}
    for worker, (_, state) in trainer.workers:
        what = {"never": "never started", "running": "running", "lost": "gone without an exit code"}.get(
            state, state.replace("exited:", "exit "))
        groups.setdefault(what, []).append(worker)
    return "; ".join(f"{what} (worker{'s' if len(ws) > 1 else ''} {', '.join(map(str, ws))})"
                     for what, ws in groups.items())


ADVICE = {  # what to do about a code relaunching cannot help (exits.STOP), after the trainer's own line
    exits.Exit.BUG: "an unanticipated error: its traceback is in the worker's log",
    exits.Exit.BAD_INPUT: "bad input (a config key, a dataset row, a path): fix what the line names",
    exits.Exit.LEASE_LOST: "another trainer holds the run's lease: stop it, or give this run another run.output_dir",
    exits.Exit.DEVICE_OOM: "the accelerator ran out of memory: follow the planner's hint in the line, or use a "
                           "larger slice",
    exits.Exit.REWARD_FAILED: "the reward function (reward.function) raised: fix it (the line names it and the row)",
}
