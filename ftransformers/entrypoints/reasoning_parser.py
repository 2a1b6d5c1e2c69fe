"""Split `<think>...</think>` reasoning from the answer (`--reasoning-parser`), whole or streamed.

- 'deepseek-r1': the chat template opens the think block itself, so the output starts inside it:
  everything before `</think>` is reasoning (a leading `<think>` the model repeats is dropped).
- 'qwen3': the model writes `<think>` explicitly; output that does not open with it is all content.
A think block that never closes (the output was cut off) is all reasoning.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("deepseek-r1", "qwen3")


class ReasoningParser:
    def __init__(self, kind: str) -> None:
        if kind not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; valid choices: {', '.join(REASONING_PARSERS)}")
        self.kind = kind
        self._state = "start"  # start -> reasoning -> content; 'start' may go straight to content
        self._buf = ""
        self._content_started = False

    # Non-streaming ----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, str]:
        """Whole output -> (reasoning_content or None, content)."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            body = stripped[len(THINK_START) :]
        elif self.kind == "deepseek-r1":
            body = text
        else:
            return None, text
        reasoning, sep, content = body.partition(THINK_END)
        if not sep:
            return reasoning, ""
        return reasoning, content.lstrip()

    # Streaming --------------------------------------------------------------------------------
    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        """Streamed text -> (reasoning delta, content delta). Tags split across deltas are held back."""
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._buf = head[len(THINK_START) :]
                    self._state = "reasoning"
                elif THINK_START.startswith(head) and not finished:
                    break  # empty or a prefix of "<think>": not yet decided
                else:
                    self._state = "reasoning" if self.kind == "deepseek-r1" else "content"
                    self._content_started = self._state == "content"  # no think block: keep text as is
            elif self._state == "reasoning":
                idx = self._buf.find(THINK_END)
                if idx != -1:
                    reasoning += self._buf[:idx]
                    self._buf = self._buf[idx + len(THINK_END) :]
                    self._state = "content"
                    continue
                hold = 0 if finished else _partial_suffix(self._buf, THINK_END)
                reasoning += self._buf[: len(self._buf) - hold]
                self._buf = self._buf[len(self._buf) - hold :]
                break
            else:
                text = self._buf
                if not self._content_started:
                    text = text.lstrip()
                    self._content_started = bool(text)
                content += text
                self._buf = ""
                break
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
