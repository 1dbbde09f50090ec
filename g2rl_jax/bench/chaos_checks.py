"""What the chaos soak (bench/chaos.py) counts of a run it interrupted, against the same run uninterrupted:

- `compare(got, want)`: metrics.jsonl's lines (metrics.metric_lines), each a step's training record or its
  validation's: lost (a line of the uninterrupted run missing), doubled (a step's training or validation record
  more than once) and differing (a step whose deterministic figures or validation figures are not the
  uninterrupted run's);
- `event_counts(directory)`: the TensorBoard events of a run, (tag, step) -> how many times TensorBoard shows it:
  the event files read as TensorBoard reads them (by name, each whole; a writer's purge, `purge_step` on resume,
  drops what earlier events hold of that step and later), every record's checksums checked;
- `fenced_writes(log, run, lock)`: the writes a holder made after another launch took the run's lease, from the
  proxy's log (each update names its launch: GcsProxy's `who`).
"""
from __future__ import annotations

import struct
from collections import Counter

from g2rl_jax import storage

# the figures of a step that do not depend on timing (metrics.step_metrics), compared with the uninterrupted run's
DETERMINISTIC = ("accuracy", "reward", "loss", "kl", "entropy", "response_length", "novelty", "grad_norm",
                 "clip_fraction", "learning_rate")


def kind(line: dict) -> str:
    """'validation' for a step's validation record (val/... figures only), else 'training'."""
    figures = [k for k in line if k != "step"]
    return "validation" if figures and all(k.startswith("val/") for k in figures) else "training"


def line_counts(lines: list[dict]) -> Counter:
    """(step, kind) -> lines."""
    return Counter((line["step"], kind(line)) for line in lines)


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def compare(got: list[dict], want: list[dict]) -> dict[str, int]:
    """{'lost', 'doubled', 'differ'}: counts of metrics.jsonl lines `got` against the uninterrupted run's `want`."""
    have, need = line_counts(got), line_counts(want)
    merged = {}
    for line in got:
        merged.setdefault(line["step"], {}).update(line)
    differ = set()
    for line in want:
        mine = merged.get(line["step"], {})
        keys = [k for k in line if k in DETERMINISTIC or k.startswith("val/")]
        if any(k in mine and not _close(mine[k], line[k]) for k in keys):
            differ.add(line["step"])
    return {"lost": sum(1 for key in need if key not in have), "doubled": sum(n - 1 for n in have.values()),
            "differ": len(differ)}


def _records(data: bytes):
    """The records of a TFRecord stream (an events file); ValueError naming the offset of a damaged one."""
    from tensorboardX.record_writer import masked_crc32c

    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("Q", header)
        body = data[at + 12:at + 12 + length]
        if struct.unpack("I", data[at + 8:at + 12])[0] != masked_crc32c(header) or \
                struct.unpack("I", data[at + 12 + length:at + 16 + length])[0] != masked_crc32c(body):
            raise ValueError(f"a damaged record at byte {at}")
        yield body
        at += 16 + length


def event_counts(directory) -> Counter:
    """(tag, step) -> how many scalar events TensorBoard shows for it, from the events files under `directory`."""
    from tensorboardX.proto.event_pb2 import Event

    shown: list[tuple[str, int]] = []
    for name in storage.names(directory):
        if not name.startswith("events.out.tfevents."):
            continue
        for record in _records(storage.read_bytes(storage.path(directory) / name)):
            event = Event.FromString(record)
            if event.session_log.status == event.session_log.START:  # a resumed writer's purge_step
                shown = [(tag, step) for tag, step in shown if step < event.step]
            shown += [(value.tag, event.step) for value in event.summary.value]
    return Counter(shown)


def event_doubles(counts: Counter) -> int:
    return sum(n - 1 for n in counts.values() if n > 1)


WRITES = ("upload", "compose", "copy", "delete", "patch")  # storage_clients.UPDATES


def fenced_writes(log, run: str, lock: str) -> list:
    """The writes (applied updates) under run `run` ("bucket/dir") by a launch after another launch wrote the run's
    lock `lock` (its name under the run) following this launch's own first lock write: the first holder's writes
    once a second holder took the lease. Each update's launch is its Request.who (None: not a launch's)."""
    lock_obj = f"{run}/{lock}"
    took: dict = {}  # launch -> when it first wrote the lock
    fenced_at: dict = {}  # launch -> when another launch first wrote the lock after that
    for r in sorted((r for r in log if r.obj == lock_obj and r.kind == "upload" and 200 <= r.status < 300
                     and r.who is not None), key=lambda r: r.t):
        took.setdefault(r.who, r.t)
        for launch, since in took.items():
            if launch != r.who and since < r.t:
                fenced_at.setdefault(launch, r.t)
    return [r for r in log if r.kind in WRITES and 200 <= r.status < 300 and r.who in fenced_at
            and (r.obj or "").startswith(f"{run}/") and r.t > fenced_at[r.who]]
