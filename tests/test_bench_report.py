"""The report side of `ftransformers bench`: synthetic run folders (summary.json + requests.jsonl in the
layout the runner writes) rendered into report.md, results.csv and PNGs; side-by-side runs; baselines."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from matplotlib.image import imread

from ftransformers.bench.baseline import BaselineError, compute_deltas, load_baseline
from ftransformers.bench.records import MaxConcurrencyResult, PointSummary, RequestRecord, Stat
from ftransformers.bench.report import ReportError, load_run, render_report, report_main

HEADER = "| Concurrency | Output | TTFT(s) | TPOT(ms) | TPS | System throughput(tok/s) | Latency(s) |"


def stat(mean: float) -> Stat:
    return Stat(mean=mean, p50=mean, p90=mean * 1.1, p95=mean * 1.15, p99=mean * 1.2, min=mean * 0.9, max=mean * 1.3)


def point(i: int, o: int, c: int, ttft: float, tpot: float, *, n: int = 4, failed: int = 0,
          errors: dict[str, int] | None = None, short: int = 0) -> PointSummary:
    ok = n - failed
    if ok == 0:
        empty = Stat()
        return PointSummary(f"in{i}-out{o}-c{c}", i, o, c, n, 0, n, 0, 1.5, empty, empty, empty, empty, empty,
                            0.0, 0.0, 0, errors=errors or {})
    latency = ttft + tpot * (o - 1) / 1000
    thr = c * o / latency
    return PointSummary(f"in{i}-out{o}-c{c}", i, o, c, n, ok, failed, short, latency * n / c, stat(ttft), stat(tpot),
                        stat(1000 / tpot), stat(tpot), stat(latency), thr, ok / latency, ok * o, errors=errors or {})


def records(p: PointSummary) -> list[dict[str, Any]]:
    out = []
    for k in range(p.number):
        if k < p.successes:
            lat = (p.latency_s.mean or 0) * (1 + 0.05 * k)
            out.append(RequestRecord(p.point, k, 1.7e9 + k, [p.ttft_s.mean or 0, lat], lat, p.input_len, p.output_len,
                                     p.output_len + (1 if k == 0 and p.concurrency == 2 else 0), p.output_len,
                                     success=True).to_json())
        else:
            out.append(RequestRecord(p.point, k, 1.7e9 + k, error=next(iter(p.errors), "boom")).to_json())
    return out


def make_run(root: Path, name: str = "run", *, scale: float = 1.0, points: list[PointSummary] | None = None,
             extras: bool = True, **summary_overrides: Any) -> Path:
    if points is None:
        points = [point(128, 64, c, 0.123 * scale, 45.6 * scale) for c in (1, 2)]
        points += [point(128, 64, 4, 0.2 * scale, 60.0 * scale, failed=2, errors={"HTTP 500: overloaded": 2}, short=1)]
        points += [point(1024, 64, c, 0.5 * scale, 50.0 * scale) for c in (1, 2, 4)]
        points += [point(1024, 64, 8, 0, 0, failed=4, errors={"HTTP 500: boom": 3, "no first token": 1})]
        if extras:
            soak = point(128, 64, 4, 0.3, 70.0, n=99)
            soak.point = "soak-in128-out64-c4"
            points.append(soak)
    d = root / name
    d.mkdir(parents=True)
    probes = [{"concurrency": 1, "tps_mean": 21.9, "passed": True},
              {"concurrency": 2, "tps_mean": 16.2, "passed": True},
              {"concurrency": 4, "tps_mean": 12.0, "passed": False, "failures": 2},
              {"concurrency": 3, "tps_mean": 14.1, "passed": False}]
    summary: dict[str, Any] = {
        "tool": {"name": "ftransformers bench", "version": "0.1.0"},
        "command": ["ftransformers", "bench", "--base-url", "http://127.0.0.1:8001", "--input-length", "128", "1024"],
        "created": "2025-01-01T00:00:00+00:00",
        "environment": {"server_info": {"model_path": "/models/demo", "dtype": "bfloat16", "device": "cpu",
                                        "chunked_prefill_size": 512, "version": "0.1.0", "api_key": None},
                        "model_info": {"served_model_name": "demo"}, "gpu": ["NVIDIA H100 80GB HBM3, 81559 MiB"],
                        "cpu": "Test CPU 9000", "python": "3.11.2", "platform": "Linux-test", "git_commit": "abc123"},
        "config": {"model": "demo", "input_length": [128, 1024], "output_length": [64]},
        "points": [asdict(p) for p in points],
        "max_concurrency": [asdict(MaxConcurrencyResult(128, 64, 15.0, 2, probes, criterion="mean"))] if extras else [],
        "prefix_cache_check": {  # the layout of bench/prefix_check.py
            "input_len": 1000, "output_len": 4, "cached_tokens": 992, "ttft_speedup": 18.0,
            "cold": {"ttft_s": 0.9, "latency_s": 1.0, "prompt_tokens": 1000, "cached_tokens": 0, "success": True,
                     "error": None},
            "warm": {"ttft_s": 0.05, "latency_s": 0.15, "prompt_tokens": 1000, "cached_tokens": 992, "success": True,
                     "error": None}} if extras else None,
        "soak": {  # the layout of bench/soak.py
            "point": "soak-in128-out64-c4", "input_len": 128, "output_len": 64, "concurrency": 4, "duration_s": 60.0,
            "interval_s": 10.0, "requests": 100, "successes": 99, "failures": 1, "errors": {"timeout": 1},
            "intervals": [{"t_start": 10.0 * k, "t_end": 10.0 * (k + 1), "completed": 16, "failures": int(k == 3),
                           "output_tokens": 1000 + k, "output_throughput": 100.0 + k, "request_throughput": 1.6,
                           "metrics": {"kv_usage": 0.1 * k, "num_running_reqs": 4.0}} for k in range(30)],
            "metrics_available": True} if extras else None,
        "notes": ["skipped input 32768 x output 1024: 33792 tokens exceed the server's context length 8192"],
        "baseline": None,
    }
    summary.update(summary_overrides)
    (d / "summary.json").write_text(json.dumps(summary))
    with (d / "requests.jsonl").open("w") as f:
        for p in points:
            for r in records(p):
                f.write(json.dumps(r) + "\n")
        for k in range(2):  # the prefix-cache check's own requests: not a point, not in the distribution
            f.write(json.dumps(RequestRecord("prefix-check", k, 1.7e9, [0.9], 50.0, success=True).to_json()) + "\n")
    return d


def section(md: str, title: str) -> str:
    start = md.index(title)
    end = md.find("\n## ", start + len(title))
    return md[start:] if end < 0 else md[start:end]


def row(md: str, *cells: str) -> str:
    prefix = "| " + " | ".join(cells) + " |"
    hits = [line for line in md.splitlines() if line.startswith(prefix)]
    assert hits, f"no row starting {prefix!r}"
    return hits[0]


def test_every_file_written_and_pngs_open(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    files = render_report(d)
    names = {f.name for f in files}
    assert {"report.md", "results.csv", "tps_vs_concurrency.png", "throughput_vs_concurrency.png",
            "ttft_vs_input_length.png", "latency_distribution.png", "soak_throughput.png"} <= names
    for f in files:
        assert f.is_file() and f.stat().st_size > 0
        if f.suffix == ".png":
            img = imread(f)
            assert img.shape[0] >= 300 and img.shape[1] >= 500 and img.shape[2] in (3, 4)
            assert img.std() > 0.01  # not a blank canvas
    md = (d / "report.md").read_text()
    for f in files:
        if f.suffix == ".png":
            assert f"({f.name})" in md


def test_header_and_environment(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    render_report(d)
    md = (d / "report.md").read_text()
    assert "ftransformers bench --base-url http://127.0.0.1:8001 --input-length 128 1024" in md
    for text in ("2025-01-01T00:00:00+00:00", "0.1.0", "abc123", "dtype=bfloat16", "device=cpu",
                 "chunked_prefill_size=512", "NVIDIA H100 80GB HBM3", "Test CPU 9000", "3.11.2", "Linux-test"):
        assert text in section(md, "# Serving benchmark") or text in section(md, "## Environment"), text


def test_one_table_per_input_length_with_fixture_values(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    render_report(d)
    md = (d / "report.md").read_text()
    results = section(md, "## Results")
    assert results.count(HEADER) == 2
    assert results.index("### Input 128 tokens") < results.index("### Input 1024 tokens")
    t128 = section(results, "### Input 128 tokens").split("### Input 1024")[0]
    # ttft 0.123 s, tpot 45.6 ms, tps 1000/45.6, throughput 1 * 64 / latency, latency 0.123 + 45.6 * 63 / 1000
    lat = 0.123 + 45.6 * 63 / 1000
    assert row(t128, "1", "64", "0.123", "45.60", f"{1000 / 45.6:.2f}", f"{64 / lat:.2f}", f"{lat:.2f}", "4", "0", "0")
    assert row(t128, "4", "64", "0.200", "60.00") .endswith("| 2 | 2 | 1 |")
    assert "p50 / p90 / p99" in results and f"0.123 / {0.123 * 1.1:.3f} / {0.123 * 1.2:.3f}" in results


def test_failed_point_shows_failures_not_zeros(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    render_report(d)
    md = (d / "report.md").read_text()
    failed = row(section(md, "### Input 1024 tokens"), "8", "64")
    assert "FAILED" in failed and "0.000" not in failed and failed.endswith("| 0 | 4 | 0 |")
    failures = section(md, "## Failures and short outputs")
    assert "`HTTP 500: boom` ×3" in failures and "`no first token` ×1" in failures
    assert "`HTTP 500: overloaded` ×2" in failures
    rows = {r["point"]: r for r in csv.DictReader((d / "results.csv").open())}
    assert rows["in1024-out64-c8"]["ttft_s_mean"] == "" and rows["in1024-out64-c8"]["output_throughput"] == ""
    assert rows["in1024-out64-c8"]["failures"] == "4" and "HTTP 500: boom" in rows["in1024-out64-c8"]["errors"]


def test_results_csv_has_every_metric(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    render_report(d)
    rows = list(csv.DictReader((d / "results.csv").open()))
    assert len(rows) == 8
    r = next(r for r in rows if r["point"] == "in128-out64-c1")
    for m in ("ttft_s", "tpot_ms", "tps", "itl_ms", "latency_s"):
        for s in ("mean", "p50", "p90", "p95", "p99", "min", "max"):
            assert r[f"{m}_{s}"] != ""
    assert float(r["ttft_s_mean"]) == pytest.approx(0.123) and float(r["tpot_ms_p99"]) == pytest.approx(45.6 * 1.2)


def test_max_concurrency_prefix_cache_soak_and_notes(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    render_report(d)
    md = (d / "report.md").read_text()
    mc = section(md, "## Max concurrency")
    assert row(mc, "128", "64", "15.00", "mean", "2")
    assert "1: 21.90 ✓" in mc and "4: 12.00 ✗ (2 failed)" in mc and "3: 14.10 ✗" in mc
    pc = section(md, "## Prefix-cache check")
    assert "|  | Cold | Warm |" in pc and "| TTFT(s) | 0.900 | 0.050 |" in pc and "| cached tokens | 0 | 992 |" in pc
    assert "| cached tokens | 992 |" in pc and "| TTFT speed-up (cold / warm) | 18.00 |" in pc
    soak = section(md, "## Soak")
    assert "| failures | 1 |" in soak and "- timeout: 1" in soak
    assert "(16 of 30 rows, every interval with failures among them; all in soak_intervals.csv)" in soak
    assert "| 20.00 | 30.00 | 16 | 0 | 1002 | 102.0 |" in soak and "| 30.00 | 40.00 | 16 | 1 |" in soak
    assert "| 10.00 | 20.00 |" not in soak
    assert "| kv_usage | 0.000 | 2.90 | 0.000 | 2.90 |" in soak
    assert "| t_start | t_end | completed | failures | output_tokens | output_throughput | request_throughput |" in soak
    rows = list(csv.DictReader((d / "soak_intervals.csv").open()))
    assert len(rows) == 30 and rows[3]["metrics.kv_usage"] == "0.30000000000000004" and rows[3]["failures"] == "1"
    assert row(section(md, "### Input 128 tokens"), "4 (soak-in128-out64-c4)", "64", "0.300")
    notes = section(md, "## Notes")
    assert "skipped input 32768 x output 1024" in notes
    assert "in128-out64-c2: 1 requests where the server's usage and the tokenizer disagree" in notes


def test_sparse_run_skips_plots_with_notes(tmp_path: Path) -> None:
    d = make_run(tmp_path, points=[point(128, 16, 1, 0.1, 40.0, n=1)], extras=False)
    (d / "requests.jsonl").write_text((d / "requests.jsonl").read_text() + '{"point": "in128-o')  # cut off mid-line
    files = render_report(d)
    assert not any(f.suffix == ".png" for f in files)
    notes = section((d / "report.md").read_text(), "## Notes")
    for name in ("tps_vs_concurrency.png", "throughput_vs_concurrency.png", "ttft_vs_input_length.png",
                 "latency_distribution.png"):
        assert f"{name} skipped" in notes
    assert "1 unreadable lines skipped" in notes
    md = (d / "report.md").read_text()
    assert "## Max concurrency" not in md and "## Prefix-cache check" not in md and "## Soak" not in md


def test_all_failed_run_renders(tmp_path: Path) -> None:
    failed = [point(128, 16, c, 0, 0, failed=2, n=2, errors={"cannot connect": 2}) for c in (1, 2)]
    d = make_run(tmp_path, points=failed, extras=False)
    render_report(d)
    md = (d / "report.md").read_text()
    assert md.count("FAILED") == 2 and "`cannot connect` ×2" in md


def test_render_into_other_folder(tmp_path: Path) -> None:
    d = make_run(tmp_path)
    assert report_main([str(d), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.md").is_file() and not (d / "report.md").exists()


def test_side_by_side_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", scale=2.0, points=[point(128, 64, c, 0.246, 91.2) for c in (1, 2, 16)])
    out = tmp_path / "cmp"
    assert report_main([str(a), str(b), "--output", str(out), "--labels", "ours", "vllm"]) == 0
    md = (out / "report.md").read_text()
    assert "# Benchmark comparison: ours vs vllm" in md
    t = section(md, "### Input 128 tokens").split("###")[1]
    assert "| TTFT(s) ours | TTFT(s) vllm | Δ vllm |" in t
    r1 = row(t, "1", "64", "0.123", "0.246", "+100.0% worse", "45.60", "91.20", "+100.0% worse")
    assert "-50.0% worse" in r1  # TPS and throughput halve: higher is better
    assert row(t, "16", "64", "not run", "0.246")
    assert "FAILED" in row(section(md, "### Input 1024 tokens"), "8", "64")
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["run"] for r in rows} == {"ours", "vllm"} and len(rows) == 11
    for name in ("tps_vs_concurrency.png", "throughput_vs_concurrency.png"):
        assert imread(out / name).shape[0] >= 300
    assert "ours: skipped input 32768" in md and "## ours: failures" in md


def test_baseline_from_summary(tmp_path: Path) -> None:
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b", scale=2.0)
    base = load_baseline(b / "summary.json")
    assert base.kind == "summary" and base.label == "b"
    deltas = {(d["concurrency"], d["metric"]): d for d in compute_deltas(load_run(a).points, base)
              if d["input_len"] == 128}
    ttft = deltas[(1, "ttft_s")]
    assert ttft["delta"] == pytest.approx(-0.123) and ttft["delta_pct"] == pytest.approx(-50) and ttft["better"]
    assert deltas[(1, "tps")]["delta_pct"] == pytest.approx(100) and deltas[(1, "tps")]["better"]
    assert not any(d["concurrency"] == 8 for d in compute_deltas(load_run(a).points, base) if d["input_len"] == 1024)
    assert report_main([str(a), "--baseline", str(b / "summary.json")]) == 0
    md = (a / "report.md").read_text()
    assert row(section(md, "## Baseline"), "128", "64", "1", "TTFT(s)", "0.123", "0.246", "-0.123", "-50.0%", "better")
    assert (a / "baseline_deltas.csv").is_file()


def test_baseline_csv_with_aliases_and_units(tmp_path: Path) -> None:
    p = tmp_path / "sglang.csv"
    p.write_text("Input,Output,Concurrency,TTFT (ms),TPOT(ms),TPS,System throughput(tok/s),Latency(s)\n"
                 "128,64,1,246,91.2,10.96,,5.99\n1K,64,2,1000,100,,12.5,\n")
    base = load_baseline(p)
    assert base.label == "sglang" and base.kind == "table"
    assert base.entries[(128, 64, 1)] == pytest.approx({"ttft_s": 0.246, "tpot_ms": 91.2, "tps": 10.96,
                                                        "latency_s": 5.99})
    assert base.entries[(1024, 64, 2)] == pytest.approx({"ttft_s": 1.0, "tpot_ms": 100.0, "output_throughput": 12.5})
    p2 = tmp_path / "other.csv"
    p2.write_text("input_len,output_len,parallel,ttft_s,tpot_s,output_throughput\n128,64,1,0.5,0.05,100\n")
    assert load_baseline(p2).entries[(128, 64, 1)] == pytest.approx({"ttft_s": 0.5, "tpot_ms": 50.0,
                                                                     "output_throughput": 100.0})


def test_baseline_json_and_embedded_in_summary(tmp_path: Path) -> None:
    rows = [{"input_len": 128, "output_len": 64, "concurrency": 1, "ttft_s": 0.2, "tps": 20.0}]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "obj.json").write_text(json.dumps({"label": "MindIE", "rows": rows}))
    assert load_baseline(tmp_path / "list.json").entries[(128, 64, 1)] == {"ttft_s": 0.2, "tps": 20.0}
    obj = load_baseline(tmp_path / "obj.json")
    assert obj.label == "MindIE"
    d = make_run(tmp_path, "run", baseline={"path": str(tmp_path / "obj.json")})
    render_report(d)
    md = (d / "report.md").read_text()
    assert "## Baseline: MindIE" in md
    assert row(section(md, "## Baseline"), "128", "64", "1", "TTFT(s)", "0.123", "0.200", "-0.077", "-38.5%", "better")
    tps = row(section(md, "## Baseline"), "128", "64", "1", "TPS", f"{1000 / 45.6:.2f}", "20.00")
    assert tps.endswith("| better |")


@pytest.mark.parametrize("name,text,problem", [
    ("bad.csv", "input_len,output_len,ttft_s\n128,64,0.1\n", "lacks concurrency"),
    ("bad2.csv", "input_len,output_len,concurrency,ttft_s\n128,64,1,fast\n", "not a number: 'fast'"),
    ("bad3.csv", "input_len,output_len,concurrency,foo\n128,64,1,3\n", "no metric column"),
    ("bad.json", "{not json", "not valid JSON"),
    ("bad2.json", '{"foo": 1}', "expected a summary.json"),
    ("empty.csv", "", "no rows"),
    ("summary.json", '{"points": []}', "no point with a successful request"),
])
def test_malformed_baseline_is_a_clear_error(tmp_path: Path, name: str, text: str, problem: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(BaselineError) as exc:
        load_baseline(p)
    msg = str(exc.value)
    assert name in msg and problem in msg and "\n" not in msg
    with pytest.raises(BaselineError, match="no such file"):
        load_baseline(tmp_path / "missing.csv")


def test_report_main_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = make_run(tmp_path, "good")
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "summary.json").write_text("{")
    bad_point = make_run(tmp_path, "badpoint", points=[])
    (bad_point / "summary.json").write_text(json.dumps({"points": [{"point": "x"}]}))
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    cases = [([str(tmp_path / "nope")], "no such folder"), ([str(empty)], "summary.json: not found"),
             ([str(broken)], "cannot read it"), ([str(bad_point)], "point 1 lacks input_len"),
             ([str(good), str(good)], "need --output"),
             ([str(good), str(good), "--output", str(tmp_path / "o"), "--labels", "x"], "--labels has 1 names"),
             ([str(good), "--baseline", str(tmp_path / "bad.csv")], "bad.csv: row 1 lacks")]
    for argv, message in cases:
        capsys.readouterr()
        assert report_main(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert report_main(["--bogus"]) == 2
    with pytest.raises(ReportError):
        render_report(empty)
    assert report_main([str(good)]) == 0 and "wrote" in capsys.readouterr().out


def test_unexpected_summary_sections_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_run(tmp_path, max_concurrency=[{"input_len": 128}], soak="oops")
    assert report_main([str(d)]) == 1
    err = capsys.readouterr().err.strip()
    assert "summary.json: unexpected content" in err and len(err.splitlines()) == 1
    e = make_run(tmp_path, "empty", points=[], extras=False, environment=None)
    render_report(e)  # a run that measured nothing (server unreachable) still gets a report
    md = (e / "report.md").read_text()
    assert "No point completed" in md and "not available" in md
