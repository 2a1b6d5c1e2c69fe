"""Dense 16-bit y = x @ W^T (+ bias) for a few dozen to a few hundred rows of x: decode steps at batch 32-256.

At those batch sizes a decode step's linears have one or two row tiles of x and weights of 16-200 MB, so they are
bound by streaming the weight once, and the step's small projections (a Qwen3-8B o or qkv projection at 128 rows:
32-48 column tiles of 128) give too few output tiles to keep every SM streaming. Here the K axis can be split
SPLIT ways: program (m tile, n tile, split) multiplies its share of the K steps on the tensor cores (tl.dot: wgmma on
Hopper, pipelined over `num_stages`), and the last of a tile's SPLIT programs out adds the float32 partials in split
order (kernels/tickets.py: deterministic, bit for bit the same on every run) and stores y.

SWAP_AB computes the tile transposed, W tile @ x tile^T: the weight rows are then the MMA's M (64 a warpgroup)
and the rows of x its N, which suits fewer rows of x.

PDL (kernels/pdl.py): every program waits before its first load; nothing is read ahead (the weight preload of the
one-row bf16 GEMV was measured slower).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ftransformers.kernels.launch import cached_launch, cdiv
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.tickets import publish_and_sum, split_scratch

DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SplitKConfig:
    """Tile rows of x (BLOCK_M) and of W (BLOCK_N), K step, K split, warps, pipeline stages, transposed tile."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    split: int = 1
    warps: int = 4
    stages: int = 4
    swap: bool = False
    tma: bool = False  # x and W through TMA descriptors (Hopper) instead of pointer loads

    def name(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} s{self.split} w{self.warps} st{self.stages}"
                + (" swap" if self.swap else "") + (" tma" if self.tma else ""))  # fmt: skip


@cached_launch
@triton.jit
def _splitk_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr, DESC: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # program (m tile, n tile, split): y[m tile, n tile] over split's share of the K / BLOCK_K steps (the caller
    # checks K % BLOCK_K == 0), cdiv(steps, SPLIT) each, the last share shorter. m fastest: the programs of a
    # weight tile run together and read it once from DRAM
    pdl_enter(USE_PDL)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    steps = K // BLOCK_K
    share = tl.cdiv(steps, SPLIT)
    k0 = pid_s * share * BLOCK_K
    if not DESC:
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :]  # [BM, BK]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]  # [BN, BK]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(tl.minimum(share, steps - pid_s * share)):
        if DESC:  # x_ptr, w_ptr: TMA descriptors of [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K] blocks (zeros past M, N)
            x = x_ptr.load([pid_m * BLOCK_M, k0 + i * BLOCK_K])
            w = w_ptr.load([pid_n * BLOCK_N, k0 + i * BLOCK_K])
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        if IEEE:  # the CPU interpreter, whose 16-bit dot is wrong: float32 operands, exact products
            x, w = x.to(tl.float32), w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee" if IEEE else None)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IEEE else None)
        if not DESC:
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT > 1:
        part_row = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # part [SPLIT, M, N]
        last, acc = publish_and_sum(acc, part_row, pid_s, M * N, mask, cnt_ptr + pid_n * tl.num_programs(0) + pid_m,
                                    SPLIT)  # fmt: skip
        if last:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fits(m: int, n: int, k: int, cfg: SplitKConfig) -> bool:
    """Whether cfg runs x [M, K] @ W [N, K]^T: K a whole number of BLOCK_K steps, every split a share of them."""
    steps = k // cfg.block_k
    return m > 0 and n > 0 and k % cfg.block_k == 0 and (cfg.split - 1) * cdiv(steps, cfg.split) < steps


def splitk_gemm(
    x: torch.Tensor,  # [M, K] 16-bit, unit stride along K
    w: torch.Tensor,  # [N, K] same dtype, unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    cfg: SplitKConfig | None = None,
) -> torch.Tensor:  # [M, N] x.dtype
    m, k = x.shape
    n = w.shape[0]
    cfg = cfg or SplitKConfig()
    assert x.dtype in DTYPES and w.dtype == x.dtype and w.shape[1] == k, (x.dtype, w.dtype, tuple(w.shape), k)
    assert x.stride(1) == 1 and w.stride(1) == 1 and fits(m, n, k, cfg), (x.stride(), w.stride(), cfg)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    n_tiles, m_tiles = cdiv(n, cfg.block_n), cdiv(m, cfg.block_m)
    split, cnt, part = split_scratch(x.device, "splitk_gemm", n_tiles * m_tiles, cfg.split, m, n)
    xa, wa = x, w
    if cfg.tma:
        xa = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
        wa = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    _splitk_gemm_kernel[(m_tiles, n_tiles, split)](
        xa, wa, bias if bias is not None else w, y, part if part is not None else y, cnt if cnt is not None else y,
        m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
        SWAP=cfg.swap, IEEE=_INTERPRET, DESC=cfg.tma, num_warps=cfg.warps, num_stages=cfg.stages, **pdl_launch(x.device),
    )  # fmt: skip
    return y
