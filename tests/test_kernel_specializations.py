"""Kernel specializations a server meets after its start-up warmup, where the warmup cannot reach them through model
steps: the sampling kernel's launch plan at every row count (warmed directly, `warm_sample_kernel`) and the MoE
alignment kernel, whose integer arguments are not specialized. On a GPU, after the warm-up, launches at every row or
token count must compile nothing new (kernels/compile_log.py records each first launch of a specialization)."""

from __future__ import annotations

import pytest
import torch

from ftransformers.kernels import compile_log
from ftransformers.kernels.launch import cdiv, next_pow2
from ftransformers.kernels.triton_sampling import LARGE_ROWS, plans_up_to, sample_plan

CUDA = torch.cuda.is_available()
QWEN3_VOCAB = 151936


def test_sample_plans_of_qwen3_vocabulary_on_132_sms() -> None:
    first = plans_up_to(256, QWEN3_VOCAB, 132)
    # programs a row follow 132 // rows until one; tiles of 4096 columns from LARGE_ROWS rows
    assert list(first.values()) == [1, 2, 4, 7, 14, 15, 16, 27, 45, 67]
    assert LARGE_ROWS == 16
    one_program = [k for k, rows in first.items() if rows == 67]
    assert one_program == [(4096, 16, 1, 64, False)]  # a row alone: ceil(151936 / 4096) = 38 tiles, no barrier


def test_sample_plan_covers_the_row() -> None:
    for vocab in (1000, 49152, QWEN3_VOCAB):
        for split in (1, 2, 7, 75, 132):
            plan = sample_plan(3, vocab, split)
            assert plan.chunk % plan.block == 0 and plan.split <= split
            assert (plan.split - 1) * plan.chunk < vocab <= plan.split * plan.chunk  # every program owns columns


def _records(name: str) -> int:
    return sum(r.kernel == name for r in compile_log.records())


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton compiles)")
def test_sampler_compiles_nothing_after_warm_sample_kernel() -> None:
    from ftransformers.kernels.triton_sampling import sample_tokens, warm_sample_kernel

    dev = torch.device("cuda")
    vocab, max_rows = QWEN3_VOCAB, 80
    launched = warm_sample_kernel(vocab, (torch.bfloat16, torch.float32), dev, max_rows)
    assert len(launched) == 2 * len(plans_up_to(max_rows, vocab, torch.cuda.get_device_properties(0).multi_processor_count))
    before = _records("_sample_kernel")
    for dtype in (torch.bfloat16, torch.float32):
        for rows in range(1, max_rows + 1):
            logits = torch.randn(rows, vocab, device=dev).to(dtype)
            t = torch.full((rows,), 1.0, device=dev)
            k = torch.zeros(rows, dtype=torch.int32, device=dev)
            tokens = sample_tokens(logits, t, k, torch.ones(rows, device=dev), torch.zeros(rows, device=dev),
                                   torch.arange(rows, device=dev))  # fmt: skip
            assert tokens.shape == (rows,) and bool(((tokens >= 0) & (tokens < vocab)).all())
    assert _records("_sample_kernel") == before


@pytest.mark.skipif(not CUDA, reason="needs CUDA (Triton compiles)")
def test_align_kernel_specializes_on_its_constexprs_only() -> None:
    from ftransformers.kernels.triton_fused_moe import align_reference, max_padded_rows, moe_align

    dev = torch.device("cuda")
    experts, top_k, block_m = 128, 8, 16
    tokens = range(2, 300)
    constexprs, with_ints = set(), set()
    for t in tokens:
        n = t * top_k
        blocks = max_padded_rows(n, experts, block_m) // block_m
        key = (min(1024, max(128, next_pow2(n))), next_pow2(cdiv(n, block_m)))
        constexprs.add(key)
        with_ints.add((*key, n % 16 == 0, blocks % 16 == 0))
    assert len(with_ints) > len(constexprs)  # Triton's integer rules alone would have asked for more compiles
    before = _records("_align_kernel")
    for t in tokens:
        ids = torch.randint(0, experts, (t, top_k), device=dev, dtype=torch.int32)
        for got, want in zip(moe_align(ids, experts, block_m), align_reference(ids, experts, block_m)):
            assert torch.equal(got, want), t
    assert _records("_align_kernel") - before <= len(constexprs)
