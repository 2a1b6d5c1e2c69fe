"""Prometheus metrics for `--enable-metrics`, in a per-app CollectorRegistry (apps never share series)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_PREFIX = "ftransformers:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(_PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(_PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(_PREFIX + name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time per output token after the first", _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.num_running = gauge("num_running_reqs", "Requests running in the scheduler")
        self.num_waiting = gauge("num_queue_reqs", "Requests waiting in the scheduler queue")
        self.kv_usage = gauge("token_usage", "Fraction of KV cache slots in use")
        self.kv_used = gauge("kv_used_tokens", "KV cache slots in use")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.requests = counter("num_requests", "Requests finished")
        self.aborted = counter("num_aborted_requests", "Requests aborted (client gone, stop string)")

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, ttft: float | None, e2e: float,
                         aborted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.requests.inc()
        if aborted:
            self.aborted.inc()
        self.e2e.observe(e2e)
        if ttft is not None and completion_tokens > 1:
            self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def observe_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def set_scheduler_stats(self, stats: Any) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_used_tokens)
        self.kv_usage.set(stats.kv_used_tokens / stats.kv_capacity if stats.kv_capacity else 0.0)
        total = stats.prompt_tokens_total
        self.cache_hit_rate.set(stats.cache_hit_tokens / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
