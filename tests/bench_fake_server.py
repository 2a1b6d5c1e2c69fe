"""A test server with programmed timing for `ftransformers bench`: OpenAI chat and completions, SGLang
/generate, /get_model_info, /v1/models, /metrics. Each request streams one token per chunk: the first
`ttft` seconds after arrival, then one every `gap` seconds, against absolute deadlines (sleep overshoot never
accumulates). POST /_config changes the behaviour between tests:

  ttft, gap              timing in seconds; gap_per_inflight adds that many seconds per request in flight
  fail_every             every k-th request (1-based) answers HTTP 500
  midstream_fail_every   every k-th request sends an error event after its first tokens
  short_every, short_by  every k-th request stops `short_by` tokens early
  context_length, model  what /get_model_info and /v1/models report; other model names get HTTP 404

Run as `python tests/bench_fake_server.py PORT TOKENIZER_PATH`, or use `FakeServer` (a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from server_process import free_port

DEFAULTS: dict[str, Any] = {"ttft": 0.1, "gap": 0.01, "gap_per_inflight": 0.0, "fail_every": 0,
                            "midstream_fail_every": 0, "short_every": 0, "short_by": 1, "context_length": 4096,
                            "model": "fake-model", "cached_tokens": 0}


def build_app(tokenizer_path: str) -> Any:
    app = FastAPI()
    cfg: dict[str, Any] = dict(DEFAULTS)
    state = {"count": 0, "inflight": 0}

    def err(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "server_error", "code": status}}, status_code=status)

    @app.post("/_config")
    async def set_config(request: Request) -> dict[str, Any]:
        cfg.clear()
        cfg.update(DEFAULTS)
        cfg.update(await request.json())
        state["count"] = 0
        return cfg

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": cfg["model"], "object": "model",
                                            "max_model_len": cfg["context_length"]}]}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "/nowhere/fake-model", "tokenizer_path": tokenizer_path,
                "served_model_name": cfg["model"], "context_length": cfg["context_length"]}

    @app.get("/metrics")
    async def metrics() -> Response:
        text = f"fake:num_running_reqs {state['inflight']}\nfake:token_usage 0.25\n"
        return Response(text, media_type="text/plain")

    async def handle(request: Request, kind: str) -> Any:
        arrived = time.perf_counter()  # the programmed TTFT counts from here
        body = await request.json()
        state["count"] += 1
        k = state["count"]
        if kind != "generate" and body.get("model") not in (None, cfg["model"]):
            return err(404, f"The model `{body.get('model')}` does not exist.")
        if cfg["fail_every"] and k % cfg["fail_every"] == 0:
            return err(500, "injected failure")
        if kind == "generate":
            sp = body.get("sampling_params") or {}
            n, prompt_text = int(sp.get("max_new_tokens", 16)), body.get("text", "")
        else:
            n = int(body.get("max_tokens") or 16)
            prompt_text = body.get("prompt") or json.dumps(body.get("messages"))
        if cfg["short_every"] and k % cfg["short_every"] == 0:
            n = max(1, n - cfg["short_by"])
        fail_mid = bool(cfg["midstream_fail_every"] and k % cfg["midstream_fail_every"] == 0)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = max(1, len(prompt_text) // 4)
        return StreamingResponse(stream(arrived, kind, n, fail_mid, usage, prompt_tokens),
                                 media_type="text/event-stream")

    async def stream(start: float, kind: str, n: int, fail_mid: bool, usage: bool,
                     prompt_tokens: int) -> AsyncIterator[bytes]:
        state["inflight"] += 1
        try:
            due = start + cfg["ttft"]
            text = ""
            for i in range(n):
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if fail_mid and i == 2:
                    yield sse({"error": {"message": "injected mid-stream error", "type": "server_error"}})
                    yield b"data: [DONE]\n\n"
                    return
                piece = " tok"
                text += piece
                if kind == "generate":
                    yield sse({"text": text, "output_ids": [], "meta_info": {
                        "prompt_tokens": prompt_tokens, "completion_tokens": i + 1, "cached_tokens": cfg["cached_tokens"],
                        "finish_reason": {"type": "length"} if i == n - 1 else None}})
                elif kind == "chat":
                    yield sse({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
                else:
                    yield sse({"choices": [{"index": 0, "text": piece, "finish_reason": None}]})
                due += cfg["gap"] + cfg["gap_per_inflight"] * state["inflight"]
            if usage and kind != "generate":
                yield sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                    "total_tokens": prompt_tokens + n,
                                                    "prompt_tokens_details": {"cached_tokens": cfg["cached_tokens"]}}})
            yield b"data: [DONE]\n\n"
        finally:
            state["inflight"] -= 1

    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, "completions")

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        return await handle(request, "generate")

    return app




class FakeServer:
    """The fake server in a subprocess (its own GIL: the client's timing is not disturbed)."""

    def __init__(self, tokenizer_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(self.port), tokenizer_path],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake server exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                httpx.get(self.url + "/v1/models", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError("fake server did not start in 60 s")

    def configure(self, **overrides: Any) -> None:
        httpx.post(self.url + "/_config", json=overrides, timeout=5).raise_for_status()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(build_app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
