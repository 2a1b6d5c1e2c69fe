"""Baselines to compare a run against: another run's summary.json, or a hand-written table of a
competitor's numbers (CSV or JSON), matched to points by (input_len, output_len, concurrency).

A point's headline figure for each metric is the mean over its successful requests; system output
throughput is the point's own figure. Column names are read leniently (`TTFT(s)`, `ttft_ms`,
`TPOT (ms)`, `system throughput(tok/s)`, ...) and times are converted to the canonical units below.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Key = tuple[int, int, int]  # (input_len, output_len, concurrency)

# metric -> (canonical unit, True when lower is better)
METRICS: dict[str, tuple[str, bool]] = {
    "ttft_s": ("s", True),
    "tpot_ms": ("ms", True),
    "tps": ("tok/s", False),
    "output_throughput": ("tok/s", False),
    "latency_s": ("s", True),
}
METRIC_LABELS = {"ttft_s": "TTFT(s)", "tpot_ms": "TPOT(ms)", "tps": "TPS",
                 "output_throughput": "System throughput(tok/s)", "latency_s": "Latency(s)"}

_KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "input_len": ("input_len", "input_length", "input", "in", "input_tokens", "prompt_len", "prompt_length",
                  "prompt_tokens", "isl"),
    "output_len": ("output_len", "output_length", "output", "out", "output_tokens", "max_tokens", "osl",
                   "completion_tokens"),
    "concurrency": ("concurrency", "parallel", "conc", "concurrent", "clients", "batch", "batch_size",
                    "num_concurrent"),
}
_METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "ttft_s": ("ttft", "avg_ttft", "mean_ttft", "time_to_first_token", "first_token_latency"),
    "tpot_ms": ("tpot", "avg_tpot", "mean_tpot", "time_per_output_token"),
    "tps": ("tps", "per_request_tps", "request_tps", "tps_per_request", "output_tps", "decode_tps",
            "tokens_per_second_per_request"),
    "output_throughput": ("output_throughput", "throughput", "system_throughput", "system_output_throughput",
                          "output_token_throughput", "total_throughput", "gen_throughput"),
    "latency_s": ("latency", "e2e_latency", "end_to_end_latency", "avg_latency", "mean_latency",
                  "request_latency", "e2el"),
}
_UNIT_SUFFIXES = ("_ms", "_s", "_tok_s", "_tokens_s")
_SCALE = {"s": 1.0, "sec": 1.0, "seconds": 1.0, "ms": 1e-3, "milliseconds": 1e-3, "us": 1e-6}


class BaselineError(ValueError):
    """A baseline file that cannot be read; the message names the file and the problem."""


@dataclass
class Baseline:
    path: str
    label: str
    kind: str  # "summary" (another run) or "table" (hand-written numbers)
    entries: dict[Key, dict[str, float]] = field(default_factory=dict)


def point_metrics(point: dict[str, Any]) -> dict[str, float | None]:
    """Headline figures of one PointSummary dict; all None when no request succeeded (never zeros)."""
    if not point.get("successes"):
        return {m: None for m in METRICS}
    out: dict[str, float | None] = {}
    for m in METRICS:
        value = point.get(m)
        out[m] = value.get("mean") if isinstance(value, dict) else value
    return out


def point_key(point: dict[str, Any]) -> Key:
    return int(point["input_len"]), int(point["output_len"]), int(point["concurrency"])


def _split_header(header: str) -> tuple[str, str | None]:
    """'TTFT (s)' -> ('ttft', 's'); 'tpot_ms' -> ('tpot', 'ms'); 'Input' -> ('input', None)."""
    text = header.strip().lower()
    unit = None
    m = re.match(r"^(.*?)\s*[\(\[]\s*([^\)\]]*?)\s*[\)\]]\s*$", text)
    if m:
        text, unit = m.group(1), m.group(2).replace(" ", "")
    name = re.sub(r"[^a-z0-9]+", "_", text).strip("_")
    if unit is None:
        for suffix in _UNIT_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name, unit = name[: -len(suffix)], suffix[1:]
                break
    return name, unit


def _column(header: str) -> tuple[str, float] | None:
    """Canonical name and the factor that converts the column's unit to the canonical one."""
    name, unit = _split_header(header)
    for canonical, aliases in _KEY_ALIASES.items():
        if name in aliases:
            return canonical, 1.0
    for canonical, aliases in _METRIC_ALIASES.items():
        if name not in aliases:
            continue
        if canonical in ("ttft_s", "latency_s"):
            return canonical, _SCALE.get(unit or "s", 1.0)
        if canonical == "tpot_ms":
            return canonical, _SCALE.get(unit or "ms", 1e-3) * 1e3
        return canonical, 1.0
    return None


