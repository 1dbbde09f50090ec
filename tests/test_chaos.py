"""The chaos soak in small (`python -m g2rl_jax.bench chaos`, g2rl_jax/bench/chaos.py; the full soak runs by hand:
docs/running.md): one trainer process on a bucket of the GCS emulator meets a SIGSTOP past its 9 s lease (a new
launch on another host takes the run over, then the frozen one is thawed) and replies lost after the server applied
the update, one of them while a checkpoint is written; the soak relaunches as control/exits.py's table says (kill -9
mid-save and the relaunch as another host: tests/test_preemption.py, tests/test_gcs.py). No record is lost or doubled,
the metrics are the uninterrupted run's, the thawed holder wrote nothing and stopped by itself, and no fault needed a
human. Also the checks themselves, on made-up records and logs."""
import json
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

from g2rl_jax.bench import chaos_checks

from _helpers import HANG_S


def test_a_small_chaos_soak_loses_doubles_and_fences_nothing(tmp_path):
    cmd = [sys.executable, "-m", "g2rl_jax.bench", "chaos", "--layout", "one", "--faults", "2", "--during-save", "1",
           "--kinds", "stop,lost", "--steps", "2", "--eval-every", "2", "--lease", "9", "--window-s", "8"]
    done = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["faults"] == 2 and result["during_save"] >= 1, result
    assert set(result["by_kind"]) == {"lost", "stop"}, result
    assert all(result[k] == 0 for k in ("lost_records", "doubled_records", "metrics_differing", "fenced_out_writes",
                                        "human_steps")), done.stdout[-4000:]
    assert list(result["by_kind"]["stop"]) == ["thawed holder exited [3] by itself"], done.stdout[-4000:]


def test_the_checks_count_what_they_name():
    want = [{"step": 0, "val/d/mean@2": 0.5}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
            {"step": 2, "val/d/mean@2": 0.75}]
    assert chaos_checks.compare(want, want) == {"lost": 0, "doubled": 0, "differ": 0}
    got = [want[0], want[1], {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.5}]  # 1 twice, 2 off, 2's val lost
    assert chaos_checks.compare(got, want) == {"lost": 1, "doubled": 1, "differ": 1}
    assert chaos_checks.event_doubles(Counter({("loss", 1): 2, ("loss", 2): 1})) == 1

    def request(who, obj, t, kind="upload", status=200):
        return SimpleNamespace(who=who, obj=f"b/run/{obj}", t=t, kind=kind, status=status)

    log = [request(1, "run.lock", 0), request(1, "metrics.jsonl", 1, "compose"), request(2, "run.lock", 5),
           request(1, "run.lock", 6, status=412), request(1, "metrics.jsonl", 7, "compose"),  # after the takeover
           request(2, "metrics.jsonl", 8), request(1, "checkpoints/3/x", 9, status=412)]  # refused: not a write
    assert chaos_checks.fenced_writes(log, "b/run", "run.lock") == [log[4]]
