"""Qwen3 model: parity with transformers' PyTorch Qwen3, padding, KV-cache decode, remat, attention backends."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig, load_pretrained
from g2rl_jax.model import attention as attn
from g2rl_jax.model import config as model_config
from g2rl_jax.model.config import resolve_attention
from g2rl_jax.model.qwen3 import positions_from_mask, rms_norm, rope

from hf_tiny import make_tiny_qwen3_dir

# (GQA ratio, tied head, head_dim != hidden/heads) are all covered across these.
CONFIGS = {
    "gqa2-tied-hd24": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
    "gqa4-untied-hd16": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
    "gqa1-untied-hd8": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8, tie_word_embeddings=False,
                            num_hidden_layers=3, rope_theta=1e6),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_tiny_qwen3_dir(root / name, seed=i, **kw) for i, (name, kw) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def tiny(hf_dirs):
    return load_pretrained(hf_dirs["gqa2-tied-hd24"])


_fwd = nnx.jit(lambda model, ids, mask=None: model(ids, mask))


def _torch_logits(path, ids, mask=None):
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask)).logits.numpy()


def _assert_close(ours, ref, rel=1e-4):
    scale = np.abs(ref).max()
    assert np.abs(np.asarray(ours) - ref).max() <= rel * scale, (np.abs(np.asarray(ours) - ref).max(), scale)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(hf_dirs, name):
    ids = np.random.RandomState(1).randint(0, 128, (2, 12))
    ours = _fwd(load_pretrained(hf_dirs[name]), jnp.asarray(ids))
    assert ours.dtype == jnp.float32 and ours.shape == (2, 12, 128)
    _assert_close(ours, _torch_logits(hf_dirs[name], ids))


def test_left_padded_batch_matches_unpadded(hf_dirs):
    path = hf_dirs["gqa4-untied-hd16"]
    model = load_pretrained(path)
    rng, L = np.random.RandomState(2), 10
    seqs = [rng.randint(0, 128, n) for n in (10, 7, 3)]
    ids = np.zeros((3, L), np.int32)
    mask = np.zeros((3, L), np.int32)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):], mask[b, L - len(s):] = s, 1
    padded = np.asarray(_fwd(model, jnp.asarray(ids), jnp.asarray(mask)))
    for b, s in enumerate(seqs):
        _assert_close(padded[b, L - len(s):], _torch_logits(path, s[None])[0])


def test_keyword_call_matches_positional(tiny):
    """The public signature: model(input_ids=..., attention_mask=...) and hidden_states alike, as transformers."""
    ids = jnp.asarray(np.random.RandomState(13).randint(0, 128, (2, 7)))
    mask = jnp.asarray(np.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7]))
    by_kw = nnx.jit(lambda m, i, a: m(input_ids=i, attention_mask=a))(tiny, ids, mask)
    assert by_kw.dtype == jnp.float32 and by_kw.shape == (2, 7, 128)
    np.testing.assert_array_equal(by_kw, _fwd(tiny, ids, mask))
    h_kw = nnx.jit(lambda m, i, a: m.hidden_states(input_ids=i, attention_mask=a))(tiny, ids, mask)
    np.testing.assert_array_equal(h_kw, nnx.jit(lambda m, i, a: m.hidden_states(i, a))(tiny, ids, mask))
    np.testing.assert_array_equal(tiny(input_ids=ids), tiny(ids, None))


def test_positions_from_mask():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions_from_mask(jnp.asarray(mask)), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


# ---- independent float64 NumPy transcriptions of the equations ----

def _np_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_rope(x, pos, theta):
    K = x.shape[-1]
    out = np.empty_like(x)
    for i in range(K // 2):  # pair (i, i + K/2) rotated by angle pos * theta^(-2i/K)
        a = pos[..., None] * theta ** (-2.0 * i / K)
        c, s = np.cos(a), np.sin(a)
        out[..., i] = x[..., i] * c - x[..., i + K // 2] * s
        out[..., i + K // 2] = x[..., i + K // 2] * c + x[..., i] * s
    return out


def _np_attention(q, k, v, mask):
    B, L, H, K = q.shape
    G = k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for i in range(L):
                allowed = [j for j in range(L) if j <= i and mask[b, j]]
                if not allowed:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, g] for j in allowed]) / np.sqrt(K)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, h] = sum(pj * v[b, j, g] for pj, j in zip(p, allowed))
    return out


def test_rms_norm_and_rope_match_numpy():
    rng = np.random.RandomState(3)
    x, w = rng.randn(2, 5, 3, 8), rng.randn(8)
    pos = rng.randint(0, 50, (2, 5)).astype(np.float64)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-6),
                               _np_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 1e4),
                               _np_rope(x, pos, 1e4), rtol=1e-4, atol=1e-4)


def _qkv_mask(seed=4, B=2, L=6, H=4, G=2, K=8):
    rng = np.random.RandomState(seed)
    q, k, v = rng.randn(B, L, H, K), rng.randn(B, L, G, K), rng.randn(B, L, G, K)
    mask = np.ones((B, L), np.int32)
    mask[1, :2] = 0  # left padding in row 1
    return q, k, v, mask


def test_xla_attention_matches_numpy():
    q, k, v, mask = _qkv_mask()
    out = attn.xla(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), jnp.asarray(mask))
    real = mask.astype(bool)  # padding query rows are don't-care
    np.testing.assert_allclose(np.asarray(out)[real], _np_attention(q, k, v, mask)[real], rtol=1e-5, atol=1e-5)


def test_fused_attention_masking_matches_numpy():
    """The mask handed to cuDNN, checked through jax.nn.dot_product_attention's XLA implementation."""
    q, k, v, mask = _qkv_mask()
    out = np.asarray(attn.fused(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), jnp.asarray(mask), "xla"))
    real = mask.astype(bool)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[real], _np_attention(q, k, v, mask)[real], rtol=1e-5, atol=1e-5)


