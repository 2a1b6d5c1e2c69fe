"""The real server (scheduler in its own process) on a tiny random Llama with a tiny BPE tokenizer.

Random weights produce gibberish, but real tokens: the tests compare endpoints against each other
(chat vs /generate, streaming vs not), check usage, errors, auth, health under load, disconnects.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import running_server
from test_server_fixtures import make_tiny_server_checkpoint

API_KEY = "sk-test-123"
SERVED = "tiny-llama"
CONTEXT = 1024  # the checkpoint's max_position_embeddings
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    ckpt = make_tiny_server_checkpoint(tmp_path_factory.mktemp("tiny_llama"))
    args = ["--model-path", str(ckpt), "--device", "cpu", "--max-total-tokens", "4096", "--served-model-name", SERVED,
            "--api-key", API_KEY, "--enable-metrics", "--chunked-prefill-size", "64", "--log-level", "warning"]
    from transformers import AutoTokenizer

    with running_server(args, module="ftransformers.entrypoints.launch_server", timeout=120) as proc:
        yield {"base": proc.base, "proc": proc.proc, "tokenizer": AutoTokenizer.from_pretrained(ckpt), "ckpt": ckpt,
               "log": proc.log}


@pytest.fixture(scope="module")
def client(server: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: dict[str, Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server["base"], headers=AUTH, timeout=60) as c:
        yield c


def _stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/server_info")
    assert r.status_code == 200, r.text
    return r.json()["scheduler_stats"]


def _assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED]


def test_chat_matches_generate_and_stream(client: openai.OpenAI, http: httpx.Client, server: dict[str, Any]) -> None:
    resp = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 12
    tok = server["tokenizer"]
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(ids)
    gen = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert gen.status_code == 200, gen.text
    out = gen.json()
    assert len(out["output_ids"]) == 12 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True) == choice.message.content

    chunks = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=SERVED, prompt="Hello world! How", max_tokens=10, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=SERVED, prompt="Hello world! How", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    # Without include_usage, no usage chunk.
    plain = list(client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_stop_string_trims_output(client: openai.OpenAI) -> None:
    full = client.completions.create(model=SERVED, prompt="The capital", max_tokens=30, temperature=0).choices[0].text
    candidates = [full[i : i + 2] for i in range(3, len(full) - 2)
                  if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2] and full[i : i + 2].strip()]
    assert candidates, full
    stop = candidates[len(candidates) // 2]
    got = client.completions.create(model=SERVED, prompt="The capital", max_tokens=30, temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == full[: full.index(stop)]


def test_logprobs_and_seed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2,
                                       temperature=1.0, seed=11)
    lps = r.choices[0].logprobs.content
    assert len(lps) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lps)
    again = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=11)
    assert again.choices[0].message.content == r.choices[0].message.content


def test_health_fast_during_long_generation(server: dict[str, Any], http: httpx.Client) -> None:
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
    latencies, finished = [], False
    with httpx.Client(base_url=server["base"], timeout=30) as fresh:  # /health needs no key
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data: {"))  # generation is under way
            for _ in range(5):
                t0 = time.perf_counter()
                assert fresh.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
            assert _stats(http)["num_running"] == 1  # still generating while /health answered
            finished = any(l == "data: [DONE]" for l in lines)
    assert finished and max(latencies) < 1.0, latencies


def test_native_endpoints(http: httpx.Client, server: dict[str, Any]) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(server["ckpt"]) and info["served_model_name"] == SERVED
    assert info["context_length"] == CONTEXT and info["is_generation"] is True
    sinfo = http.get("/server_info").json()
    assert sinfo["api_key"] == "***" and sinfo["chunked_prefill_size"] == 64
    assert {"num_running", "num_waiting", "kv_used_tokens", "kv_capacity"} <= set(sinfo["scheduler_stats"])
    assert http.get("/health_generate").status_code == 200
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True, (r.text, _stats(http), server["log"]())
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    for name in ("ftransformers:time_to_first_token_seconds_count", "ftransformers:e2e_request_latency_seconds",
                 "ftransformers:time_per_output_token_seconds", "ftransformers:num_running_reqs",
                 "ftransformers:num_queue_reqs", "ftransformers:token_usage", "ftransformers:cache_hit_rate"):
        assert name in metrics.text, name


def test_cached_tokens_on_repeated_prompt(client: openai.OpenAI) -> None:
    prompt = "A quick brown fox jumps over the lazy dog near the river bank. " * 4
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text


def test_api_key_required(server: dict[str, Any]) -> None:
    with httpx.Client(base_url=server["base"], timeout=10) as anon:
        assert anon.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/get_model_info"):
            err = _assert_error(anon.get(path), 401)
            assert err["code"] == "invalid_api_key"
        _assert_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        _assert_error(anon.post("/v1/completions", json={"prompt": "x"}), 401)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "word " * (CONTEXT + 20)}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": " end"}, "suffix"),
    ({"prompt": "hi", "logit_bias": {"1": -101}}, "logit_bias"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
])
def test_bad_completion_requests(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    err = _assert_error(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"logit_bias": {"tok": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
])
def test_unsupported_chat_fields_are_refused(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    # what the server does not do is refused by name, never silently dropped
    err = _assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_supported_forms_of_those_fields(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    for extra in ({"response_format": {"type": "text"}}, {"tools": tools, "tool_choice": "none"},
                  {"messages": [{"role": "user", "content": parts}]}):
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    one = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1,
                                                  "temperature": 0})
    assert one.json()["usage"]["prompt_tokens"] == http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1, "temperature": 0}).json()["usage"]["prompt_tokens"]


def test_tools_reach_the_chat_template_with_tool_choice_none() -> None:
    from ftransformers.entrypoints.openai_protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="none",
                                 chat_template_kwargs={"enable_thinking": False})
    body.sampling_params()
    assert body.template_kwargs() == {"tools": tools, "enable_thinking": False}
    assert ChatCompletionRequest(messages=MESSAGES).template_kwargs() == {}


def test_logit_bias_steers_decoding(http: httpx.Client) -> None:
    # +100 on one token makes greedy decoding pick it at every step; -100 on the unbiased greedy choice removes it
    free = http.post("/generate", json={"text": "Hello world", "sampling_params": {"max_new_tokens": 4,
                                                                                  "temperature": 0}}).json()
    first = free["output_ids"][0]
    target = (first + 7) % 300 + 3
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {str(target): 100}}
    assert http.post("/generate", json={"text": "Hello world", "sampling_params": sp}).json()["output_ids"] == [
        target] * 4
    banned = http.post("/generate", json={"text": "Hello world", "sampling_params": {
        "max_new_tokens": 1, "temperature": 0, "logit_bias": {str(first): -100}}}).json()
    assert banned["output_ids"][0] != first
    r = http.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 3, "temperature": 0.8,
                                           "ignore_eos": True, "logit_bias": {str(target): 100}, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    ids = http.post("/generate", json={"text": "Hello world", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0.8, "ignore_eos": True, "logit_bias": {str(target): 100}}}).json()
    assert ids["output_ids"] == [target] * 3


def test_bad_requests_then_still_serving(http: httpx.Client, client: openai.OpenAI) -> None:
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert "JSON" in _assert_error(r, 400)["message"]
    long_chat = {"messages": [{"role": "user", "content": "word " * CONTEXT}], "max_tokens": 4}
    _assert_error(http.post("/v1/chat/completions", json=long_chat), 400)
    _assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": -1}), 400)
    err = _assert_error(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES}), 404)
    assert err["code"] == "model_not_found"
    _assert_error(http.post("/generate", json={"text": "hi", "sampling_params": {"top_p": 2}}), 400)
    _assert_error(http.get("/no/such/route"), 404)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=-1)
    assert exc.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    ok = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3)
    assert ok.usage.completion_tokens == 3


def _wait_until_freed(http: httpx.Client, seconds: float) -> dict[str, Any]:
    """The frontend's stats once the scheduler runs and queues nothing and holds no KV (within `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = _stats(http)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_used_tokens"] == 0:
            return http.get("/server_info").json()["frontend_stats"]
        assert time.monotonic() < deadline, f"request not freed: {stats}"
        time.sleep(0.1)


