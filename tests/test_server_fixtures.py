"""Helpers for the server tests (no tests here): a tiny byte-level BPE tokenizer built offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! How are you today? I am fine, thank you.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: ( ) [ ] { } < > / \\ = + - * .",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u00e7a va \u2014 \u4f60\u597d\u4e16\u754c \U0001f600 \U0001f680",
    "<think>Let me think about it step by step.</think> The answer is 42.",
]


def build_tiny_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE (GPT-2 style: every byte is a token, so any text round-trips) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def make_tiny_server_checkpoint(path: str | Path) -> Path:
    """Tiny random Llama (tests/model_harness.py) whose vocab matches the tiny tokenizer, saved together."""
    from model_harness import make_tiny_checkpoint

    tokenizer = build_tiny_tokenizer()
    path = make_tiny_checkpoint("llama", path, vocab_size=len(tokenizer), max_position_embeddings=1024)
    tokenizer.save_pretrained(path)
    return Path(path)
