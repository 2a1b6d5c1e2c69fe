"""scheduler/warmup.py: the start-up warmup's prompt lengths follow the context, the prefill chunk and the KV pool,
and its requests (each length alone, all together, behind a cached prefix, sampled decode batches) all run to their
max_tokens on a real tiny model through a real Scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftransformers.config.model_config import ModelConfig
from ftransformers.config.server_args import ServerArgs
from ftransformers.runtime.model_runner import ModelRunner
from ftransformers.scheduler import warmup
from tests.model_harness import make_tiny_checkpoint


def test_lengths_follow_context_chunk_and_pool() -> None:
    args = ServerArgs(model_path="unused", chunked_prefill_size=64)
    # every length to DENSE_UP_TO (64), both sides of every power of two up to the chunk and one past it (64 + 17),
    # under the context (200 - 8)
    assert warmup.warmup_lengths(args, 200, 10**6) == [*range(1, 66), 81]
    assert warmup.warmup_lengths(args, 90, 10**6)[-1] == 81
    assert warmup.warmup_lengths(args, 40, 10**6) == list(range(1, 33))  # the context: 40 - 8
    # together in half the pool: the ladder's 39 tokens fit 50, the dense lengths' 2080 do not
    assert warmup.warmup_lengths(args, 10**6, 100) == [1, 2, 3, 4, 5, 7, 8, 9]
    big = warmup.warmup_lengths(ServerArgs(model_path="unused"), 40960, 10**6)
    assert big[-4:] == [8191, 8192, 8193, 8209] and {4095, 4096, 4097, 100, 1000} <= set(big)
    assert {257, 384, 448, 511} <= set(big)  # both divisibilities by 16 in the int4 rule's 257-384 and 385-511 bands
    unchunked = warmup.warmup_lengths(ServerArgs(model_path="unused", chunked_prefill_size=-1), 40960, 10**6)
    assert unchunked[-1] == 16385


def test_decode_batches_reach_the_most_running() -> None:
    # past the CUDA graphs' largest batch a decode runs eagerly, and kernels pick variants by batch size
    assert warmup.decode_batches(256) == [1, 2, 3, 5, 8, 16, 32, 64, 128, 256]
    assert warmup.decode_batches(200) == [1, 2, 3, 5, 8, 16, 32, 64, 128, 200]
    assert warmup.decode_batches(8) == [1, 2, 3, 5, 8]
    assert warmup.decode_batches(4) == [1, 2, 3, 4]
    assert warmup.decode_batches(1) == [1]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_every_warmup_request_runs_to_its_end(kind: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(kind, tmp_path / kind)
    args = ServerArgs(model_path=str(path), dtype="float32", device="cpu", max_total_tokens=2048,
                      max_running_requests=8, chunked_prefill_size=96, context_length=320)  # fmt: skip
    runner = ModelRunner(args, ModelConfig.from_server_args(args))
    report = warmup.run_warmup(runner, args, [], runner.model_config.vocab_size)
    lengths = warmup.warmup_lengths(args, 320, runner.kv_capacity)
    assert lengths[-4:] == [65, 96, 100, 113] and sum(lengths) <= runner.kv_capacity // 2
    # each alone, together, behind a prefix; then sampled decode batches of 1, 2, 3, 5 and 8
    assert report.requests == 3 * len(lengths) + 1 + 2 + 3 + 5 + 8
    assert report.errors == [] and report.finished == report.requests
    assert report.sampler_rows == []  # the sampling kernel is warmed directly on CUDA only
    assert report.prompt_tokens == 3 * sum(lengths) + 5 * len(lengths) + 16 * 19
