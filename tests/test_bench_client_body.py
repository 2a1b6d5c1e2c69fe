"""`ftransformers bench`'s request bodies: greedy, fixed-length streaming by default, and `--extra-request-body`
merged over those defaults (into `sampling_params` for /generate), so a run can sample instead."""

from __future__ import annotations

import pytest

from ftransformers.bench.client import BenchClient, Prompt


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions", "generate"])
def test_extra_body_overrides_the_defaults(api: str) -> None:
    plain = BenchClient("http://127.0.0.1:1", "m", api).body(Prompt("hi"), 8)
    extra = {"temperature": 1.0, "top_p": 0.9}
    body = BenchClient("http://127.0.0.1:1", "m", api, extra_body=extra).body(Prompt("hi"), 8)
    if api == "generate":
        assert plain["sampling_params"]["temperature"] == 0.0
        assert body["sampling_params"] == {**plain["sampling_params"], **extra}
        assert {k: v for k, v in body.items() if k != "sampling_params"} == {
            k: v for k, v in plain.items() if k != "sampling_params"
        }
    else:
        assert plain["temperature"] == 0.0 and plain["ignore_eos"] and plain["min_tokens"] == 8
        assert body == {**plain, **extra}
