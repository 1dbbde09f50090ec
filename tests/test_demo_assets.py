"""The demo's assets: task, tokenizer, warm start, and the built model directories (real transformers + torch)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from g2rl_jax.data import load_dataset
from g2rl_jax.data.prompts import plain_prompt
from g2rl_jax.demo import build, sft, task
from g2rl_jax.demo import tokenizer as demo_tokenizer
from g2rl_jax.rewards import math_reward

SFT_STEPS = 40  # enough to see the loss fall and check the build path end to end; far from a useful policy


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer.make_tokenizer()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    policy = build.build_demo_model(root / "model", sft_steps=SFT_STEPS)
    return policy, build.build_demo_embedder(root / "embedder", policy)


# ------------------------------------------------------------------------------------------- task
def test_the_demo_datasets_load_in_a_fresh_process():
    """Imports run one way: `data` imports nothing of the demo, yet knows its dataset names; the first
    `load_dataset` of one imports the demo's task module, which registers them (a fresh process, as a user's)."""
    import subprocess
    import sys

    code = ("import sys; from g2rl_jax.data import dataset_names, load_dataset; "
            "assert not any(m.startswith('g2rl_jax.demo') for m in sys.modules), 'data imported the demo'; "
            "assert {'demo', 'demo_test', 'countdown', 'countdown_test'} <= set(dataset_names()), dataset_names(); "
            "assert len(load_dataset('demo_test')) == 256; assert 'g2rl_jax.demo.task' in sys.modules; "
            "assert len(load_dataset('countdown_test', limit=3)) == 3")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_splits_are_deterministic_disjoint_and_cover_every_problem():
    train, test = task.examples("train"), task.examples("test")
    assert [e.id for e in train] == [e.id for e in task.examples("train")]
    assert len(test) == task.TEST_SIZE and len(train) + len(test) == len(task.OPERANDS) ** 2
    assert not {e.problem for e in train} & {e.problem for e in test}
    assert test[0] == task.examples("test")[0]
    with pytest.raises(ValueError, match="unknown demo split 'dev'"):
        task.examples("dev")


def test_registered_datasets_are_the_splits():
    assert load_dataset("demo") == task.examples("train")
    assert load_dataset("demo_test") == task.examples("test")


def test_answers_verify_with_the_project_reward():
    for ex in task.examples("test")[:50] + task.examples("train")[:50]:
        a, b = map(int, ex.problem.split("+"))
        assert int(ex.answer) == a + b
        assert math_reward(task.solution(ex), ex.answer) == 1.0
        for error in task.TEACHER_ERRORS:  # every teacher slip is a wrong answer
            assert math_reward(task.solution(ex, error), ex.answer) == -1.0


# ------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trips_every_task_string(tokenizer):
    texts = [plain_prompt(ex) + task.solution(ex, e) for ex in task.examples("train") + task.examples("test")
             for e in (0, -10)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert tokenizer.batch_decode(ids) == texts
    assert tokenizer.unk_token_id not in {i for row in ids for i in row}
    other = "Any ASCII text: {x} ~ 3.14\n"
    assert tokenizer.decode(tokenizer(other, add_special_tokens=False)["input_ids"]) == other


def test_tokenizer_keeps_digits_single_and_prompts_short(tokenizer):
    vocab = tokenizer.get_vocab()
    assert not [t for t in vocab if len(t) > 1 and any(c.isdigit() for c in t)]
    ex = task.examples("test")[0]
    prompt_ids = tokenizer(plain_prompt(ex), add_special_tokens=False)["input_ids"]
    assert len(prompt_ids) <= 10
    assert demo_tokenizer.make_tokenizer().get_vocab() == vocab  # deterministic training


def test_autotokenizer_loads_the_built_directory(built, tokenizer):
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(built[0])
    text = plain_prompt(task.examples("test")[3]) + task.solution(task.examples("test")[3])
    assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert loaded.eos_token == loaded.pad_token == "<|endoftext|>" and loaded.eos_token_id == 0
    assert not loaded.chat_template


# ------------------------------------------------------------------------------------------- warm start
def test_encode_sft_masks_exactly_the_response_and_eos(tokenizer):
    examples = task.examples("train")[:3]
    ids, mask = sft.encode_sft(examples, tokenizer)
    assert ids.shape[:2] == mask.shape[:2] == (3, len(sft.ERRORS))
    for i, ex in enumerate(examples):
        for k, error in enumerate(sft.ERRORS):
            text = tokenizer.decode(ids[i, k][mask[i, k] > 0])
            assert text == task.solution(ex, error) + tokenizer.eos_token
            assert tokenizer.decode(ids[i, k][: int(np.argmax(mask[i, k]))]) == plain_prompt(ex)


def test_sft_loss_goes_down(built):
    losses = json.loads((built[0] / build.MARKER).read_text())["sft_losses"]
    assert len(losses) == SFT_STEPS and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses


def test_teacher_probabilities():
    probs = sft.SFTConfig(teacher_accuracy=0.4).variant_probs()
    np.testing.assert_allclose(probs, [0.4, 0.15, 0.15, 0.15, 0.15])
    with pytest.raises(ValueError, match="teacher_accuracy"):
        sft.SFTConfig(teacher_accuracy=0.0)


# ------------------------------------------------------------------------------------------- built directories
def _ids(tokenizer, n=4):
    texts = [plain_prompt(ex) + "\\boxed{" for ex in task.examples("test")[:n]]  # all "ab+cd": equal lengths
    return np.array(tokenizer(texts, add_special_tokens=False)["input_ids"], np.int32)


def test_policy_loads_in_transformers_and_jax_with_matching_logits(built, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from g2rl_jax.model import load_pretrained

    ids = _ids(tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(built[0], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids).long()).logits.numpy()
    ours = np.asarray(load_pretrained(built[0], "float32")(ids))
    assert ref.shape == ours.shape == (*ids.shape, build.PolicySpec().qwen3_config(len(tokenizer)).vocab_size)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)


def test_embedder_is_the_policy_backbone(built, tokenizer):
    import torch
    from transformers import AutoModel

    from g2rl_jax.model import load_pretrained

    policy, embedder = built
    assert json.loads((embedder / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    ids = _ids(tokenizer)
    hf = AutoModel.from_pretrained(embedder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids).long()).last_hidden_state.numpy()
    ours = np.asarray(load_pretrained(embedder, "float32").hidden_states(ids))
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(ours, np.asarray(load_pretrained(policy, "float32").hidden_states(ids)))


def test_build_is_cached_and_rebuilt_on_a_spec_change(built, tmp_path):
    policy, embedder = built
    stamp = (policy / "model.safetensors").stat().st_mtime_ns
    assert build.build_demo_model(policy, sft_steps=SFT_STEPS) == policy
    assert build.build_demo_embedder(embedder, policy) == embedder
    assert (policy / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    record = json.loads((policy / build.MARKER).read_text())
    assert record["spec_hash"] != build._spec_hash(build.policy_spec(seed=0, sft_steps=SFT_STEPS + 1))
    assert not list(policy.parent.glob(".*building*"))  # no staging directory left behind


def test_resolve_demo_paths(built, tmp_path):
    policy, embedder = built
    assert build.resolve_demo_paths("models/Qwen3-1.7B", None) == ("models/Qwen3-1.7B", None)
    # (a "demo:" model.path would rebuild the fixture's short-SFT policy with the default spec: too slow for here)
    assert build.resolve_demo_paths(str(policy), f"demo:{embedder}") == (str(policy), str(embedder))
    with pytest.raises(ValueError, match="names no directory"):
        build.resolve_demo_paths("demo:", None)
    with pytest.raises(ValueError, match="model.path must be a demo policy"):
        build.resolve_demo_paths(str(tmp_path), f"demo:{tmp_path / 'e'}")


def test_build_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a demo build"):
        build._publish(build._staging_dir(tmp_path / "mine"), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not list(tmp_path.glob(".*building*"))
