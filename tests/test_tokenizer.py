"""The vendored real Qwen3 tokenizer and the paper's system prompt through its chat template."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from g2rl_jax.data import SYSTEM_PROMPT, Example, encode_prompts, render_prompt

TOKENIZER_DIR = Path(__file__).parent / "assets" / "qwen3_tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_known_ids(tokenizer):
    assert tokenizer("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert len(tokenizer) == 151669
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_with_system_prompt(tokenizer):
    example = Example(id="m", problem="What is $1+1$?", answer="2")
    text = render_prompt(example, tokenizer)
    assert text == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is $1+1$?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    (ids,) = encode_prompts([example], tokenizer)
    assert ids[0] == 151644 and ids.count(151644) == 3 and ids.count(151645) == 2
    assert tokenizer.decode(ids) == text
    assert render_prompt(example, tokenizer, "plain").startswith(SYSTEM_PROMPT)
    with pytest.raises(ValueError, match="unknown prompt template 'fancy'"):
        render_prompt(example, tokenizer, "fancy")


def test_missing_chat_template_is_a_clear_error(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="template='plain'"):
        render_prompt(Example(id="m", problem="1+1?", answer="2"), tokenizer)


def project_datasets() -> list[str]:
    """The datasets g2rl_jax registers (not those another test module registered in this worker process)."""
    from g2rl_jax import registry
    from g2rl_jax.data import dataset_names, datasets

    return [name for name in dataset_names() if name in registry.DATASETS
            or datasets._REGISTRY[name].__module__.startswith("g2rl_jax.")]


def test_load_tokenizer_equals_autotokenizer_on_every_dataset(tokenizer):
    """g2rl_jax's loader (no torch import) against AutoTokenizer on the real Qwen3 tokenizer: the same special
    tokens, and the same ids for every vendored dataset's prompts through the chat template and the plain template,
    with their references and solutions encoded and decoded."""
    from g2rl_jax.data import load_dataset
    from g2rl_jax.data.tokenizer import load_tokenizer

    ours = load_tokenizer(TOKENIZER_DIR)
    assert type(ours) is not type(tokenizer)  # not AutoTokenizer's class: the comparison below compares two loaders
    assert len(ours) == len(tokenizer) and ours.all_special_tokens == tokenizer.all_special_tokens
    assert (ours.eos_token_id, ours.pad_token_id, ours.chat_template) == \
        (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.chat_template)
    for name in project_datasets():
        examples = load_dataset(name, limit=300)
        for template in ("chat", "plain"):
            assert encode_prompts(examples, ours, template) == encode_prompts(examples, tokenizer, template), name
        texts = [f"{ex.answer} \\boxed{{{ex.answer}}}<|im_end|>" for ex in examples]
        ids = ours(texts)["input_ids"]
        assert ids == tokenizer(texts)["input_ids"], name
        assert ours.batch_decode(ids, skip_special_tokens=True) == tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_commands_load_tokenizers_without_importing_torch(tmp_path):
    """Where torch is installed (this test extra), AutoTokenizer's import brings it in (about 1.2 s); the commands'
    tokenizer loading does not, for the Qwen3 tokenizer and the demo's own."""
    import subprocess
    import sys

    from g2rl_jax.demo.tokenizer import make_tokenizer

    make_tokenizer().save_pretrained(tmp_path)
    code = ("import sys\n"
            "import g2rl_jax.train.loop, g2rl_jax.eval, g2rl_jax.analyze, g2rl_jax.train.sides\n"
            "from g2rl_jax.data.tokenizer import load_tokenizer\n"
            f"for folder in {str(TOKENIZER_DIR)!r}, {str(tmp_path)!r}:\n"
            "    load_tokenizer(folder)('1+1')\n"
            "print('torch before:', 'torch' in sys.modules)\n"
            "from transformers import AutoTokenizer\n"
            "print('torch after:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch before: False" in done.stdout and "torch after: True" in done.stdout, done.stdout


def test_every_command_loads_tokenizers_through_load_tokenizer():
    """One way in: no module but the loader itself (and `bench step`, which saves a tokenizer folder as
    AutoTokenizer writes it) names AutoTokenizer, so no command's start imports torch for its tokenizer."""
    root = Path(__file__).resolve().parents[1] / "g2rl_jax"
    allowed = {root / "data" / "tokenizer.py", root / "bench" / "step.py"}
    named = [p for p in root.rglob("*.py") if p not in allowed and "AutoTokenizer" in p.read_text()]
    assert named == [], named
