"""`--duration SECONDS`: a soak at one concurrency. Closed-loop load until the deadline (requests in flight
then finish); every `--soak-interval` seconds one interval row: requests completed and failed, output
throughput, and the server's memory / KV / queue gauges from `/metrics` when it exposes them.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx

from ftransformers.bench.client import BenchClient
from ftransformers.bench.metrics import output_tokens, summarize
from ftransformers.bench.records import RequestRecord
from ftransformers.bench.runner import Runner, print_row, progress_bar

# gauges worth following over a soak: KV usage, memory, queue depth (ours, SGLang, vLLM, process)
_INTERESTING = re.compile(r"token_usage|kv|cache_usage|memory|mem_|num_running|num_queue|waiting|running|cache_hit")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """First sample of each interesting gauge-like series of a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) in out or m.group(1).endswith(("_bucket", "_created", "_sum", "_count")):
            continue
        if _INTERESTING.search(m.group(1)):
            try:
                out[m.group(1)] = float(m.group(3))
            except ValueError:
                continue
    return out


async def scrape(http: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        resp = await http.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None


async def soak(runner: Runner, input_len: int, output_len: int, concurrency: int, duration: float,
               interval: float) -> dict[str, Any]:
    client: BenchClient = runner.client
    await runner.warm(input_len, output_len)
    point = runner.point_id(input_len, output_len, concurrency).replace("in", "soak-in", 1)
    records: list[RequestRecord] = []
    intervals: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    deadline = t0 + duration
    bar = progress_bar(int(duration), f"soak c={concurrency}", runner.progress)
    index = 0

    async def worker() -> None:
        nonlocal index
        while time.perf_counter() < deadline:
            i, index = index, index + 1
            prompt = await asyncio.to_thread(runner.prompts, 1, input_len, output_len)
            rec = await client.send(prompt[0], prompt[0].output_len or output_len, point, i)
            records.append(rec)
            runner.sink.write(rec)

    async def sampler() -> None:
        start = t0
        while True:
            await asyncio.sleep(max(0.0, start + interval - time.perf_counter()))
            end = time.perf_counter()
            done = [r for r in records if r.send_mono is not None and start <= r.send_mono + (r.end_time or 0) < end]
            ok = [r for r in done if r.success]
            toks = sum(output_tokens(r) or 0 for r in ok)
            intervals.append({"t_start": start - t0, "t_end": end - t0, "completed": len(ok),
                              "failures": len(done) - len(ok), "output_tokens": toks,
                              "output_throughput": toks / (end - start), "request_throughput": len(ok) / (end - start),
                              "metrics": await scrape(client.http)})
            bar.update(min(int(end - t0), int(duration)) - bar.n)
            start = end

    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        sampling.cancel()
        bar.close()
    summary = summarize(records, point, input_len, output_len, concurrency)
    runner.points.append(summary)
    print_row(summary)
    return {"point": point, "input_len": input_len, "output_len": output_len, "concurrency": concurrency,
            "duration_s": duration, "interval_s": interval, "requests": len(records), "successes": summary.successes,
            "failures": summary.failures, "errors": summary.errors, "intervals": intervals,
            "metrics_available": any(iv["metrics"] for iv in intervals)}
