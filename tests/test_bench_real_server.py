"""`ftransformers bench` end to end against the real server on the demo model (CPU): a tiny sweep writes every
output file (PNGs that open), the prefix-cache check sees cached tokens, /generate and a soak with /metrics work."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import running_server

from ftransformers.entrypoints.demo_model import ensure_demo_model


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    ensure_demo_model()
    with running_server(["--device", "cpu", "--enable-metrics"]) as proc:
        yield proc.base


def bench(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "ftransformers", "bench", "--output", str(out), *flags],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


def test_sweep_writes_every_file_and_sees_cached_tokens(server: str, tmp_path: Path) -> None:
    from PIL import Image

    bench(tmp_path, "--base-url", server, "--input-length", "32", "--output-length", "8", "--parallel", "1", "2",
          "--number", "2", "4", "--prefix-cache-check", "--prefix-check-length", "128")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [(p["concurrency"], p["successes"], p["failures"], p["short_outputs"]) for p in s["points"]] == [
        (1, 2, 0, 0), (2, 4, 0, 0)]
    for p in s["points"]:
        assert p["prompt_tokens_mean"] == 32 and p["prompt_token_mismatches"] == 0
        assert p["total_output_tokens"] == p["successes"] * 8 and p["tps"]["mean"] > 0
    check = s["prefix_cache_check"]
    assert check["warm"]["prompt_tokens"] == 128 and check["cached_tokens"] > 0
    assert s["environment"]["server_info"]["model_path"] and s["environment"]["context_length"] > 0
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 2 + 4 + 2
    for name in ("report.md", "results.csv"):
        assert (tmp_path / name).stat().st_size > 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert pngs
    for png in pngs:
        with Image.open(png) as im:
            im.verify()
    report = (tmp_path / "report.md").read_text()
    assert "TTFT" in report and "TPOT" in report


def test_generate_api_soak_scrapes_metrics(server: str, tmp_path: Path) -> None:
    bench(tmp_path, "--base-url", server, "--api", "generate", "--input-length", "16", "--output-length", "4",
          "--duration", "3", "--soak-interval", "1")
    soak = json.loads((tmp_path / "summary.json").read_text())["soak"]
    assert soak["successes"] >= 1 and soak["failures"] == 0
    assert soak["metrics_available"]
    assert any("token_usage" in k for iv in soak["intervals"] if iv["metrics"] for k in iv["metrics"])
