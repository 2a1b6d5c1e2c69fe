"""PNG plots of a benchmark run (matplotlib's object API on the Agg canvas: no pyplot, no GUI, no
global backend switch). Each function writes one file or returns why it skipped it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ftransformers.bench.baseline import point_metrics

Series = dict[str, list[tuple[float, float]]]  # label -> (x, y) points


def _figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _merge_repeats(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    by_x: dict[float, list[float]] = {}
    for x, y in pts:
        by_x.setdefault(x, []).append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in sorted(by_x.items())]


def _swept(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points of the sweep and search; a soak point has its own plot."""
    return [p for p in points if not str(p.get("point", "")).startswith("soak")]


def plot_lines(path: Path, series: Series, *, title: str, xlabel: str, ylabel: str,
               hline: float | None = None, hline_label: str | None = None) -> Path | str:
    """One line per series (a repeated x, such as a re-run search probe, drawn at its mean); a log2 x axis
    when x spans a factor of 8 or more (concurrencies, lengths)."""
    series = {k: _merge_repeats(v) for k, v in series.items() if v}
    xs = {x for pts in series.values() for x, _ in pts}
    if len(xs) < 2:
        return f"{path.name} skipped: fewer than two {xlabel.split(' (')[0].lower()} values with data"
    fig, ax = _figure()
    for label, pts in series.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    if hline is not None:
        ax.axhline(hline, linestyle="--", color="grey", label=hline_label)
    if min(xs) > 0 and max(xs) / min(xs) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(xs))
    ax.set_xticklabels([f"{x:g}" for x in sorted(xs)])
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_cdf(path: Path, samples: dict[str, list[float]], *, title: str, xlabel: str) -> Path | str:
    samples = {k: sorted(v) for k, v in samples.items() if v}
    if sum(len(v) for v in samples.values()) < 2:
        return f"{path.name} skipped: fewer than two successful requests"
    fig, ax = _figure()
    for label, values in samples.items():
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=f"{label} (n={n})")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of requests", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    if len(samples) <= 20:
        ax.legend(fontsize="x-small")
    return _save(fig, path)


def _label(point: dict[str, Any], several_outputs: bool, prefix: str = "") -> str:
    text = f"in {point['input_len']}" + (f" / out {point['output_len']}" if several_outputs else "")
    return prefix + text


def _by_concurrency(points: list[dict[str, Any]], metric: str, prefix: str = "",
                    several_outputs: bool | None = None) -> Series:
    """Failed points (no successful request) are left out, never drawn as zeros."""
    if several_outputs is None:
        several_outputs = len({p["output_len"] for p in points}) > 1
    series: Series = {}
    for p in _swept(points):
        value = point_metrics(p)[metric]
        if value is not None:
            series.setdefault(_label(p, several_outputs, prefix), []).append((p["concurrency"], value))
    return series


def _ttft_by_input(points: list[dict[str, Any]]) -> Series:
    several_outputs = len({p["output_len"] for p in points}) > 1
    series: Series = {}
    for p in _swept(points):
        value = point_metrics(p)["ttft_s"]
        if value is not None:
            label = f"concurrency {p['concurrency']}" + (f" / out {p['output_len']}" if several_outputs else "")
            series.setdefault(label, []).append((p["input_len"], value))
    return series


def _soak_series(soak: dict[str, Any]) -> Series:
    """Throughput over time from the soak's list of windows, whatever the measuring side named it."""
    for key in ("timeline", "windows", "intervals", "throughput_over_time", "samples"):
        rows = soak.get(key)
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
            continue
        x_key = next((k for k in ("t_end", "t_s", "elapsed_s", "time_s", "t", "end_s", "t_start") if k in rows[0]),
                     None)
        y_key = next((k for k in ("output_throughput", "throughput", "tok_s", "output_tok_s") if k in rows[0]), None)
        if x_key and y_key:
            pts = [(float(r[x_key]), float(r[y_key])) for r in rows
                   if r.get(x_key) is not None and r.get(y_key) is not None]
            return {"output throughput": pts}
    return {}


def run_plots(out_dir: Path, points: list[dict[str, Any]], max_concurrency: list[dict[str, Any]],
              latencies: dict[str, list[float]], soak: dict[str, Any] | None) -> tuple[list[Path], list[str]]:
    """Every plot of one run: (files written, notes on the ones skipped)."""
    min_tps = {m["min_tps"] for m in max_concurrency if m.get("min_tps") is not None}
    hline = min(min_tps) if min_tps else None
    results = [
        plot_lines(out_dir / "tps_vs_concurrency.png", _by_concurrency(points, "tps"),
                   title="Per-request TPS vs concurrency", xlabel="Concurrency", ylabel="TPS (tok/s per request)",
                   hline=hline, hline_label=f"min TPS {hline:g}" if hline is not None else None),
        plot_lines(out_dir / "throughput_vs_concurrency.png", _by_concurrency(points, "output_throughput"),
                   title="System output throughput vs concurrency", xlabel="Concurrency",
                   ylabel="Output throughput (tok/s)"),
        plot_lines(out_dir / "ttft_vs_input_length.png", _ttft_by_input(points),
                   title="TTFT vs input length", xlabel="Input length (tokens)", ylabel="TTFT (s)"),
        plot_cdf(out_dir / "latency_distribution.png", latencies,
                 title="End-to-end latency distribution (CDF)", xlabel="Latency (s)"),
    ]
    if soak:
        results.append(plot_lines(out_dir / "soak_throughput.png", _soak_series(soak),
                                  title="Soak: output throughput over time", xlabel="Time (s)",
                                  ylabel="Output throughput (tok/s)"))
    return [r for r in results if isinstance(r, Path)], [r for r in results if isinstance(r, str)]


def comparison_plots(out_dir: Path, runs: list[tuple[str, list[dict[str, Any]]]]) -> tuple[list[Path], list[str]]:
    """Side-by-side runs: one line per (run, input length) on shared axes."""
    several_outputs = len({p["output_len"] for _, pts in runs for p in pts}) > 1
    results: list[Path | str] = []
    for metric, name, ylabel in (("tps", "tps_vs_concurrency", "TPS (tok/s per request)"),
                                 ("output_throughput", "throughput_vs_concurrency", "Output throughput (tok/s)"),
                                 ("ttft_s", "ttft_vs_concurrency", "TTFT (s)"),
                                 ("tpot_ms", "tpot_vs_concurrency", "TPOT (ms)")):
        series: Series = {}
        for label, pts in runs:
            series.update(_by_concurrency(pts, metric, f"{label}: ", several_outputs))
        results.append(plot_lines(out_dir / f"{name}.png", series, title=f"{ylabel.split(' (')[0]} vs concurrency",
                                  xlabel="Concurrency", ylabel=ylabel))
    return [r for r in results if isinstance(r, Path)], [r for r in results if isinstance(r, str)]
