"""benchmarks/bench_serve.py runs as documented (a CPU dry run at a tiny size): the server starts on the dummy
checkpoint, writes a profile trace, serves every request of `ftransformers bench`, stops, and the engine rows and the
table land beside it. Not a timing test: no figure is compared with another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftransformers.entrypoints.demo_model import ensure_demo_model
from ftransformers.kernels import compile_log

ROOT = Path(__file__).resolve().parent.parent


def test_bench_serve_dry_run(tmp_path: Path) -> None:
    tokenizer = ensure_demo_model()
    out = tmp_path / "serve.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--out", str(out),
                           "--model", "qwen3-30b-a3b:2", "--tokenizer", str(tokenizer), "--parallel", "1,2",
                           "--number", "2,2", "--input-length", "24", "--output-length", "8", "--profile-steps", "2",
                           "--log-interval", "0.5", "--passes", "2", "--temperature", "1.0", "--dry-run"],
                          check=False, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "error" not in res and res["server_start_s"] > 0 and res["server_exit"] is not None
    assert res["config"]["model_type"] == "qwen3_moe" and res["config"]["num_hidden_layers"] == 2
    assert res["profile"]["start_answer"]["success"] and res["profile"]["traces"][0]["bytes"] > 0
    assert len(res["bench_passes"]) == 2
    cmds = [run["command"] for run in res["bench_passes"]]
    assert all(c[-2:] == ["--extra-request-body", '{"temperature": 1.0}'] for c in cmds)
    assert [c[c.index("--seed") + 1] for c in cmds] == ["0", "1"]  # no pass finds another's prompts cached
    assert cmds[0][cmds[0].index("--api") + 1] == "openai-completions"
    for run in res["bench_passes"]:
        points = run["summary"]["points"]
        assert [(p["concurrency"], p["successes"], p["failures"]) for p in points] == [(1, 2, 0), (2, 2, 0)]
        assert all(p["total_output_tokens"] == 2 * 8 for p in points)  # ignore_eos: every request its 8 tokens
    rows = res["engine"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["engine_overlap_ms"] > 0 < r["floor_ms"] for r in rows)
    assert len(res["table"]) == 2 + 2 * 2 and res["table"][2].startswith("| 1 | 1 (2/2 ok) |")
    assert res["table"][5].startswith("| 2 | 2 (2/2 ok) |")
    assert res["compile_lines"] == [] and res["compiles_while_serving"] == 0  # no Triton compiles on the CPU
    assert out.with_suffix(".server.log").exists()


def test_compile_lines_reads_compile_log_messages(caplog: pytest.LogCaptureFixture) -> None:
    """The server log's filter matches what compile_log writes: the count before ready and each stall after it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serve

    compile_log.reset()
    try:
        with caplog.at_level("INFO", logger=compile_log.__name__):
            compile_log.record("_align_kernel", 0.8)
            compile_log.mark_ready()
            compile_log.record("_extend_kernel", 1.5)
            compile_log.record("_extend_kernel", 0.001)  # a hit of Triton's in-memory cache: not a stall
    finally:
        compile_log.reset()
    lines = ["[scheduler] Step stats: batch 1"] + [f"[scheduler] {r.getMessage()}" for r in caplog.records]
    kept, stalls = bench_serve.compile_lines(lines)
    assert stalls == 1 and len(kept) == 2
    assert "before ready: 1" in kept[0] and "_extend_kernel" in kept[1]
