"""Who holds a lease: a process named by its host, its machine's boot id, its PID namespace, its pid and its start
time. Two records with the same five are the same process; a record with this process's five is its own.

A pid says something only to a process that shares its machine's boot and its PID namespace (containers on one host
share the hostname with host networking, and each has its own PID namespace): `judge` then tells a holder that is
gone (no such pid, or a pid reused by a later process: another start time) from one that runs; anyone else can only
watch its lease (control/lease.py).
"""
from __future__ import annotations

import functools
import os
import socket

KEYS = ("host", "boot", "pidns", "pid", "start")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), None if there is none
    (or no /proc)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: count from the last ')'
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


@functools.cache
def me() -> dict:
    """This process's identity (computed once; a forked child has its own pid, so its own record: `mine()`)."""
    return _identity(os.getpid())


def _identity(pid: int) -> dict:
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": _pid_namespace(), "pid": pid, "start": start_time(pid)}


def mine() -> dict:
    """This process's identity: host, boot id, PID namespace, pid and start time."""
    return me() if me()["pid"] == os.getpid() else _identity(os.getpid())


def of(record: dict) -> dict:
    """The identity part of a lease record (missing keys None: a record written before they existed)."""
    return {key: record.get(key) for key in KEYS}


def is_mine(record: dict) -> bool:
    """Whether `record` names this very process (all five keys equal)."""
    return of(record) == mine()


def judge(record: dict) -> str:
    """"gone" when the holder named by `record` shares this machine's boot and PID namespace and its process is not
    running (no such pid, or that pid now belongs to a process started at another time); "running" when it also
    shares this host's name and its process runs (alive, or frozen: only its lease tells which); "unknown" otherwise
    (another machine, another container, a process in another UTS namespace, an old record)."""
    here = mine()
    same_place = record.get("boot") and record.get("boot") == here["boot"] and \
        record.get("pidns") and record.get("pidns") == here["pidns"]
    pid = record.get("pid")
    if not same_place or not isinstance(pid, int):
        return "unknown"
    started = start_time(pid)
    if started is None or started != record.get("start"):
        return "gone"
    return "running" if record.get("host") == here["host"] else "unknown"


def describe(record: dict) -> str:
    """`pid P on host 'H'` (and the container's PID namespace when it is not this process's)."""
    ns = record.get("pidns")
    other_ns = f", PID namespace {ns}" if ns and ns != mine()["pidns"] else ""
    return f"pid {record.get('pid')} on host {record.get('host')!r}{other_ns}"
