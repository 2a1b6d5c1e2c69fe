"""Front-end half of the server (main process): tokenize, validate, send, detokenize, stream back.

One background task receives every message from the scheduler process and dispatches ReqOutputs
to per-request asyncio queues; request handlers detokenize their own outputs. Nothing here waits
on the model loop: sends are non-blocking and the model runs in another process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.config.server_args import ServerArgs
from ftransformers.entrypoints.detokenizer import OutputDelta, RequestState
from ftransformers.entrypoints.metrics import ServerMetrics
from ftransformers.entrypoints.openai_protocol import APIError
from ftransformers.entrypoints.scheduler_process import INTERNAL_ERROR_PREFIX, FlushCacheOutput, error_output
from ftransformers.ipc.zmq_channel import AsyncPullChannel, AsyncPushChannel
from ftransformers.scheduler.io_struct import (
    AbortReq, FlushCacheReq, GenerateReq, ProfileOutput, ProfileReq, ReqOutput, SchedulerStats, StatsReq,
)

logger = logging.getLogger("ftransformers.server")

_DISCONNECT_POLL_S = 0.5
_WATCHDOG_S = 1.0


@dataclass
class _Req:
    state: RequestState
    queue: asyncio.Queue[ReqOutput] = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


def load_tokenizer(server_args: ServerArgs) -> Any:
    from transformers import AutoTokenizer

    path = server_args.tokenizer_path or server_args.model_path
    return AutoTokenizer.from_pretrained(path, trust_remote_code=server_args.trust_remote_code)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, tokenizer: Any, model_info: dict[str, Any], in_addr: str,
                 out_addr: str, metrics: ServerMetrics | None = None,
                 is_scheduler_alive: Callable[[], bool] | None = None) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.model_info = model_info  # the scheduler's ready message: context_len, kv_capacity, ...
        self.context_len: int = model_info["context_len"]
        self.kv_capacity: int = model_info["kv_capacity"]
        self.metrics = metrics
        self._in_addr, self._out_addr = in_addr, out_addr
        self._is_alive = is_scheduler_alive
        self._reqs: dict[str, _Req] = {}
        self._stats_waiters: collections.deque[asyncio.Future[SchedulerStats]] = collections.deque()
        self._flush_waiters: collections.deque[asyncio.Future[bool]] = collections.deque()
        self._profile_waiters: collections.deque[asyncio.Future[ProfileOutput]] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._token_str: dict[int, str] = {}
        self.scheduler_dead = False
        self.num_requests = 0
        self.num_finished = 0
        self.num_aborted = 0

    # Lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._push = AsyncPushChannel(self._in_addr, bind=False)
        self._pull = AsyncPullChannel(self._out_addr, bind=True)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watchdog())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._push.close()
        self._pull.close()

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._pull.recv()
            if isinstance(msg, list):
                for out in msg:
                    req = self._reqs.get(out.rid)
                    if req is not None:  # outputs of a request already finished here are dropped
                        req.queue.put_nowait(out)
            elif isinstance(msg, SchedulerStats):
                _resolve(self._stats_waiters, msg)
            elif isinstance(msg, FlushCacheOutput):
                _resolve(self._flush_waiters, msg.success)
            elif isinstance(msg, ProfileOutput):
                _resolve(self._profile_waiters, msg)
            else:
                logger.warning("unexpected message from the scheduler: %r", type(msg).__name__)

    async def _watchdog(self) -> None:
        while self._is_alive is not None and not self.scheduler_dead:
            await asyncio.sleep(_WATCHDOG_S)
            if not self._is_alive():
                self.scheduler_dead = True
                logger.error("the scheduler process died; failing %d requests", len(self._reqs))
                for rid, req in list(self._reqs.items()):
                    req.queue.put_nowait(error_output(rid, INTERNAL_ERROR_PREFIX + "the scheduler process died"))

    # Tokenization and validation --------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
            )
        except Exception as exc:
            raise APIError(f"could not apply the chat template: {exc}", param="messages") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def validate(self, input_ids: list[int], sp: SamplingParams, param: str = "prompt") -> None:
        n, ctx = len(input_ids), self.context_len
        if n == 0:
            raise APIError("the prompt is empty", param=param)
        vocab = self.model_info.get("vocab_size") or (1 << 62)
        if any(not 0 <= t < vocab for t in input_ids):
            raise APIError(f"prompt token ids must lie in [0, {vocab})", param=param)
        if any(t >= vocab for t in sp.logit_bias or ()):
            raise APIError(f"logit_bias token ids must lie in [0, {vocab})", param="logit_bias")
        if n >= ctx:
            raise APIError(f"This model's maximum context length is {ctx} tokens. However, your prompt has {n} "
                           "tokens, which leaves no room for output. Please shorten the prompt.", param=param,
                           code="context_length_exceeded")
        if sp.max_tokens is not None and n + sp.max_tokens > ctx:
            raise APIError(f"This model's maximum context length is {ctx} tokens. However, you requested "
                           f"{n + sp.max_tokens} tokens ({n} in the prompt, {sp.max_tokens} for the completion). "
                           "Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        if n + 1 > self.kv_capacity:
            raise APIError(f"the prompt has {n} tokens but the KV cache holds only {self.kv_capacity}", param=param)

    def token_str(self, token_id: int) -> str:
        s = self._token_str.get(token_id)
        if s is None:
            s = self._token_str[token_id] = self.tokenizer.decode([token_id])
        return s

    # Generation -------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sp: SamplingParams, prompt_text: str | None = None,
                       is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                       rid: str | None = None) -> AsyncIterator[tuple[OutputDelta, RequestState]]:
        """Yield (delta, state) as outputs arrive, until finished. Leaving early aborts the request."""
        if self.scheduler_dead:
            raise APIError("the model process is not running", status=503, type="server_error")
        rid = rid or uuid.uuid4().hex
        if rid in self._reqs:
            raise APIError(f"request id {rid!r} is already in flight", param="rid")
        state = RequestState(rid, self.tokenizer, sp, prompt_text=prompt_text, prompt_ids=list(input_ids))
        req = _Req(state)
        self._reqs[rid] = req
        self.num_requests += 1
        self._push.send_nowait(GenerateReq(rid=rid, input_ids=list(input_ids), sampling_params=sp,
                                           return_logprob=sp.logprobs is not None))
        try:
            # the client is asked every _DISCONNECT_POLL_S whether outputs arrive or not: a non-streaming response
            # writes nothing until the end, so only this notices a client that went away
            check_at = time.monotonic() + _DISCONNECT_POLL_S
            while not state.finished:
                try:
                    out = await asyncio.wait_for(req.queue.get(), max(0.01, check_at - time.monotonic()))
                except asyncio.TimeoutError:
                    out = None
                if time.monotonic() >= check_at:
                    check_at = time.monotonic() + _DISCONNECT_POLL_S
                    if is_disconnected is not None and await is_disconnected():
                        logger.info("client gone; aborting %s", rid)
                        return
                if out is None:
                    continue
                delta = state.apply(out)
                while not state.finished and not req.queue.empty():  # coalesce what is already here
                    delta = _merge(delta, state.apply(req.queue.get_nowait()))
                if req.first_token_at is None and state.token_ids:
                    req.first_token_at = time.perf_counter()
                    if self.metrics:
                        self.metrics.observe_first_token(req.first_token_at - req.created)
                if state.stopped_by_string:
                    self._push.send_nowait(AbortReq(rid=rid))  # free its KV; its abort output is dropped
                yield delta, state
        finally:
            self._finish(req)

    def _finish(self, req: _Req) -> None:
        state = req.state
        self._reqs.pop(state.rid, None)
        aborted = not state.finished or state.finish_reason == "abort"
        if not state.finished:
            try:
                self._push.send_nowait(AbortReq(rid=state.rid))
            except Exception:
                logger.exception("could not send abort for %s", state.rid)
        self.num_finished += 1
        self.num_aborted += int(aborted)
        if self.metrics:
            ttft = None if req.first_token_at is None else req.first_token_at - req.created
            self.metrics.observe_finished(state.prompt_tokens, len(state.token_ids), ttft,
                                          time.perf_counter() - req.created, aborted)

    async def generate_full(self, input_ids: list[int], sp: SamplingParams, prompt_text: str | None = None,
                            is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> RequestState | None:
        """The finished request; None when the client went away first (the request was aborted)."""
        state: RequestState | None = None
        async for _, state in self.generate(input_ids, sp, prompt_text, is_disconnected):
            pass
        return state if state is not None and state.finished else None

    # Control ----------------------------------------------------------------------------------
    async def get_stats(self, timeout: float = 5.0) -> SchedulerStats:
        fut: asyncio.Future[SchedulerStats] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._push.send_nowait(StatsReq())
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self, timeout: float = 10.0) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        self._push.send_nowait(FlushCacheReq())
        return await asyncio.wait_for(fut, timeout)

    async def profile(self, req: ProfileReq, timeout: float = 120.0) -> ProfileOutput:
        """Start or stop the profiler in the scheduler process (stopping writes the trace: allow time)."""
        fut: asyncio.Future[ProfileOutput] = asyncio.get_running_loop().create_future()
        self._profile_waiters.append(fut)
        self._push.send_nowait(req)
        return await asyncio.wait_for(fut, timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)


def _resolve(waiters: collections.deque[asyncio.Future[Any]], value: Any) -> None:
    # Replies come back in request order; a waiter that timed out still owns its (late) reply.
    if waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(value)


def _merge(a: OutputDelta, b: OutputDelta) -> OutputDelta:
    lps = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return OutputDelta(a.text + b.text, a.token_ids + b.token_ids, lps, b.finished, b.finish_reason, b.matched_stop)


def is_internal_error(message: str | None) -> bool:
    return bool(message) and message.startswith(INTERNAL_ERROR_PREFIX)  # type: ignore[union-attr]
