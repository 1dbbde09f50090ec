"""The chaos soak's launches (bench/chaos.py): a run's processes started as their own hosts, signalled, and watched
through the proxy's log.

- `Layout`: the processes of one launch: "one" (one trainer), "two" (two trainer processes joined by
  jax.distributed, gloo on CPU), "sides" (a trainer and a rollout process: mesh.rollout_processes=1,
  rollout.max_staleness=1; docs/async.md); one fake CPU device each.
- `Launch`: a launch's processes, each as host vm-<launch>-<process> (`unshare -u -m -p`, where it works: its own
  hostname, resolvable in its own /etc/hosts, which gloo needs, and its own PID namespace, so a later launch judges
  it as one on another machine and waits out its lease) in a session of its own (a kill -9 or a SIGSTOP reaches its
  children too), its log, its exit codes (a signal as 128 + signal).
- `Saves`: the checkpoint steps written and committed under a run, from the proxy's log as it grows (on GCS a
  launch writes a step into `<step>.orbax-checkpoint-tmp-<launch>/` and its commit copies it to `<step>/`,
  commit_success.txt last: control/commits.py), costing no request.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from g2rl_jax import localhost

ROOT = str(Path(__file__).resolve().parents[2])
LAYOUTS = ("one", "two", "sides")
# the trainer, printing the traceback of an error it reports in one line (a soak that finds one should say where)
TRAIN = ("import sys, traceback\nimport g2rl_jax.cli as cli\none_line = cli.fail\n"
         "def fail(command, err):\n    traceback.print_exception(err)\n    return one_line(command, err)\n"
         "cli.fail = fail\nfrom g2rl_jax.train.command import main\nsys.exit(main(sys.argv[1:]))\n")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...]  # the run's config (demo.yaml and these)

    @property
    def processes(self) -> int:
        return 1 if self.name == "one" else 2

    def command(self, process: int, port: int) -> list[str]:
        distributed = [] if self.name == "one" else localhost.distributed_args(
            process, port, 2, transfers=self.name == "sides")
        return [sys.executable, "-c", TRAIN, "--config", os.path.join(ROOT, "configs", "demo.yaml"), *self.overrides,
                *distributed]


def layout(name: str, overrides: list[str]) -> Layout:
    joined = [f"distributed.join_timeout_seconds={JOIN_S}"]
    extra = {"one": [], "two": joined,
             "sides": [*joined, "mesh.rollout_processes=1", "rollout.max_staleness=1", "algorithm.rollout_is_cap=2.0",
                       "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]}[name]
    return Layout(name, (*overrides, *extra))


# a process killed before its peers joined jax.distributed: they abort (134) after this, within the soak's bound on a
# launch whose other processes still run (chaos.PEER_S); the default, 300 s, is JAX's
JOIN_S = 60
PID_NAMESPACE = ["-p", "-f", "--mount-proc", "--kill-child"]  # a PID namespace of its own, as on another machine


def unshare_prefix() -> list[str] | None:
    """The command prefix that gives a process its own hostname, mounts and PID namespace (`unshare -u -m -p`, as
    root or in a user namespace; without the PID namespace where that fails); None where none works. In its own PID
    namespace a holder's pid means nothing to a later launch (control/holder.py's judge: "unknown"), so a takeover
    waits out the lease as one on another machine does, whether the holder was killed or frozen."""
    for prefix in (["unshare", "-u", "-m", *PID_NAMESPACE], ["unshare", "-r", "-u", "-m", *PID_NAMESPACE],
                   ["unshare", "-u", "-m"], ["unshare", "-r", "-u", "-m"]):
        try:
            if subprocess.run([*prefix, "sh", "-c", "mount --bind /etc/hosts /etc/hosts && hostname vm-x"],
                              capture_output=True).returncode == 0:
                return prefix
        except FileNotFoundError:
            return None
    return None


def as_host(prefix: list[str] | None, host: str, cmd: list[str], hosts: Path) -> list[str]:
    """`cmd` as host `host`: its hostname, and an /etc/hosts of its own (the file `hosts`, written here) that
    resolves it to loopback."""
    if not prefix:
        return cmd
    hosts.write_text(f"127.0.0.1 localhost {host}\n::1 localhost\n")
    # not exec: in a PID namespace of its own the shell is its init (pid 1) and the trainer its child, as on a
    # machine; an init ignores the signals it raises itself, so a trainer as pid 1 that aborts dies of SIGSEGV
    return [*prefix, "sh", "-c", f'mount --bind {hosts} /etc/hosts && hostname {host} && "$@"', "sh", *cmd]


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: a signal as 128 + its number."""
    return 128 - returncode if returncode < 0 else returncode


