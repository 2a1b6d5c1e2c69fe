"""Render a benchmark run folder (summary.json + requests.jsonl) into report.md, results.csv and PNG
plots, or several runs side by side: `ftransformers bench report DIR [DIR...]`.

A point whose requests all failed has no figures: it is shown as failed with its error messages,
never as zeros, and left out of plots and deltas.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftransformers.bench.baseline import (
    METRIC_LABELS,
    METRICS,
    Baseline,
    BaselineError,
    compute_deltas,
    load_baseline,
    point_key,
    point_metrics,
)

STATS = ("ttft_s", "tpot_ms", "tps", "itl_ms", "latency_s")
STAT_FIELDS = ("mean", "p50", "p90", "p95", "p99", "min", "max")
SCALARS = ("number", "successes", "failures", "short_outputs", "duration_s", "output_throughput",
           "request_throughput", "total_output_tokens")
SERVER_FLAGS = ("version", "model_path", "served_model_name", "dtype", "device", "quantization", "kv_cache_dtype",
                "tp_size", "dp_size", "ep_size", "context_length", "attention_backend", "max_total_tokens",
                "max_total_num_tokens", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                "mem_fraction_static", "disable_radix_cache", "enable_metrics")

ENV_LABELS = {"gpu": "GPU", "cpu": "CPU", "cpu_count": "CPU count", "python": "Python", "platform": "Platform",
              "served_models": "Served models (/v1/models)", "tool_version": "Tool version"}

LABELS = {"ttft_s": "TTFT(s)", "latency_s": "latency(s)", "ttft_speedup": "TTFT speed-up (cold / warm)",
          "duration_s": "duration(s)", "interval_s": "interval(s)", "input_len": "input length",
          "output_len": "output length"}


class ReportError(ValueError):
    """A run folder that cannot be rendered; one line naming the folder or file and the problem."""


@dataclass
class Run:
    path: Path
    label: str
    summary: dict[str, Any]
    points: list[dict[str, Any]]
    latencies: dict[str, list[float]] = field(default_factory=dict)  # point id -> successful latencies
    notes: list[str] = field(default_factory=list)


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    a = abs(value)
    return f"{value:.0f}" if a >= 1000 else f"{value:.1f}" if a >= 100 else f"{value:.2f}" if a >= 1 else f"{value:.3f}"


def _cell(value: Any) -> str:
    return (value if isinstance(value, str) else fmt(value)).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows), ""]


def _stat(point: dict[str, Any], metric: str, which: str) -> float | None:
    value = point.get(metric)
    return value.get(which) if isinstance(value, dict) else None


def _point_name(p: dict[str, Any]) -> str:
    return f"input {p['input_len']} / output {p['output_len']} / concurrency {p['concurrency']}"


def load_run(path: str | Path, label: str | None = None) -> Run:
    d = Path(path)
    if not d.is_dir():
        raise ReportError(f"{d}: no such folder")
    sp = d / "summary.json"
    try:
        summary = json.loads(sp.read_text())
    except FileNotFoundError:
        raise ReportError(f"{sp}: not found (is {d} a benchmark output folder?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{sp}: cannot read it ({exc})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("points", []), list):
        raise ReportError(f"{sp}: not a benchmark summary (no 'points' list)")
    points = summary.get("points") or []
    for i, p in enumerate(points, 1):
        missing = [k for k in ("point", "input_len", "output_len", "concurrency", "successes", "failures")
                   if not isinstance(p, dict) or k not in p]
        if missing:
            raise ReportError(f"{sp}: point {i} lacks {', '.join(missing)}")
        try:
            point_key(p), int(p["successes"]), int(p["failures"])
        except (TypeError, ValueError):
            raise ReportError(f"{sp}: point {i} has a non-integer length, concurrency or count") from None
    run = Run(d, label or d.resolve().name, summary, sorted(points, key=point_key))
    _read_requests(run)
    return run


def _read_requests(run: Run) -> None:
    """Latencies per point for the distribution plot, and server-vs-tokenizer token count mismatches."""
    path = run.path / "requests.jsonl"
    if not path.is_file():
        run.notes.append("requests.jsonl not found: no latency distribution")
        run.notes += [f"{p['point']}: {p['usage_tokenizer_mismatches']} requests where the server's usage and the "
                      "tokenizer disagree on the output token count" for p in run.points
                      if p.get("usage_tokenizer_mismatches")]
        return
    bad, mismatches = 0, {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                if r.get("success") and r.get("end_time") is not None:
                    run.latencies.setdefault(str(r.get("point")), []).append(float(r["end_time"]))
                usage, tok = r.get("completion_tokens"), r.get("completion_tokens_tokenizer")
                if r.get("success") and usage is not None and tok is not None and usage != tok:
                    first, n = mismatches.get(r.get("point"), ((usage, tok), 0))
                    mismatches[r.get("point")] = (first, n + 1)
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                bad += 1
    if bad:
        run.notes.append(f"requests.jsonl: {bad} unreadable lines skipped")
    for pid, ((usage, tok), n) in mismatches.items():
        run.notes.append(f"{pid}: {n} requests where the server's usage and the tokenizer disagree on the "
                         f"output token count (e.g. {usage} vs {tok})")


def _errors(p: dict[str, Any]) -> str:
    return "; ".join(f"`{msg}` ×{n}" for msg, n in (p.get("errors") or {}).items())


def _failures(points: list[dict[str, Any]]) -> list[str]:
    """Every point with failed or short requests, with its error messages and their counts."""
    rows = [[_point_name(p) + (f" ({_tag(p)})" if _tag(p) else ""), p.get("number"), p.get("failures", 0),
             p.get("short_outputs", 0), _errors(p) or "—"]
            for p in points if p.get("failures") or p.get("short_outputs")]
    return ["## Failures and short outputs", "", *_table(["Point", "Sent", "Failed", "Short", "Errors"], rows)] \
        if rows else []


def _env_value(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "; ".join(value)
    return value if isinstance(value, str) else json.dumps(value)


def _header(run: Run) -> list[str]:
    s, env = run.summary, run.summary.get("environment") or {}
    server, config = env.get("server_info") or {}, s.get("config") or {}
    cmd = s.get("command")
    model = config.get("model") or (env.get("model_info") or {}).get("served_model_name") or server.get("model_path")
    tool = s.get("tool") or {}
    out = [f"# Serving benchmark: {model or run.label}", "", "Command:", "", "```bash",
           shlex.join(map(str, cmd)) if isinstance(cmd, list) else str(cmd or "(not recorded)"), "```", "",
           f"- Date: {s.get('created', '—')}",
           f"- Tool: {tool.get('name', 'ftransformers bench')} {tool.get('version', '')}",
           f"- Git commit: {env.get('git_commit') or '—'}", "", "## Environment", ""]
    flags = ", ".join(f"{k}={server[k]}" for k in SERVER_FLAGS if server.get(k) is not None) if server else \
        "not available (the server has no /server_info)"
    rows = [["Server", flags], ["Model info", env.get("model_info")]]
    rows += [[ENV_LABELS.get(k, k.replace("_", " ").capitalize()), v] for k, v in env.items()
             if k not in ("server_info", "model_info", "git_commit")]
    out += _table(["", ""], [[k, _env_value(v)] for k, v in rows if v is not None])
    for title, data in (("Run configuration", config), ("Server info (/server_info)", server)):
        if data:
            out += [f"<details><summary>{title}</summary>", "", "```json", json.dumps(data, indent=2), "```",
                    "", "</details>", ""]
    return out


def _tag(p: dict[str, Any]) -> str:
    """'' for a plain point; its id for a soak or a repeated point, so those are not mixed up with it."""
    return "" if p["point"] == f"in{p['input_len']}-out{p['output_len']}-c{p['concurrency']}" else str(p["point"])


def _conc(p: dict[str, Any]) -> str:
    return f"{p['concurrency']} ({_tag(p)})" if _tag(p) else str(p["concurrency"])


def _results(points: list[dict[str, Any]]) -> list[str]:
    out = ["## Results", "", "Means over successful requests; TPS = 1000 / TPOT(ms) per request.", ""]
    if not points:
        return [*out, "No point completed (see Notes).", ""]
    for length in sorted({p["input_len"] for p in points}):
        rows, detail = [], []
        for p in (p for p in points if p["input_len"] == length):
            m = point_metrics(p)
            cells = [m[k] for k in METRICS] if p["successes"] else ["FAILED (see Failures)"] + ["—"] * 4
            rows.append([_conc(p), p["output_len"], *cells, p["successes"], p["failures"],
                         p.get("short_outputs", 0)])
            ptiles = [" / ".join(fmt(_stat(p, k, q)) for q in ("p50", "p90", "p99")) for k in STATS]
            detail.append([_conc(p), p["output_len"], *ptiles, fmt(_stat(p, "tps", "min")),
                           p.get("duration_s"), p.get("request_throughput") if p["successes"] else None])
        out += [f"### Input {length} tokens", ""]
        out += _table(["Concurrency", "Output", *METRIC_LABELS.values(), "Successes", "Failures", "Short outputs"],
                      rows)
        out += [f"<details><summary>Percentiles p50 / p90 / p99, input {length}</summary>", ""]
        out += _table(["Concurrency", "Output", "TTFT(s)", "TPOT(ms)", "TPS", "ITL(ms)", "Latency(s)", "TPS min",
                       "Duration(s)", "Requests/s"], detail) + ["</details>", ""]
    return out


def _probe_text(probe: dict[str, Any], min_tps: float | None, criterion: str | None) -> str:
    keys = (f"tps_{criterion}", "tps", "tps_mean", "tps_p50", "tps_min")
    tps_key = next((k for k in keys if probe.get(k) is not None), None)
    text = f"{probe.get('concurrency', '?')}"
    if tps_key:
        ok = probe.get("passed", probe.get("ok"))
        ok = (probe[tps_key] >= min_tps) if ok is None and min_tps is not None else ok
        text += f": {fmt(probe[tps_key])}" + ("" if ok is None else " ✓" if ok else " ✗")
    return text + (f" ({probe['failures']} failed)" if probe.get("failures") else "")


def _max_concurrency(results: list[dict[str, Any]]) -> list[str]:
    if not results:
        return []
    rows = [[m["input_len"], m["output_len"], m.get("min_tps"), m.get("criterion", "mean"),
             m["max_concurrency"] if m.get("max_concurrency") is not None else "none (even 1 misses the bar)",
             ", ".join(_probe_text(p, m.get("min_tps"), m.get("criterion")) for p in m.get("probes") or []),
             m.get("note") or ""]
            for m in results]
    return ["## Max concurrency", "", ("Largest concurrency whose per-request TPS holds the bar; probes as "
                                       "concurrency: TPS (✓ holds, ✗ misses)."), "",
            *_table(["Input", "Output", "Min TPS", "TPS statistic", "Max concurrency", "Probes", "Note"], rows)]


def _label(key: str) -> str:
    return LABELS.get(key) or key.replace("_", " ")


def _rows_section(key: str, rows: list[dict[str, Any]], csv_name: str) -> list[str]:
    """A list of row dicts (soak intervals): scalar columns as a table of at most ~20 evenly spaced rows;
    nested dicts of numbers (server gauges from /metrics) as first / last / min / max per series."""
    step = -(-len(rows) // 20)
    shown = [r for i, r in enumerate(rows) if i % step == 0 or r.get("failures")]  # never hide a failing interval
    head = [k for k in dict.fromkeys(k for r in rows for k in r) if not any(isinstance(r.get(k), dict) for r in rows)]
    more = f" ({len(shown)} of {len(rows)} rows, every interval with failures among them; all in {csv_name})"
    title = f"**{key.replace('_', ' ')}**" + (more if step > 1 else "")
    out = [title, "", *_table(head, [[r.get(h) for h in head] for r in shown])]
    series: dict[str, list[float]] = {}
    for r in rows:
        for nested in (v for v in r.values() if isinstance(v, dict)):
            for name, value in nested.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    series.setdefault(name, []).append(value)
    if series:
        out += ["**server gauges over the run**", ""]
        out += _table(["Series", "First", "Last", "Min", "Max"],
                      [[name, v[0], v[-1], min(v), max(v)] for name, v in sorted(series.items())])
    return out


def _dict_section(title: str, data: dict[str, Any] | None) -> list[str]:
    """Scalars as a two-column table; 'cold'/'warm'-style sides as columns of one table; error counts as a
    list; lists of rows via _rows_section."""
    if not data:
        return []
    out = [f"## {title}", ""]
    scalars = [[_label(k), v] for k, v in data.items() if not isinstance(v, (dict, list))]
    out += _table(["", ""], scalars) if scalars else []
    sides = {k: v for k, v in data.items() if k in ("cold", "warm", "first", "second") and isinstance(v, dict)}
    if sides:
        keys = list(dict.fromkeys(k for v in sides.values() for k in v))
        out += _table(["", *(k.capitalize() for k in sides)],
                      [[_label(k), *(v.get(k) for v in sides.values())] for k in keys])
    for key, value in data.items():
        if key in sides:
            continue
        if isinstance(value, dict) and value:
            out += [f"**{key.replace('_', ' ')}**", ""] + [f"- {k}: {fmt(v)}" for k, v in value.items()] + [""]
        elif isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            out += _rows_section(key, value, f"{title.lower().replace(' ', '_')}_{key}.csv")
        elif isinstance(value, list) and value:
            out += [f"**{key.replace('_', ' ')}**: " + ", ".join(fmt(v) for v in value), ""]
    return out


def _write_rows_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows with nested dicts flattened one level (`metrics.<series>`)."""
    flat = [{f"{k}.{n}" if isinstance(v, dict) else k: x for k, v in r.items()
             for n, x in (v.items() if isinstance(v, dict) else [(None, v)])} for r in rows]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
        w.writeheader()
        w.writerows(flat)
    return path


