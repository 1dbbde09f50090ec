"""Rollout tests: `generate` against transformers (greedy tokens, log-probs), sampling statistics, stop handling,
seeds, sharding, bucketing, bf16 KV cache and input validation. One tiny random Qwen3 per module."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from g2rl_jax.config import MeshConfig
from g2rl_jax.model import RuntimeConfig, load_pretrained
from g2rl_jax.parallel import make_mesh
from g2rl_jax.rollout import engine, generate
from g2rl_jax.rollout.batching import bucket, new_tokens_bucket
from g2rl_jax.rollout.sampling import SamplerSpec, categorical, sample_tokens
from g2rl_jax.train.step import build_batch

from _helpers import tiny_qwen3_fixtures

PROMPTS = [[5, 17, 99, 3], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [42], [100, 3, 64, 2, 9, 88, 31]]
NEW = 12


# initializer_range 0.2: peaked next-token distributions (a test can tell T=0.8 from T=1, few argmax ties).
model_dir, model = tiny_qwen3_fixtures(initializer_range=0.2)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits_f64(hf_model, ids_BxL, mask_BxL) -> np.ndarray:
    """transformers' logits [B, L, V] for padded sequences (positions from the mask), as float64."""
    ids, mask = torch.tensor(np.asarray(ids_BxL), dtype=torch.long), torch.tensor(np.asarray(mask_BxL, np.int64))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.double().numpy()


def log_softmax64(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def completion_logits(hf_model, rollout) -> np.ndarray:
    """[B, T, V]: the logits that predicted each completion slot t (position S - 1 + t of the sequence that
    training joins, `train.step.build_batch`)."""
    S = rollout.prompt_ids_BxS.shape[1]
    B = rollout.prompt_ids_BxS.shape[0]
    joined = build_batch(rollout.prompt_ids_BxS, rollout.prompt_mask_BxS, rollout.completion_ids_BxT,
                         rollout.completion_mask_BxT, np.zeros(B), np.zeros(B, bool), rollout.num_samples)
    z = hf_logits_f64(hf_model, joined.input_ids, joined.attention_mask)
    return z[:, S - 1:-1]


@pytest.fixture(scope="module")
def greedy(model):
    return generate(model, PROMPTS, max_new_tokens=NEW, temperature=0, num_samples=2)


# ---------------------------------------------------------------- parity with transformers


def test_greedy_matches_transformers_generate(greedy, hf_model):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                                return_dict_in_generate=True, output_logits=True)
    hf_tokens = out.sequences[:, width:].numpy()
    hf_logp = log_softmax64(torch.stack(out.logits, 1).double().numpy())  # [P, NEW, V] at T = 1
    assert len(greedy.completion_ids) == len(PROMPTS) * 2
    for b, ids_b in enumerate(greedy.completion_ids):
        p = b // 2
        assert ids_b == hf_tokens[p].tolist(), f"sample {b} (prompt {p})"
        np.testing.assert_allclose(greedy.logprobs[b], hf_logp[p, np.arange(NEW), hf_tokens[p]], atol=1e-4)
    assert greedy.finish_reasons == ["length"] * len(greedy.completion_ids) and greedy.decode_steps == NEW


