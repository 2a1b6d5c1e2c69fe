"""The absorbed MLA decode's two per-head products at a few rows, in Triton: c[h, m, n] = sum_k a[h, m, k] * b[h, k, n].

DeepSeek-V3's absorbed attention multiplies each head's query by its W_UK slice before the latent attention
(q_nope [T, H, N] -> [T, H, L]) and each head's latent output by its W_UV slice after it ([T, H, L] -> [T, H, V]).
At decode these are batched GEMVs that only stream the weights (16 MB each a layer at 128 heads). cuBLAS's
batched kernel read them at 57-59% of copy bandwidth on an H200 (nvjet, 7.0 / 6.7 us a layer, DeepSeek-V3 B=1,
benchmarks/results/ab_combine1_dsv3_bf16_b1_ctx4096_s55_h200.log) and, as a torch op, breaks the PDL chain before the
attention. Here a program owns BLOCK_N outputs of one head for every row and walks K once, on CUDA cores
([BLOCK_M, BLOCK_K, BLOCK_N] products summed over K in float32; tensor cores would waste 15 of 16 rows at M = 1).
Any strides: `b` is W_UK ([H, N, L], n contiguous) or W_UV transposed ([H, L, V] viewed from [H, V, L], k
contiguous), and `c` may be written in [T, H, *] order so that no transpose copy follows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch

# Which products `takes`: one row always, 2-MAX_M rows where the product's weight is at most SMALL_WEIGHT_BYTES; the
# rest go to torch.bmm. H200, benchmarks/bench_mla_bmm.py (benchmarks/results/mla_bmm_tiles_s56_h200.log), us against
# torch.bmm, W_UK / W_UV^T: 128 heads (16 MB, floor 4.0 us) 1 row 6.30 / 6.08 against 6.89 / 6.83, 2 rows 8.27 /
# 7.59 against 6.99 / 6.83, 4 rows 13.0 / 10.5 against 7.0 / 6.9; 16 heads (2 MB) 1 row 2.45 / 2.33 against 3.55 /
# 4.01, 4 rows 3.12 / 2.80 against 3.61 / 3.97. DeepSeek-V3 (3 layers, 128 heads) B=1 ctx 4096 graph replay 1.487 ->
# 1.469 and 1.486 -> 1.474 ms in two processes (ab_mlabmm{,_tiles}_dsv3_b1_ctx4096_s56_h200.log). ENABLED False sends
# every product to torch.bmm (an A/B toggle, `set=triton_mla_bmm.ENABLED=0` in benchmarks/ab_decode.py)
ENABLED = True
MAX_M = 4
SMALL_WEIGHT_BYTES = 4 << 20
# Tiles: weight elements a program loads a K step (8 KB of bf16), its K step's cap, warps, pipeline stages. Of the
# variants in mla_bmm_tiles_s56_h200.log (8K-32K elements, 2 or 8 warps) none was faster at one row
TILE_ELEMS = 4096
MAX_BLOCK_K = 512
WARPS = 4
STAGES = 3
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@cached_launch
@triton.jit
def _mla_bmm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    s_ah, s_am, s_ak, s_bh, s_bk, s_bn, s_ch, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # program (n block, head): c[h, :M, n block] from a[h, :M, :] and b[h, :, n block]
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + h * s_ah + offs_m[:, None] * s_am + offs_k[None, :] * s_ak  # [BM, BK]
    b_ptrs = b_ptr + h * s_bh + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c_ptrs = c_ptr + h * s_ch + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a model should call mla_bmm for a [H, M, K] x [H, K, N] product: ENABLED, on CUDA, one row, or up to
    MAX_M rows of a weight of at most SMALL_WEIGHT_BYTES (the measured rule above)."""
    return a.is_cuda and _rule(a, b)


def _rule(a: torch.Tensor, b: torch.Tensor) -> bool:
    m = a.shape[1]
    return ENABLED and (m == 1 or (2 <= m <= MAX_M and b.numel() * b.element_size() <= SMALL_WEIGHT_BYTES))


def _runs_kernel(a: torch.Tensor, b: torch.Tensor) -> bool:  # takes, or (tests) the same rule in the CPU interpreter
    return (a.is_cuda or _INTERPRET) and _rule(a, b)


def mla_bmm(
    a: torch.Tensor,  # [H, M, K], any strides
    b: torch.Tensor,  # [H, K, N], any strides
    out: torch.Tensor | None = None,  # [H, M, N], any strides (e.g. a transposed view of [M, H, N])
) -> torch.Tensor:  # out, or a new [H, M, N] in a's dtype
    """torch.bmm(a, b) (float32 accumulation, rounded to the output's dtype), through the kernel where `takes` (and in
    the CPU interpreter)."""
    H, M, K = a.shape
    N = b.shape[2]
    assert b.shape == (H, K, N) and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    c = torch.empty(H, M, N, dtype=a.dtype, device=a.device) if out is None else out
    assert c.shape == (H, M, N), (c.shape, (H, M, N))
    if not _runs_kernel(a, b):
        return torch.bmm(a, b, out=c) if c.is_contiguous() else c.copy_(torch.bmm(a, b))
    block_k = min(MAX_BLOCK_K, max(16, next_pow2(K)))
    block_n = min(max(1, TILE_ELEMS // block_k), next_pow2(N))
    _mla_bmm_kernel[(cdiv(N, block_n), H)](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        BLOCK_M=next_pow2(M), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=WARPS, num_stages=STAGES,
        **pdl_launch(a.device),
    )  # fmt: skip
    return c


def mla_bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: float32 products, rounded to a's dtype."""
    return torch.bmm(a.float(), b.float()).to(a.dtype)
