"""Side-by-side report of several benchmark runs (engine A vs engine B), matched by (input, output,
concurrency): each run's figures and every later run's delta against the first."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ftransformers.bench.baseline import METRIC_LABELS, METRICS, point_key, point_metrics
from ftransformers.bench.report import Run, _env_value, _failures, _table, _tag, write_csv


def _pct(value: float | None, ref: float | None, metric: str) -> str:
    if value is None or ref is None or not ref:
        return "—"
    pct = (value - ref) / ref * 100.0
    better = "" if pct == 0 else " better" if (pct < 0) == METRICS[metric][1] else " worse"
    return f"{pct:+.1f}%{better}"


def _comparison_tables(runs: list[Run]) -> list[str]:
    """Per input length: rows = (output, concurrency) of any run; per metric each run's value and, for
    every run after the first, its delta vs the first run."""
    index = [{(*point_key(p), _tag(p)): p for p in r.points} for r in runs]
    keys = sorted({k for idx in index for k in idx})
    head = ["Concurrency", "Output"]
    for metric, name in METRIC_LABELS.items():
        head += [f"{name} {r.label}" for r in runs] + [f"Δ {r.label}" for r in runs[1:]]
    out = ["## Results side by side", "", f"Means over successful requests; Δ = run vs {runs[0].label}.", ""]
    for length in sorted({k[0] for k in keys}):
        rows = []
        for key in (k for k in keys if k[0] == length):
            figures = [point_metrics(idx[key]) if key in idx else None for idx in index]
            row: list[Any] = [f"{key[2]} ({key[3]})" if key[3] else key[2], key[1]]
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
                 [[v if isinstance(v, (int, float)) or v is None else _env_value(v) for v in row] for row in rows])
    md += _comparison_tables(runs)
    mc = [(r.label, m) for r in runs for m in r.summary.get("max_concurrency") or []]
    if mc:
        pairs = sorted({(m["input_len"], m["output_len"], m.get("min_tps")) for _, m in mc},
                       key=lambda t: (t[0], t[1], t[2] or 0))
        found = {(label, m["input_len"], m["output_len"], m.get("min_tps")):
                 "none" if m.get("max_concurrency") is None else m["max_concurrency"] for label, m in mc}
        md += ["## Max concurrency side by side", ""]
        md += _table(["Input", "Output", "Min TPS", *(r.label for r in runs)],
                     [[i, o, t, *(found.get((r.label, i, o, t), "—") for r in runs)] for i, o, t in pairs])
    for r in runs:
        md += [line.replace("## Failures", f"## {r.label}: failures", 1) for line in _failures(r.points)]
    files = [write_csv(out / "results.csv", [(r.label, r.points) for r in runs])]
    try:
        plots, plot_notes = comparison_plots(out, [(r.label, r.points) for r in runs])
    except Exception as exc:  # noqa: BLE001 - a plot must never cost the report
        plots, plot_notes = [], [f"plots failed: {exc!r}"]
    notes = [f"{r.label}: {n}" for r in runs for n in [*(r.summary.get("notes") or []), *r.notes]] + plot_notes
    md += ["## Notes", ""] + ([f"- {n}" for n in notes] or ["- none"]) + [""]
    if plots:
        md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    files += plots
    (out / "report.md").write_text("\n".join(md))
    return [out / "report.md", *files]