def test_padded_arrays_agree_with_lists(greedy):
    B = len(PROMPTS) * 2
    S, T = greedy.prompt_ids_BxS.shape[1], greedy.completion_ids_BxT.shape[1]
    assert (S, T) == (bucket(11, 16), bucket(NEW, 16))
    assert greedy.prompt_ids_BxS.shape == (B, S) and greedy.logprobs_BxT.shape == (B, T)
    for b in range(B):
        prompt, n = PROMPTS[b // 2], greedy.completion_lengths[b]
        assert greedy.prompt_ids_BxS[b, S - len(prompt):].tolist() == prompt
        assert greedy.prompt_mask_BxS[b].sum() == len(prompt) and greedy.prompt_mask_BxS[b, -len(prompt):].all()
        assert greedy.completion_ids_BxT[b, :n].tolist() == greedy.completion_ids[b]
        assert greedy.completion_mask_BxT[b].tolist() == [True] * n + [False] * (T - n)
        np.testing.assert_array_equal(greedy.logprobs_BxT[b, :n], greedy.logprobs[b])
        assert not greedy.logprobs_BxT[b, n:].any() and not greedy.completion_ids_BxT[b, n:].any()


def test_sampled_logprobs_and_truncation_match_forward(model, hf_model):
    """T=0.7, top-k 6, top-p 0.8: every token lies in the truncated set computed in float64 from transformers'
    logits, and its log-prob is the UNtruncated log softmax(z / T)."""
    T, k, top_p = 0.7, 6, 0.8
    r = generate(model, PROMPTS[:3], max_new_tokens=NEW, temperature=T, top_k=k, top_p=top_p, num_samples=4,
                 seed=3)
    z_BxTxV = completion_logits(hf_model, r) / T
    for b, ids in enumerate(r.completion_ids):
        for t, tok in enumerate(ids):
            z = z_BxTxV[b, t]
            order = np.argsort(-z)
            rank = int(np.nonzero(order == tok)[0][0])
            assert rank < k, f"sample {b} step {t}: token of rank {rank} escaped top-k={k}"
            probs = np.exp(log_softmax64(z[order[:k]]))
            assert probs[:rank].sum() < top_p + 1e-5, f"sample {b} step {t}: token outside the top-p nucleus"
        np.testing.assert_allclose(r.logprobs[b], log_softmax64(z_BxTxV[b])[np.arange(len(ids)), ids], atol=1e-4)


# ---------------------------------------------------------------- sampling statistics


def test_first_token_frequencies_match_model_distribution(model, hf_model):
    """Chi-square at T=1 over 8192 draws of one prompt's first token; the same counts must reject T=0.8."""
    prompt, n = [5, 17, 99, 3, 42], 8192
    r = generate(model, [prompt], max_new_tokens=1, temperature=1.0, num_samples=n, seed=11)
    counts = np.bincount([ids[0] for ids in r.completion_ids], minlength=128)
    z = hf_logits_f64(hf_model, [prompt], [[1] * len(prompt)])[0, -1]

    def pvalue(temperature):
        expected = np.exp(log_softmax64(z / temperature)) * n
        small = expected < 5  # pool the rare tokens into one bin
        obs = np.append(counts[~small], counts[small].sum())
        return stats.chisquare(obs, np.append(expected[~small], expected[small].sum())).pvalue

    assert pvalue(1.0) > 1e-3
    assert pvalue(0.8) < 1e-6
    np.testing.assert_allclose([lp[0] for lp in r.logprobs],
                               log_softmax64(z)[[ids[0] for ids in r.completion_ids]], atol=1e-4)


LOGITS_V = np.array([3.0, 2.5, 2.2, 2.0, 1.6, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], np.float32)


def truncated_probs64(z, temperature, top_k, top_p):
    """Independent float64 transcription of temperature -> top-k -> renormalise -> top-p -> renormalise."""
    z = z.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[:top_k or len(z)]] = True
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    sorted_p = probs[order]
    before = np.cumsum(sorted_p) - sorted_p
    keep[order[before >= top_p]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 4, 1.0), (0.8, 0, 0.7), (1.3, 5, 0.9)])
def test_sample_tokens_matches_truncated_distribution(temperature, top_k, top_p):
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)
    spec = SamplerSpec(greedy=False, top_k=top_k, use_top_p=top_p < 1)
    tokens, logprobs = jax.jit(sample_tokens, static_argnames="spec")(
        jnp.tile(LOGITS_V, (n, 1)), keys, jnp.float32(temperature), jnp.float32(top_p), spec=spec)
    expected = truncated_probs64(LOGITS_V, temperature, top_k, top_p)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS_V))
    assert not counts[expected == 0].any(), f"excluded tokens drawn: {np.nonzero(counts * (expected == 0))}"
    assert (expected > 0).sum() < len(LOGITS_V)  # the case does exclude something
    allowed = expected > 0
    assert stats.chisquare(counts[allowed], expected[allowed] * n).pvalue > 1e-3
    full = log_softmax64(LOGITS_V.astype(np.float64) / temperature)
    np.testing.assert_allclose(np.asarray(logprobs), full[np.asarray(tokens)], atol=1e-5)


