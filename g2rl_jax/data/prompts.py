"""Prompt templates: an Example becomes the text (and token ids) the policy is conditioned on.

- "chat" (default): the paper's system prompt (from SimpleRL-Zoo) and the question through the tokenizer's chat
  template, ending with the assistant header (`<|im_start|>assistant\\n` for Qwen3).
- "plain": the same instruction as plain text, for base models without a chat template.
Multiple-choice questions list their options as "A. ...", "B. ...", and ask for the letter in \\boxed{}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from g2rl_jax.data.datasets import LETTERS, Example

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
Template = Literal["chat", "plain"]
TEMPLATES: tuple[str, ...] = ("chat", "plain")


def user_message(example: Example) -> str:
    """The question as the user turn; choice questions get lettered options and the answer-format line."""
    if example.kind == "math":
        return example.problem
    assert example.choices is not None  # guaranteed by Example.__post_init__
    options = "\n".join(f"{LETTERS[i]}. {option}" for i, option in enumerate(example.choices))
    letters = ", ".join(LETTERS[: len(example.choices)])
    return (
        f"{example.problem}\n\n{options}\n\n"
        f"Answer with the letter of the correct option ({letters}) within \\boxed{{}}."
    )


def chat_prompt(example: Example, tokenizer: Any, *, system_prompt: str = SYSTEM_PROMPT) -> str:
    """System prompt + question through the tokenizer's chat template, ready for the assistant's reply."""
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat template; use template='plain' for base models without one")
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_message(example)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def plain_prompt(example: Example, *, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The same instruction and question as plain text, for base models without a chat template."""
    return f"{system_prompt}\n\nQuestion:\n{user_message(example)}\n\nAnswer:\n"


def render_prompt(example: Example, tokenizer: Any, template: Template = "chat") -> str:
    if template == "chat":
        return chat_prompt(example, tokenizer)
    if template == "plain":
        return plain_prompt(example)
    raise ValueError(f"unknown prompt template {template!r}; choose one of {TEMPLATES}")


def encode_prompts(examples: Sequence[Example], tokenizer: Any, template: Template = "chat") -> list[list[int]]:
    """Token ids per example; special tokens come from the template text itself, none are added."""
    texts = [render_prompt(example, tokenizer, template) for example in examples]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