def _baseline_rows(deltas: list[dict[str, Any]]) -> list[list[Any]]:
    return [[d["input_len"], d["output_len"], d["concurrency"], METRIC_LABELS.get(d["metric"], d["metric"]),
             d["run"], d["baseline"], f"{d['delta']:+.4g}",
             "—" if d.get("delta_pct") is None else f"{d['delta_pct']:+.1f}%",
             {True: "better", False: "worse"}.get(d.get("better"), "same")] for d in deltas]


def _resolve_baseline(run: Run, explicit: str | Path | None) -> tuple[str, list[dict[str, Any]]] | None:
    """(label, deltas) from --baseline, or from the run's own summary['baseline'] (a path, or a dict
    with 'path' and/or precomputed 'deltas'); a baseline that cannot be read becomes a note."""
    ref = explicit if explicit is not None else run.summary.get("baseline")
    if not ref:
        return None
    if isinstance(ref, dict) and isinstance(ref.get("deltas"), list):
        return str(ref.get("label") or ref.get("path") or "baseline"), ref["deltas"]
    path = Path(str(ref.get("path") or ref.get("file") or "") if isinstance(ref, dict) else ref)
    if not path.is_absolute() and not path.exists() and (run.path / path).exists():
        path = run.path / path
    try:
        baseline: Baseline = load_baseline(path, ref.get("label") if isinstance(ref, dict) else None)
    except BaselineError as exc:
        if explicit is not None:
            raise
        run.notes.append(str(exc))
        return None
    deltas = compute_deltas(run.points, baseline)
    if not deltas:
        run.notes.append(f"baseline {baseline.path}: no point of this run matches it")
    return f"{baseline.label} ({baseline.path})", deltas


