"""`--prefix-cache-check`: the same long prompt twice in a row. The first (cold) pays the whole prefill; the
second (warm) should find the prompt in the server's prefix cache: a far lower TTFT and a cached-token count
(`usage.prompt_tokens_details.cached_tokens`, or `meta_info.cached_tokens` for /generate).

The prompt comes from an unseeded generator so that a repeated run never starts warm.
"""

from __future__ import annotations

import random
from typing import Any

from ftransformers.bench.client import BenchClient
from ftransformers.bench.prompts import PromptFactory
from ftransformers.bench.records import RequestRecord
from ftransformers.bench.runner import RecordSink

_OUTPUT_LEN = 4


def _side(rec: RequestRecord) -> dict[str, Any]:
    return {"ttft_s": rec.ttft, "latency_s": rec.end_time, "prompt_tokens": rec.prompt_tokens,
            "cached_tokens": rec.cached_tokens, "success": rec.success, "error": rec.error}


async def prefix_cache_check(client: BenchClient, factory: PromptFactory, input_len: int,
                             sink: RecordSink) -> dict[str, Any]:
    seeded, factory.rng = factory.rng, random.Random()
    try:
        warmup, prompt = factory.exact(min(input_len, 16)), factory.exact(input_len)
    finally:
        factory.rng = seeded
    await client.send(warmup, _OUTPUT_LEN, "prefix-check-warmup", 0)  # first-request overheads, not counted
    cold = await client.send(prompt, _OUTPUT_LEN, "prefix-check", 0)
    warm = await client.send(prompt, _OUTPUT_LEN, "prefix-check", 1)
    for rec in (cold, warm):
        sink.write(rec)
    result: dict[str, Any] = {"input_len": input_len, "output_len": _OUTPUT_LEN, "cold": _side(cold),
                              "warm": _side(warm), "cached_tokens": warm.cached_tokens, "ttft_speedup": None}
    if cold.ttft and warm.ttft:
        result["ttft_speedup"] = cold.ttft / warm.ttft
    if not (cold.success and warm.success):
        result["note"] = f"a request failed: {cold.error or warm.error}"
    elif warm.cached_tokens is None:
        result["note"] = "the server reported no cached-token count"
    elif warm.cached_tokens == 0:
        result["note"] = "the server reported 0 cached tokens on the repeat: is its prefix cache off?"
    return result


def describe(result: dict[str, Any]) -> str:
    cold, warm = result["cold"], result["warm"]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    speed = result.get("ttft_speedup")
    return (f"prefix-cache check ({result['input_len']} tokens): cold TTFT {fmt(cold['ttft_s'])} s, warm TTFT "
            f"{fmt(warm['ttft_s'])} s ({'-' if speed is None else f'{speed:.1f}x'}), cached tokens "
            f"{result['cached_tokens']}" + (f"; {result['note']}" if result.get("note") else ""))
