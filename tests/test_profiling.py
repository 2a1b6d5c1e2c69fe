"""Profiling and tuning: StepProfiler traces, the periodic step log line, `LLM.start_profile`, and the
server's /start_profile and /stop_profile on a tiny random Llama."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from model_harness import make_tiny_checkpoint

from ftransformers.runtime.profiler import PROFILE_DIR_ENV, ProfilerError, StepProfiler, resolve_profile_dir
from ftransformers.scheduler.io_struct import ReqOutput, SchedulerStats
from ftransformers.scheduler.stats_log import StatsLogger

if TYPE_CHECKING:
    import httpx
    from server_process import ServerProcess


def _trace_events(path: Path) -> list[dict[str, Any]]:
    assert path.name.endswith(".trace.json.gz") and path.stat().st_size > 0
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert events
    return events


def _fake_step() -> None:
    a = torch.randn(32, 32)
    (a @ a).relu_().sum()


# StepProfiler --------------------------------------------------------------------------------
def test_step_profiler_writes_a_chrome_trace(tmp_path: Path) -> None:
    prof = StepProfiler()
    path = prof.start(tmp_path / "traces", activities=["CPU", "GPU"], record_shapes=True)
    assert prof.active and path.parent == (tmp_path / "traces").resolve()
    for _ in range(3):
        _fake_step()
        assert prof.on_step() is None
    assert prof.stop() == path and not prof.active
    names = {e.get("name", "") for e in _trace_events(path)}
    assert {"ProfilerStep#0", "ProfilerStep#1"} <= names and any("mm" in n for n in names)


def test_step_profiler_stops_after_num_steps(tmp_path: Path) -> None:
    prof = StepProfiler(configured_dir=str(tmp_path))
    path = prof.start(num_steps=2, activities=["CPU"])
    _fake_step()
    assert prof.on_step() is None and prof.active
    _fake_step()
    assert prof.on_step() == path and not prof.active and prof.last_path == path
    assert _trace_events(path)
    assert prof.on_step() is None


def test_step_profiler_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prof = StepProfiler()
    with pytest.raises(ProfilerError, match="not profiling"):
        prof.stop()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ProfilerError, match="cannot write profiles"):
        prof.start(blocker / "sub")
    with pytest.raises(ProfilerError, match="activities"):
        prof.start(tmp_path, activities=["TPU"])
    with pytest.raises(ProfilerError, match="num_steps"):
        prof.start(tmp_path, num_steps=0)
    prof.start(tmp_path, activities=["CPU"])
    with pytest.raises(ProfilerError, match="already profiling"):
        prof.start(tmp_path)
    prof.stop()
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "env"))
    assert resolve_profile_dir(None) == (tmp_path / "env").resolve()
    assert resolve_profile_dir(None, str(tmp_path / "flag")) == (tmp_path / "flag").resolve()
    assert resolve_profile_dir(tmp_path / "arg", str(tmp_path / "flag")) == (tmp_path / "arg").resolve()


# Step log line -------------------------------------------------------------------------------
def _stats(**kw: int) -> SchedulerStats:
    base = {"num_running": 4, "num_waiting": 2, "kv_used_tokens": 1024, "kv_capacity": 4096, "cache_hit_tokens": 0,
            "prompt_tokens_total": 0, "num_retractions": 0, "kv_cached_tokens": 0}
    return SchedulerStats(**{**base, **kw})


def _out(n: int) -> ReqOutput:
    return ReqOutput("r", [7] * n, None, False, None, None, 1, n, 0)


def test_stats_logger_formats_the_interval() -> None:
    now = [100.0]
    lines: list[str] = []
    log = StatsLogger(10.0, lines.append, clock=lambda: now[0])
    stats = [_stats(prompt_tokens_total=1000, cache_hit_tokens=200, num_retractions=1, kv_cached_tokens=64)]
    assert log.maybe_log(lambda: stats[0]) is None  # no step yet
    for _ in range(20):  # 20 steps of 4 sequences each, then one finishing output with no token
        log.on_step([_out(1)] * 4)
        now[0] += 0.25
    log.on_step([_out(0)])
    assert log.maybe_log(lambda: stats[0]) is None  # 5 s < 10 s
    now[0] += 5.0
    line = log.maybe_log(lambda: stats[0])
    assert lines == [line]
    assert line == ("Step stats (10.0 s): 2.10 steps/s, gen 8.0 tok/s, prefill 80.0 tok/s, running 4, waiting 2, "
                    "batch 3.8, KV 1024/4096 (25.0%), cached 64, cache hit 20.0%, retractions 1 (1 total)")
    # The next window is a delta: 500 more prompt tokens (100 cached), no new retraction.
    stats[0] = _stats(prompt_tokens_total=1500, cache_hit_tokens=300, num_retractions=1, num_running=1,
                      num_waiting=0, kv_used_tokens=2048)
    for _ in range(10):
        log.on_step([_out(1)])
    now[0] += 10.0
    assert log.maybe_log(lambda: stats[0]) == (
        "Step stats (10.0 s): 1.00 steps/s, gen 1.0 tok/s, prefill 40.0 tok/s, running 1, waiting 0, batch 1.0, "
        "KV 2048/4096 (50.0%), cached 0, cache hit 20.0%, retractions 0 (1 total)")
    # A whole idle interval prints nothing; the next window starts at the next step.
    now[0] += 60.0
    assert log.maybe_log(lambda: stats[0]) is None
    log.on_step([_out(1)])
    now[0] += 10.0
    assert log.maybe_log(lambda: stats[0]).startswith("Step stats (10.0 s): 0.10 steps/s, gen 0.1 tok/s")  # type: ignore[union-attr]
    assert len(lines) == 3


def test_stats_logger_disabled() -> None:
    log = StatsLogger(0.0, pytest.fail, clock=lambda: 1e9)
    log.on_step([_out(1)])
    assert not log.enabled and log.maybe_log(_stats) is None


# Offline LLM ---------------------------------------------------------------------------------
def test_offline_llm_profile(tmp_path: Path) -> None:
    from ftransformers import LLM, SamplingParams

    ckpt = make_tiny_checkpoint("llama", tmp_path / "ckpt")
    llm = LLM(str(ckpt), skip_tokenizer_init=True, device="cpu", dtype="float32", max_total_tokens=512,
              profile_dir=str(tmp_path / "profiles"))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    path = llm.start_profile()
    assert path.parent == (tmp_path / "profiles").resolve()
    out = llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=sp)
    assert len(out[0].token_ids) == 4
    assert llm.stop_profile() == path
    # 4 steps, then the range from the last step to stop_profile
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in _trace_events(path)) == 5
    auto = llm.start_profile(tmp_path / "other", num_steps=2, activities=["CPU"])
    llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=sp)
    assert not llm.profiler.active and llm.profiler.last_path == auto
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in _trace_events(auto)) == 2
    with pytest.raises(ProfilerError):
        llm.stop_profile()


# Server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    for name in ("fastapi", "uvicorn", "zmq", "httpx"):  # absent on the GPU image: the tests above still run
        pytest.importorskip(name)
    from server_process import running_server
    from test_server_fixtures import make_tiny_server_checkpoint

    ckpt = make_tiny_server_checkpoint(tmp_path_factory.mktemp("tiny_llama"))
    profiles = tmp_path_factory.mktemp("profiles")
    args = ["--model-path", str(ckpt), "--device", "cpu", "--max-total-tokens", "2048", "--log-interval-s", "1",
            "--profile-dir", str(profiles), "--log-level", "info"]
    with running_server(args, module="ftransformers.entrypoints.launch_server", timeout=120) as proc:
        yield proc, profiles


def _complete(base: str, max_tokens: int = 8) -> None:
    import httpx

    r = httpx.post(base + "/v1/completions", json={"prompt": "Hello world", "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text


def _error(r: httpx.Response, match: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and match in err["message"]


def test_server_profile_num_steps(server: tuple[ServerProcess, Path]) -> None:
    import httpx

    proc, profiles = server
    r = httpx.post(proc.base + "/start_profile", json={"num_steps": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    path = Path(body["path"])
    assert body["success"] and path.parent == profiles.resolve() and "after 3 model steps" in body["message"]
    _complete(proc.base)
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # gzip finishes writing
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in _trace_events(path)) == 3
    _error(httpx.post(proc.base + "/stop_profile"), "not profiling")


def test_server_profile_start_stop_and_errors(server: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    import httpx

    proc, _ = server
    _error(httpx.post(proc.base + "/stop_profile"), "not profiling")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _error(httpx.post(proc.base + "/start_profile", json={"output_dir": str(blocker / "x")}), "cannot write")
    r = httpx.post(proc.base + "/start_profile", json={"output_dir": str(tmp_path / "mine"), "activities": ["CPU"]})
    assert r.status_code == 200, r.text
    _error(httpx.post(proc.base + "/start_profile"), "already profiling")
    _complete(proc.base, 4)
    r = httpx.post(proc.base + "/stop_profile", timeout=60)
    assert r.status_code == 200, r.text
    path = Path(r.json()["path"])
    assert path.parent == (tmp_path / "mine").resolve() and _trace_events(path)
    assert httpx.get(proc.base + "/start_profile").status_code == 200  # SGLang also accepts GET
    assert httpx.get(proc.base + "/stop_profile", timeout=60).status_code == 200


def test_server_logs_step_stats(server: tuple[ServerProcess, Path]) -> None:
    proc, _ = server
    _complete(proc.base, 48)
    deadline = time.monotonic() + 10
    while "Step stats (" not in proc.log(20000) and time.monotonic() < deadline:
        time.sleep(0.3)
    lines = [ln for ln in proc.log(20000).splitlines() if "Step stats (" in ln]
    assert lines, proc.log()
    assert all(f in lines[-1] for f in ("steps/s, gen ", " tok/s, prefill ", "running ", "batch ", "/2048 (",
                                          "cache hit ", "retractions "))
