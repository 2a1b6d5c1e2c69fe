"""Render a benchmark run folder (summary.json + requests.jsonl) into report.md, results.csv and PNG
plots, or several runs side by side: `ftransformers bench report DIR [DIR...]`.

A point whose requests all failed has no figures: it is shown as failed with its error messages,
never as zeros, and left out of plots and deltas.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftransformers.bench.baseline import (METRIC_LABELS, METRICS, Baseline, BaselineError, compute_deltas,
                                          load_baseline, point_key, point_metrics)

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


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cell = lambda v: (v if isinstance(v, str) else fmt(v)).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows), ""]


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
    with path.open() as f:
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


def _failures(points: list[dict[str, Any]]) -> list[str]:
    """Every point with failed or short requests, with its error messages and their counts."""
    rows = [[_point_name(p), p.get("number"), p.get("failures", 0), p.get("short_outputs", 0),
             "; ".join(f"`{msg}` ×{n}" for msg, n in (p.get("errors") or {}).items()) or "—"]
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
           f"- Date: {s.get('created', '—')}", f"- Tool: {tool.get('name', 'ftransformers bench')} {tool.get('version', '')}",
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


def _results(points: list[dict[str, Any]]) -> list[str]:
    out = ["## Results", "", "Means over successful requests; TPS = 1000 / TPOT(ms) per request.", ""]
    for length in sorted({p["input_len"] for p in points}):
        rows, detail = [], []
        for p in (p for p in points if p["input_len"] == length):
            m = point_metrics(p)
            cells = [m[k] for k in METRICS] if p["successes"] else ["FAILED (see Failures)"] + ["—"] * 4
            rows.append([p["concurrency"], p["output_len"], *cells, p["successes"], p["failures"],
                         p.get("short_outputs", 0)])
            ptiles = [" / ".join(fmt(_stat(p, k, q)) for q in ("p50", "p90", "p99")) for k in STATS]
            detail.append([p["concurrency"], p["output_len"], *ptiles, fmt(_stat(p, "tps", "min")),
                           p.get("duration_s"), p.get("request_throughput") if p["successes"] else None])
        out += [f"### Input {length} tokens", ""]
        out += _table(["Concurrency", "Output", *METRIC_LABELS.values(), "Successes", "Failures", "Short outputs"], rows)
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
             ", ".join(_probe_text(p, m.get("min_tps"), m.get("criterion")) for p in m.get("probes") or []), m.get("note") or ""]
            for m in results]
    return ["## Max concurrency", "", "Largest concurrency whose per-request TPS holds the bar; probes as "
            "concurrency: TPS (✓ holds, ✗ misses).", "",
            *_table(["Input", "Output", "Min TPS", "TPS statistic", "Max concurrency", "Probes", "Note"], rows)]


def _dict_section(title: str, data: dict[str, Any] | None) -> list[str]:
    """Scalars as a two-column table, error counts as a list, lists of rows as (sampled) tables."""
    if not data:
        return []
    out = [f"## {title}", ""]
    scalars = [[k.replace("_", " "), v] for k, v in data.items() if not isinstance(v, (dict, list))]
    out += _table(["", ""], scalars) if scalars else []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += [f"**{key.replace('_', ' ')}**", ""] + [f"- {k}: {fmt(v)}" for k, v in value.items()] + [""]
        elif isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            step = max(1, len(value) // 20)
            head = list(dict.fromkeys(k for r in value for k in r))
            out += [f"**{key.replace('_', ' ')}**" + (f" (every {step}th of {len(value)})" if step > 1 else ""), ""]
            out += _table(head, [[r.get(h) for h in head] for r in value[::step]])
        elif isinstance(value, list) and value:
            out += [f"**{key.replace('_', ' ')}**: " + ", ".join(fmt(v) for v in value), ""]
    return out


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
                row = ([label] if with_run else []) + [p.get(k) for k in ("point", "input_len", "output_len", "concurrency")]
                row += [p.get(k) if ok or k in ("number", "successes", "failures", "short_outputs") else None
                        for k in SCALARS]
                row += [_stat(p, m, s) if ok else None for m in STATS for s in STAT_FIELDS]
                row.append("; ".join(f"{msg} (x{n})" for msg, n in (p.get("errors") or {}).items()))
                w.writerow(["" if v is None else v for v in row])
    return path


def render_report(out_dir: str | Path, *, source_dir: str | Path | None = None,
                  baseline: str | Path | None = None) -> list[Path]:
    """Write report.md, results.csv and the plots of the run in `source_dir` (default `out_dir`) into
    `out_dir`; return the files written. Raises ReportError when summary.json cannot be read."""
    from ftransformers.bench.plots import run_plots

    out = Path(out_dir)
    run = load_run(source_dir if source_dir is not None else out)
    out.mkdir(parents=True, exist_ok=True)
    s = run.summary
    files = [write_csv(out / "results.csv", [(None, run.points)])]
    try:
        plots, plot_notes = run_plots(out, run.points, s.get("max_concurrency") or [], run.latencies, s.get("soak"))
    except Exception as exc:  # a plot must never cost the report
        plots, plot_notes = [], [f"plots failed: {exc!r}"]
    files += plots
    base = _resolve_baseline(run, baseline)
    md = _header(run) + _results(run.points) + _failures(run.points) + _max_concurrency(s.get("max_concurrency") or [])
    md += _dict_section("Prefix-cache check", s.get("prefix_cache_check"))
    md += _dict_section("Soak", s.get("soak"))
    if base is not None:
        label, deltas = base
        md += [f"## Baseline: {label}", "", "Δ = this run − baseline; lower is better for TTFT, TPOT and "
               "latency, higher for TPS and throughput.", ""]
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


def _pct(value: float | None, ref: float | None, metric: str) -> str:
    if value is None or ref is None or not ref:
        return "—"
    pct = (value - ref) / ref * 100.0
    better = "" if pct == 0 else " better" if (pct < 0) == METRICS[metric][1] else " worse"
    return f"{pct:+.1f}%{better}"


def _comparison_tables(runs: list[Run]) -> list[str]:
    """Per input length: rows = (output, concurrency) of any run; per metric each run's value and, for
    every run after the first, its delta vs the first run."""
    index = [{point_key(p): p for p in r.points} for r in runs]
    keys = sorted({k for idx in index for k in idx})
    head = ["Concurrency", "Output"]
    for metric, name in METRIC_LABELS.items():
        head += [f"{name} {r.label}" for r in runs] + [f"Δ {r.label}" for r in runs[1:]]
    out = ["## Results side by side", "", f"Means over successful requests; Δ = run vs {runs[0].label}.", ""]
    for length in sorted({k[0] for k in keys}):
        rows = []
        for key in (k for k in keys if k[0] == length):
            figures = [point_metrics(idx[key]) if key in idx else None for idx in index]
            row: list[Any] = [key[2], key[1]]
            for metric in METRIC_LABELS:
                row += [("not run" if f is None else "FAILED" if f[metric] is None and not idx[key]["successes"]
                         else f[metric]) for f, idx in zip(figures, index)]
                ref = figures[0][metric] if figures[0] else None
                row += [_pct(f[metric] if f else None, ref, metric) for f in figures[1:]]
            rows.append(row)
        out += [f"### Input {length} tokens", ""] + _table(head, rows)
    return out


def render_comparison(out_dir: str | Path, runs: list[Run]) -> list[Path]:
    """Side-by-side report of several runs (engine A vs engine B) matched by (input, output, concurrency)."""
    from ftransformers.bench.plots import comparison_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, int] = {}
    for r in runs:  # equal folder names (a/run, b/run) still need distinct labels
        seen[r.label] = seen.get(r.label, 0) + 1
        r.label = r.label if seen[r.label] == 1 else f"{r.label}#{seen[r.label]}"
    md = [f"# Benchmark comparison: {' vs '.join(r.label for r in runs)}", "", "## Runs", ""]
    rows = []
    for r in runs:
        env, cfg = r.summary.get("environment") or {}, r.summary.get("config") or {}
        cmd = r.summary.get("command")
        rows.append([r.label, str(r.path), cfg.get("model") or (env.get("server_info") or {}).get("model_path"),
                     (env.get("server_info") or {}).get("version"), env.get("gpu"), env.get("cpu"),
                     r.summary.get("created"), shlex.join(map(str, cmd)) if isinstance(cmd, list) else cmd])
    md += _table(["Run", "Folder", "Model", "Server version", "GPU", "CPU", "Date", "Command"],
                 [[v if isinstance(v, (str, int, float)) or v is None else json.dumps(v) for v in row] for row in rows])
    md += _comparison_tables(runs)
    mc = [(r.label, m) for r in runs for m in r.summary.get("max_concurrency") or []]
    if mc:
        pairs = sorted({(m["input_len"], m["output_len"], m.get("min_tps")) for _, m in mc}, key=str)
        found = {(label, m["input_len"], m["output_len"], m.get("min_tps")): m.get("max_concurrency") for label, m in mc}
        md += ["## Max concurrency side by side", ""]
        md += _table(["Input", "Output", "Min TPS", *(r.label for r in runs)],
                     [[i, o, t, *(found.get((r.label, i, o, t), "—") for r in runs)] for i, o, t in pairs])
    files = [write_csv(out / "results.csv", [(r.label, r.points) for r in runs])]
    plots, plot_notes = comparison_plots(out, [(r.label, r.points) for r in runs])
    files += plots
    if plots:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    for r in runs:
        md += [line.replace("## Failures", f"## {r.label}: failures", 1) for line in _failures(r.points)]
    notes = [f"{r.label}: {n}" for r in runs for n in [*(r.summary.get("notes") or []), *r.notes]]
    md += ["## Notes", ""] + [f"- {n}" for n in notes + plot_notes] + ([] if notes + plot_notes else ["- none"]) + [""]
    (out / "report.md").write_text("\n".join(md))
    return [out / "report.md", *files]


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
            runs = [load_run(d, label) for d, label in zip(args.dirs, args.labels or [None] * len(args.dirs))]
            files = render_comparison(args.output, runs)
    except (ReportError, BaselineError, OSError) as exc:
        print(f"ftransformers bench report: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files: {files[0]}" + ("" if len(files) < 2 else " ..."))
    return 0
