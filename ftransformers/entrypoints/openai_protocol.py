"""OpenAI (and SGLang native) request/response models with OpenAI's field names.

Unknown fields are ignored, as the OpenAI API does; SGLang/vLLM sampling extras (`top_k`, `min_p`,
`ignore_eos`, `min_tokens`, `repetition_penalty`, `stop_token_ids`, ...) are accepted. OpenAI fields asking for what
this server does not do get HTTP 400 naming the field, never a silent default: `n` or `best_of` above 1, a
`response_format` other than text (no constrained decoding), `tools` unless `tool_choice` is "none" (no tool-call
parser; with "none" the tools reach the chat template) and `functions`, content parts other than text (text-only
models), and a completion's `suffix`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ftransformers.config.sampling_params import SamplingParams, SamplingParamsError


class APIError(Exception):
    """Becomes an OpenAI error object {"error": {message, type, param, code}} with `status`."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    # SGLang / vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise APIError(f"n={self.n} is not supported; only n=1", param="n")
        if self.top_k == 0:
            top_k = -1
        else:
            top_k = self.top_k
        return make_sampling_params(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k, min_p=self.min_p, max_tokens=max_tokens, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
            logprobs=logprobs, frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        msg = str(exc)
        raise APIError(msg, param=msg.split(" ", 1)[0]) from exc
    except TypeError as exc:
        raise APIError(str(exc)) from exc


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # tools' deprecated form

    def sampling_params(self) -> SamplingParams:
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise APIError(f"response_format type {kind!r} is not supported: this server has no constrained "
                           "decoding; only 'text'", param="response_format")
        if self.functions:
            raise APIError("function calls are not supported: this server has no tool-call parser", param="functions")
        if self.tools and self.tool_choice != "none":
            raise APIError("tool calls are not supported: this server has no tool-call parser. Send tool_choice "
                           "'none' to show the model the tools without calling them", param="tool_choice")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, lp)

    def template_kwargs(self) -> dict[str, Any]:
        """apply_chat_template's extra arguments: chat_template_kwargs, and the tools (tool_choice 'none')."""
        return {**({"tools": self.tools} if self.tools else {}), **(self.chat_template_kwargs or {})}

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for apply_chat_template; the text parts of a content list are joined."""
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                for part in m.content:
                    if part.get("type", "text") != "text":
                        raise APIError(f"content part type {part.get('type')!r} is not supported: the model takes "
                                       "text only", param="messages")
                d["content"] = "".join(str(p.get("text", "")) for p in m.content)
            elif m.content is None:
                d["content"] = ""
            out.append(d)
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.best_of not in (None, 1):
            raise APIError(f"best_of={self.best_of} is not supported; only 1", param="best_of")
        if self.suffix:
            raise APIError("suffix (insertion) is not supported", param="suffix")
        return self._sampling(self.max_tokens, self.logprobs)


class GenerateRequest(_Request):
    """SGLang native /generate."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | None = None

    def make_sampling_params(self) -> SamplingParams:
        sp = dict(self.sampling_params)
        renames = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
        for old, new in renames.items():
            if old in sp:
                sp[new] = sp.pop(old)
        sp.setdefault("max_tokens", 128)
        if sp.get("top_k") == 0:
            sp["top_k"] = -1
        sp.pop("n", None)
        if self.return_logprob:
            sp["logprobs"] = self.top_logprobs_num
        return make_sampling_params(**sp)


# Responses ------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def make(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ftransformers"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Logprobs formatting --------------------------------------------------------------------------
def chat_logprobs(results: list[Any], token_str: Any) -> dict[str, Any]:
    """SeqResults -> OpenAI chat `logprobs` ({"content": [...]}); `token_str` maps an id to its text."""

    def entry(tid: int, lp: float | None) -> dict[str, Any]:
        s = token_str(tid)
        return {"token": s, "logprob": lp if lp is not None else 0.0, "bytes": list(s.encode("utf-8"))}

    content = []
    for r in results:
        e = entry(r.token_id, r.logprob)
        e["top_logprobs"] = [entry(t, lp) for t, lp in (r.top_logprobs or [])]
        content.append(e)
    return {"content": content}


def completion_logprobs(results: list[Any], token_str: Any, text_offset: int = 0) -> dict[str, Any]:
    """SeqResults -> legacy completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for r in results:
        s = token_str(r.token_id)
        tokens.append(s)
        token_lps.append(r.logprob)
        tops.append({token_str(t): lp for t, lp in (r.top_logprobs or [])})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
