"""Parity with transformers (float32): Llama, Qwen3, Qwen3-MoE through the loader, the paged KV pool
and the torch-native backend, with prefill chunks and decodes of several sequences in one forward."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model_harness import (
    hf_greedy_reference,
    make_tiny_checkpoint,
    random_prompts,
    run_engineless_greedy,
    single_thread,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    # tied head, biases, llama3 rope, head_dim != hidden / heads, multi-query attention
    "llama_variant": (
        "llama",
        dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3_ROPE,
             head_dim=32, num_key_value_heads=1, num_hidden_layers=2),
    ),  # fmt: skip
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    # every second layer sparse, no top-k renormalisation
    "qwen3_moe_variant": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)),
}
MAX_NEW_TOKENS = 32


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_transformers(case: str, tmp_path: Path) -> None:
    kind, overrides = CASES[case]
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    path = make_tiny_checkpoint(kind, tmp_path / case, seed=seed, **overrides)
    prompts = random_prompts(4, 384, lengths=[1, 6, 13, 22], seed=seed)
    ours, our_logits = run_engineless_greedy(path, prompts, MAX_NEW_TOKENS, chunk_size=5)
    ref, ref_logits = hf_greedy_reference(path, prompts, MAX_NEW_TOKENS)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert len(a) == MAX_NEW_TOKENS
        assert a == b, f"{case} (seed {seed}) prompt {i}: tokens diverge at {next(j for j in range(len(a)) if a[j] != b[j])}"
    diff = max((x - y).abs().max().item() for x, y in zip(our_logits, ref_logits))
    assert diff <= 1e-3, f"{case} (seed {seed}): logits differ by {diff}"
