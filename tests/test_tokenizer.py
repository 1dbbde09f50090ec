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
