"""RequestRecords of one point -> PointSummary, with the standard serving definitions.

Per request (successes only; a failure never contributes a zero):
  TTFT = send -> first token; latency = send -> end; TPOT = (latency - TTFT) / (output tokens - 1), undefined
  for a single output token; TPS = 1000 / TPOT(ms); ITL = gaps between consecutive streamed chunks.
Per point: output throughput = sum of successful output tokens / (last end - first start) over all the
point's requests; request throughput = successes / the same span.
Output tokens: the server's `usage.completion_tokens`, else our tokenizer's count of the returned text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np

from ftransformers.bench.records import PointSummary, RequestRecord, Stat


def stat(values: Iterable[float]) -> Stat:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return Stat()
    p50, p90, p95, p99 = (float(x) for x in np.percentile(arr, [50, 90, 95, 99]))
    return Stat(mean=float(arr.mean()), p50=p50, p90=p90, p95=p95, p99=p99, min=float(arr.min()), max=float(arr.max()))


def output_tokens(rec: RequestRecord) -> int | None:
    return rec.completion_tokens if rec.completion_tokens is not None else rec.completion_tokens_tokenizer


def tpot_ms(rec: RequestRecord) -> float | None:
    n, ttft = output_tokens(rec), rec.ttft
    if not rec.success or n is None or n < 2 or ttft is None or rec.end_time is None:
        return None
    return (rec.end_time - ttft) / (n - 1) * 1000.0


def itl_ms(rec: RequestRecord) -> list[float]:
    return [(b - a) * 1000.0 for a, b in pairwise(rec.token_times)]


def _start(rec: RequestRecord) -> float:
    return rec.send_mono if rec.send_mono is not None else rec.send_time


def span_s(records: Sequence[RequestRecord]) -> float:
    """Last end - first start over the requests (one clock: send_mono when every record has it)."""
    ended = [r for r in records if r.end_time is not None]
    if not ended:
        return 0.0
    if any(r.send_mono is None for r in ended):
        first, last = min(r.send_time for r in ended), max(r.send_time + (r.end_time or 0.0) for r in ended)
    else:
        first, last = min(_start(r) for r in ended), max(_start(r) + (r.end_time or 0.0) for r in ended)
    return max(last - first, 0.0)


def summarize(records: Sequence[RequestRecord], point: str, input_len: int, output_len: int,
              concurrency: int) -> PointSummary:
    ok = [r for r in records if r.success]
    tpots = [tpot_ms(r) for r in ok]
    duration = span_s(records)
    total_out = sum(output_tokens(r) or 0 for r in ok)
    errors = Counter(r.error or "unknown error" for r in records if not r.success)
    summary = PointSummary(
        point=point, input_len=input_len, output_len=output_len, concurrency=concurrency, number=len(records),
        successes=len(ok), failures=len(records) - len(ok), short_outputs=sum(r.short for r in ok),
        duration_s=duration,
        ttft_s=stat(r.ttft for r in ok if r.ttft is not None),
        tpot_ms=stat(t for t in tpots if t is not None),
        tps=stat(1000.0 / t for t in tpots if t is not None and t > 0),
        itl_ms=stat(g for r in ok for g in itl_ms(r)),
        latency_s=stat(r.end_time for r in ok if r.end_time is not None),
        output_throughput=total_out / duration if duration > 0 else 0.0,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        total_output_tokens=total_out, errors=dict(errors.most_common()),
    )
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    summary.prompt_tokens_mean = float(np.mean(prompt)) if prompt else None
    summary.prompt_token_mismatches = sum(
        1 for r in ok if r.prompt_tokens is not None and r.expected_prompt_tokens is not None
        and r.prompt_tokens != r.expected_prompt_tokens)
    summary.usage_tokenizer_mismatches = sum(
        1 for r in ok if r.completion_tokens is not None and r.completion_tokens_tokenizer is not None
        and r.completion_tokens != r.completion_tokens_tokenizer)
    summary.usage_missing = sum(1 for r in ok if r.completion_tokens is None)
    return summary
