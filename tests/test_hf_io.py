"""HF interop: export round trip through transformers, Qwen3Model (embedding) layout, bad inputs."""
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jax.numpy as jnp
from flax import nnx

from g2rl_jax.model import load_pretrained, save_pretrained
from hf_tiny import make_tiny_qwen3_dir

_fwd = nnx.jit(lambda model, ids: model(ids))
IDS = np.random.RandomState(0).randint(0, 128, (2, 9))


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_tiny_qwen3_dir(tmp_path_factory.mktemp("hf") / "untied", num_key_value_heads=1, head_dim=16,
                               tie_word_embeddings=False)


def _torch_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("max_shard_bytes", [4 * 1024**3, 60_000])
def test_export_round_trip(untied, tmp_path, max_shard_bytes):
    """load -> save_pretrained -> transformers loads -> same logits (single file and sharded with an index)."""
    model = load_pretrained(untied)
    out = save_pretrained(model, tmp_path / "export", max_shard_bytes=max_shard_bytes)
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 10**6)
    ref = _torch_logits(untied)
    np.testing.assert_allclose(_torch_logits(out), ref, rtol=0, atol=1e-6)  # same weights, same torch code
    ours = np.asarray(_fwd(load_pretrained(out), jnp.asarray(IDS)))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_tied_export_round_trip(tmp_path):
    src = make_tiny_qwen3_dir(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    out = save_pretrained(load_pretrained(src), tmp_path / "export")
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    np.testing.assert_allclose(_torch_logits(out), _torch_logits(src), rtol=0, atol=1e-6)


def test_bf16_load_and_save(untied, tmp_path):
    model = load_pretrained(untied, dtype="bfloat16")
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    out = save_pretrained(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ref = _torch_logits(untied)
    assert np.abs(np.asarray(_fwd(model, jnp.asarray(IDS))) - ref).max() <= 5e-2 * np.abs(ref).max()


def test_qwen3model_layout_without_prefix_or_head(tmp_path):
    """Qwen3-Embedding style: architecture Qwen3Model, keys without 'model.', no lm_head."""
    torch.manual_seed(5)
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=False, rope_theta=10000.0)
    hf = transformers.Qwen3Model(cfg).float().eval()
    hf.save_pretrained(tmp_path / "emb")
    assert "embed_tokens.weight" in load_file(tmp_path / "emb" / "model.safetensors")
    model = load_pretrained(tmp_path / "emb")
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)).last_hidden_state.numpy()
    ours = np.asarray(nnx.jit(lambda m, i: m.hidden_states(i))(model, jnp.asarray(IDS)))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_rejects_other_architecture(untied, tmp_path):
    bad = _copy(untied, tmp_path / "llama")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config\.json: model_type is 'llama', expected 'qwen3'"):
        load_pretrained(bad)


def _rewrite_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_rejects_missing_tensor(untied, tmp_path):
    bad = _copy(untied, tmp_path / "missing")
    _rewrite_tensors(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_pretrained(bad)


def test_rejects_misshaped_tensor(untied, tmp_path):
    bad = _copy(untied, tmp_path / "shape")

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]

    _rewrite_tensors(bad, edit)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                         r"has shape \[8, 64\], expected \[16, 64\]"):
        load_pretrained(bad)


def test_rejects_unknown_dtype_and_missing_files(untied, tmp_path):
    with pytest.raises(ValueError, match="unknown load_pretrained dtype 'float8'"):
        load_pretrained(untied, dtype="float8")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)
