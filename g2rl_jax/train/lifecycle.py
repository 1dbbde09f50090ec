"""What keeps a run directory whole across starts, stops and relaunches (the run lock: control/runlock.py).

- `pin_revision`: a Hugging Face id's resolved commit in model.revision, kept by every resume.
- `config_changes`: the keys whose change alters what a resumed run computes (model, data, rollout, algorithm,
  optim, seeds), listed old -> new; the trainer refuses them unless run.allow_config_change=true.
- `append_history`: every start appends its resolved config to `<run>/config_history.jsonl`.
- `StopSignal`: SIGTERM (preemption) ends the run within run.preempt_grace_seconds: the step in progress is finished
  and checkpointed when its measured time fits the grace, else abandoned at once (the last checkpoint stands), the
  abandon announced on control/stop.py's one stop path so that every other process of the run ends with it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from g2rl_jax import storage
from g2rl_jax.config import RESOLVED_NAME, Config, ConfigError, load_config, to_dict
from g2rl_jax.control import stop
from g2rl_jax.control.exits import Exit

HISTORY_FILE = "config_history.jsonl"
# keys that change how or how long the run is carried out or what it reports, never what a step computes
FREE_KEYS = ("run.output_dir", "run.checkpoint_every", "run.keep_checkpoints", "run.eval_every",
             "run.allow_config_change", "run.compilation_cache_dir", "run.lock_lease_seconds", "data.eval_datasets",
             "data.eval_samples", "data.eval_temperature", "data.eval_max_new_tokens", "model.attention", "model.remat")
FREE_GROUPS = ("mesh.", "distributed.")


# ------------------------------------------------------------------------------------------------ config
def _flat(cfg: Config) -> dict[str, Any]:
    def walk(prefix: str, body: dict[str, Any]):
        for key, value in body.items():
            yield from walk(f"{prefix}.{key}", value) if isinstance(value, dict) else [(f"{prefix}.{key}", value)]

    return {key: value for group, body in to_dict(cfg).items() for key, value in walk(group, body)}


def _free(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    if key == "run.total_steps":  # the cosine schedule's length depends on it; a constant schedule does not
        return old["optim.min_lr_ratio"] == new["optim.min_lr_ratio"] == 1.0
    if key == "model.revision":  # a run from before revisions were recorded: the commit is unknown
        return old[key] == ""
    return key in FREE_KEYS or key.startswith(FREE_GROUPS)


def config_changes(old: Config, new: Config) -> list[str]:
    """'key: old -> new' for every key whose change alters what the run computes."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k] and not _free(k, a, b)]


def check_resume_config(cfg: Config, run_dir) -> None:
    """Refuse to resume a run whose config.yaml differs from `cfg` in keys that change what it computes."""
    if cfg.run.allow_config_change or not storage.is_file(run_dir / RESOLVED_NAME):
        return
    try:
        old = load_config(run_dir / RESOLVED_NAME)
    except ConfigError as err:
        raise ConfigError(f"run.output_dir: the run's {RESOLVED_NAME} cannot be read ({err}); pass "
                          "run.allow_config_change=true to resume under the new config anyway") from None
    changes = config_changes(old, cfg)
    if changes:
        raise ConfigError(f"run.output_dir: resuming {str(run_dir)!r} with a config that changes what the run "
                          f"computes ({'; '.join(changes)}); use the run's own config "
                          f"(--config {run_dir / RESOLVED_NAME}), choose a new run.output_dir, or pass "
                          "run.allow_config_change=true to continue with the change (it is logged in "
                          f"{HISTORY_FILE})")


def pin_revision(cfg: Config, run_dir, resuming: bool) -> Config:
    """`cfg` with model.revision set to a commit hash when model.path is a Hugging Face id: on a resume that names
    none, the commit the run's config.yaml recorded (a resume loads the same weights and tokenizer); else the commit
    that model.revision ("" = main) resolves to now. A different commit is then refused by check_resume_config."""
    from g2rl_jax.model.sources import hub_commit, is_hub_id

    if not is_hub_id(cfg.model.path):
        if cfg.model.revision:
            raise ConfigError(f"model.revision: {cfg.model.revision!r} is set, but model.path {cfg.model.path!r} is "
                              "not a Hugging Face id; set model.revision=\"\" or name the model by its hub id")
        return cfg
    revision = cfg.model.revision
    if not revision and resuming and storage.is_file(run_dir / RESOLVED_NAME):
        try:
            old = load_config(run_dir / RESOLVED_NAME)
        except ConfigError:
            old = None  # check_resume_config says so
        if old is not None and old.model.path == cfg.model.path:
            revision = old.model.revision
    commit = hub_commit(cfg.model.path, "model.path", revision)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, revision=commit))


