"""Decode attention's stage 2 (`decode_combine`, the split merge shared by the GQA and MLA decodes) on warp counts
other than its default `COMBINE_WARPS`, against the references: the GPU only, as Triton's interpreter ignores
num_warps. Inputs, helpers and tolerances are tests/test_triton_attention.py's (bfloat16, <= 1e-2)."""

from __future__ import annotations

import pytest
import torch

from tests.test_triton_attention import CUDA, DECODE_LENS, DEV, MLA_LENS, TOL, paged, randn, rel_err

pytest.importorskip("triton")

from ftransformers.kernels.triton_decode_attention import decode_attention_fwd, decode_attention_ref, decode_scratch
from ftransformers.kernels.triton_mla_attention import mla_attention_ref, mla_decode_fwd


@pytest.mark.skipif(not CUDA, reason="the interpreter ignores num_warps")
@pytest.mark.parametrize("warps", [2, 4, 8])
def test_stage2_on_other_warp_counts(monkeypatch: pytest.MonkeyPatch, warps: int) -> None:
    """Stage 2 (decode_combine) on COMBINE_WARPS warps other than the default merges the splits as well: the GQA
    decode at Qwen3-30B-A3B's batch-1 split launch (64 splits, 8 query heads a KV head) and at 3 splits, with
    stage 1 writing one-split rows itself and without; the MLA decode at 128 and 33 splits (16 heads)."""
    from ftransformers.kernels import triton_decode_attention as tda

    monkeypatch.setattr(tda, "COMBINE_WARPS", warps)
    gen = torch.Generator().manual_seed(warps)
    h_kv, group, d = 4, 8, 128
    B, N = len(DECODE_LENS), sum(DECODE_LENS) + 50
    r2t, rows = paged(DECODE_LENS, N, gen)
    seq_lens = torch.tensor(DECODE_LENS, device=DEV)
    q = randn(B, h_kv * group, d, gen=gen)
    k_buf, v_buf = randn(N + 1, h_kv, d, gen=gen), randn(N + 1, h_kv, d, gen=gen)
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rows, seq_lens, d**-0.5)
    for splits, direct in ((64, True), (64, False), (3, True)):
        mid_o, mid_lse = decode_scratch(B, h_kv * group, d, splits, DEV)
        out = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, d**-0.5, block_n=64,
                             direct=direct)  # fmt: skip
        assert rel_err(out, ref) <= TOL, (warps, splits, direct, rel_err(out, ref))
    H, L, R = 16, 512, 64
    B, N = len(MLA_LENS), sum(MLA_LENS) + 20
    r2t, rows = paged([max(n, 1) for n in MLA_LENS], N, gen)
    seq_lens = torch.tensor(MLA_LENS, device=DEV)
    q_nope, q_rope, buf = randn(B, H, L, gen=gen), randn(B, H, R, gen=gen), randn(N + 1, L + R, gen=gen)
    real = B - 1  # the last row is a padded CUDA-graph row (length 0)
    ref = mla_attention_ref(q_nope[:real], q_rope[:real], buf, r2t, rows[:real], [n - 1 for n in MLA_LENS[:real]],
                            [1] * real, (L + R) ** -0.5)  # fmt: skip
    for splits in (128, 33):
        mid_o, mid_lse = decode_scratch(B, H, L, splits, DEV)
        out = torch.full_like(q_nope, float("nan"))
        mla_decode_fwd(q_nope, q_rope, buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, (L + R) ** -0.5)
        assert rel_err(out[:real], ref) <= TOL, (warps, splits, rel_err(out[:real], ref))
