"""One of two processes of tests/test_micro_multihost.py: jax.distributed over localhost (CPU, gloo), 4 fake devices
each, the (data 2, fsdp 2, tensor 2) mesh over the 8 global devices. Scores test_micro's long-tailed batch and
accumulates the update's gradients over length-grouped micro-batches; process 0 writes what it gathered to an .npz.

    python tests/micro_multihost_worker.py PROCESS_ID PORT OUT.npz
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax import parallel
from g2rl_jax.config import DistributedConfig, MeshConfig


def main(process_id: int, port: int, out: str) -> None:
    parallel.initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                                      process_id=process_id))
    from test_micro import AGGS, CFG, RT, B, _long_tailed_batch, _mini, _settings

    from g2rl_jax.model import Qwen3
    from g2rl_jax.train import micro as micro_lib
    from g2rl_jax.train import step as train_step
    from g2rl_jax.train import update as train_update

    from _helpers import create_sharded

    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, params = nnx.split(create_sharded(lambda: Qwen3(CFG, RT, rngs=nnx.Rngs(0), mesh=mesh), mesh))
    rows = parallel.process_rows(mesh, B)
    to_global = lambda tree: jax.tree.map(lambda x: parallel.global_rows(mesh, np.asarray(x)[rows], B), tree)  # noqa: E731
    host = _long_tailed_batch(0)
    batch = to_global(host)
    scores = train_step.score(graphdef, params, batch, temperature=0.9, micro=4)
    result = {name: parallel.gather(x) for name, x in zip(("logp", "entropy", "phi"), jax.tree.leaves(scores))}
    result["ref"] = parallel.gather(train_step.ref_logprobs(graphdef, params, batch, temperature=0.9, micro=4))
    mini = to_global(_mini(host, jnp.asarray(result["logp"])))
    result["update_rows"] = np.asarray([len(r) for r in micro_lib.plan_for(batch, 8).rows])
    for agg in AGGS:
        grads, loss, _ = train_update.gradients(graphdef, params, mini, settings=_settings(agg), micro=8)
        result[f"{agg}/loss"] = np.asarray(loss)
        for i, g in enumerate(jax.tree.leaves(grads)):
            result[f"{agg}/grad{i}"] = parallel.gather(g)
    if process_id == 0:
        np.savez(out, **result)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
