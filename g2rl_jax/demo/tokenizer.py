"""The demo's own tokenizer: a tiny BPE trained on the demo's prompts, saved as a Hugging Face directory.

The base alphabet is one token per character of printable ASCII plus newline, so `decode(encode(text)) == text`
for any ASCII text (other characters become `<|unk|>`). Digits are always single tokens (a pre-tokenizer
isolates them, so no merge ever spans a digit); BPE merges, learned from the plain-template prompts and reference
responses of the demo task, compress the fixed text around them ("Please reason step by step, ... Question:\\n",
"\\n\\nAnswer:\\n", "\\boxed{") to a few tokens. A prompt is then ~10 tokens instead of ~100 characters, which
is most of what makes the demo's RL steps fast on a laptop CPU.

Special tokens: `<|endoftext|>` (id 0: end of sequence and padding, as in Qwen3 base models) and `<|unk|>`.
No chat template: the demo formats prompts with `data.prompt_template: plain`.

    tokenizer = make_tokenizer()                      # deterministic: same merges on every machine
    tokenizer.save_pretrained(model_dir)              # load_tokenizer(model_dir) loads it back (data/tokenizer.py)
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from g2rl_jax.data.prompts import plain_prompt
from g2rl_jax.demo.task import examples, solution

EOS = "<|endoftext|>"
UNK = "<|unk|>"
SPECIALS = (EOS, UNK)
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII (space .. ~)
MAX_VOCAB = 256  # upper bound for BPE training; it stops earlier, once every digit-free span is one token
CORPUS_EXAMPLES = 64  # the fixed text is the same in every prompt, so a few examples teach every merge


def corpus() -> list[str]:
    """The texts the merges are learned from: prompt + reference response of the first training examples."""
    return [plain_prompt(ex) + solution(ex) for ex in examples("train")[:CORPUS_EXAMPLES]]


def make_tokenizer(texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train the BPE on `texts` (default: the addition demo's `corpus()`; deterministic: same corpus, same
    merges) and wrap it for transformers."""
    core = Tokenizer(models.BPE(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[0-9]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=MAX_VOCAB, special_tokens=list(SPECIALS),
                                  initial_alphabet=list(CHARACTERS), limit_alphabet=len(CHARACTERS),
                                  show_progress=False)
    core.train_from_iterator(corpus() if texts is None else texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS, unk_token=UNK,
                                   clean_up_tokenization_spaces=False, model_max_length=256)
