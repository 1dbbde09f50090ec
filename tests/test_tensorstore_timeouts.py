"""tensorstore (Orbax's checkpoint writer) against an endpoint that cannot serve: a write and a read through the
context Orbax builds, after storage_clients.configure(), each fail within $G2RL_JAX_STORAGE_TIMEOUT seconds for a
closed port, a server that accepts connections and never answers, and one whose connections are never made (its
accept queue full, so the kernel drops the handshake: libcurl's connect timeout, not its stall limit, ends those).
Each endpoint in a fresh process, since tensorstore reads its address and libcurl limits once per process."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

TIMEOUT_S = 15  # G2RL_JAX_STORAGE_TIMEOUT for these processes

PROBE = """
import json, sys, time
from g2rl_jax import storage_clients
storage_clients.configure()
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils
context = tensorstore_utils.get_ts_context(use_ocdbt=True)  # the context Orbax's savers and restorers get
store = ts.KvStore.open({"driver": "gcs", "bucket": "g2rl-timeouts"}, context=context).result()
out = {"retries": context["gcs_request_retries"].to_json()}
calls = (("write", lambda: store.write("probe", b"ok").result()), ("read", lambda: store.read("probe").result()))
for op, call in calls:
    t0 = time.monotonic()
    try:
        call()
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    out[op] = [time.monotonic() - t0, error]
print(json.dumps(out))
"""


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1], []


def _silent_server():
    """Accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s.getsockname()[1], [s]


def _full_accept_queue():
    """A listener whose accept queue is full: the kernel drops further handshakes, so a connect never completes."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", s.getsockname()[1]))
        except BlockingIOError:
            pass
        fillers.append(c)
    time.sleep(0.3)
    return s.getsockname()[1], [s, *fillers]


@pytest.fixture(scope="module")
def probes():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs, held = {}, []
    try:
        for name, make in (("closed port", _closed_port), ("never answers", _silent_server),
                           ("connection never made", _full_accept_queue)):
            port, sockets = make()
            held += sockets
            env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_", "STORAGE_EMULATOR"))}
            env.update(TENSORSTORE_GCS_HTTP_URL=f"http://127.0.0.1:{port}", GOOGLE_AUTH_TOKEN_FOR_TESTING="test",
                       G2RL_JAX_STORAGE_TIMEOUT=str(TIMEOUT_S), JAX_PLATFORMS="cpu",
                       PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
            procs[name] = subprocess.Popen([sys.executable, "-c", PROBE], env=env, cwd=root, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        results = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            results[name] = json.loads(out.strip().splitlines()[-1])
        return results
    finally:
        for proc in procs.values():
            proc.kill()
        for s in held:
            s.close()


@pytest.mark.parametrize("endpoint", ["closed port", "never answers", "connection never made"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_tensorstore_fails_within_the_storage_timeout(probes, endpoint, op):
    seconds, error = probes[endpoint][op]
    assert error is not None, f"{op} to an endpoint that cannot serve succeeded"
    assert seconds < TIMEOUT_S, (endpoint, op, seconds, error)


def test_orbax_contexts_carry_the_budgeted_retries(probes):
    """The retries in Orbax's context are storage_clients.tensorstore_retries() at that timeout, and fit it."""
    from g2rl_jax import storage_clients

    os.environ["G2RL_JAX_STORAGE_TIMEOUT"] = str(TIMEOUT_S)
    try:
        want = storage_clients.tensorstore_retries()
    finally:
        del os.environ["G2RL_JAX_STORAGE_TIMEOUT"]
    assert probes["closed port"]["retries"]["max_retries"] == want["max_retries"] == 1
