"""Messages between the front end and the scheduler: plain picklable dataclasses (they cross the
zmq socket when the scheduler runs in its own process)."""

from __future__ import annotations

from dataclasses import dataclass

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.runtime.step_io import SeqResult


@dataclass
class GenerateReq:
    """Front end -> scheduler: a tokenized request."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False  # also implied by sampling_params.logprobs is not None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class StatsReq:
    """Answered with a SchedulerStats."""


@dataclass
class ReqOutput:
    """Scheduler -> front end, incremental: what changed for one request during one step."""

    rid: str
    new_token_ids: list[int]  # tokens generated since the last ReqOutput of this rid
    new_logprobs: list[SeqResult] | None  # one per new token when logprobs were asked for
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | 'error'
    matched_stop: int | None  # the stop/eos token id that ended it, if any
    prompt_tokens: int
    completion_tokens: int  # total so far
    cached_tokens: int  # prompt tokens served from the prefix cache (first prefill)
    error: str | None = None


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_used_tokens: int  # slots held by requests in flight (their cached prefixes included)
    kv_capacity: int
    cache_hit_tokens: int  # cumulative prompt tokens served from the prefix cache
    prompt_tokens_total: int  # cumulative prompt tokens of admitted requests
    num_retractions: int  # cumulative
    kv_cached_tokens: int = 0  # slots held only by the prefix cache (evictable)


@dataclass
class ProfileReq:
    """Front end -> scheduler: start or stop the torch profiler; answered with a ProfileOutput."""

    action: str  # 'start' | 'stop'
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None  # 'CPU', 'GPU'
    record_shapes: bool = False
    with_stack: bool = False


@dataclass
class ProfileOutput:
    success: bool
    message: str
    path: str | None = None  # the trace file (written, or to be written after num_steps)
