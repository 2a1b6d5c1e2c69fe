"""W8A8 INT8 linear in Triton: y[M, N] = (q_x @ q_w^T) * s_x * s_w (+ bias) for the "int8" layout of
kernels/quant_formats.py (weight int8 [N, K], per-channel float32 scales [N]; x quantized per token,
scale = amax / 127, round half to even), int32 accumulation.

Where the activation is quantized depends on M:
- M <= INT8_FUSED_MAX_M (one row): in the GEMV's prologue, no second launch. Every program first
  reads its x row once for the amax, then quantizes each x tile as it streams the weight on CUDA
  cores (int32 products). The extra x reads hit L1/L2 (a few KB) and cost less than a second kernel
  launch (H100: 13-22% faster than the same GEMV after a separate quantization launch).
- 1 < M <= INT8_GEMV_MAX_M: one quantization kernel writes int8 x and its per-row scales, then a
  GEMV-shaped kernel (x padded to 16 rows, int8 tl.dot on tensor cores, long K steps) streams the
  weight. On an H100 at M = 4 (benchmarks/results/w8_h100.json) re-quantizing every row in every
  program (the fused form) on tensor cores was 5-8x slower, the best CUDA-core tile 2-2.5x slower.
- larger M: the same quantization kernel, then a tiled GEMM with int8 tl.dot.

Quantization is exactly `quantize_act_int8`: division with IEEE rounding (`div_rn`, Triton's `/` is
approximate on GPUs) and round half to even (`rint_f32`, exact for |y| < 2^23), so the int8 x here
is bit-identical to the reference's. Graph-safe: no host syncs, sizes depend only on shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.tiling import grouped_tile

INT8_GEMV_MAX_M = 16
INT8_FUSED_MAX_M = 1


@triton.jit
def rint_f32(y):
    # Round half to even in float32 arithmetic (the interpreter has no libdevice); exact for |y| < 2^23.
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return f + ((d > 0.5) | ((d == 0.5) & odd)).to(tl.float32)


@triton.jit
def quant_int8(x, scale):
    # x float32, scale broadcastable to x -> int8 round(x / scale) clamped to [-127, 127]
    q = rint_f32(tl.math.div_rn(x, scale))
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)


@triton.jit
def int8_scale(amax):
    return tl.maximum(tl.math.div_rn(amax, 127.0), 1e-10)


@cached_launch
@triton.jit
def _quant_int8_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False
):
    # One program per row: amax over K, then quantize.
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = int8_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k0 + offs, quant_int8(x, scale), mask=k0 + offs < K)
    tl.store(s_ptr + row, scale)


def quant_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (int8 [M, K], float32 scale [M]), as `quantize_act_int8`."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quant_int8_kernel[(m,)](
            x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=min(2048, next_pow2(k)), **pdl_launch(x.device)
        )
    return q, s


@cached_launch
@triton.jit
def _int8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, PREQUANT: tl.constexpr, DOT: tl.constexpr, LATE_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # y[m, n] for rows n of [pid*BLOCK_N, (pid+1)*BLOCK_N), all M (<= BLOCK_M) rows, whole K.
    # PREQUANT: x is int8 with scales xs [M]; else x is 16-bit and quantized here (prologue amax pass).
    # LATE_SUM (CUDA cores): products accumulate elementwise in [BM, BN, BK], reduced once at the end.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    if PREQUANT:
        xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        xs = int8_scale(amax)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0)
        if not PREQUANT:
            x = quant_int8(x.to(tl.float32), xs[:, None])
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0)
        if DOT:  # tensor cores, x padded to BLOCK_M >= 16 rows
            acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
        elif LATE_SUM:  # CUDA cores: exact int32 products
            acc3 += x.to(tl.int32)[:, None, :] * w.to(tl.int32)[None, :, :]
        else:
            acc += tl.sum(x.to(tl.int32)[:, None, :] * w.to(tl.int32)[None, :, :], axis=2)
    if LATE_SUM:
        acc = tl.sum(acc3, axis=2)
    ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@cached_launch
@triton.jit
def _int8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_am, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # y = (a @ w^T) * as[m] * ws[n]: a int8 [M, K], w int8 [N, K], int32 accumulator.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N read a valid row (wrapped) and are never stored: no masks on the hot loads.
    a_ptrs = a_ptr + (offs_m % M)[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + (offs_n % N)[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k < K)[None, :]
        a = tl.load(a_ptrs, mask=mask_k, other=0)
        w = tl.load(w_ptrs, mask=mask_k, other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
    w_s = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@dataclass(frozen=True)
class Int8GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    dot: bool
    prequant: bool
    late_sum: bool = False
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class Int8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


def int8_gemv_config(m: int, n: int, k: int) -> Int8GemvConfig:
    """One row: CUDA cores, x quantized in the prologue, 8 weight rows x 1024 columns per step (H100
    sweep in benchmarks/bench_w8.py: the best on Qwen3 qkv, within 8% on DeepSeek q_a+kv_a).
    2..16 rows: pre-quantized x, 16 x 32 tensor-core tiles, 512-wide K steps for K >= 4096."""
    if m <= INT8_FUSED_MAX_M:
        return Int8GemvConfig(1, 8, min(1024, max(16, next_pow2(k))), dot=False, prequant=False)
    return Int8GemvConfig(16, 32, 512 if k >= 4096 else 256, dot=True, prequant=True, num_stages=4)


def int8_gemm_config(m: int, n: int, k: int) -> Int8GemmConfig:
    if m <= 64:
        return Int8GemmConfig(64 if m > 32 else 32, 64, 128, 8, 4, 4)
    if m <= 256:
        return Int8GemmConfig(64, 128, 128, 8, 4, 4)
    return Int8GemmConfig(128, 128, 128, 8, 8, 3)


def int8_gemm(
    xq: torch.Tensor,  # int8 [M, K]
    xs: torch.Tensor,  # float32 [M]
    qw: QuantizedWeight,
    out: torch.Tensor,  # [M, N]
    bias: torch.Tensor | None = None,
    config: Int8GemmConfig | None = None,
) -> torch.Tensor:
    """The tensor-core GEMM on already quantized activations (int8_linear's large-M path)."""
    m, k = xq.shape
    w, ws = qw.qweight, qw.scales.reshape(-1)
    n = w.shape[0]
    cfg = config or int8_gemm_config(m, n, k)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _int8_gemm_kernel[grid](
        xq, xs, w, ws, bias if bias is not None else ws, out, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(xq.device),
    )  # fmt: skip
    return out


def int8_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    qw: QuantizedWeight,  # fmt "int8": qweight int8 [N, K], scales float32 [N]
    bias: torch.Tensor | None = None,  # [N]
    config: Int8GemvConfig | Int8GemmConfig | None = None,
) -> torch.Tensor:  # [..., N] x.dtype
    if qw.fmt != "int8" or qw.perm is not None:
        raise ValueError(f"int8_linear needs an 'int8' weight without perm, got {qw.fmt!r}")
    w, ws = qw.qweight, qw.scales.reshape(-1)
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    cfg = config or (int8_gemv_config(m, n, k) if m <= INT8_GEMV_MAX_M else int8_gemm_config(m, n, k))
    b = bias if bias is not None else ws
    if isinstance(cfg, Int8GemvConfig):
        assert m <= cfg.block_m, (m, cfg)
        xq, xs = quant_act_int8(x2) if cfg.prequant else (x2, ws)
        _int8_gemv_kernel[(cdiv(n, cfg.block_n),)](
            xq, xs, w, ws, b, y, m, n, k, xq.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, PREQUANT=cfg.prequant, DOT=cfg.dot, LATE_SUM=cfg.late_sum,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl_launch(xq.device),
        )  # fmt: skip
    else:
        xq, xs = quant_act_int8(x2)
        int8_gemm(xq, xs, qw, y, bias, cfg)
    return y.view(*lead, n)
