"""One activation row times an 8-bit weight ("int8" or "fp8_block"), all of K in one load: the decode-time linear of
W8A8 and FP8 checkpoints at batch 1.

`triton_int8_gemm`'s GEMV walks K twice (an amax pass over x, then the products, tile by tile) and
`triton_fp8_gemm`'s runs behind a separate quantization kernel. Here a program loads its BLOCK_N weight rows over
all of K (K <= MAX_K, padded to a power of two and masked) and their scales before the PDL wait (they are
constant), then quantizes x itself, as the checkpoint's scheme says (int8: per token, amax / 127; fp8: per K group
of 128, amax / 448, bit for bit as `quantize_act_*`), and sums the products: int8 exactly in int32, scaled once;
fp8 in float32, each group's dequantized x folded with the weight block's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.triton_fp8_gemm import fp8_scale, quant_fp8
from ftransformers.kernels.triton_int8_gemm import int8_scale, quant_int8

# int8_linear and fp8_block_linear take one row here where `takes` says (module names, so that
# benchmarks/ab_decode.py's `set=` can change them in a whole model)
INT8_ENABLED = True
FP8_ENABLED = True
# quant_reads_ahead says yes for the rows taken here, so the kernel before them triggers early (pdl.py)
READS_AHEAD = True
MAX_K = 4096
ROW_WARPS = 8
ROW_ELEMS = 64  # weight elements a thread: BLOCK_N = ROW_ELEMS * threads / K padded


@triton.jit
def quant_row(x, FP8: tl.constexpr, NG: tl.constexpr, GROUP: tl.constexpr):
    # x float32 [NG * GROUP] (zero past K) quantized as the scheme says -> fp8: (q * scale float32 [NG, GROUP],
    # scale [NG]); int8: (q int32 [NG * GROUP], scale [])
    if FP8:
        x2 = tl.reshape(x, [NG, GROUP])
        scale = fp8_scale(tl.max(tl.abs(x2), axis=1))
        values = quant_fp8(x2, scale[:, None]).to(tl.float32) * scale[:, None]
    else:
        scale = int8_scale(tl.max(tl.abs(x), axis=0))
        values = quant_int8(x, scale).to(tl.int32)
    return values, scale


@cached_launch
@triton.jit
def _w8_row_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_sn,
    FP8: tl.constexpr, SCALE_N: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # y[n] = x . w[n] (+ bias) for rows n of [pid * BLOCK_N, (pid + 1) * BLOCK_N); fp8: BLOCK_N divides SCALE_N.
    BK: tl.constexpr = NG * GROUP
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BK)
    g = tl.arange(0, NG)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :],
                other=0.0 if FP8 else 0)  # [BN, BK]  # fmt: skip
    if FP8:
        ws = tl.load(ws_ptr + (pid * BLOCK_N // SCALE_N) * stride_sn + g, mask=g < tl.cdiv(K, GROUP), other=0.0)
    else:
        ws = tl.load(ws_ptr + n, mask=n < N, other=0.0)  # [BN]
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)  # [BK]
    xq, sx = quant_row(x, FP8, NG, GROUP)
    if FP8:
        y = tl.sum(w.to(tl.float32) * tl.reshape(xq * ws[:, None], [BK])[None, :], axis=1)  # [BN]
    else:
        y = tl.sum(w.to(tl.int32) * xq[None, :], axis=1).to(tl.float32) * (sx * ws)
    if HAS_BIAS:
        y += bias
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


def _switched_on(qw: QuantizedWeight) -> bool:
    return INT8_ENABLED if qw.fmt == "int8" else FP8_ENABLED if qw.fmt == "fp8_block" else False


def pow2_dividing(n: int, *sizes: int) -> int:
    """The largest power of two <= n dividing every size (1 at least): fp8 row tiles that stay in one scale block."""
    while n > 1 and any(s % n for s in sizes):
        n //= 2
    return n


def k_tiles(qw: QuantizedWeight) -> tuple[int, int]:
    """(GROUP, NG): K as NG groups of GROUP, NG * GROUP the next power of two >= K (fp8: GROUP = its K block)."""
    bk = next_pow2(qw.in_features)
    group = min(qw.group_size, bk) if qw.fmt == "fp8_block" else min(128, bk)
    return group, max(1, bk // group)


def takes(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """One row of a 16-bit x on CUDA (or the interpreter), K <= MAX_K, the format's switch on."""
    return (
        _switched_on(qw) and x.shape[0] == 1 and qw.in_features <= MAX_K and x.dtype in (torch.bfloat16, torch.float16)
    )


def reads_ahead(qw: QuantizedWeight, rows: int) -> bool:
    """Whether quant_linear on `rows` rows of qw runs this kernel, which reads its weight ahead of its PDL wait (the
    16-bit x that `takes` also asks for is the model's dtype)."""
    return READS_AHEAD and _switched_on(qw) and rows == 1 and qw.in_features <= MAX_K and qw.perm is None


def w8_row(
    x: torch.Tensor,  # [1, K] bf16 / fp16, unit stride
    qw: QuantizedWeight,  # int8 [N, K] + float32 [N], or fp8_block [N, K] + float32 [ceil(N/BN), ceil(K/BK)]
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [1, N] x.dtype
    warps: int | None = None,
    elems: int | None = None,
) -> torch.Tensor:
    n, k = qw.qweight.shape
    fp8 = qw.fmt == "fp8_block"
    group, ng = k_tiles(qw)
    warps = warps or ROW_WARPS
    block_n = max(1, min(16, (elems or ROW_ELEMS) * 32 * warps // (group * ng)))
    block_n = 1 << (block_n.bit_length() - 1)  # a power of two
    if fp8:
        block_n = pow2_dividing(block_n, qw.block_n)  # inside one scale block
    ws = qw.scales if fp8 else qw.scales.reshape(-1)
    assert x.stride(-1) == 1 and qw.qweight.stride(-1) == 1 and ws.stride(-1) == 1
    _w8_row_kernel[(cdiv(n, block_n),)](
        x, qw.qweight, ws, bias if bias is not None else ws, out, n, k, qw.qweight.stride(0),
        ws.stride(0) if fp8 else 1,
        FP8=fp8, SCALE_N=qw.block_n, GROUP=group, NG=ng, BLOCK_N=block_n, HAS_BIAS=bias is not None,
        num_warps=warps, **pdl_launch(x.device),
    )  # fmt: skip
    return out
