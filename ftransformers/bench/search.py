"""`--find-max-concurrency`: the largest closed-loop concurrency whose per-request TPS still reaches `--min-tps`.

Criterion: a probe passes when none of its requests failed and the chosen statistic (`--tps-criterion`:
mean, p50 or min) of per-request TPS = 1000 / TPOT(ms) is >= min-tps. The concurrency doubles from 1
until a probe fails (or `--max-concurrency-limit` is reached), then the interval between the last pass and
the first failure is bisected. Assumes TPS falls as concurrency rises; every probe is also a point.
"""

from __future__ import annotations

from collections.abc import Callable

from ftransformers.bench.records import MaxConcurrencyResult, PointSummary
from ftransformers.bench.runner import Runner

CRITERIA = ("mean", "p50", "min")


def passes(s: PointSummary, min_tps: float, criterion: str) -> bool:
    value = getattr(s.tps, criterion)
    return s.failures == 0 and s.successes > 0 and value is not None and value >= min_tps


async def find_max_concurrency(runner: Runner, input_len: int, output_len: int, min_tps: float, criterion: str,
                               number_for: Callable[[int], int], limit: int) -> MaxConcurrencyResult:
    result = MaxConcurrencyResult(input_len=input_len, output_len=output_len, min_tps=min_tps, max_concurrency=None,
                                  criterion=criterion)

    async def probe(c: int) -> bool:
        s = await runner.run_point(input_len, output_len, c, number_for(c))
        ok = passes(s, min_tps, criterion)
        result.probes.append({"concurrency": c, "tps_mean": s.tps.mean, "tps_p50": s.tps.p50, "tps_min": s.tps.min,
                              "failures": s.failures, "output_throughput": s.output_throughput, "passed": ok})
        return ok

    last_ok, first_bad, c = 0, 0, 1
    while c <= limit:
        if not await probe(c):
            first_bad = c
            break
        last_ok, c = c, c * 2
    if last_ok == 0:
        result.note = f"concurrency 1 misses {min_tps:g} tok/s ({criterion} per-request TPS)"
        return result
    if first_bad == 0:
        result.max_concurrency = last_ok
        result.note = f"still holds at the search limit {last_ok} (--max-concurrency-limit)"
        return result
    lo, hi = last_ok, first_bad
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await probe(mid):
            lo = mid
        else:
            hi = mid
    result.max_concurrency = lo
    return result