def _number(text: Any, where: str, k: float = 1000.0) -> float | None:
    """A cell as a float; '4K' is 4 * k (1024 for token lengths, 1000 for figures); blanks are None."""
    if text is None or (isinstance(text, str) and text.strip() in ("", "-", "—", "n/a", "na", "null")):
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip().replace(",", "").lower()
    factor = 1.0
    if s.endswith("k"):
        s, factor = s[:-1], k
    try:
        return float(s) * factor
    except ValueError:
        raise BaselineError(f"{where}: not a number: {text!r}") from None


def _from_rows(rows: list[dict[str, Any]], path: str) -> dict[Key, dict[str, float]]:
    entries: dict[Key, dict[str, float]] = {}
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise BaselineError(f"baseline {path}: row {i} is not an object")
        values: dict[str, float] = {}
        for header, raw in row.items():
            col = _column(str(header)) if header is not None else None
            if col is None:
                continue
            number = _number(raw, f"baseline {path}: row {i}, column {header!r}",
                             1024.0 if col[0] in _KEY_ALIASES else 1000.0)
            if number is not None:
                values[col[0]] = number * col[1]
        missing = [k for k in _KEY_ALIASES if k not in values]
        if missing:
            raise BaselineError(f"baseline {path}: row {i} lacks {', '.join(missing)} "
                                f"(columns: {', '.join(str(h) for h in row)})")
        key = (int(values.pop("input_len")), int(values.pop("output_len")), int(values.pop("concurrency")))
        if not values:
            raise BaselineError(f"baseline {path}: row {i} has no metric column "
                                f"(any of {', '.join(METRIC_LABELS.values())})")
        entries[key] = values
    if not entries:
        raise BaselineError(f"baseline {path}: no rows")
    return entries


def _from_summary(data: dict[str, Any]) -> dict[Key, dict[str, float]]:
    entries: dict[Key, dict[str, float]] = {}
    for point in data["points"]:
        values = {m: v for m, v in point_metrics(point).items() if v is not None}
        if values:
            entries[point_key(point)] = values
    return entries


def is_summary(data: Any) -> bool:
    points = data.get("points") if isinstance(data, dict) else None
    return isinstance(points, list) and all(isinstance(p, dict) and isinstance(p.get("ttft_s"), dict)
                                            for p in points)


def load_baseline(path: str | Path, label: str | None = None) -> Baseline:
    p = Path(path)
    if not p.is_file():
        raise BaselineError(f"baseline {p}: no such file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise BaselineError(f"baseline {p}: cannot read it ({exc})") from None
    name = label or (p.parent.name if p.name == "summary.json" else p.stem) or "baseline"
    if p.suffix.lower() == ".csv":
        try:
            rows = list(csv.DictReader(text.splitlines()))
        except csv.Error as exc:
            raise BaselineError(f"baseline {p}: bad CSV ({exc})") from None
        return Baseline(str(p), name, "table", _from_rows(rows, str(p)))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BaselineError(f"baseline {p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if is_summary(data):
        try:
            entries = _from_summary(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise BaselineError(f"baseline {p}: malformed summary.json point ({exc!r})") from None
        if not entries:
            raise BaselineError(f"baseline {p}: the run has no point with a successful request")
        return Baseline(str(p), name, "summary", entries)
    if isinstance(data, dict):
        name = label or str(data.get("label") or data.get("name") or name)
        data = next((data[k] for k in ("rows", "points", "results") if isinstance(data.get(k), list)), None)
    if not isinstance(data, list):
        raise BaselineError(f"baseline {p}: expected a summary.json, a list of rows, or an object with 'rows'")
    return Baseline(str(p), name, "table", _from_rows(data, str(p)))


def compute_deltas(points: list[Any], baseline: Baseline) -> list[dict[str, Any]]:
    """One row per (matching point, metric both sides have): run, baseline, delta, delta_pct, better.

    `better` is True when the run beats the baseline (lower TTFT/TPOT/latency, higher TPS/throughput),
    None when equal. Points where every request failed have no figures and produce no rows."""
    rows: list[dict[str, Any]] = []
    for point in points:
        pd = point if isinstance(point, dict) else asdict(point)
        ref = baseline.entries.get(point_key(pd))
        if ref is None:
            continue
        for metric, value in point_metrics(pd).items():
            base = ref.get(metric)
            if value is None or base is None:
                continue
            delta = value - base
            lower_better = METRICS[metric][1]
            better = None if delta == 0 else (delta < 0) == lower_better
            rows.append({"point": pd.get("point"), "input_len": pd["input_len"], "output_len": pd["output_len"],
                         "concurrency": pd["concurrency"], "metric": metric, "run": value, "baseline": base,
                         "delta": delta, "delta_pct": (delta / base * 100.0) if base else None, "better": better})
    return rows
