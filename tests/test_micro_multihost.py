"""Length-grouped micro-batches across processes: two processes joined by jax.distributed (tests/
micro_multihost_worker.py) score a long-tailed batch and accumulate the update's gradients over uneven micro-batches
on the 8-device mesh; the log-probs, entropy, Φ, reference log-probs, loss and gradients equal one unpacked pass
over the whole padded batch in this process (float32, <= 1e-6 relative), for every algorithm.loss_agg. (Not a
trainer run: no warm-up, so no strict mode; tests/test_multihost.py runs the trainer strict on two processes.)"""
import pathlib
import sys

import jax
import numpy as np
from flax import nnx
from test_micro import AGGS, CFG, RT, _long_tailed_batch, _rel, unpacked_pass

from g2rl_jax.model import Qwen3

from _helpers import run_processes

WORKER = pathlib.Path(__file__).resolve().parent / "micro_multihost_worker.py"


def test_two_processes_equal_one_unpacked_pass(tmp_path):
    out = tmp_path / "two.npz"
    run_processes(lambda i, port: [sys.executable, str(WORKER), str(i), str(port), str(out)], timeout=300)
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
