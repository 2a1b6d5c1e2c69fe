"""The built-in demo model (SmolLM2-135M-Instruct) answers coherently: offline, and through the real
server started the way a user starts it, spoken to with the `openai` client."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from server_process import running_server

from ftransformers.entrypoints.demo_model import ensure_demo_model


@pytest.fixture(scope="module")
def demo_server() -> Iterator[str]:
    ensure_demo_model()
    with running_server(["--device", "cpu"]) as server:
        yield server.base


def test_offline_llm_completes_capital_of_france() -> None:
    from ftransformers import LLM, SamplingParams

    llm = LLM(device="cpu", max_total_tokens=2048)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.text, out.text
    assert out.token_ids and out.finish_reason in ("length", "stop")
    paris = llm.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    away = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8,
                                                                     logit_bias={paris: -100}))[0]
    assert paris not in away.token_ids and "Paris" not in away.text, away.text
    with pytest.raises(ValueError, match="logit_bias token ids must lie in"):
        llm.generate(["x"], SamplingParams(logit_bias={len(llm.tokenizer) + 10**6: 1.0}))


def test_chat_through_server(demo_server: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=demo_server + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
    text = reply.choices[0].message.content or ""
    assert "Paris" in text, text
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text, "streamed text differs from the non-streamed greedy answer"
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens


def test_bad_model_path_is_one_line_error(tmp_path: object) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ftransformers.launch_server", "--model-path", "/nonexistent/model"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and "/nonexistent/model" in lines[0], result.stderr


def test_bad_flag_value_names_choices() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ftransformers.launch_server", "--device", "tpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "cuda" in result.stderr and "cpu" in result.stderr and "Traceback" not in result.stderr