on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="cuDNN attention needs a GPU (run on the lent H100: docs/performance.md)")


@on_gpu
def test_cudnn_attention_matches_numpy_on_gpu():
    """The real cuDNN kernel on bf16 inputs against float64 NumPy on the same bf16-rounded inputs."""
    q, k, v, mask = _qkv_mask(seed=11, B=2, L=128, H=4, G=2, K=64)
    mask[1, :40] = 0
    q, k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (q, k, v))
    assert resolve_attention("cudnn", jnp.bfloat16) == "cudnn"
    out = attn.attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), jnp.asarray(mask), "cudnn")
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out, np.float64)[real], _np_attention(q, k, v, mask)[real],
                               rtol=2e-2, atol=2e-2)


@on_gpu
def test_cudnn_model_matches_xla_model_on_gpu():
    """A left-padded bf16 batch through the whole model: cuDNN and XLA attention agree to bf16 rounding."""
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    rts = {b: RuntimeConfig(param_dtype="bfloat16", compute_dtype="bfloat16", attention=b) for b in ("xla", "cudnn")}
    models = {b: Qwen3(cfg, rt, rngs=nnx.Rngs(0)) for b, rt in rts.items()}
    ids = np.random.RandomState(12).randint(0, 256, (2, 64))
    mask = np.ones((2, 64), np.int32)
    mask[0, :17] = 0
    out = {b: np.asarray(_fwd(m, jnp.asarray(ids), jnp.asarray(mask))) for b, m in models.items()}
    real = mask.astype(bool)
    assert np.isfinite(out["cudnn"]).all()
    _assert_close(out["cudnn"][real], out["xla"][real], rel=3e-2)


def _np_decode_attention(q, pk, pv, pmask, sk, sv, valid, m):
    """float64 NumPy: each sample's joint softmax over its prompt's unmasked prefix and its first `valid` slots."""
    (B, H, K), G = q.shape, pk.shape[2]
    ref = np.zeros_like(q)
    for b in range(B):
        p = b // m
        for h in range(H):
            g = h // (H // G)
            keys = [pk[p, s, g] for s in range(pk.shape[1]) if pmask[p, s]] + [sk[b, t, g] for t in range(valid)]
            vals = [pv[p, s, g] for s in range(pk.shape[1]) if pmask[p, s]] + [sv[b, t, g] for t in range(valid)]
            s_ = np.array([q[b, h] @ kk for kk in keys]) / np.sqrt(K)
            w = np.exp(s_ - s_.max())
            ref[b, h] = (w / w.sum()) @ np.array(vals)
    return ref


