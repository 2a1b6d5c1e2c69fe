"""benchmarks/bench_cpu_decode.py runs as documented (at a tiny size) and writes a row per context and variant, each
beside a positive floor. Not a timing test: no figure is compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_cpu_decode_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "cpu_decode.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_decode.py"), "--out", str(out),
                           # a token's time is the difference of two requests' times: 8 tokens and the median of
                           # 3 keep it above a busy CI box's noise (2 tokens once read negative under pytest -n 2)
                           "--contexts", "8,40", "--tokens", "8", "--repeats", "3"],
                          check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dram_copy_gbs"] > 0 and result["matmul_tflops"] > 0
    rows = result["rows"]
    assert [(r["context"], r["variant"]) for r in rows] == [(8, "one_query"), (8, "sdpa"), (40, "one_query"),
                                                            (40, "sdpa")]
    assert all(r["token_ms"] > 0 and r["floor_ms"] == max(r["bytes_floor_ms"], r["flops_floor_ms"]) > 0 for r in rows)
    assert rows[2]["bytes_floor_ms"] > rows[0]["bytes_floor_ms"]  # more context, more KV bytes
    assert out.with_suffix(".log").read_text().count("ms a token") == 4
