"""Prompts of an exact token length, from random vocabulary tokens, a JSONL file, or a shared prefix.

A random prompt is a sequence of ordinary vocabulary tokens (no special tokens, none that decode to a
partial UTF-8 character), decoded to text and re-encoded; the sequence is trimmed or extended until the
text the server will see counts exactly `target` tokens. For `openai-chat` that count includes the chat
template around the user message, so the server's `usage.prompt_tokens` should equal `--input-length`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ftransformers.bench.client import Prompt

_MAX_ROUNDS = 64


class PromptError(RuntimeError):
    """A user-facing failure (bad tokenizer path, unreadable dataset); printed as one line."""


def load_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=not _looks_remote(path))
    except Exception as exc:  # transformers raises many kinds (OSError, ValueError, ...)
        raise PromptError(f"cannot load a tokenizer from {path!r} ({type(exc).__name__}); pass --tokenizer-path "
                          "with a local model or tokenizer folder") from exc


def _looks_remote(path: str) -> bool:
    return not Path(path).exists() and "/" in path and not path.startswith(("/", "."))


class PromptFactory:
    def __init__(self, tokenizer: Any, api: str, seed: int) -> None:
        self.tok, self.api = tokenizer, api
        self.rng = random.Random(seed)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [i for i in range(len(tokenizer)) if i not in special]
        pieces = tokenizer.batch_decode([[i] for i in ids])
        # tokens that decode to whole, visible text re-encode predictably
        self.vocab = [i for i, p in zip(ids, pieces) if p.strip() and "\ufffd" not in p]
        if not self.vocab:
            raise PromptError("the tokenizer has no ordinary tokens to build random prompts from")
        if api == "openai-chat" and getattr(tokenizer, "chat_template", None) is None:
            raise PromptError("the tokenizer has no chat template; use --api openai-completions or --tokenizer-path "
                              "with the served model's tokenizer")

    def count(self, text: str) -> int:
        """Prompt tokens the server will count for `text`, sent as this API's prompt."""
        if self.api == "openai-chat":
            templated = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False)
            return len(self.tok.encode(templated, add_special_tokens=False))
        return len(self.tok.encode(text))

    def count_output(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def random_ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def exact(self, target: int, prefix: str = "") -> Prompt:
        """A prompt of exactly `target` tokens (as `count` sees it) starting with `prefix`."""
        overhead = self.count(prefix + "a") - 1 if prefix else self.count("a") - 1
        ids = self.random_ids(max(target - overhead, 1))
        best: tuple[int, str] | None = None
        for _ in range(_MAX_ROUNDS):
            text = prefix + self.tok.decode(ids)
            n = self.count(text)
            if best is None or abs(n - target) < abs(best[0] - target):
                best = (n, text)
            if n == target:
                break
            if n > target:
                cut = n - target
                if cut >= len(ids):
                    break
                ids = ids[:-cut]
            else:
                ids = ids + self.random_ids(target - n)
        assert best is not None
        return Prompt(text=best[1], expected_prompt_tokens=best[0])

    def random_prompts(self, n: int, input_len: int, prefix_len: int = 0, output_len: int | None = None,
                       range_ratio: float = 1.0) -> list[Prompt]:  # fmt: skip
        """`n` prompts of `input_len` tokens sharing a random prefix of `prefix_len`. Below a `range_ratio` of 1, each
        prompt's length is uniform over [max(1, int(input_len x ratio)), input_len] (past the prefix) and its
        `output_len` over [max(1, int(output_len x ratio)), output_len] (SGLang's --random-range-ratio)."""
        prefix = ""
        if prefix_len > 0:
            prefix = self.tok.decode(self.random_ids(prefix_len))
            prefix = self.tok.decode(self.tok.encode(prefix, add_special_tokens=False)[:prefix_len])
        if range_ratio >= 1.0:
            return [self.exact(input_len, prefix) for _ in range(n)]
        out = []
        for _ in range(n):
            length = self.rng.randint(max(int(input_len * range_ratio), 1, prefix_len + 1), input_len)
            prompt = self.exact(length, prefix)
            if output_len is not None:
                prompt.output_len = self.rng.randint(max(int(output_len * range_ratio), 1), output_len)
            out.append(prompt)
        return out


def load_jsonl(path: str) -> list[str]:
    """Prompts from a JSONL file: each line an object with `prompt`, `text`, `question` or `messages`, or a string."""
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"--dataset-path {path!r} is not a file")
    prompts: list[str] = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise PromptError(f"{path}:{lineno}: not JSON ({exc})") from exc
        text = _prompt_text(obj)
        if not text:
            raise PromptError(f"{path}:{lineno}: no `prompt`, `text`, `question` or `messages` field")
        prompts.append(text)
    if not prompts:
        raise PromptError(f"--dataset-path {path!r} holds no prompts")
    return prompts


def _prompt_text(obj: Any) -> str | None:
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        return None
    for key in ("prompt", "text", "question", "input"):
        if isinstance(obj.get(key), str):
            return obj[key]
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        users = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[0], str):
            return users[0]
    return None


def dataset_prompts(factory: PromptFactory, texts: list[str], n: int, start: int) -> list[Prompt]:
    """`n` prompts cycling through the file from `start` (each point continues where the last stopped)."""
    chosen = [texts[(start + i) % len(texts)] for i in range(n)]
    return [Prompt(text=t, expected_prompt_tokens=factory.count(t)) for t in chosen]