class Launch:
    """One launch of a layout's processes on run directory `out`."""

    def __init__(self, number: int, layout: Layout, out: str, env: dict, logs: Path, prefix: list[str] | None):
        self.number, self.out, self.started = number, out, time.monotonic()
        port = localhost.free_port()
        self.logs = [logs / f"launch{number}.{i}.log" for i in range(layout.processes)]
        self.procs = []
        for i, log in enumerate(self.logs):
            with open(log, "w") as fh:
                host = f"vm-{number}-{i}"
                cmd = as_host(prefix, host, [*layout.command(i, port), f"run.output_dir={out}"], logs / f"{host}.hosts")
                self.procs.append(subprocess.Popen(cmd, env=localhost.cpu_env(1, env), stdout=fh,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        self.frozen_at = self.thawed_at = None
        self.faults: list = []  # the faults that hit this launch (chaos.Fault)
        self.victim: int | None = None  # the process a kill fault ended
        self.ended_at: float | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def signal(self, sig: int, which: list[int] | None = None) -> None:
        for i in range(len(self.procs)) if which is None else which:
            try:
                os.killpg(self.procs[i].pid, sig)
            except ProcessLookupError:
                pass

    def codes(self) -> list[int | None]:
        return [None if p.poll() is None else exit_code(p.returncode) for p in self.procs]

    def ended(self) -> bool:
        if self.ended_at is None and all(c is not None for c in self.codes()):
            self.ended_at = time.monotonic()
        return self.ended_at is not None

    def some_ended_since(self) -> float | None:
        """When the first of its processes was seen ended while others run (None: all run, or all ended)."""
        codes = self.codes()
        if any(c is None for c in codes) and any(c is not None for c in codes):
            self._partial = getattr(self, "_partial", None) or time.monotonic()
            return self._partial
        return None

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.ended()

    def log(self, i: int = 0) -> str:
        return self.logs[i].read_text(errors="replace")


class Saves:
    """The checkpoint steps written and committed under run `out` (a gs:// URL), from the proxy's log."""

    def __init__(self, proxy, out: str):
        self.proxy, self.prefix, self.at = proxy, out.removeprefix("gs://") + "/checkpoints/", 0
        self.written: dict[int, float] = {}  # step -> when its directory was last written to
        self.committed: set[int] = set()

    def update(self) -> None:
        log = self.proxy.log
        end = len(log)
        for r in log[self.at:end]:
            if r.kind in ("upload", "compose", "copy") and 200 <= r.status < 300 and (r.obj or "").startswith(
                    self.prefix):
                parts = r.obj[len(self.prefix):].split("/")
                step = parts[0].split(".")[0]  # <step>/, or a launch's <step>.orbax-checkpoint-tmp-<launch>/
                if step.isdigit() and len(parts) > 1:
                    self.written[int(step)] = r.t
                    if parts[0] == step and parts[1:] == ["commit_success.txt"]:
                        self.committed.add(int(step))
        self.at = end

    def saving(self, since: float) -> bool:
        """A checkpoint save under way: a step's directory written to after `since` (a launch's start), its
        commit_success.txt not yet."""
        self.update()
        return any(t >= since and step not in self.committed for step, t in self.written.items())

    def newest(self) -> int:
        self.update()
        return max(self.committed, default=0)