def _decode_inputs(seed: int, m: int, T: int):
    """(q, prefix k, v, suffix k, v, prefix mask) of 2 prompts x m samples, 4 prompt slots (the first prompt's first
    masked), T suffix slots, 4 heads on 2 KV heads of 8 dims."""
    rng = np.random.RandomState(seed)
    P, S, H, G, K = 2, 4, 4, 2, 8
    q = rng.randn(P * m, H, K)
    pk, pv = rng.randn(P, S, G, K), rng.randn(P, S, G, K)
    sk, sv = rng.randn(P * m, T, G, K), rng.randn(P * m, T, G, K)
    return q, pk, pv, sk, sv, np.array([[0, 1, 1, 1], [1, 1, 1, 1]], bool)


def _heads_first(a):
    return jnp.asarray(a.swapaxes(1, 2), jnp.float32)  # cache [rows, G, len, K]


def test_decode_attention_matches_numpy():
    """One joint softmax over the prompt's prefix and the sample's own suffix, prefix shared by m samples."""
    m, (q, pk, pv, sk, sv, pmask) = 3, _decode_inputs(seed=5, m=3, T=3)
    out = attn.decode_attention(jnp.asarray(q, jnp.float32), _heads_first(pk), _heads_first(pv), jnp.asarray(pmask),
                                _heads_first(sk), _heads_first(sv), 2)
    np.testing.assert_allclose(np.asarray(out), _np_decode_attention(q, pk, pv, pmask, sk, sv, 2, m),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("valid", [1, 2, 3, 4, 5, 8])
def test_decode_attention_read_rungs_match_numpy(valid):
    """Read rungs (2, 4, 8) of an 8-slot suffix, one jitted program for every `valid` (a lax.switch): the step
    reads the smallest rung that holds `valid` slots, and nothing past it (NaN there would poison the output)."""
    m, (q, pk, pv, sk, sv, pmask) = 2, _decode_inputs(seed=6, m=2, T=8)
    rung = next(r for r in (2, 4, 8) if r >= valid)
    sk_read, sv_read = sk.copy(), sv.copy()
    sk_read[:, rung:], sv_read[:, rung:] = np.nan, np.nan
    step = jax.jit(attn.decode_attention, static_argnames="reads")
    out = step(jnp.asarray(q, jnp.float32), _heads_first(pk), _heads_first(pv), jnp.asarray(pmask),
               _heads_first(sk_read), _heads_first(sv_read), jnp.int32(valid), reads=(2, 4, 8))
    np.testing.assert_allclose(np.asarray(out), _np_decode_attention(q, pk, pv, pmask, sk, sv, valid, m),
                               rtol=1e-5, atol=1e-5)


# ---- KV cache ----

def _prompts(seed=6, lens=(5, 8, 3), S=8, T=4, m=3, vocab=128):
    rng = np.random.RandomState(seed)
    ids = np.zeros((len(lens), S), np.int32)
    mask = np.zeros((len(lens), S), np.int32)
    for p, n in enumerate(lens):
        ids[p, S - n:], mask[p, S - n:] = rng.randint(1, vocab, n), 1
    gen = rng.randint(0, vocab, (len(lens) * m, T)).astype(np.int32)
    return ids, mask, gen


def _decode_all(model, ids, mask, gen, m):
    step = nnx.jit(lambda model, tok, pre, suf, t: model.decode_step(tok, pre, suf, t))
    first, prefix = nnx.jit(lambda model, i, k: model.prefill(i, k))(model, jnp.asarray(ids), jnp.asarray(mask))
    suffix = model.init_suffix(prefix, num_samples=m, max_new_tokens=gen.shape[1])
    out = [np.repeat(np.asarray(first), m, 0)]
    for t in range(gen.shape[1]):
        logits, suffix = step(model, jnp.asarray(gen[:, t]), prefix, suffix, t)
        out.append(np.asarray(logits))
    return np.stack(out, 1), prefix, suffix


def test_kv_cache_decode_matches_full_forward(tiny):
    """Left-padded prompts of different lengths, m=3 samples each: token-by-token == one full forward."""
    m = 3
    ids, mask, gen = _prompts(m=m)
    S, T = ids.shape[1], gen.shape[1]
    full_ids = np.concatenate([np.repeat(ids, m, 0), gen], 1)
    full_mask = np.concatenate([np.repeat(mask, m, 0), np.ones_like(gen)], 1)
    ref = np.asarray(_fwd(tiny, jnp.asarray(full_ids), jnp.asarray(full_mask)))[:, S - 1:S + T]
    got, prefix, suffix = _decode_all(tiny, ids, mask, gen, m)
    _assert_close(got, ref, rel=1e-5)
    cfg = tiny.config
    assert len(prefix.k) == len(suffix.v) == cfg.num_hidden_layers  # one buffer per layer
    assert {x.shape for x in prefix.k} == {(3, cfg.num_key_value_heads, S, cfg.head_dim)}
    assert {x.shape for x in suffix.k} == {(3 * m, cfg.num_key_value_heads, T, cfg.head_dim)}


def test_bf16_kv_cache_close_to_f32(hf_dirs):
    """bf16 cache storage only rounds K/V (8 mantissa bits): logits stay within bf16 rounding of f32."""
    path = hf_dirs["gqa2-tied-hd24"]
    ids, mask, gen = _prompts(seed=7, m=2)
    f32, _, _ = _decode_all(load_pretrained(path), ids, mask, gen, 2)
    bf16_model = load_pretrained(path, runtime=RuntimeConfig(kv_cache_dtype="bfloat16"))
    got, prefix, suffix = _decode_all(bf16_model, ids, mask, gen, 2)
    assert prefix.k[0].dtype == jnp.bfloat16 and suffix.v[-1].dtype == jnp.bfloat16
    _assert_close(got, f32, rel=2e-2)


# ---- remat, dtypes, config validation ----

def _loss_and_grads(model, ids):
    def loss(model):
        return jax.nn.logsumexp(model(ids), -1).mean()
    return nnx.jit(nnx.value_and_grad(loss))(model)


def test_remat_same_logits_and_grads():
    cfg = PRESETS["tiny"]
    ids = jnp.asarray(np.random.RandomState(8).randint(0, 128, (2, 9)))
    l0, g0 = _loss_and_grads(Qwen3(cfg, rngs=nnx.Rngs(0)), ids)
    for policy in ("full", "dots"):
        l1, g1 = _loss_and_grads(Qwen3(cfg, RuntimeConfig(remat=policy), rngs=nnx.Rngs(0)), ids)
        np.testing.assert_allclose(l1, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_bf16_params_and_compute_give_f32_logits():
    cfg = PRESETS["tiny-untied"]
    ids = jnp.asarray(np.random.RandomState(9).randint(0, 128, (2, 7)))
    f32 = Qwen3(cfg, rngs=nnx.Rngs(0))
    bf16 = Qwen3(cfg, RuntimeConfig(param_dtype="bfloat16", compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert bf16.embed_tokens[...].dtype == jnp.bfloat16
    out = _fwd(bf16, ids)
    assert out.dtype == jnp.float32
    _assert_close(out, np.asarray(_fwd(f32, ids)), rel=5e-2)
    assert nnx.jit(lambda m, i: m.hidden_states(i))(bf16, ids).shape == (2, 7, cfg.hidden_size)
    assert bf16.lm_head_weight().shape == (cfg.vocab_size, cfg.hidden_size)


@pytest.mark.parametrize("bad, match", [
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
])
def test_config_validation(bad, match):
    base = {**PRESETS["tiny"].__dict__, **bad}
    with pytest.raises(ValueError, match=match):
        Qwen3Config(**base)


@pytest.mark.parametrize("bad, match", [
    (dict(param_dtype="float16"), "unknown RuntimeConfig.param_dtype 'float16'"),
    (dict(remat="some"), "RuntimeConfig.remat='some'"),
    (dict(attention="flash"), "RuntimeConfig.attention='flash'"),
    (dict(attention="cudnn"), "needs compute_dtype='bfloat16'"),
])
def test_runtime_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**bad)


def test_presets_match_published_sizes():
    # Parameter counts of the published checkpoints (Qwen3 model cards: 0.6B, 1.7B, 4.0B, 8.2B).
    expected = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9}
    for name, n in expected.items():
        assert abs(PRESETS[name].num_params() - n) / n < 0.03, (name, PRESETS[name].num_params())


# ---- attention backends ----

def test_backend_falls_back_to_xla_with_one_warning(caplog):
    absent = "splash" if jax.default_backend() == "gpu" else "cudnn"  # a backend whose hardware is not here
    model_config._warned.clear()
    with caplog.at_level(logging.WARNING, logger=model_config.__name__):
        assert resolve_attention(absent, jnp.bfloat16) == "xla"
        assert resolve_attention(absent, jnp.bfloat16) == "xla"
    assert len([r for r in caplog.records if absent in r.getMessage()]) == 1


@pytest.mark.parametrize("requested, dtype, platform, kernel", [
    ("auto", "bfloat16", "tpu", "splash"), ("auto", "float32", "tpu", "splash"),
    ("auto", "bfloat16", "gpu", "cudnn"), ("auto", "float32", "gpu", "xla"),   # cuDNN has no float32 kernel
    ("auto", "bfloat16", "cpu", "xla"), ("xla", "bfloat16", "tpu", "xla"),
    ("cudnn", "bfloat16", "gpu", "cudnn"), ("splash", "float32", "tpu", "splash"),
    ("cudnn", "bfloat16", "tpu", "xla"), ("splash", "bfloat16", "gpu", "xla"),  # hardware absent: fall back
])
def test_resolve_attention_decides_every_case(requested, dtype, platform, kernel):
    assert resolve_attention(requested, dtype, platform) == kernel


@pytest.mark.parametrize("requested, cc, kernel", [
    ("auto", (7, 5), "xla"), ("auto", (7, 0), "xla"), ("cudnn", (7, 5), "xla"),   # T4, V100: no fused kernel
    ("auto", (8, 0), "cudnn"), ("auto", (9, 0), "cudnn"), ("cudnn", (8, 9), "cudnn"), ("auto", None, "cudnn"),
])
def test_resolve_attention_follows_the_gpus_compute_capability(requested, cc, kernel):
    assert resolve_attention(requested, jnp.bfloat16, "gpu", cc) == kernel


def test_colab_and_the_model_agree_on_the_fused_kernels_gpus():
    from g2rl_jax import colab
    assert colab.FUSED_ATTENTION_CC == model_config.FUSED_ATTENTION_CC


def test_resolve_attention_rejects_cudnn_without_bfloat16_everywhere():
    for platform in ("cpu", "gpu", "tpu"):
        with pytest.raises(ValueError, match="needs compute_dtype='bfloat16'"):
            resolve_attention("cudnn", jnp.float32, platform)


def test_splash_backend_model_falls_back_on_cpu(tiny):
    ids = jnp.asarray(np.random.RandomState(10).randint(0, 128, (1, 6)))
    splash = Qwen3(tiny.config, RuntimeConfig(attention="splash"), rngs=nnx.Rngs(0))
    nnx.update(splash, nnx.state(tiny))
    np.testing.assert_array_equal(_fwd(splash, ids), _fwd(tiny, ids))


def test_splash_kernel_interpret_matches_xla():
    """The TPU splash kernel run by the Pallas interpreter, against the XLA path, both in full float32 (on a GPU
    the default f32 matmul is TF32, off by ~1e-3). Skipped only when this jax lacks the kernel module; any error
    from running it is a failure (it runs with jax 0.10.2 and 0.11.2, on CPU and on an H100)."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention",
                        reason=f"jax {jax.__version__} has no Pallas TPU splash_attention module")
    q, k, v, mask = _qkv_mask(seed=11, B=2, L=130, H=4, G=2, K=128)
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        got = attn.splash(*args, jnp.asarray(mask), interpret=True)
        ref = attn.xla(*args, jnp.asarray(mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(ref)[real], rtol=2e-5, atol=2e-5)
