"""Sampling parameters with vLLM's field names; `validate()` gives one-line reasons for bad values."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message is fit for an HTTP 400 body."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k limit
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob plus the top k
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100), after penalties
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is not None:  # JSON gives the ids as strings
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = float(value)
                except (TypeError, ValueError):
                    raise SamplingParamsError(
                        f"logit_bias maps token ids to numbers; got {key!r}: {value!r}") from None
            self.logit_bias = bias or None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        if self.temperature < 0.0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.repetition_penalty <= 0.0:
            raise SamplingParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(f"logit_bias must map token ids >= 0 to values in [-100, 100]; got "
                                          f"{token}: {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be in [0, 20], got {self.logprobs}")
