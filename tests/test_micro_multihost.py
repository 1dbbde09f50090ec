"""Length-grouped micro-batches across processes: two processes joined by jax.distributed (tests/
micro_multihost_worker.py) score a long-tailed batch and accumulate the update's gradients over uneven micro-batches
on the 8-device mesh; the log-probs, entropy, Φ, reference log-probs, loss and gradients equal one unpacked pass
over the whole padded batch in this process (float32, <= 1e-6 relative), for every algorithm.loss_agg."""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
from flax import nnx
from test_micro import AGGS, CFG, RT, _long_tailed_batch, _rel, unpacked_pass

from g2rl_jax.model import Qwen3

from _helpers import xla_flags

HERE = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_unpacked_pass(tmp_path):
    out, port = tmp_path / "two.npz", _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, str(HERE / "micro_multihost_worker.py"), str(i), str(port), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-4000:]}"
    got = dict(np.load(out))
    assert got["update_rows"].tolist() == [4, 4]  # 2 micro-batches of micro/2 (the mesh's 4 row shards): cut by length

    graphdef, params = nnx.split(Qwen3(CFG, RT, rngs=nnx.Rngs(0)))
    want = unpacked_pass(graphdef, params, _long_tailed_batch(0), old_logp_BxT=got["logp"])
    real = np.asarray(want["batch"].response_mask) > 0
    for name, w in zip(("logp", "entropy"), want["scores"][:2]):
        np.testing.assert_allclose(got[name][real], np.asarray(w)[real], rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["ref"][real], np.asarray(want["ref"])[real], rtol=1e-6, atol=1e-6)
    assert _rel(got["phi"], want["scores"][2]) <= 1e-6
    for agg in AGGS:
        (loss0, _), grads0 = want["grads"][agg]
        assert abs(float(got[f"{agg}/loss"]) / float(loss0) - 1) <= 1e-6, agg
        leaves0 = jax.tree.leaves(grads0)
        assert _rel([got[f"{agg}/grad{i}"] for i in range(len(leaves0))], leaves0) <= 1e-6, agg
