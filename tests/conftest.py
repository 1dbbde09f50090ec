"""Test set-up: JAX on CPU with 8 fake devices, so sharded code runs on a (data, fsdp, tensor) mesh.

XLA:CPU runs each fake device's share of a program on its own thread and ends the process (SIGABRT, "Fatal Python
error: Aborted") when a collective's 8 threads do not all arrive within
--xla_cpu_collective_call_terminate_timeout_seconds (40 s by default). On a 2-core machine shared with other jobs a
thread can be starved that long: one CI run aborted so in test_train.py. The tests allow 10 minutes.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_cpu_collective_call_terminate_timeout_seconds=600"):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
