"""One of the two jax.distributed processes of tests/test_multihost_lease.py: process 0 holds the run lock of a
directory, as the trainer's process 0 does, and both run the training loop's frame (lifecycle.StopSignal) around a
loop of cross-process collectives, standing in for the steps.

    python tests/lease_multihost_worker.py COORDINATOR PROCESS_ID RUN_DIR
"""
import sys
import time

from g2rl_jax import parallel
from g2rl_jax.config import DistributedConfig

coordinator, process_id, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
parallel.initialize_distributed(DistributedConfig(coordinator_address=coordinator, num_processes=2,
                                                  process_id=process_id))
from jax.experimental import multihost_utils  # noqa: E402 - after jax.distributed

from g2rl_jax.control.runlock import RunLock  # noqa: E402
from g2rl_jax.train.lifecycle import StopSignal  # noqa: E402

if process_id == 0:
    RunLock(run_dir, lease_seconds=3.0).acquire()
with StopSignal(grace=5.0):
    multihost_utils.sync_global_devices("started")
    print("running", flush=True)
    while True:  # every step ends in collectives that need both processes
        multihost_utils.sync_global_devices("step")
        time.sleep(0.05)
