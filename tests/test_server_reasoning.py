"""HTTP layer with --reasoning-parser, in process, against a scripted fake scheduler on the zmq pipes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_server_fixtures import build_tiny_tokenizer

from ftransformers.config.server_args import ServerArgs
from ftransformers.entrypoints.http_server import create_app
from ftransformers.entrypoints.tokenizer_manager import TokenizerManager
from ftransformers.ipc.zmq_channel import PullChannel, PushChannel, ipc_addr, make_ipc_dir, remove_ipc_dir
from ftransformers.scheduler.io_struct import GenerateReq, ReqOutput, SchedulerStats, StatsReq

SCRIPT = "I should answer: 2 + 2.\n</think>\n\nIt is 4 \U0001f600."  # deepseek-r1: the template opened <think>


def _fake_scheduler(tokenizer: Any, in_addr: str, out_addr: str, stop: threading.Event) -> None:
    pull, push = PullChannel(in_addr, bind=True), PushChannel(out_addr)
    ids = tokenizer.encode(SCRIPT)
    while not stop.is_set():
        msg = pull.recv(timeout_ms=50)
        if isinstance(msg, StatsReq):
            push.send(SchedulerStats(0, 0, 0, 100, 0, 0, 0))
        elif isinstance(msg, GenerateReq):
            n = len(msg.input_ids)
            for i, tok in enumerate(ids):  # one token per message, like decode steps
                done = i == len(ids) - 1
                push.send([ReqOutput(msg.rid, [tok], None, done, "length" if done else None, None, n, i + 1, 0)])
    pull.close()
    push.close()


@pytest.fixture()
def client() -> Iterator[TestClient]:
    tokenizer = build_tiny_tokenizer()
    ipc_dir = make_ipc_dir()
    in_addr, out_addr = ipc_addr(ipc_dir, "in"), ipc_addr(ipc_dir, "out")
    stop = threading.Event()
    thread = threading.Thread(target=_fake_scheduler, args=(tokenizer, in_addr, out_addr, stop), daemon=True)
    thread.start()
    args = ServerArgs(model_path="/fake/model", served_model_name="fake", reasoning_parser="deepseek-r1")
    info = {"context_len": 128, "kv_capacity": 1000, "vocab_size": len(tokenizer)}
    tm = TokenizerManager(args, tokenizer, info, in_addr, out_addr)
    with TestClient(create_app(args, tm)) as c:
        yield c
    stop.set()
    thread.join(5)
    remove_ipc_dir(ipc_dir)


BODY = {"model": "fake", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 64}


def test_reasoning_content_non_streaming(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should answer: 2 + 2.\n" and msg["content"] == "It is 4 \U0001f600."


def test_reasoning_content_streaming(client: TestClient) -> None:
    reasoning, content, pieces = "", "", []
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            pieces.append(delta)
    assert reasoning == "I should answer: 2 + 2.\n" and content == "It is 4 \U0001f600."
    assert all("\ufffd" not in (d.get("content") or "") for d in pieces)
    # separate_reasoning=false turns the parser off for one request.
    r = client.post("/v1/chat/completions", json={**BODY, "separate_reasoning": False})
    assert r.json()["choices"][0]["message"]["content"] == SCRIPT