def write_csv(path: Path, runs: list[tuple[str | None, list[dict[str, Any]]]]) -> Path:
    """One row per point with every metric; cells of a failed point's figures are empty, not zero."""
    with_run = any(label is not None for label, _ in runs)
    head = (["run"] if with_run else []) + ["point", "input_len", "output_len", "concurrency", *SCALARS]
    head += [f"{m}_{s}" for m in STATS for s in STAT_FIELDS] + ["errors"]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        for label, points in runs:
            for p in points:
                ok = bool(p.get("successes"))
                row = [label] if with_run else []
                row += [p.get(k) for k in ("point", "input_len", "output_len", "concurrency")]
                row += [p.get(k) if ok or k in ("number", "successes", "failures", "short_outputs") else None
                        for k in SCALARS]
                row += [_stat(p, m, s) if ok else None for m in STATS for s in STAT_FIELDS]
                row.append("; ".join(f"{msg} (x{n})" for msg, n in (p.get("errors") or {}).items()))
                w.writerow(["" if v is None else v for v in row])
    return path


def render_report(out_dir: str | Path, *, source_dir: str | Path | None = None,
                  baseline: str | Path | None = None) -> list[Path]:
    """Write report.md, results.csv and the plots of the run in `source_dir` (default `out_dir`) into
    `out_dir`; return the files written. Raises ReportError when summary.json cannot be read, BaselineError
    when an explicit `baseline` cannot."""
    out = Path(out_dir)
    run = load_run(source_dir if source_dir is not None else out)
    out.mkdir(parents=True, exist_ok=True)
    with _unexpected_layout(str(run.path / "summary.json")):
        return _render(run, out, baseline)