def test_two_stage_categorical_is_exact():
    """Blocks of 4 over 14 entries (the last block padded): frequencies match softmax; a 0.8 scaling is rejected."""
    n, z = 40000, np.linspace(-2.0, 2.5, 14).astype(np.float32)[np.random.default_rng(0).permutation(14)]
    keys = jax.random.split(jax.random.key(1), n)
    draws = jax.jit(categorical, static_argnames="block")(jnp.tile(z, (n, 1)), keys, block=4)
    counts = np.bincount(np.asarray(draws), minlength=14)
    assert counts.shape == (14,)
    for scale, accept in ((1.0, True), (0.8, False)):
        expected = np.exp(log_softmax64(scale * z.astype(np.float64))) * n
        p = stats.chisquare(counts, expected).pvalue
        assert (p > 1e-3) if accept else (p < 1e-6), (scale, p)


# ---------------------------------------------------------------- stops, seeds, buckets


def trim_at_stop(ids, stops):
    for i, tok in enumerate(ids):
        if tok in stops:
            return ids[:i + 1], "stop"
    return ids, "length"


def test_greedy_stop_token_ends_sequence(model, greedy):
    stop = greedy.completion_ids[0][3]  # appears in sample 0 at index <= 3
    r = generate(model, PROMPTS, max_new_tokens=NEW, temperature=0, num_samples=2, stop_token_ids=(stop,))
    expected = [trim_at_stop(ids, {stop}) for ids in greedy.completion_ids]
    assert r.completion_ids == [e[0] for e in expected]
    assert r.finish_reasons == [e[1] for e in expected]
    assert r.finish_reasons[0] == "stop" and len(r.completion_ids[0]) <= 4
    assert r.decode_steps == max(map(len, r.completion_ids))


def test_loop_ends_when_every_real_sample_stopped(model, greedy):
    """3 prompts (bucketed to 4: one dummy row that must not keep the loop alive), all stopping early."""
    firsts = {ids[0] for ids in greedy.completion_ids[:6]}
    r = generate(model, PROMPTS[:3], max_new_tokens=NEW, temperature=0, num_samples=2, stop_token_ids=firsts)
    assert r.completion_ids == [ids[:1] for ids in greedy.completion_ids[:6]]
    assert r.finish_reasons == ["stop"] * 6 and r.decode_steps == 1
    # the padded arrays are cut to the bucket of the longest completion, not the whole budget
    assert r.completion_ids_BxT.shape == r.logprobs_BxT.shape == r.completion_mask_BxT.shape == (6, 16)


def test_new_token_buckets():
    """Powers of two (floor 16) up to 1,024, then multiples of 1,024: the 4B run's 12,288 stays 12,288."""
    got = {n: new_tokens_bucket(n) for n in (1, 9, 16, 17, 1000, 1024, 1025, 8192, 12288, 12289)}
    assert got == {1: 16, 9: 16, 16: 16, 17: 32, 1000: 1024, 1024: 1024, 1025: 2048, 8192: 8192, 12288: 12288,
                   12289: 13312}


def test_sampled_stops_trim_and_report(model):
    stops = (3, 17, 64, 99, 15, 50)
    r = generate(model, PROMPTS, max_new_tokens=NEW, temperature=1.0, num_samples=4, stop_token_ids=stops, seed=5)
    assert "stop" in r.finish_reasons
    for ids, reason, lp in zip(r.completion_ids, r.finish_reasons, r.logprobs):
        assert len(lp) == len(ids) >= 1
        assert not set(ids[:-1]) & set(stops), "a token after a stop token was returned"
        if reason == "stop":
            assert ids[-1] in stops
        else:
            assert ids[-1] not in stops and len(ids) == NEW


