"""SGLang's native endpoints: /generate, /health, /health_generate, /flush_cache, /get_model_info,
/server_info, /start_profile, /stop_profile, and /metrics (with --enable-metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.config.server_args import ServerArgs
from ftransformers.entrypoints.detokenizer import RequestState
from ftransformers.entrypoints.metrics import ServerMetrics
from ftransformers.entrypoints.openai_protocol import APIError, GenerateRequest, error_body
from ftransformers.entrypoints.tokenizer_manager import TokenizerManager, is_internal_error
from ftransformers.scheduler.io_struct import ProfileReq

_HEALTH_GENERATE_TIMEOUT_S = 20.0


class ProfileRequest(BaseModel):
    """SGLang's /start_profile body; every field optional, the body too."""

    model_config = ConfigDict(extra="ignore")
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None  # 'CPU', 'GPU' (default: both; GPU only where CUDA exists)
    record_shapes: bool = False
    with_stack: bool = False


def _meta_info(state: RequestState, started: float) -> dict[str, Any]:
    reason: dict[str, Any] | None = None
    if state.finish_reason == "length":
        reason = {"type": "length", "length": len(state.token_ids)}
    elif state.finish_reason is not None:
        reason = {"type": state.finish_reason, "matched": state.matched_stop}
        if state.error:
            reason["message"] = state.error
    meta: dict[str, Any] = {
        "id": state.rid, "finish_reason": reason, "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.token_ids), "cached_tokens": state.cached_tokens,
        "e2e_latency": time.perf_counter() - started,
    }
    if state.logprobs is not None:
        meta["output_token_logprobs"] = [[r.logprob, r.token_id, None] for r in state.logprobs]
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in (r.top_logprobs or [])] for r in state.logprobs]
    return meta


def _generate_result(state: RequestState, started: float) -> dict[str, Any]:
    return {"text": state.text, "output_ids": list(state.token_ids), "meta_info": _meta_info(state, started)}


def add_native_routes(app: FastAPI, server_args: ServerArgs, tm: TokenizerManager, metrics: ServerMetrics | None,
                      served_name: str) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request) -> Any:
        if (body.text is None) == (body.input_ids is None):
            raise APIError("pass exactly one of `text` and `input_ids`", param="text")
        sp = body.make_sampling_params()
        if body.text is not None:
            batch = isinstance(body.text, list)
            inputs = [(t, tm.encode(t)) for t in (body.text if batch else [body.text])]
        else:
            ids = body.input_ids or []
            batch = bool(ids) and isinstance(ids[0], list)
            inputs = [(None, list(x)) for x in (ids if batch else [ids])]  # type: ignore[arg-type]
        for _, ids in inputs:
            tm.validate(ids, sp, param="text" if body.text is not None else "input_ids")
        started = time.perf_counter()
        if body.stream:
            if batch:
                raise APIError("streaming supports a single prompt", param="text")
            text, ids = inputs[0]
            return StreamingResponse(_stream(tm.generate(ids, sp, text, rid=body.rid), started),
                                     media_type="text/event-stream")
        states = await asyncio.gather(*(tm.generate_full(ids, _copy(sp), t, raw.is_disconnected) for t, ids in inputs))
        if any(s is None for s in states):
            return Response(status_code=499)
        for st in states:
            assert st is not None
            if st.finish_reason == "error":
                status = 500 if is_internal_error(st.error) else 400
                kind = "server_error" if status == 500 else "invalid_request_error"
                return JSONResponse(error_body(st.error or "the request failed", kind), status_code=status)
        results = [_generate_result(st, started) for st in states if st is not None]
        return results if batch else results[0]

    async def _stream(gen: Any, started: float) -> AsyncIterator[bytes]:
        import orjson

        async with contextlib.aclosing(gen):
            async for _, state in gen:
                yield b"data: " + orjson.dumps(_generate_result(state, started)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if tm.scheduler_dead else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        ids = tm.encode("Hi") or [0]
        try:
            state = await asyncio.wait_for(tm.generate_full(ids[:8], sp), _HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, APIError):
            return Response(status_code=503)
        ok = state is not None and state.finish_reason != "error" and len(state.token_ids) == 1
        return Response(status_code=200 if ok else 503)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Any:
        if not await tm.flush_cache():
            raise APIError("the cache was not flushed: requests are running or waiting", status=400)
        return {"success": True, "message": "Cache flushed."}

    async def _profile(req: ProfileReq) -> dict[str, Any]:
        try:
            out = await tm.profile(req)
        except asyncio.TimeoutError:
            raise APIError("the model process did not answer the profile request", status=503,
                           type="server_error") from None
        if not out.success:
            raise APIError(out.message, status=400)
        return {"success": True, "message": out.message, "path": out.path}

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(body: ProfileRequest | None = None) -> dict[str, Any]:
        body = body or ProfileRequest()
        if body.num_steps is not None and body.num_steps < 1:
            raise APIError("num_steps must be at least 1", param="num_steps")
        return await _profile(ProfileReq("start", body.output_dir, body.num_steps, body.activities,
                                         body.record_shapes, body.with_stack))

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> dict[str, Any]:
        return await _profile(ProfileReq("stop"))

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": server_args.model_path,
            "tokenizer_path": server_args.tokenizer_path or server_args.model_path,
            "served_model_name": served_name,
            "context_length": tm.context_len,
            "is_generation": True,
            "architecture": tm.model_info.get("architecture"),
        }

    @app.api_route("/server_info", methods=["GET"])
    @app.api_route("/get_server_info", methods=["GET"])
    async def server_info() -> dict[str, Any]:
        args = dataclasses.asdict(server_args)
        if args.get("api_key"):
            args["api_key"] = "***"
        stats = await tm.get_stats()
        info = {k: v for k, v in tm.model_info.items() if k != "status"}
        return {**args, "model_info": info, "max_total_num_tokens": tm.kv_capacity,
                "scheduler_stats": dataclasses.asdict(stats),
                "frontend_stats": {"num_requests": tm.num_requests, "num_finished": tm.num_finished,
                                   "num_aborted": tm.num_aborted, "num_in_flight": tm.num_in_flight},
                "version": _version()}

    if metrics is not None:
        @app.get("/metrics")
        async def metrics_endpoint() -> Response:
            with contextlib.suppress(asyncio.TimeoutError):
                metrics.set_scheduler_stats(await tm.get_stats(timeout=2.0))
            return Response(metrics.render(), media_type=metrics.content_type)


def _copy(sp: SamplingParams) -> SamplingParams:
    return dataclasses.replace(sp) if dataclasses.is_dataclass(sp) else sp


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ftransformers")
    except Exception:
        return "unknown"

