"""One of the two jax.distributed processes of tests/test_multihost_lease.py: process 0 holds the run lock of a
directory and process 1 follows it, as the trainer's processes do (RunLock.take), and both run the training loop's
frame (lifecycle.StopSignal) around a loop of cross-process collectives, standing in for the steps. With `write`,
process 1 also writes a new object under the run directory every 0.5 s from a thread, as its share of a checkpoint
would, and prints `refused CODE` once the fence refuses one.

    python tests/lease_multihost_worker.py COORDINATOR PROCESS_ID RUN_DIR [write]
"""
import sys
import threading
import time

from g2rl_jax import parallel
from g2rl_jax.config import DistributedConfig

coordinator, process_id, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
writes = sys.argv[4:] == ["write"]
parallel.initialize_distributed(DistributedConfig(coordinator_address=coordinator, num_processes=2,
                                                  process_id=process_id))
from jax.experimental import multihost_utils  # noqa: E402 - after jax.distributed

from g2rl_jax import storage  # noqa: E402
from g2rl_jax.control.errors import LeaseLost  # noqa: E402
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
    while True:  # every step ends in collectives that need both processes
        multihost_utils.sync_global_devices("step")
        time.sleep(0.05)