@contextlib.contextmanager
def _unexpected_layout(where: str) -> Iterator[None]:
    """A summary.json whose sections are not shaped as the runner writes them: one line, not a traceback."""
    try:
        yield
    except (ReportError, BaselineError):
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ReportError(f"{where}: unexpected content ({type(exc).__name__}: {exc})") from None


def _render(run: Run, out: Path, baseline: str | Path | None) -> list[Path]:
    from ftransformers.bench.plots import run_plots

    s = run.summary
    files = [write_csv(out / "results.csv", [(None, run.points)])]
    try:
        latencies = {pid: v for pid, v in run.latencies.items() if pid in {p["point"] for p in run.points}}
        plots, plot_notes = run_plots(out, run.points, s.get("max_concurrency") or [], latencies, s.get("soak"))
    except Exception as exc:  # noqa: BLE001 - a plot must never cost the report
        plots, plot_notes = [], [f"plots failed: {exc!r}"]
    files += plots
    base = _resolve_baseline(run, baseline)
    md = _header(run) + _results(run.points) + _failures(run.points) + _max_concurrency(s.get("max_concurrency") or [])
    md += _dict_section("Prefix-cache check", s.get("prefix_cache_check"))
    md += _dict_section("Soak", s.get("soak"))
    for key, rows in (s.get("soak") or {}).items():
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            files.append(_write_rows_csv(out / f"soak_{key}.csv", rows))
    if base is not None:
        label, deltas = base
        md += [f"## Baseline: {label}", "", ("Δ = this run − baseline; lower is better for TTFT, TPOT and "
                                             "latency, higher for TPS and throughput."), ""]
        md += _table(["Input", "Output", "Concurrency", "Metric", "This run", "Baseline", "Δ", "Δ%", ""],
                     _baseline_rows(deltas))
        if deltas:
            files.append(_write_deltas(out / "baseline_deltas.csv", deltas))
    notes = [str(n) for n in s.get("notes") or []] + run.notes + plot_notes
    md += ["## Notes", ""] + ([f"- {n}" for n in notes] or ["- none"]) + [""]
    if plots:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out / "report.md").write_text("\n".join(md))
    return [out / "report.md", *files]


