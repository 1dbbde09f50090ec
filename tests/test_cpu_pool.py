"""XLA:CPU's pool for fake CPU devices (g2rl_jax/__init__.py): two threads per device when the cores give fewer.

With one thread per device and no spare, the 8-device trainer of test_multihost.py hung in a collective-permute on a
busy 2-core machine (XLA's rendezvous: 6 of 8 threads arrived, the other 2 pool threads waiting for their device's
in-flight slot). The hang needs a loaded machine and minutes to show, so it is not a test; README "Tests" gives the
runs that measured it. Here: the sizes, and that each process, children included, gets its own.
"""
import os
import subprocess
import sys

import g2rl_jax
from g2rl_jax import CPU_POOL_MARK, _cpu_pool_threads


def test_two_threads_per_fake_device_when_the_cores_are_fewer():
    flag = "--xla_force_host_platform_device_count"
    assert _cpu_pool_threads(f"{flag}=8", cores=2) == 16
    assert _cpu_pool_threads(f"--xla_dump_to=x {flag}=4 --xla_cpu_enable_fast_math=false", cores=2) == 8
    assert _cpu_pool_threads(f"{flag}=8 {flag}=2", cores=2) == 4  # XLA reads the last one
    assert _cpu_pool_threads(f"{flag}=8", cores=16) is None  # XLA's default, one per core, is enough
    assert _cpu_pool_threads(f"{flag}=1", cores=1) is None
    assert _cpu_pool_threads("", cores=1) is None


def _pool_of(env: dict) -> tuple[str | None, str | None]:
    """PJRT_NPROC and its mark in a fresh process that imports g2rl_jax with `env`."""
    code = f"import os, g2rl_jax; print(os.environ.get('PJRT_NPROC'), os.environ.get({CPU_POOL_MARK!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return tuple(None if v == "None" else v for v in out.split())


def test_each_process_sizes_its_own_pool_and_a_users_value_wins():
    base = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", CPU_POOL_MARK)}
    eight = dict(base, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cores = len(os.sched_getaffinity(0))
    want = str(16) if cores < 16 else None
    assert _pool_of(eight) == (want, want)
    # a child of that process with one device (the value and the mark inherited) drops it
    assert _pool_of(dict(base, PJRT_NPROC="16", **{CPU_POOL_MARK: "16"}, XLA_FLAGS="")) == (None, None)
    # one with 4 devices sets its own
    four = "8" if cores < 8 else None
    assert _pool_of(dict(base, PJRT_NPROC="16", **{CPU_POOL_MARK: "16"},
                         XLA_FLAGS="--xla_force_host_platform_device_count=4")) == (four, four)
    # the user's value stays, even with the mark of another
    assert _pool_of(dict(eight, PJRT_NPROC="3")) == ("3", None)
    assert _pool_of(dict(eight, PJRT_NPROC="3", **{CPU_POOL_MARK: "16"})) == ("3", "16")


def test_the_suites_own_process_has_the_pool():
    """conftest.py gives pytest's process 8 fake devices and imports g2rl_jax before any backend starts."""
    assert g2rl_jax.__version__
    if len(os.sched_getaffinity(0)) < 16:
        assert os.environ.get("PJRT_NPROC") == "16"
