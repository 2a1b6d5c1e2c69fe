"""Async streaming client for the three `--api` kinds: OpenAI chat, OpenAI completions, SGLang `/generate`.

One call to `BenchClient.send` is one request and one `RequestRecord`. Times come from
`time.perf_counter()` relative to the send; the first chunk carrying text (or `reasoning_content`) is the
first token. A request that errors, or ends without a single token, is a failure, never a zero.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ftransformers.bench.records import RequestRecord

API_KINDS = ("openai-chat", "openai-completions", "generate")
_PATHS = {"openai-chat": "/v1/chat/completions", "openai-completions": "/v1/completions", "generate": "/generate"}


@dataclass
class Prompt:
    text: str
    expected_prompt_tokens: int | None = None  # what our tokenizer counts (chat template included for chat)
    output_len: int | None = None  # this request's output tokens (--random-range-ratio); None: the point's


class StreamError(Exception):
    """An error object that arrived inside an SSE stream."""


def error_message(payload: Any, fallback: str) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or fallback)
        if isinstance(err, str):
            return err
        if "detail" in payload:
            return str(payload["detail"])
    return fallback


def describe_http_error(exc: Exception, timeout: float) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect: {exc}" if str(exc) else "cannot connect"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out after {timeout:g} s ({type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"connection closed by the server: {exc}"
    return f"{type(exc).__name__}: {exc}"


class BenchClient:
    def __init__(self, base_url: str, model: str | None, api: str, api_key: str | None = None,
                 timeout: float = 600.0, fixed_output: bool = True,
                 count_tokens: Callable[[str], int] | None = None, max_connections: int = 1024,
                 extra_body: dict[str, Any] | None = None) -> None:
        if api not in API_KINDS:
            raise ValueError(f"unknown api {api!r}; valid: {', '.join(API_KINDS)}")
        self.base_url, self.model, self.api = base_url.rstrip("/"), model, api
        self.timeout, self.fixed_output, self.count_tokens = timeout, fixed_output, count_tokens
        self.extra_body = dict(extra_body or {})  # merged last: it overrides the defaults (e.g. temperature 0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits,
                                      timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)))

    async def aclose(self) -> None:
        await self.http.aclose()

    def body(self, prompt: Prompt, output_len: int) -> dict[str, Any]:
        fixed = {"ignore_eos": True, "min_tokens": output_len} if self.fixed_output else {}
        if self.api == "generate":
            sp: dict[str, Any] = {"max_new_tokens": output_len, "temperature": 0.0}
            if self.fixed_output:
                sp.update(ignore_eos=True, min_new_tokens=output_len)
            return {"text": prompt.text, "sampling_params": {**sp, **self.extra_body}, "stream": True}
        body: dict[str, Any] = {"model": self.model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}, **fixed}
        if self.api == "openai-chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        return {**body, **self.extra_body}

    async def send(self, prompt: Prompt, output_len: int, point: str, index: int) -> RequestRecord:
        rec = RequestRecord(point=point, index=index, send_time=time.time(), expected_output_tokens=output_len,
                            expected_prompt_tokens=prompt.expected_prompt_tokens)
        start = rec.send_mono = time.perf_counter()
        pieces: list[str] = []
        try:
            async with self.http.stream("POST", _PATHS[self.api], json=self.body(prompt, output_len)) as resp:
                if resp.status_code != 200:
                    raw = await resp.aread()
                    try:
                        payload: Any = json.loads(raw)
                    except ValueError:
                        payload = raw.decode(errors="replace")[:200]
                    rec.error = f"HTTP {resp.status_code}: {error_message(payload, str(payload) or resp.reason_phrase)}"
                else:
                    await self._read_stream(resp, rec, pieces, start)
        except StreamError as exc:
            rec.error = f"stream error: {exc}"
        except httpx.HTTPError as exc:
            rec.error = describe_http_error(exc, self.timeout)
        rec.end_time = time.perf_counter() - start
        text = "".join(pieces)
        if self.count_tokens is not None and text:
            rec.completion_tokens_tokenizer = self.count_tokens(text)
        if rec.error is None and not rec.token_times:
            rec.error = "no tokens returned"
        rec.success = rec.error is None
        if rec.success:
            got = rec.completion_tokens if rec.completion_tokens is not None else rec.completion_tokens_tokenizer
            rec.short = self.fixed_output and got is not None and got < output_len
        return rec

    async def _read_stream(self, resp: httpx.Response, rec: RequestRecord, pieces: list[str], start: float) -> None:
        seen_text = ""  # /generate streams cumulative text
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            if not data:
                continue
            now = time.perf_counter() - start
            try:
                obj = json.loads(data)
            except ValueError as exc:
                raise StreamError(f"malformed SSE data: {data[:80]!r}") from exc
            if isinstance(obj, dict) and "error" in obj and obj["error"]:
                raise StreamError(error_message(obj, "error event"))
            if self.api == "generate":
                text = str(obj.get("text") or "")
                new = text.removeprefix(seen_text)
                meta = obj.get("meta_info") or {}
                if new:
                    rec.token_times.append(now)
                    pieces.append(new)
                    seen_text = text
                _take_usage(rec, meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens"))
                continue
            for choice in obj.get("choices") or []:
                if self.api == "openai-chat":
                    delta = choice.get("delta") or {}
                    new = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
                else:
                    new = choice.get("text") or ""
                if new:
                    rec.token_times.append(now)
                    pieces.append(new)
            usage = obj.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                _take_usage(rec, usage.get("prompt_tokens"), usage.get("completion_tokens"), details.get("cached_tokens"))


def _take_usage(rec: RequestRecord, prompt: Any, completion: Any, cached: Any) -> None:
    if isinstance(prompt, int):
        rec.prompt_tokens = prompt
    if isinstance(completion, int):
        rec.completion_tokens = completion
    if isinstance(cached, int):
        rec.cached_tokens = cached
