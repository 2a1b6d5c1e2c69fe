"""Metric math of `ftransformers bench` on synthetic records: the standard definitions, failures never
counted as zeros, TPOT undefined for one output token, throughput over the point's span."""

from __future__ import annotations

import numpy as np
import pytest

from ftransformers.bench.metrics import itl_ms, span_s, stat, summarize, tpot_ms
from ftransformers.bench.records import RequestRecord
from ftransformers.bench.search import passes


def rec(start: float, ttft: float, gap: float, n: int, *, index: int = 0, usage: bool = True,
        error: str | None = None) -> RequestRecord:
    times = [ttft + i * gap for i in range(n)]
    r = RequestRecord(point="p", index=index, send_time=1000.0 + start, send_mono=start, token_times=times,
                      end_time=times[-1] if times else 0.5, expected_output_tokens=n,
                      completion_tokens=n if usage and not error else None, completion_tokens_tokenizer=n)
    r.success = error is None and bool(times)
    r.error = error
    return r


def test_stat_percentiles_match_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    s = stat(values)
    assert s.mean == pytest.approx(50.5)
    assert s.p50 == pytest.approx(np.percentile(values, 50))
    assert s.p90 == pytest.approx(np.percentile(values, 90))
    assert s.p99 == pytest.approx(np.percentile(values, 99))
    assert (s.min, s.max) == (1.0, 100.0)
    assert stat([]).mean is None


def test_tpot_tps_itl_of_one_request() -> None:
    r = rec(0.0, ttft=0.2, gap=0.05, n=11)  # latency 0.7 s: 10 gaps of 50 ms after the first token
    assert tpot_ms(r) == pytest.approx(50.0)
    assert itl_ms(r) == pytest.approx([50.0] * 10)
    s = summarize([r], "p", 32, 11, 1)
    assert s.ttft_s.mean == pytest.approx(0.2)
    assert s.tps.mean == pytest.approx(20.0)
    assert s.latency_s.mean == pytest.approx(0.7)


def test_one_output_token_has_no_tpot_but_counts() -> None:
    r = rec(0.0, ttft=0.3, gap=0.0, n=1)
    assert tpot_ms(r) is None
    s = summarize([r], "p", 32, 1, 1)
    assert s.successes == 1 and s.tpot_ms.mean is None and s.tps.mean is None
    assert s.ttft_s.mean == pytest.approx(0.3) and s.total_output_tokens == 1


def test_failures_are_excluded_not_zeros() -> None:
    good = [rec(0.0, 0.2, 0.05, 11, index=i) for i in range(3)]
    bad = [rec(0.0, 0.0, 0.0, 0, index=3, error="HTTP 500: boom"), rec(0.0, 0.01, 0.01, 2, index=4, error="stream error: x")]
    s = summarize(good + bad, "p", 32, 11, 4)
    assert (s.number, s.successes, s.failures) == (5, 3, 2)
    assert s.ttft_s.min == pytest.approx(0.2)  # a failed request's early token is not a TTFT
    assert s.tps.min == pytest.approx(20.0)
    assert s.errors == {"HTTP 500: boom": 1, "stream error: x": 1}
    assert s.total_output_tokens == 33


def test_throughput_over_span() -> None:
    # two back-to-back waves of two requests, each 1.0 s long with 11 tokens: span 2.0 s
    recs = [rec(start, 0.5, 0.05, 11, index=i) for i, start in enumerate([0.0, 0.0, 1.0, 1.0])]
    assert span_s(recs) == pytest.approx(2.0)
    s = summarize(recs, "p", 32, 11, 2)
    assert s.output_throughput == pytest.approx(44 / 2.0)
    assert s.request_throughput == pytest.approx(2.0)


def test_usage_preferred_tokenizer_fallback_counted() -> None:
    r = rec(0.0, 0.2, 0.05, 11, usage=False)
    s = summarize([r], "p", 32, 11, 1)
    assert s.usage_missing == 1 and s.total_output_tokens == 11
    r2 = rec(0.0, 0.2, 0.05, 11)
    r2.completion_tokens_tokenizer = 10
    assert summarize([r2], "p", 32, 11, 1).usage_tokenizer_mismatches == 1