def append_history(cfg: Config, run_dir, **facts: Any):
    """Append this start's resolved config (and `facts`: checkpoint found, rows kept, ...) to the history file."""
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(), "pid": os.getpid(),
              "argv": sys.argv, **facts, "config": to_dict(cfg)}
    path = storage.path(run_dir) / HISTORY_FILE
    storage.append_text(path, json.dumps(record) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ signals
SAVE_SHARE = 0.2  # the share of the grace kept for the checkpoint of a step finished after SIGTERM
STOP_LAST_S = 1.0  # the least an abandon gives the run's other processes to have its line


class Preempted(BaseException):
    """Raised where a stop request abandons work in progress (a validation).
    A BaseException, like KeyboardInterrupt, so that no `except Exception` turns it into an ordinary error."""


def step_fits(step_started: float | None, step_seconds: float | None, deadline: float, grace: float) -> bool:
    """Whether the step in progress, started at `step_started` (None: between steps) and expected to take
    `step_seconds` (the measured time of the last one, compiles excluded; None: none measured yet), ends before
    `deadline` with SAVE_SHARE of the grace left for its checkpoint."""
    if step_started is None:
        return True
    return step_seconds is not None and step_started + step_seconds <= deadline - SAVE_SHARE * grace


class StopSignal:
    """While active (the training loop), SIGTERM, e.g. a spot VM's preemption notice, ends the run within `grace`
    seconds. A watchdog thread wakes the moment the signal arrives (signal.set_wakeup_fd: even while the main thread
    waits on the accelerator) and decides with `step_fits`:
    - the step in progress fits the grace: `requested` is set, the loop stops after it and saves its checkpoint;
    - it does not (or no step has been timed yet): the step is abandoned at once: `on_abandon` (wait for a save in
      flight, release the run lock) and the process exits with Exit.PREEMPTED, the last checkpoint intact; in a run
      of several processes the others end with it and its line (stop.stop_everywhere).
    Either way the process exits at the deadline if it still runs then, and a second SIGTERM abandons at once.
    The loop reports its steps with `begin_step` and `end_step`."""

    def __init__(self, grace: float = 25.0, on_abandon=None):
        self.grace = grace
        self.requested = False
        self.step_started: float | None = None  # time.monotonic() at the start of the step in progress
        self.step_seconds: float | None = None  # the last step's wall time less its compiles
        self._on_abandon = on_abandon or (lambda: None)
        self._previous = None
        self._wakeup = self._pipe = None
        self._thread = None
        self._peers = stop.Watch()

    def begin_step(self) -> None:
        self.step_started = time.monotonic()

    def end_step(self) -> None:
        """The step begun last has ended; its wall time is the next step's estimate (see less_compiles)."""
        if self.step_started is not None:
            self.step_seconds = time.monotonic() - self.step_started
        self.step_started = None

    def less_compiles(self, compile_seconds: float) -> None:
        """Take what the last step spent compiling out of the estimate: a run compiles at its first step only."""
        if self.step_seconds is not None:
            self.step_seconds = max(self.step_seconds - compile_seconds, 0.0)

    def _handle(self, signum, frame):
        self.requested = True  # the watchdog decides the rest; without one (no wakeup fd) the step is finished

    def _exit(self, why: str, timeout: float) -> None:
        """Say why, run on_abandon for at most `timeout` seconds, and end the process (and the run's other
        processes, told within what is left of the grace, at least STOP_LAST_S)."""
        stop.print_own_line(why)
        ends = time.monotonic() + max(timeout, 0.0)
        helper = threading.Thread(target=self._on_abandon, daemon=True)
        helper.start()
        helper.join(max(timeout, 0.0))
        if helper.is_alive():  # the deadline came first: say so, the lock (a dead pid here) is taken over at once
            print(f"the {self.grace:g} s grace (run.preempt_grace_seconds) is over before the run lock could be "
                  "released; exiting now, the next launch takes the lock of this dead process over",
                  file=sys.stderr, flush=True)
        stop.stop_everywhere(why, Exit.PREEMPTED, say=False, within=max(ends - time.monotonic(), STOP_LAST_S))

    def _watch(self) -> None:
        deadline = None
        while True:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self._pipe[0]], [], [], wait)
            if not ready:  # the grace is over
                self._exit(f"SIGTERM: the {self.grace:g} s grace (run.preempt_grace_seconds) is over; exiting now, "
                           "the last complete checkpoint stands", timeout=2.0)
            data = os.read(self._pipe[0], 64)
            if not data or 0 in data:  # the loop ended: disarm
                return
            if signal.SIGTERM not in data:
                continue
            now = time.monotonic()
            if deadline is not None:
                self._exit("a second SIGTERM: the step in progress is abandoned, the last checkpoint stands",
                           timeout=deadline - now)
            deadline = now + self.grace
            self.requested = True
            started, seconds = self.step_started, self.step_seconds
            if step_fits(started, seconds, deadline, self.grace):
                left = "" if started is None else f", expected to end in {started + seconds - now:.1f} s"
                print(f"SIGTERM received: finishing the current step{left}, then saving a checkpoint and stopping "
                      f"(within the {self.grace:g} s grace; send SIGTERM again to stop at once)",
                      file=sys.stderr, flush=True)
                continue
            measured = "no step has been timed yet" if seconds is None else f"a step takes {seconds:.1f} s"
            self._exit(f"SIGTERM received: the step in progress would not end within the {self.grace:g} s grace "
                       f"({measured}); abandoning it, the last checkpoint stands", timeout=deadline - now)

    def __enter__(self) -> StopSignal:
        self._peers.__enter__()  # multi-host: another process that stops at once (control/stop.py) stops this one
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): no handler, nothing changes
            self._previous = None
            return self
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="sigterm-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._peers.__exit__()
        if self._previous is None:
            return
        signal.signal(signal.SIGTERM, self._previous)
        signal.set_wakeup_fd(self._wakeup)
        os.write(self._pipe[1], b"\0")  # the watchdog returns
        self._thread.join()
        for fd in self._pipe:
            os.close(fd)
        self._previous = self._pipe = self._thread = None
