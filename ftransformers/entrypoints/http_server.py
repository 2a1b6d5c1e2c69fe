"""FastAPI app: OpenAI endpoints, SGLang native endpoints, /metrics; every error an OpenAI error object."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ftransformers.config.server_args import ServerArgs
from ftransformers.entrypoints.detokenizer import RequestState
from ftransformers.entrypoints.metrics import ServerMetrics
from ftransformers.entrypoints.openai_protocol import (
    APIError, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse, ChatResponseMessage,
    CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList, UsageInfo, chat_logprobs,
    completion_logprobs, error_body,
)
from ftransformers.entrypoints.reasoning_parser import ReasoningParser
from ftransformers.entrypoints.tokenizer_manager import TokenizerManager, is_internal_error

logger = logging.getLogger("ftransformers.server")
_SSE_DONE = b"data: [DONE]\n\n"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status)


def _raise_if_error(state: RequestState) -> None:
    if state.finish_reason == "error":
        if is_internal_error(state.error):
            raise APIError(state.error or "internal error", status=500, type="server_error")
        raise APIError(state.error or "the request failed")


def _usage(state: RequestState) -> dict[str, Any]:
    return UsageInfo.make(state.prompt_tokens, len(state.token_ids), state.cached_tokens).model_dump()


class APIKeyMiddleware:
    """Bearer-token check on every path but /health (pure ASGI, so streaming is untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                body = error_body("Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server_args: ServerArgs, tm: TokenizerManager, metrics: ServerMetrics | None = None) -> FastAPI:
    served_name = server_args.served_model_name or server_args.model_path or "default"
    reasoning_kind = server_args.reasoning_parser

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(title="ftransformers", lifespan=lifespan)
    app.state.tm = tm
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".rstrip(": ")))
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return _error_response(APIError(msg, param=loc[-1] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    def check_model(name: str | None) -> None:
        if name and name not in (served_name, server_args.model_path):
            raise APIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")

    # OpenAI -----------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=served_name, root=server_args.model_path, max_model_len=tm.context_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return ModelCard(id=served_name, root=server_args.model_path, max_model_len=tm.context_len).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        check_model(body.model)
        sp = body.sampling_params()
        ids = tm.apply_chat_template(body.template_messages(), body.template_kwargs())
        tm.validate(ids, sp, param="messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        use_parser = reasoning_kind != "none" and body.separate_reasoning
        if body.stream:
            parser = ReasoningParser(reasoning_kind) if use_parser else None
            gen = tm.generate(ids, sp, rid=rid)
            return StreamingResponse(_chat_stream(gen, rid, parser, body.include_usage), media_type="text/event-stream")
        state = await tm.generate_full(ids, sp, is_disconnected=raw.is_disconnected)
        if state is None:
            return Response(status_code=499)
        _raise_if_error(state)
        reasoning, content = ReasoningParser(reasoning_kind).parse(state.text) if use_parser else (None, state.text)
        choice = ChatCompletionChoice(
            finish_reason=state.finish_reason, matched_stop=state.matched_stop,
            message=ChatResponseMessage(content=content, reasoning_content=reasoning),
            logprobs=chat_logprobs(state.logprobs, tm.token_str) if state.logprobs is not None else None,
        )
        usage = UsageInfo.make(state.prompt_tokens, len(state.token_ids), state.cached_tokens)
        return ChatCompletionResponse(id=rid, model=served_name, choices=[choice], usage=usage).model_dump()

    async def _chat_stream(gen: Any, rid: str, parser: ReasoningParser | None, include_usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_name,
                                   "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        state: RequestState | None = None
        async with contextlib.aclosing(gen):
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for delta, state in gen:
                    if state.finish_reason == "error":
                        err = APIError(state.error or "the request failed")
                        yield _sse(err.to_dict())
                        break
                    reasoning, content = parser.feed(delta.text, delta.finished) if parser else ("", delta.text)
                    lps = chat_logprobs(delta.logprobs, tm.token_str) if delta.logprobs else None
                    if reasoning:
                        yield chunk({"reasoning_content": reasoning})
                    if content or lps:
                        yield chunk({"content": content}, logprobs=lps)
                    if delta.finished:
                        yield chunk({}, finish=state.finish_reason)
            except APIError as exc:
                yield _sse(exc.to_dict())
        if include_usage and state is not None:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_name,
                        "choices": [], "usage": _usage(state)})
        yield _SSE_DONE

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        check_model(body.model)
        sp = body.sampling_params()
        prompts = _prompt_list(body.prompt)
        inputs = [(p, tm.encode(p)) if isinstance(p, str) else (None, p) for p in prompts]
        for _, ids in inputs:
            tm.validate(ids, sp)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            if len(inputs) != 1:
                raise APIError("streaming supports a single prompt", param="prompt")
            text, ids = inputs[0]
            echo = (text if text is not None else tm.tokenizer.decode(ids)) if body.echo else ""
            gen = tm.generate(ids, sp, prompt_text=text, rid=rid)
            return StreamingResponse(_completion_stream(gen, rid, echo, body.include_usage), media_type="text/event-stream")
        states = await asyncio.gather(*(tm.generate_full(ids, sp, t, raw.is_disconnected) for t, ids in inputs))
        if any(s is None for s in states):
            return Response(status_code=499)
        choices: list[CompletionChoice] = []
        prompt_toks, completion_toks, cached = 0, 0, 0
        for i, ((text, ids), st) in enumerate(zip(inputs, states)):
            assert st is not None
            _raise_if_error(st)
            echo = (text if text is not None else tm.tokenizer.decode(ids)) if body.echo else ""
            lps = completion_logprobs(st.logprobs, tm.token_str, len(echo)) if st.logprobs is not None else None
            choices.append(CompletionChoice(index=i, text=echo + st.text, logprobs=lps, finish_reason=st.finish_reason,
                                            matched_stop=st.matched_stop))
            prompt_toks += st.prompt_tokens
            completion_toks += len(st.token_ids)
            cached += st.cached_tokens
        usage = UsageInfo.make(prompt_toks, completion_toks, cached)
        return CompletionResponse(id=rid, model=served_name, choices=choices, usage=usage).model_dump()

    async def _completion_stream(gen: Any, rid: str, echo: str, include_usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        offset = len(echo)

        def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": served_name,
                                   "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        state: RequestState | None = None
        async with contextlib.aclosing(gen):
            if echo:
                yield chunk(echo)
            try:
                async for delta, state in gen:
                    if state.finish_reason == "error":
                        yield _sse(APIError(state.error or "the request failed").to_dict())
                        break
                    lps = completion_logprobs(delta.logprobs, tm.token_str, offset) if delta.logprobs else None
                    offset += len(delta.text)
                    if delta.text or lps or delta.finished:
                        yield chunk(delta.text, state.finish_reason if delta.finished else None, lps)
            except APIError as exc:
                yield _sse(exc.to_dict())
        if include_usage and state is not None:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": served_name,
                        "choices": [], "usage": _usage(state)})
        yield _SSE_DONE

    # SGLang native ----------------------------------------------------------------------------
    from ftransformers.entrypoints.native_api import add_native_routes

    add_native_routes(app, server_args, tm, metrics, served_name)
    return app


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if not prompt:
        raise APIError("the prompt is empty", param="prompt")
    return list(prompt)