def test_all_failed_point_has_no_figures() -> None:
    s = summarize([rec(0.0, 0.0, 0.0, 0, error="cannot connect")], "p", 32, 8, 1)
    assert s.successes == 0 and s.ttft_s.mean is None and s.tps.mean is None and s.output_throughput == 0.0
    assert not passes(s, 15.0, "mean")


def test_search_criterion() -> None:
    recs = [rec(0.0, 0.1, gap, 11, index=i) for i, gap in enumerate([0.05, 0.05, 0.1])]  # TPS 20, 20, 10
    s = summarize(recs, "p", 32, 11, 3)
    assert passes(s, 15.0, "mean") and passes(s, 15.0, "p50") and not passes(s, 15.0, "min")


def test_seed_matrix_skips_beyond_context() -> None:
    from ftransformers.bench.matrix import seed_matrix, split_by_context

    items = seed_matrix()
    assert len(items) == 5 * 3 + 2 and sum(it.search for it in items) == 15
    kept, notes = split_by_context(items, 8192)
    assert {(it.input_len, it.output_len) for it in kept} == {
        (i, o) for i in (128, 1024, 4096) for o in (128, 512, 1024)}
    assert len(notes) == len(items) - len(kept) and all("context length 8192" in n for n in notes)
    assert split_by_context(items, None) == (items, [])


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
def test_random_prompts_have_exact_length(api: str) -> None:
    from ftransformers.bench.prompts import PromptFactory, load_tokenizer
    from ftransformers.entrypoints.demo_model import ensure_demo_model

    factory = PromptFactory(load_tokenizer(str(ensure_demo_model())), api, seed=0)
    for n in (40, 333, 2000):
        prompts = factory.random_prompts(3, n)
        assert [factory.count(p.text) for p in prompts] == [n] * 3
        assert [p.expected_prompt_tokens for p in prompts] == [n] * 3
        assert len({p.text for p in prompts}) == 3
    shared = factory.random_prompts(3, 200, prefix_len=100)
    prefix = shared[0].text[:200]
    assert all(p.text.startswith(prefix) for p in shared) and [factory.count(p.text) for p in shared] == [200] * 3
    again = PromptFactory(factory.tok, api, seed=0).random_prompts(1, 40)
    assert again[0].text == PromptFactory(factory.tok, api, seed=0).random_prompts(1, 40)[0].text


def test_random_range_ratio_draws_lengths_in_range() -> None:
    from ftransformers.bench.prompts import PromptFactory, load_tokenizer
    from ftransformers.entrypoints.demo_model import ensure_demo_model

    factory = PromptFactory(load_tokenizer(str(ensure_demo_model())), "openai-completions", seed=3)
    prompts = factory.random_prompts(24, 200, output_len=40, range_ratio=0.25)
    lengths = [factory.count(p.text) for p in prompts]
    assert [p.expected_prompt_tokens for p in prompts] == lengths
    assert all(50 <= n <= 200 for n in lengths) and len(set(lengths)) > 12  # uniform over 151 values
    outs = [p.output_len for p in prompts]
    assert all(o is not None and 10 <= o <= 40 for o in outs) and len(set(outs)) > 6
    again = PromptFactory(factory.tok, "openai-completions", seed=3).random_prompts(24, 200, output_len=40,
                                                                                   range_ratio=0.25)  # fmt: skip
    assert [(p.text, p.output_len) for p in again] == [(p.text, p.output_len) for p in prompts]
    # with a shared prefix the shortest prompt still holds one token past it; ratio 1: the exact lengths, as before
    shared = factory.random_prompts(8, 40, prefix_len=30, output_len=8, range_ratio=0.0)
    assert all(31 <= factory.count(p.text) <= 40 for p in shared)
    fixed = factory.random_prompts(3, 40, output_len=8)
    assert [factory.count(p.text) for p in fixed] == [40] * 3 and {p.output_len for p in fixed} == {None}
