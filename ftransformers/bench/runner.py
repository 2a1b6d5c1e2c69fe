"""Closed-loop load: `concurrency` workers, each sending its next request as soon as its last one ends,
until `number` requests have been sent. Warmup requests run once per (input, output) pair, unrecorded.

Every finished request is appended to `requests.jsonl` at once, so an interrupted run keeps what it did.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ftransformers.bench.client import BenchClient, Prompt
from ftransformers.bench.metrics import summarize
from ftransformers.bench.prompts import PromptFactory, dataset_prompts
from ftransformers.bench.records import PointSummary, RequestRecord


class BenchAbort(RuntimeError):
    """Stop the whole run (the server went away); printed as one line, what completed is still written."""


class RecordSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: TextIO = path.open("a", encoding="utf-8")

    def write(self, rec: RequestRecord) -> None:
        self._fh.write(json.dumps(rec.to_json()) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled, leave=False,
                dynamic_ncols=True)


async def closed_loop(client: BenchClient, prompts: list[Prompt], output_len: int, concurrency: int, point: str,
                      on_done: Any = None) -> list[RequestRecord]:
    records: list[RequestRecord | None] = [None] * len(prompts)
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(prompts):
            i = next_index
            next_index += 1  # single-threaded event loop: no lock needed between the check and the claim
            rec = await client.send(prompts[i], prompts[i].output_len or output_len, point, i)
            records[i] = rec
            if on_done is not None:
                on_done(rec)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
    return [r for r in records if r is not None]


def all_unreachable(records: list[RequestRecord]) -> bool:
    return bool(records) and all(not r.success and (r.error or "").startswith("cannot connect") for r in records)


@dataclass
class Runner:
    client: BenchClient
    factory: PromptFactory
    sink: RecordSink
    dataset: list[str] | None = None
    prefix_len: int = 0
    warmup: int = 1
    range_ratio: float = 1.0  # random prompts: each request's lengths uniform in [ratio x the point's, the point's]
    progress: bool = True
    points: list[PointSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _warmed: set[tuple[int, int]] = field(default_factory=set)
    _dataset_pos: int = 0
    _ids: dict[str, int] = field(default_factory=dict)

    def prompts(self, n: int, input_len: int, output_len: int) -> list[Prompt]:
        if self.dataset is not None:
            out = dataset_prompts(self.factory, self.dataset, n, self._dataset_pos)
            self._dataset_pos += n
            return out
        return self.factory.random_prompts(n, input_len, self.prefix_len, output_len, self.range_ratio)

    def point_id(self, input_len: int, output_len: int, concurrency: int) -> str:
        source = "jsonl" if self.dataset is not None else f"in{input_len}"
        base = f"{source}-out{output_len}-c{concurrency}"
        seen = self._ids.get(base, 0)
        self._ids[base] = seen + 1
        return base if seen == 0 else f"{base}-r{seen + 1}"

    async def warm(self, input_len: int, output_len: int) -> None:
        if self.warmup <= 0 or (input_len, output_len) in self._warmed:
            return
        self._warmed.add((input_len, output_len))
        recs = await closed_loop(self.client, self.prompts(self.warmup, input_len, output_len), output_len,
                                 self.warmup, "warmup")
        if all_unreachable(recs):
            raise BenchAbort(f"the server at {self.client.base_url} cannot be reached ({recs[0].error})")
        failed = [r for r in recs if not r.success]
        if failed:
            self.notes.append(f"warmup in={input_len} out={output_len}: {len(failed)}/{len(recs)} failed "
                              f"({failed[0].error})")

    async def run_point(self, input_len: int, output_len: int, concurrency: int, number: int) -> PointSummary:
        await self.warm(input_len, output_len)
        point = self.point_id(input_len, output_len, concurrency)
        prompts = self.prompts(number, input_len, output_len)
        bar = progress_bar(number, f"in={input_len} out={output_len} c={concurrency}", self.progress)

        def done(rec: RequestRecord) -> None:
            self.sink.write(rec)
            bar.update(1)
            if not rec.success:
                bar.set_postfix_str(f"failed: {(rec.error or '')[:40]}", refresh=False)

        try:
            recs = await closed_loop(self.client, prompts, output_len, concurrency, point, done)
        finally:
            bar.close()
        summary = summarize(recs, point, input_len, output_len, concurrency)
        if self.dataset is not None and summary.prompt_tokens_mean is not None:
            summary.input_len = round(summary.prompt_tokens_mean)
        self.points.append(summary)
        self._check(summary, input_len)
        print_row(summary)
        if all_unreachable(recs):
            raise BenchAbort(f"the server at {self.client.base_url} cannot be reached ({recs[0].error})")
        return summary

    def _check(self, s: PointSummary, input_len: int) -> None:
        if s.failures:
            top = next(iter(s.errors))
            self.notes.append(f"{s.point}: {s.failures}/{s.number} requests failed (most common: {top})")
        if s.short_outputs:
            asked = f"{s.output_len}" if self.range_ratio == 1.0 else "their output length in"
            self.notes.append(f"{s.point}: {s.short_outputs} requests returned fewer than {asked} tokens")
        if s.prompt_token_mismatches:
            self.notes.append(f"{s.point}: {s.prompt_token_mismatches} requests' usage.prompt_tokens differ from the "
                              f"tokenizer's count (server mean {s.prompt_tokens_mean}, target {input_len})")
        elif (self.dataset is None and self.range_ratio == 1.0 and s.prompt_tokens_mean is not None
              and round(s.prompt_tokens_mean) != input_len):
            self.notes.append(f"{s.point}: prompts are {s.prompt_tokens_mean:g} tokens, not {input_len} "
                              "(shorter than the chat template?)")
        if s.usage_missing:
            self.notes.append(f"{s.point}: {s.usage_missing} responses had no usage; output tokens counted with "
                              "the tokenizer")


_HEADER = (f"{'point':<24} {'ok/n':>7} {'short':>5} {'TTFT(s)':>8} {'TPOT(ms)':>9} {'TPS':>7} "
           f"{'thr(tok/s)':>10} {'lat(s)':>7}")
_header_printed = False


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_row(s: PointSummary, out: TextIO | None = None) -> None:
    global _header_printed
    out = out or sys.stdout
    if not _header_printed:
        print(_HEADER, file=out)
        _header_printed = True
    print(f"{s.point:<24} {f'{s.successes}/{s.number}':>7} {s.short_outputs:>5} {_fmt(s.ttft_s.mean, '.3f'):>8} "
          f"{_fmt(s.tpot_ms.mean, '.2f'):>9} {_fmt(s.tps.mean, '.2f'):>7} {s.output_throughput:>10.2f} "
          f"{_fmt(s.latency_s.mean, '.3f'):>7}", file=out, flush=True)
