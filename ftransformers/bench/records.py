"""What a benchmark run records and summarises: the contract between measuring and reporting.

Times are seconds. `send_time` is wall-clock (time.time()) so runs can be lined up with server logs;
every other time of a request is relative to its own `send_time`, measured with a monotonic clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request, as written line by line to `requests.jsonl`."""

    point: str  # id of the (input_len, output_len, concurrency) point it belongs to
    index: int
    send_time: float  # wall clock at send
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk with content, since send
    end_time: float | None = None  # since send; None when it never ended
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None  # from the server's usage
    completion_tokens_tokenizer: int | None = None  # our tokenizer's count of the returned text
    expected_output_tokens: int | None = None
    cached_tokens: int | None = None
    success: bool = False
    error: str | None = None
    short: bool = False  # succeeded but returned fewer tokens than asked for
    send_mono: float | None = None  # time.perf_counter() at send: orders requests of one run on one clock
    expected_prompt_tokens: int | None = None  # our tokenizer's count of the prompt as the server should see it

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Stat:
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None


@dataclass
class PointSummary:
    """One (input length, output length, concurrency) point: the standard serving metrics."""

    point: str
    input_len: int
    output_len: int
    concurrency: int
    number: int  # requests sent
    successes: int
    failures: int
    short_outputs: int
    duration_s: float  # last end - first start over the point's requests
    ttft_s: Stat
    tpot_ms: Stat
    tps: Stat  # per-request 1000 / TPOT(ms)
    itl_ms: Stat
    latency_s: Stat
    output_throughput: float  # sum of output tokens / duration, tok/s
    request_throughput: float  # successes / duration, req/s
    total_output_tokens: int
    errors: dict[str, int] = field(default_factory=dict)  # error message -> count
    prompt_tokens_mean: float | None = None  # from the server's usage
    prompt_token_mismatches: int = 0  # successes whose usage.prompt_tokens differs from our tokenizer's count
    usage_tokenizer_mismatches: int = 0  # successes whose usage.completion_tokens differs from our re-count
    usage_missing: int = 0  # successes without usage.completion_tokens (the tokenizer count stood in)


@dataclass
class MaxConcurrencyResult:
    input_len: int
    output_len: int
    min_tps: float
    max_concurrency: int | None  # None: even concurrency 1 misses the bar
    probes: list[dict[str, float]] = field(default_factory=list)  # [{concurrency, tps_p50 ... }]
    note: str | None = None
    criterion: str = "mean"  # which per-request TPS statistic must reach min_tps (mean, p50 or min)
