"""HF interop: export round trip through transformers, Qwen3Model (embedding) layout, the Qwen3-Embedding
tokenizer's pooled end token, bad inputs."""
import json
import logging
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import processors

from g2rl_jax.model import load_pretrained, save_pretrained
from g2rl_jax.train.setup import embedding_token_ids

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


@pytest.mark.parametrize("architectures, tied", [
    (["Qwen3Model"], False),
    (["Qwen3ForCausalLM"], False),  # as the Qwen3-Embedding-8B release: a bare Qwen3Model under this name
    (["Qwen3ForCausalLM"], True),   # as Qwen3-Embedding-0.6B / 4B
])
def test_qwen3model_layout_without_prefix_or_head(tmp_path, caplog, architectures, tied):
    """Qwen3-Embedding style: keys without 'model.', no lm_head; the layout comes from the tensor names, whatever
    config.json's architectures says. Hidden states match transformers' Qwen3Model read from the same files."""
    path = make_tiny_qwen3_dir(tmp_path / "emb", seed=5, encoder=True, vocab_size=131, num_key_value_heads=2,
                               head_dim=16, tie_word_embeddings=tied)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": architectures}))
    keys = load_file(path / "model.safetensors")
    assert "embed_tokens.weight" in keys and "norm.weight" in keys and "lm_head.weight" not in keys
    with caplog.at_level(logging.WARNING, logger="g2rl_jax.model.hf_io"):
        model = load_pretrained(path)
    assert model.lm_head is None and model.config.vocab_size == 131
    assert any("no lm_head" in r.getMessage() for r in caplog.records) == (not tied)
    hf = transformers.Qwen3Model.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)).last_hidden_state.numpy()
    ours = np.asarray(nnx.jit(lambda m, i: m.hidden_states(i))(model, jnp.asarray(IDS)))
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


QWEN3_TOKENIZER = pathlib.Path(__file__).parent / "assets" / "qwen3_tokenizer"
ENDOFTEXT, IM_END = 151643, 151645


def _qwen3_embedding_tokenizer(path):
    """The vendored Qwen3 tokenizer with Qwen3-Embedding's post-processor (appends <|endoftext|>), from disk."""
    shutil.copytree(QWEN3_TOKENIZER, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = json.loads(processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", ENDOFTEXT)]).__getstate__())
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return transformers.AutoTokenizer.from_pretrained(path)


def test_embedding_ids_end_with_the_tokenizers_own_end_token(tmp_path):
    """Qwen3-Embedding pools on the <|endoftext|> its post-processor appends (not its eos <|im_end|>): no second
    end token after it. A tokenizer that appends nothing (Qwen3 base) gets its eos appended."""
    emb = _qwen3_embedding_tokenizer(tmp_path / "emb_tok")
    assert emb.eos_token_id == IM_END and emb.pad_token_id == ENDOFTEXT
    text_ids = emb("test again", add_special_tokens=False)["input_ids"]
    assert emb("test again")["input_ids"] == text_ids + [ENDOFTEXT]  # the post-processor is live
    assert embedding_token_ids(emb, "test again", 1024) == text_ids + [ENDOFTEXT]
    for max_tokens in (1024, 37):  # algorithm.embedding_max_tokens: the tail is kept, end token included
        long_ids = embedding_token_ids(emb, "word " * 2000, max_tokens)
        assert len(long_ids) == max_tokens and long_ids[-1] == ENDOFTEXT and long_ids.count(ENDOFTEXT) == 1
    base = transformers.AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    assert embedding_token_ids(base, "test again", 1024) == text_ids + [IM_END]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_rejects_other_architecture(untied, tmp_path):
    bad = _copy(untied, tmp_path / "llama")
    config = json.loads((bad / "config.json").read_text())
    llama = {**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (bad / "config.json").write_text(json.dumps(llama))
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


def test_rejects_causal_lm_without_head(untied, tmp_path):
    """A `model.`-prefixed (Qwen3ForCausalLM) untied checkpoint without lm_head.weight is broken, not an encoder."""
    bad = _copy(untied, tmp_path / "headless")
    _rewrite_tensors(bad, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"tensor 'lm_head\.weight' is missing from the checkpoint"):
        load_pretrained(bad)


def test_rejects_checkpoint_without_embedding(untied, tmp_path):
    bad = _copy(untied, tmp_path / "noembed")
    _rewrite_tensors(bad, lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(ValueError, match=r"neither 'model\.embed_tokens\.weight' \(Qwen3ForCausalLM\) nor "
                                         r"'embed_tokens\.weight' \(Qwen3Model\)"):
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