def test_client_disconnect_frees_request(server: dict[str, Any], http: httpx.Client) -> None:
    body = {"model": SERVED, "prompt": "Hello world", "max_tokens": 230, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server["base"], headers=AUTH, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:])
                    got += 1
                    if got >= 3:
                        break
    sinfo = _wait_until_freed(http, 10)
    assert sinfo["num_in_flight"] == 0 and sinfo["num_aborted"] >= 1


def test_non_streaming_client_disconnect_aborts(server: dict[str, Any], http: httpx.Client) -> None:
    # a client that gives up on a non-streaming request while its tokens keep coming: the request is aborted (not run
    # to its max_tokens, which would count as finished, not aborted) and its KV freed
    before = http.get("/server_info").json()["frontend_stats"]["num_aborted"]
    body = {"model": SERVED, "prompt": "Hello world", "max_tokens": CONTEXT - 16, "ignore_eos": True}
    with httpx.Client(base_url=server["base"], headers=AUTH, timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    sinfo = _wait_until_freed(http, 30)
    assert sinfo["num_in_flight"] == 0 and sinfo["num_aborted"] == before + 1


def test_bad_model_path_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ftransformers.entrypoints.launch_server", "--model-path",
                           str(tmp_path / "missing"), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing" in lines[0], proc.stderr
