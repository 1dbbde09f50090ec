"""train/compiles.py: the compile clock counts backend compiles and the seconds spent compiling (overlaps once),
names each program by its function and shapes, and sees nothing once a shape is compiled."""
import jax
import jax.numpy as jnp
import numpy as np

from g2rl_jax.train.compiles import CompileClock, describe, union_seconds


def test_union_seconds_against_a_fine_grid():
    rng = np.random.default_rng(0)
    for _ in range(20):
        starts = rng.uniform(0, 10, 6)
        intervals = [(a, a + rng.uniform(0, 3)) for a in starts]
        grid = np.linspace(0, 14, 140001)
        covered = np.zeros_like(grid, bool)
        for a, b in intervals:
            covered |= (grid >= a) & (grid < b)
        assert abs(union_seconds(intervals) - covered.mean() * 14) < 1e-3
    assert union_seconds([]) == 0.0


def test_the_clock_counts_names_and_forgets_nothing():
    @jax.jit
    def affine(x_BxD, w_DxE):
        return x_BxD @ w_DxE + 1.0

    x, x2, w, wider = jnp.ones((3, 5)), jnp.zeros((3, 5)), jnp.ones((5, 7)), jnp.ones((4, 5))
    leaked = CompileClock()  # a clock left open (a trainer never closed) must not blind a later one
    clock = CompileClock()
    try:
        clock.take()
        jax.block_until_ready(affine(x, w))
        first = clock.take()
        jax.block_until_ready(affine(x2, w))  # the same shapes: nothing to compile
        again = clock.take()
        jax.block_until_ready(affine(wider, w))
        third = clock.take()
    finally:
        clock.close()
        leaked.close()
    assert first.programs >= 1 and any(n == "affine float32[3,5] float32[5,7]" for n in first.names), first
    assert 0 < first.seconds
    assert again.programs == 0 and again.seconds < first.seconds
    assert third.programs >= 1 and any(n.startswith("affine float32[4,5]") for n in third.names), third
    assert describe("jit(f)", [f"s{i}" for i in range(9)]) == "f s4 s5 s6 s7 s8"


def test_masked_metric_compiles_at_its_first_call_whatever_the_mask():
    """A step metric over masked rows (single-class groups) compiled nothing new the first step one was present."""
    from g2rl_jax.train.metrics import single_class_metrics

    adv_B = jnp.arange(6, dtype=jnp.float32)
    none_B, some_B = jnp.zeros(6, bool), jnp.asarray(np.array([1, 1, 0, 0, 0, 0], bool))
    signal = lambda single_B: {"single_class": single_B, "all_wrong": none_B, "most_novel_advantage": adv_B,  # noqa: E731
                               "least_novel_advantage": adv_B}
    assert np.isnan(single_class_metrics(signal(none_B), novelty=True)["single_class_adv_most_novel"])  # no group
    clock = CompileClock()
    try:
        assert single_class_metrics(signal(some_B), novelty=True)["single_class_adv_most_novel"] == 0.5
        window = clock.take()
    finally:
        clock.close()
    assert window.programs == 0, window.names


def _sharded_tree():
    """A row-split [16, 4] and a replicated [3] array on the 8 test devices."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((8,), ("fsdp",))
    return {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(16, 4),
                                NamedSharding(mesh, PartitionSpec("fsdp"))),
            "b": jax.device_put(np.ones(3, np.float32), NamedSharding(mesh, PartitionSpec()))}


def test_reference_copy_compiles_nothing_and_outlives_the_params():
    """The KL reference's copy of the params (train/loop.py) is placed as they are, in buffers of its own (the
    optimizer step donates the params'), without a compiled program."""
    from g2rl_jax.train.setup import copy_tree

    params = _sharded_tree()
    want = {k: np.asarray(v) for k, v in params.items()}
    clock = CompileClock()
    try:
        copy = copy_tree(params)
        window = clock.take()
    finally:
        clock.close()
    assert window.programs == 0, window.names
    assert all(copy[k].sharding == params[k].sharding for k in params)
    for x in params.values():
        x.delete()
    for k, x in copy.items():
        np.testing.assert_array_equal(np.asarray(x), want[k])


def test_optimizer_init_is_its_one_program():
    """The optimizer state placed like the params (train/optim.py): one program, optax's own placeholder init
    (whose step counts are jnp.zeros) only traced."""
    from g2rl_jax.config import OptimConfig
    from g2rl_jax.train import optim

    params = _sharded_tree()
    clock = CompileClock()
    try:
        state = optim.init_optimizer(optim.make_optimizer(OptimConfig(), 10), params)
        window = clock.take()
    finally:
        clock.close()
    assert window.programs == 1, window.names
    moments = [x for x in jax.tree.leaves(state) if x.shape == (16, 4)]
    assert moments and all(x.sharding == params["w"].sharding for x in moments)
