"""The periodic step log line (SGLang's "Decode batch" line), one every `--log-interval-s` while busy.

The loop calls `on_step(outputs)` after each model step (integer counters only) and `maybe_log(...)`
once per turn; a line covers the interval since the previous one. A whole interval without a step
prints nothing, and the next window starts at the next step, so long idle spells never dilute rates.

Prefill tok/s counts prompt tokens admitted and not served from the prefix cache (from the
cumulative `SchedulerStats` counters), so a long chunked prompt counts when it is admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftransformers.scheduler.io_struct import ReqOutput, SchedulerStats


@dataclass
class _Totals:
    prompt_tokens: int = 0
    cache_hit_tokens: int = 0
    retractions: int = 0


def format_stats_line(stats: SchedulerStats, seconds: float, steps: int, gen_tokens: int, seqs: int,
                      prefill_tokens: int, retractions: int) -> str:
    seconds = max(seconds, 1e-9)
    kv_pct = 100.0 * stats.kv_used_tokens / max(stats.kv_capacity, 1)
    hit_pct = 100.0 * stats.cache_hit_tokens / max(stats.prompt_tokens_total, 1)
    return (
        f"Step stats ({seconds:.1f} s): {steps / seconds:.2f} steps/s, gen {gen_tokens / seconds:.1f} tok/s, "
        f"prefill {prefill_tokens / seconds:.1f} tok/s, running {stats.num_running}, waiting {stats.num_waiting}, "
        f"batch {seqs / max(steps, 1):.1f}, KV {stats.kv_used_tokens}/{stats.kv_capacity} ({kv_pct:.1f}%), "
        f"cached {stats.kv_cached_tokens}, cache hit {hit_pct:.1f}%, "
        f"retractions {retractions} ({stats.num_retractions} total)"
    )


class StatsLogger:
    def __init__(self, interval_s: float, emit: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.enabled = interval_s > 0
        self._emit = emit
        self._clock = clock
        self._window_start: float | None = None  # None: no step since the last line
        self._steps = 0
        self._gen_tokens = 0
        self._seqs = 0  # sequences that produced tokens, summed over steps
        self._last = _Totals()

    def on_step(self, outputs: Sequence[ReqOutput]) -> None:
        if not self.enabled:
            return
        if self._window_start is None:
            self._window_start = self._clock()
        self._steps += 1
        for out in outputs:
            n = len(out.new_token_ids)
            self._gen_tokens += n
            self._seqs += n > 0

    def maybe_log(self, get_stats: Callable[[], SchedulerStats]) -> str | None:
        """Emit and return the line when an interval with steps has passed; otherwise None."""
        if self._window_start is None:
            return None
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.interval_s:
            return None
        if self._steps == 0:  # idle for a whole interval: the next window starts at the next step
            self._window_start = None
            return None
        stats = get_stats()
        last = self._last
        prefill = (stats.prompt_tokens_total - stats.cache_hit_tokens) - (last.prompt_tokens - last.cache_hit_tokens)
        line = format_stats_line(stats, elapsed, self._steps, self._gen_tokens, self._seqs, max(prefill, 0),
                                 max(stats.num_retractions - last.retractions, 0))
        self._last = _Totals(stats.prompt_tokens_total, stats.cache_hit_tokens, stats.num_retractions)
        self._window_start = now
        self._steps = self._gen_tokens = self._seqs = 0
        self._emit(line)
        return line

    def reset_totals(self) -> None:
        """The scheduler was replaced (its cumulative counters restart at zero)."""
        self._last = _Totals()