def _write_deltas(path: Path, deltas: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(deltas[0]), extrasaction="ignore")
        w.writeheader()
        w.writerows(deltas)
    return path


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ftransformers bench report",
                                     description="Re-render one benchmark run, or several side by side.")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="run folders (holding summary.json)")
    parser.add_argument("--output", help="folder to write into (default: the run folder; required for several)")
    parser.add_argument("--labels", nargs="+", help="one name per DIR (default: the folder names)")
    parser.add_argument("--baseline", help="summary.json or a CSV/JSON table to compare one run against")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.labels and len(args.labels) != len(args.dirs):
            raise ReportError(f"--labels has {len(args.labels)} names for {len(args.dirs)} folders")
        if len(args.dirs) == 1:
            files = render_report(args.output or args.dirs[0], source_dir=args.dirs[0], baseline=args.baseline)
        elif not args.output:
            raise ReportError("several folders need --output DIR for the comparison")
        else:
            from ftransformers.bench.compare import render_comparison  # compare builds on this module

            runs = [load_run(d, label) for d, label in zip(args.dirs, args.labels or [None] * len(args.dirs))]
            with _unexpected_layout("summary.json of " + ", ".join(args.dirs)):
                files = render_comparison(args.output, runs)
    except (ReportError, BaselineError, OSError) as exc:
        print(f"ftransformers bench report: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files: {files[0]}" + ("" if len(files) < 2 else " ..."))
    return 0
