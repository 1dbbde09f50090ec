"""One of the two jax.distributed processes of tests/test_multihost_lease.py: process 0 holds the run lock of a
directory and process 1 follows it, as the trainer's processes do (RunLock.take), and both run the training loop's
frame (lifecycle.StopSignal) around a loop of cross-process collectives, standing in for the steps. With `write`,
process 1 also writes a new object under the run directory every 0.5 s from a thread, as its share of a checkpoint
would, and prints `refused CODE` once the fence refuses one. With `end`, process 0's main thread ends as the
trainer's does once its steps are done (train/command.py): it waits for its last save (here: until a stop is
decided), makes its last write (refused once the fence is closed), then `await_stop`, then prints `done` and exits 0.

    python tests/lease_multihost_worker.py COORDINATOR PROCESS_ID RUN_DIR [write|end]
"""
import sys
import threading
import time

from g2rl_jax import parallel
from g2rl_jax.config import DistributedConfig

coordinator, process_id, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
writes, ends = sys.argv[4:] == ["write"], sys.argv[4:] == ["end"]
parallel.initialize_distributed(DistributedConfig(coordinator_address=coordinator, num_processes=2,
                                                  process_id=process_id))
from jax.experimental import multihost_utils  # noqa: E402 - after jax.distributed

from g2rl_jax import storage  # noqa: E402
from g2rl_jax.control import fence, stop  # noqa: E402
from g2rl_jax.control.errors import LeaseLost, RunFailure  # noqa: E402
from g2rl_jax.control.runlock import RunLock  # noqa: E402
from g2rl_jax.train.lifecycle import StopSignal  # noqa: E402


def write_forever():
    n = 0
    while True:
        try:
            storage.write_text(f"{run_dir}/p{process_id}/{n}.txt", f"{n}\n")
        except LeaseLost as err:
            print(f"refused {int(err.code)}", flush=True)
            return
        print(f"wrote {n}", flush=True)
        n += 1
        time.sleep(0.5)  # the test freezes the processes right after a write: in this sleep


RunLock(run_dir, lease_seconds=3.0).take(process_id)
with StopSignal(grace=5.0):
    multihost_utils.sync_global_devices("started")
    print("running", flush=True)
    if writes and process_id == 1:
        threading.Thread(target=write_forever, daemon=True).start()
    if ends and process_id == 0:  # the steps are done; the last save is in flight
        while not fence.closed():
            time.sleep(0.01)
        try:
            storage.write_text(f"{run_dir}/summary.json", "{}")
        except RunFailure:
            pass  # a failure is being reported already (the trainer's _close_run)
        stop.await_stop()
        print("done", flush=True)
        sys.exit(0)
    while True:  # every step ends in collectives that need both processes
        multihost_utils.sync_global_devices("step")
        time.sleep(0.05)