def test_seed_reproducible_and_group_samples_differ(model):
    kw = dict(max_new_tokens=NEW, temperature=1.0, num_samples=4)
    a, b = generate(model, PROMPTS, seed=7, **kw), generate(model, PROMPTS, seed=7, **kw)
    c = generate(model, PROMPTS, seed=8, **kw)
    assert a.completion_ids == b.completion_ids
    np.testing.assert_array_equal(a.logprobs_BxT, b.logprobs_BxT)
    assert a.completion_ids != c.completion_ids
    for p in range(len(PROMPTS)):
        group = {tuple(ids) for ids in a.completion_ids[4 * p:4 * p + 4]}
        assert len(group) > 1, f"the 4 samples of prompt {p} are identical"


def test_shapes_in_one_bucket_compile_once(model, greedy):
    before = dict(engine.TRACE_COUNTS)
    r = generate(model, [[1, 2, 3], [4] * 16, [9] * 13], max_new_tokens=9, temperature=0, num_samples=2)
    assert dict(engine.TRACE_COUNTS) == before, "a call in the same bucket (4 prompts, S 16, T 16) re-traced"
    assert len(r.completion_ids) == 6 and all(len(ids) == 9 for ids in r.completion_ids)


# ---------------------------------------------------------------- sharding, bf16 cache


def test_sharded_greedy_equals_unsharded(model_dir, greedy):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = load_pretrained(model_dir, mesh=mesh)
    with jax.set_mesh(mesh):
        r = generate(sharded, PROMPTS, max_new_tokens=NEW, temperature=0, num_samples=2)
    assert r.completion_ids == greedy.completion_ids
    np.testing.assert_allclose(r.logprobs_BxT, greedy.logprobs_BxT, atol=1e-5)


def test_bf16_kv_cache(model_dir, hf_model):
    model = load_pretrained(model_dir, runtime=RuntimeConfig(kv_cache_dtype="bfloat16"))
    r = generate(model, PROMPTS, max_new_tokens=NEW, temperature=0, num_samples=2)
    from flax import nnx
    graphdef, state = nnx.split(model)
    ids, mask = np.ones((4, 16), np.int32), np.ones((4, 16), bool)
    _, prefix, suffix = engine.prefill_fn(None, 2, 2)(graphdef, state, ids, mask, num_samples=2, capacity=16)
    assert {x.dtype for x in prefix.k + prefix.v + suffix.k + suffix.v} == {jnp.dtype(jnp.bfloat16)}
    # Its greedy log-probs match transformers' float32 forward on the sequences it produced, to bf16 accuracy.
    z = completion_logits(hf_model, r)
    for b, ids_b in enumerate(r.completion_ids):
        np.testing.assert_allclose(r.logprobs[b], log_softmax64(z[b])[np.arange(NEW), ids_b], atol=3e-2)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("prompts,kwargs,match", [
    ([[1, 2], []], {}, r"prompts\[1\] is empty"),
    ([], {}, "non-empty list"),
    ([[1] * 250], {"max_new_tokens": 10}, r"prompts\[0\].*beyond the model's context of 256"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be a positive int"),
    ([[1]], {"max_new_tokens": -3}, "max_new_tokens must be a positive int"),
    ([[1]], {"top_p": 0.0}, r"top_p must satisfy 0 < top_p <= 1"),
    ([[1]], {"top_p": 1.5}, r"top_p must satisfy 0 < top_p <= 1"),
    ([[1]], {"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ([[1]], {"top_k": -1}, "top_k must be an int >= 0"),
    ([[1]], {"num_samples": 0}, "num_samples must be an int >= 1"),
    ([[1, 500]], {}, r"prompts\[0\] holds values that are not token ids in \[0, 128\)"),
    ([[1], [2, 0.5]], {}, r"prompts\[1\] holds values that are not token ids"),
    ([[1], [[2, 3]]], {}, r"prompts\[1\] holds values that are not token ids"),
    ([[1]], {"stop_token_ids": (128,)}, r"stop_token_ids \[128\]"),
    ([[1]], {"seed": 1.5}, "seed must be an int"),
])
def test_bad_input_raises_value_error(model, prompts, kwargs, match):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, **kwargs)
