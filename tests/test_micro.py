"""Length-grouped micro-batches (train.micro) change no result and bound the compiled shapes.

Against one unpacked pass over the whole padded batch (today's computation): log-probs, entropy and Φ per
response, and the loss, gradients and diagnostics of the update for every algorithm.loss_agg mode, with several
micro-batches accumulated, on one device and on the 8-device (data, fsdp, tensor) mesh. The plan itself (row
order, widths, padding counts) against brute-force NumPy; the number of compiled model passes over many random
length distributions against the width ladder.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from g2rl_jax import g2rl, parallel
from g2rl_jax.config import AlgorithmConfig, MeshConfig
from g2rl_jax.model import Qwen3, Qwen3Config, RuntimeConfig
from g2rl_jax.shapes import layouts
from g2rl_jax.train import micro as micro_lib
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update

from _helpers import create_sharded

CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
RT = RuntimeConfig(param_dtype="float32", compute_dtype="float32", remat="none", attention="xla")
B, S, T = 8, 6, 40
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _long_tailed_batch(seed: int, lengths=None) -> train_step.Batch:
    rng = np.random.default_rng(seed)
    if lengths is None:  # long-tailed, one row at the full width, one empty (a filtered row)
        lengths = np.minimum(rng.geometric(1 / 6, B), T)
        lengths[rng.integers(B)] = T
        lengths[rng.integers(B)] = 0
    prompt_mask = (np.arange(S)[None] >= rng.integers(0, 3, (B, 1))).astype(np.int32)  # left padding
    completion_mask = (np.arange(T)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    return train_step.build_batch(rng.integers(1, CFG.vocab_size, (B, S)) * prompt_mask, prompt_mask,
                                  rng.integers(1, CFG.vocab_size, (B, T)) * completion_mask, completion_mask,
                                  rng.choice([-1.0, 1.0], B), rng.random(B) < 0.5, group_size=4)


def _mini(batch, scores_logp, seed=1) -> train_step.MiniBatch:
    rng = np.random.default_rng(seed)
    noise = jnp.asarray(0.05 * rng.standard_normal((B, T)), jnp.float32)
    return train_step.MiniBatch(batch, old_logp_BxT=scores_logp + noise, ref_logp_BxT=scores_logp - noise,
                                advantages_B=jnp.asarray(rng.standard_normal(B), jnp.float32))


def _settings(agg: str) -> train_update.LossSettings:
    algo = dataclasses.replace(AlgorithmConfig(), loss_agg=agg, kl_coef=0.05, exploration="entropy_bonus",
                               entropy_coef=0.01, dual_clip=1.5)
    return train_update.LossSettings.from_config(algo, 0.9)


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(Qwen3(CFG, RT, rngs=nnx.Rngs(0)))
    return graphdef, params


def unpacked_pass(graphdef, params, batch, old_logp_BxT=None) -> dict:
    """Today's computation: one pass over the whole padded batch, autodiff of the whole mini-batch's loss (old
    log-probs: those of this pass unless given)."""
    m = nnx.merge(graphdef, params)
    h, y = train_step.response_hidden(m, batch)
    logp, ent, phi = jax.jit(lambda h, y, w, mask: g2rl.token_stats(h, w, y, mask, temperature=0.9))(
        h, y, train_step.head(m, h), batch.response_mask)
    ref = g2rl.token_logprobs(h, train_step.head(m, h), y, temperature=0.9)
    mini = _mini(batch, logp if old_logp_BxT is None else jnp.asarray(old_logp_BxT))
    grads = {}
    for agg in AGGS:
        fn = jax.jit(jax.value_and_grad(train_update.policy_loss, has_aux=True), static_argnums=(1, 3))
        grads[agg] = fn(params, graphdef, mini, _settings(agg))
    return {"batch": batch, "scores": (logp, ent, phi), "ref": ref, "mini": mini, "grads": grads}


@pytest.fixture(scope="module")
def unpacked(model):
    return unpacked_pass(*model, _long_tailed_batch(0))


def _rel(a_tree, b_tree) -> float:
    """‖a − b‖ / ‖b‖ over all leaves."""
    a, b = jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)
    num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)) for x, y in zip(a, b))
    den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in b)
    return (num / den) ** 0.5


def _assert_same_scores(got: train_step.Scores, want, mask_BxT):
    real = np.asarray(mask_BxT) > 0
    for g, w in zip((got.logp_BxT, got.entropy_BxT), want[:2]):
        np.testing.assert_allclose(np.asarray(g)[real], np.asarray(w)[real], rtol=1e-6, atol=1e-6)
    assert _rel(got.phi_BxD, want[2]) <= 1e-6


# ------------------------------------------------------------------------------------------ the plan
def test_width_ladder():
    assert [layouts.width_bucket(n) for n in (0, 1, 16, 17, 33, 64, 65, 80, 81, 129, 1000, 1025, 8192)] == \
        [16, 16, 16, 32, 64, 64, 80, 80, 96, 160, 1024, 1280, 8192]
    widths = {layouts.width_bucket(n) for n in range(1, 8193)}
    assert len(widths) == 3 + 4 * 7  # 16, 32, 64, then 4 per octave from 64 to 8,192
    for n in range(65, 8193):
        assert n <= layouts.width_bucket(n) <= 1.25 * n + 1


def test_plan_sorts_rows_and_counts_padding():
    batch = _long_tailed_batch(3)
    mask, attn = np.asarray(batch.response_mask), np.asarray(batch.attention_mask)
    lengths = mask.sum(1).astype(int)
    plan = micro_lib.plan_micro(mask, 2, attn)
    flat = np.concatenate(plan.rows)
    assert sorted(flat.tolist()) == list(range(B))  # every row once: membership unchanged
    assert (np.diff(lengths[flat]) >= 0).all()
    for rows, width in zip(plan.rows, plan.widths):
        assert len(rows) in (1, 2) and width == min(layouts.width_bucket(lengths[rows].max()), T)
    positions = sum(len(rows) * (S + w) for rows, w in zip(plan.rows, plan.widths))
    padding = sum(int((attn[r, :S + w] == 0).sum()) for rows, w in zip(plan.rows, plan.widths) for r in rows)
    assert (plan.positions, plan.padding) == (positions, padding)
    padded = micro_lib.plan_micro(mask, 2, attn, padded=True)
    assert padded.widths == (T,) * 4 and padded.padding == int((attn == 0).sum())
    assert [len(r) for r in padded.rows] == [2] * 4
    with pytest.raises(ValueError, match="batch of 8 responses is not a multiple of micro_batch_size=3"):
        micro_lib.plan_micro(mask, 3)


def test_row_counts():
    assert layouts.row_counts(16) == (16, 8, 4, 2, 1)
    assert layouts.row_counts(16, min_rows=4) == (16, 8, 4)
    assert layouts.row_counts(6) == (6, 3)
    assert layouts.row_counts(4, min_rows=8) == (4,)


def _brute_force_cost(lengths, micro: int, s: int, t: int, sizes) -> float:
    """Least cost over every cut of the sorted rows into consecutive runs of `sizes` (enumerated, no DP)."""
    order = np.sort(lengths)
    best = np.inf

    def cuts(start, cost):
        nonlocal best
        if start == len(order):
            best = min(best, cost)
        for r in sizes:
            if start + r <= len(order):
                width = min(layouts.width_bucket(order[start + r - 1]), t)
                cuts(start + r, cost + (r + layouts.OVERHEAD_ROWS) * (s + width))

    cuts(0, 0.0)
    return best


@pytest.mark.parametrize("micro,min_rows", [(4, 1), (8, 1), (8, 2)])
def test_plan_is_the_least_cost_cut(micro, min_rows):
    """The dynamic programme finds the cut an exhaustive search finds, over many long-tailed batches of 16 rows."""
    rng = np.random.default_rng(micro + min_rows)
    t, s = 512, 32
    for _ in range(20):
        lengths = np.minimum(rng.geometric(1 / rng.uniform(8, 128), 16), t)
        mask = np.arange(t)[None] < lengths[:, None]
        plan = micro_lib.plan_micro(mask, micro, np.ones((16, s + t), bool), min_rows=min_rows)
        sizes = [len(r) for r in plan.rows]
        assert set(sizes) <= set(layouts.row_counts(micro, min_rows)) and sum(sizes) == 16
        cost = sum((len(r) + layouts.OVERHEAD_ROWS) * (s + w) for r, w in zip(plan.rows, plan.widths))
        assert cost == _brute_force_cost(lengths, micro, s, t, layouts.row_counts(micro, min_rows))
    equal = micro_lib.plan_micro(np.ones((16, t), bool), micro, np.ones((16, s + t), bool), min_rows=min_rows)
    assert [len(r) for r in equal.rows] == [micro] * (16 // micro)  # equal lengths: the fewest micro-batches


# ------------------------------------------------------------------------------------------ results unchanged
@pytest.mark.parametrize("micro", [2, 8])
def test_score_and_reference_equal_one_unpacked_pass(model, unpacked, micro):
    graphdef, params = model
    batch = unpacked["batch"]
    scores = train_step.score(graphdef, params, batch, temperature=0.9, micro=micro)
    _assert_same_scores(scores, unpacked["scores"], batch.response_mask)
    ref = train_step.ref_logprobs(graphdef, params, batch, temperature=0.9, micro=micro)
    real = np.asarray(batch.response_mask) > 0
    np.testing.assert_allclose(np.asarray(ref)[real], np.asarray(unpacked["ref"])[real], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("agg,micro", [("token-mean", 2), ("seq-mean-token-mean", 2), ("seq-mean-token-sum", 4)])
def test_loss_and_gradients_equal_one_unpacked_pass(model, unpacked, agg, micro):
    graphdef, params = model
    (loss0, diag0), grads0 = unpacked["grads"][agg]
    assert len({len(r) for r in train_step.plan(unpacked["batch"], micro, "update").rows}) > 1  # uneven micro-batches
    grads, loss, diag = train_update.gradients(graphdef, params, unpacked["mini"], settings=_settings(agg), micro=micro)
    assert abs(float(loss) / float(loss0) - 1) <= 1e-6, (float(loss), float(loss0))
    assert _rel(grads, grads0) <= 1e-6
    for key in diag0:
        np.testing.assert_allclose(float(diag[key]), float(diag0[key]), rtol=1e-6, atol=1e-7, err_msg=key)


def test_on_the_8_device_mesh(unpacked):
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    module = create_sharded(lambda: Qwen3(CFG, RT, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    graphdef, params = nnx.split(module)
    put = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(np.asarray(x), parallel.batch_sharding(mesh, ndim=np.ndim(x))), t)
    batch = put(unpacked["batch"])
    assert {len(r) for r in micro_lib.plan_for(batch, 8).rows} <= {8, 4}  # rows split over data x fsdp = 4
    scores = train_step.score(graphdef, params, batch, temperature=0.9, micro=4)
    _assert_same_scores(scores, unpacked["scores"], unpacked["batch"].response_mask)
    assert scores.logp_BxT.sharding.is_equivalent_to(batch.response_mask.sharding, 2)
    (loss0, _), grads0 = unpacked["grads"]["seq-mean-token-mean"]
    grads, loss, _ = train_update.gradients(graphdef, params, put(unpacked["mini"]),
                                          settings=_settings("seq-mean-token-mean"), micro=4)
    assert abs(float(loss) / float(loss0) - 1) <= 1e-6
    assert _rel(grads, grads0) <= 1e-6
    same = jax.tree.map(lambda g, p: g.sharding.is_equivalent_to(p.sharding, p.ndim), grads, params)
    assert all(jax.tree.leaves(same)), "the gradient accumulator is not sharded like the params"


# ------------------------------------------------------------------------------------------ compiled shapes
def test_compiled_shapes_are_bounded_by_the_width_ladder(model):
    """Eight steps of random long-tailed lengths compile one model pass per (rows, width) used, never more, and
    those come from the row counts x the width ladder."""
    graphdef, params = model
    settings = _settings("token-mean")
    score_before = train_step.score_micro._cache_size()
    grads_before = train_update.accumulate._cache_size()
    shapes = set()
    for seed in range(8):
        batch = _long_tailed_batch(100 + seed)
        plan = micro_lib.plan_for(batch, 4)
        shapes |= {(len(rows), w) for rows, w in zip(plan.rows, plan.widths)}
        scores = train_step.score(graphdef, params, batch, temperature=0.9, micro=4)
        train_update.gradients(graphdef, params, _mini(batch, scores.logp_BxT), settings=settings, micro=4)
    ladder = {min(layouts.width_bucket(n), T) for n in range(T + 1)}
    assert len(ladder) == 3  # 16, 32 and the full width 40
    assert shapes <= {(r, w) for r in layouts.row_counts(4) for w in ladder} and len(shapes) > 3
    assert train_step.score_micro._cache_size() - score_before <= len(shapes)
    assert train_update.accumulate._cache_size() - grads_before <= len(shapes)
