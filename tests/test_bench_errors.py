"""Bad input to `ftransformers bench` (run as a user runs it, in a subprocess): an unreachable server, a server
that fails every request, a wrong model name, lengths beyond the context, bad flags. Each ends with one
`error:` line, a non-zero status, no traceback, and an output folder holding what did complete."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fake_server import FakeServer
from server_process import free_port

from ftransformers.entrypoints.demo_model import ensure_demo_model


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer(str(ensure_demo_model()))
    try:
        yield server
    finally:
        server.close()


def bench(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ftransformers.bench", "--output", str(out), *flags],
                          check=False, capture_output=True, text=True, timeout=120)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def written(out: Path) -> dict:
    assert (out / "report.md").is_file() and (out / "requests.jsonl").is_file()
    return json.loads((out / "summary.json").read_text())


def test_unreachable_server(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_error_line(bench(tmp_path, "--base-url", url, "--input-length", "16", "--output-length", "4"))
    assert "cannot reach the server" in line and url in line
    s = written(tmp_path)
    assert s["points"] == [] and s["notes"] == [line]
    assert line in (tmp_path / "report.md").read_text()  # its "No point completed (see Notes)" names the reason


def test_server_failing_every_request(fake: FakeServer, tmp_path: Path) -> None:
    fake.configure(ttft=0.01, gap=0.001, fail_every=1)
    line = one_error_line(bench(tmp_path, "--base-url", fake.url, "--input-length", "16", "--output-length", "4",
                                "--parallel", "1", "2", "--number", "2", "4"))
    assert "nothing was measured" in line and "6 requests failed" in line and "HTTP 500: injected failure" in line
    s = written(tmp_path)
    assert line in s["notes"]
    assert [(p["successes"], p["failures"]) for p in s["points"]] == [(0, 2), (0, 4)]
    assert all(p["ttft_s"]["mean"] is None and p["output_throughput"] == 0 for p in s["points"])
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 6


def test_wrong_model_name(fake: FakeServer, tmp_path: Path) -> None:
    fake.configure()
    line = one_error_line(bench(tmp_path, "--base-url", fake.url, "--model", "no-such-model"))
    assert "no-such-model" in line and "fake-model" in line
    assert written(tmp_path)["points"] == []


def test_lengths_beyond_context(fake: FakeServer, tmp_path: Path) -> None:
    fake.configure(context_length=512)
    result = bench(tmp_path, "--base-url", fake.url, "--input-length", "600", "1000", "--output-length", "8")
    line = one_error_line(result)
    assert "context length" in line
    s = written(tmp_path)
    assert s["points"] == [] and len([n for n in s["notes"] if "exceed the server's context length 512" in n]) == 2


def test_bad_flags_are_one_line(tmp_path: Path) -> None:
    result = bench(tmp_path, "--parallel", "1", "2", "--number", "4")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--number has 1 values for 2 --parallel values" in result.stderr
    result = bench(tmp_path, "--api", "grpc")
    assert result.returncode == 2 and "openai-chat" in result.stderr and "Traceback" not in result.stderr
    for flags, says in ((("--random-range-ratio", "1.5"), "--random-range-ratio must be in [0, 1]"),
                        (("--random-range-ratio", "0.5", "--dataset", "jsonl", "--dataset-path", "x.jsonl"),
                         "--random-range-ratio applies to --dataset random only")):
        result = bench(tmp_path, *flags)
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr
    for bad, says in (("{temperature: 1}", "not JSON"), ("[1]", "must be a JSON object, not list")):
        result = bench(tmp_path, "--extra-request-body", bad)
        assert result.returncode == 2 and "--extra-request-body" in result.stderr and says in result.stderr
        assert "Traceback" not in result.stderr


def test_request_timeout_is_a_failure(fake: FakeServer, tmp_path: Path) -> None:
    fake.configure(ttft=3.0)
    line = one_error_line(bench(tmp_path, "--base-url", fake.url, "--input-length", "16", "--output-length", "4",
                                "--parallel", "2", "--number", "2", "--warmup", "0", "--request-timeout", "0.5"))
    assert "2 requests failed" in line and "timed out after 0.5 s" in line
    assert written(tmp_path)["points"][0]["failures"] == 2


def test_bad_baseline_file(tmp_path: Path) -> None:
    line = one_error_line(bench(tmp_path, "--baseline", str(tmp_path / "missing.csv")))
    assert "missing.csv" in line
