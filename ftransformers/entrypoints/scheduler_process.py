"""The scheduler process: ModelRunner + Scheduler behind two zmq pipes, one `step()` per loop turn.

Incoming: GenerateReq / AbortReq / FlushCacheReq / StatsReq / ProfileReq. Outgoing, in order:
`list[ReqOutput]` (all outputs of one step in one message), `SchedulerStats` (answering a StatsReq),
`FlushCacheOutput` (answering a FlushCacheReq) and `ProfileOutput` (answering a ProfileReq; a
profile that stops by itself after `num_steps` sends nothing). Every `--log-interval-s` while busy
the loop logs one line of step statistics (`scheduler/stats_log.py`). The loop never dies from one
request: a bad request becomes a finished 'error' output; a crashing model step fails every request
in flight, with an "internal error: ..." message, and a fresh Scheduler takes over (the runner's
pool is reused).
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from ftransformers.config.server_args import ServerArgs

if TYPE_CHECKING:  # torch loads only in the scheduler process, not in the HTTP front end
    from ftransformers.runtime.profiler import StepProfiler
    from ftransformers.scheduler.stats_log import StatsLogger

logger = logging.getLogger("ftransformers.scheduler_process")

INTERNAL_ERROR_PREFIX = "internal error: "
_IDLE_POLL_MS = 1000  # while idle, wake this often to notice a dead parent


@dataclass
class FlushCacheOutput:
    success: bool


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def error_output(rid: str, message: str, prompt_tokens: int = 0) -> Any:
    from ftransformers.scheduler.io_struct import ReqOutput

    return ReqOutput(rid=rid, new_token_ids=[], new_logprobs=None, finished=True, finish_reason="error",
                     matched_stop=None, prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0,
                     error=message)


class SchedulerLoop:
    """The process body, separated from process setup so it can be driven in tests."""

    def __init__(self, scheduler_factory: Callable[[], Any], profiler: StepProfiler | None = None,
                 stats_logger: StatsLogger | None = None) -> None:
        self._factory = scheduler_factory
        self.scheduler = scheduler_factory()
        self._in_flight: dict[str, int] = {}  # rid -> prompt length, until its finished output is sent
        from ftransformers.runtime.profiler import StepProfiler
        from ftransformers.scheduler.stats_log import StatsLogger

        self.profiler = profiler or StepProfiler()
        self.stats_logger = stats_logger or StatsLogger(0.0, logger.info)

    def handle(self, msg: Any) -> list[Any]:
        """Apply one incoming message; returns the messages to send at once (error outputs, replies)."""
        from ftransformers.scheduler.io_struct import AbortReq, FlushCacheReq, GenerateReq, ProfileReq, StatsReq

        if isinstance(msg, GenerateReq):
            try:
                self.scheduler.add_request(msg)
                self._in_flight[msg.rid] = len(msg.input_ids)
            except Exception as exc:  # a bad request must not stop the loop
                logger.warning("request %s rejected: %s", msg.rid, one_line(exc))
                return [[error_output(msg.rid, one_line(exc), len(msg.input_ids))]]
        elif isinstance(msg, AbortReq):
            if msg.rid in self._in_flight:
                try:
                    self.scheduler.abort(msg.rid)
                except Exception:
                    logger.exception("abort of %s failed", msg.rid)
        elif isinstance(msg, FlushCacheReq):
            try:
                ok = bool(self.scheduler.flush_cache())
            except Exception:
                logger.exception("flush_cache failed")
                ok = False
            return [FlushCacheOutput(ok)]
        elif isinstance(msg, StatsReq):
            return [self.scheduler.stats()]
        elif isinstance(msg, ProfileReq):
            return [self._profile(msg)]
        else:
            logger.warning("ignoring unknown message %r", type(msg).__name__)
        return []

    def step(self) -> list[Any]:
        try:
            outs = self.scheduler.step()
        except Exception as exc:
            logger.error("model step failed; failing %d requests:\n%s", len(self._in_flight), traceback.format_exc())
            message = INTERNAL_ERROR_PREFIX + one_line(exc)
            outs = [error_output(rid, message, n) for rid, n in self._in_flight.items()]
            self._in_flight.clear()
            self.scheduler = self._factory()
            self.stats_logger.reset_totals()
            return outs
        for out in outs:
            if out.finished:
                self._in_flight.pop(out.rid, None)
        self.stats_logger.on_step(outs)
        if self.profiler.active:
            try:
                self.profiler.on_step()
            except RuntimeError as exc:  # ProfilerError: the trace could not be written
                logger.warning("profiling stopped: %s", exc)
        return outs

    def _profile(self, req: Any) -> Any:
        from ftransformers.runtime.profiler import ProfilerError
        from ftransformers.scheduler.io_struct import ProfileOutput

        try:
            if req.action == "start":
                path = self.profiler.start(req.output_dir, req.num_steps, req.activities, req.record_shapes,
                                           req.with_stack)
                when = f"after {req.num_steps} model steps" if req.num_steps else "at /stop_profile"
                return ProfileOutput(True, f"Profiling started; the trace is written to {path} {when}.", str(path))
            if req.action == "stop":
                path = self.profiler.stop()
                return ProfileOutput(True, f"Profiling stopped; the trace is at {path}.", str(path))
            return ProfileOutput(False, f"unknown profile action {req.action!r}; use 'start' or 'stop'")
        except ProfilerError as exc:
            return ProfileOutput(False, str(exc))
        except Exception as exc:
            logger.exception("profile %s failed", req.action)
            return ProfileOutput(False, one_line(exc))

    def run_once(self, recv: Callable[[int | None], list[Any]], send: Callable[[Any], None],
                 block_ms: int | None) -> None:
        """One turn: drain messages (block only when idle), then one scheduler step if there is work."""
        for msg in recv(0 if self.scheduler.has_work() else block_ms):
            for reply in self.handle(msg):
                send(reply)
        if self.scheduler.has_work():
            outs = self.step()
            if outs:
                send(outs)
        if self.stats_logger.enabled:
            self.stats_logger.maybe_log(self.scheduler.stats)


def _leave_a_core_for_the_front_end(server_args: ServerArgs) -> None:
    """On the CPU, torch's threads would take every core and starve the HTTP process (tokenizing,
    streaming) and the clients beside it: measured on 2 cores, TPOT went from 42 ms to 337 ms under
    a benchmark client. Keep one core free unless the user set OMP_NUM_THREADS."""
    import torch

    from ftransformers.runtime.model_runner import resolve_device

    if "OMP_NUM_THREADS" not in os.environ and resolve_device(server_args.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def run_scheduler_process(server_args: ServerArgs, model_config_or_path: Any, in_addr: str, out_addr: str,
                          ready_conn: Connection) -> None:
    logging.basicConfig(level=server_args.log_level.upper(), format="[scheduler %(asctime)s] %(message)s")
    parent = os.getppid()
    try:
        from ftransformers.config.model_config import ModelConfig
        from ftransformers.runtime.model_runner import ModelRunner
        from ftransformers.scheduler.scheduler import Scheduler

        if isinstance(model_config_or_path, ModelConfig):
            model_config = model_config_or_path
        else:
            if model_config_or_path is not None:
                server_args = server_args.replace(model_path=str(model_config_or_path))
            model_config = ModelConfig.from_server_args(server_args)
        _leave_a_core_for_the_front_end(server_args)
        runner = ModelRunner(server_args, model_config)
        eos = list(model_config.eos_token_ids)
        if runner.device.type == "cuda" and not server_args.skip_warmup:  # Triton compiles now, not under requests
            from ftransformers.scheduler.warmup import run_warmup

            run_warmup(runner, server_args, eos, int(model_config.vocab_size), server_args.random_seed)
        from ftransformers.runtime.profiler import StepProfiler
        from ftransformers.scheduler.stats_log import StatsLogger

        loop = SchedulerLoop(lambda: Scheduler(runner, server_args, eos), StepProfiler(server_args.profile_dir),
                             StatsLogger(server_args.log_interval_s, logger.info))
    except BaseException as exc:  # reported as one line by the launcher
        logger.debug("startup failed:\n%s", traceback.format_exc())
        ready_conn.send({"status": "error", "error": one_line(exc)})
        ready_conn.close()
        raise SystemExit(1) from None

    from ftransformers.ipc.zmq_channel import PullChannel, PushChannel

    pull = PullChannel(in_addr, bind=True)
    push = PushChannel(out_addr, bind=False)

    def recv(timeout_ms: int | None) -> list[Any]:
        first = pull.recv(timeout_ms)
        return [] if first is None else [first, *pull.recv_all_nowait()]

    ready_conn.send({
        "status": "ok",
        # The scheduler's own limit: a request must fit the context and the whole KV pool.
        "context_len": int(min(model_config.context_len, runner.max_context_len, runner.kv_capacity)),
        "kv_capacity": int(runner.kv_capacity),
        "max_req_slots": int(runner.max_req_slots),
        "eos_token_ids": eos,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "architecture": model_config.architecture,
        "vocab_size": int(model_config.vocab_size),
    })
    ready_conn.close()
    from ftransformers.kernels import compile_log

    compile_log.mark_ready()
    logger.info("ready: %s on %s", model_config.architecture, runner.device)
    while True:
        loop.run_once(recv, push.send, _IDLE_POLL_MS)
        if os.getppid() != parent:
            logger.info("parent process gone; exiting")
            return
