"""Incremental detokenization and stop strings, shared by the server and the offline `LLM`.

Free of server dependencies: it needs only a Hugging Face tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftransformers.config.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token, so that a leading space the tokenizer
# strips at the start of a sequence (sentencepiece "▁") is kept on the first output word.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """vLLM-style prefix/read offsets over the output tokens.

    Invariant: tokens [prefix_offset, read_offset) have been emitted as text; each step decodes
    [prefix_offset, end) and [prefix_offset, read_offset) and emits the difference, but only when
    the new text does not end in U+FFFD (an incomplete UTF-8 character whose bytes span tokens).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-INITIAL_CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids: list[int] = context
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # everything emitted so far

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. only special tokens, or bytes of a character still being assembled
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds the first stop string in the generated text; trims it and everything after it.

    While streaming it holds back the longest tail of the text that is a proper prefix of some stop
    string (never more than the longest stop string minus one characters), so a partial stop string
    is never emitted and later retracted.
    """

    def __init__(self, stop: list[str] | None) -> None:
        self.stop = [s for s in (stop or []) if s]
        self.max_len = max((len(s) for s in self.stop), default=0)
        self._text = ""
        self._emitted = 0  # chars of _text already returned
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """All text that is (or will be) emitted: trimmed at the stop string once one matched."""
        return self._text

    def process(self, new_text: str, finished: bool = False) -> tuple[str, bool]:
        """Feed newly decoded text; return (text safe to emit now, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        self._text += new_text
        if not self.stop:
            return self._take(len(self._text)), False
        # Any match starts at or after _emitted: the emitted text never ends in a stop-string prefix.
        hit, hit_stop = -1, None
        for s in self.stop:
            idx = self._text.find(s, self._emitted)
            if idx != -1 and (hit == -1 or idx < hit):
                hit, hit_stop = idx, s
        if hit_stop is not None:
            self.matched = hit_stop
            self._text = self._text[:hit]
            return self._take(hit), True
        if finished:
            return self._take(len(self._text)), False
        return self._take(len(self._text) - self._held_tail()), False

    def _held_tail(self) -> int:
        limit = min(self.max_len - 1, len(self._text) - self._emitted)
        for n in range(limit, 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out


@dataclass
class OutputDelta:
    """What one batch of ReqOutputs added to a request: new text and tokens, and how it ended."""

    text: str
    token_ids: list[int]
    logprobs: list[Any] | None
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None


@dataclass
class RequestState:
    """Turns a request's stream of ReqOutputs into text: detokenizer + stop strings + bookkeeping.

    `apply(out)` returns the OutputDelta; when a stop string matched (`stopped_by_string`) the
    request is finished here with reason 'stop' and the caller must abort it in the scheduler.
    """

    rid: str
    tokenizer: Any
    sampling_params: SamplingParams
    prompt_text: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stopped_by_string: bool = False

    def __post_init__(self) -> None:
        sp = self.sampling_params
        self.detokenizer = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens, self.prompt_ids)
        self.matcher = StopStringMatcher(sp.stop_strings)
        self.prompt_tokens = len(self.prompt_ids)
        if sp.logprobs is not None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.matcher.text

    def apply(self, out: Any) -> OutputDelta:
        """Consume one ReqOutput (from io_struct) of this request."""
        if self.finished:
            return OutputDelta("", [], None, True, self.finish_reason, self.matched_stop)
        new_ids = list(out.new_token_ids)
        self.token_ids.extend(new_ids)
        new_lps = list(out.new_logprobs) if out.new_logprobs is not None else None
        if self.logprobs is not None and new_lps is not None:
            self.logprobs.extend(new_lps)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        text_ids = new_ids
        # A stop token (eos or stop_token_ids) ends the sequence but is not part of its text.
        if out.finished and out.finish_reason == "stop" and out.matched_stop is not None:
            if text_ids and text_ids[-1] == out.matched_stop:
                text_ids = text_ids[:-1]
        text = self.detokenizer.add_tokens(text_ids)
        if out.finished:
            text += self.detokenizer.flush()
        emit, stopped = self.matcher.process(text, finished=out.finished)
        if stopped:
            self.stopped_by_string = True
            self.finish_reason, self.matched_stop = "stop", self.matcher.matched
        elif out.finished:
            self.finish_reason, self.matched_stop, self.error = out.finish_reason, out.matched_stop, out.error
        return OutputDelta(emit, new_ids, new_lps, self.finished, self.finish_reason, self.matched_stop)
