"""FP8 block-scaled linear in Triton: y[M, N] = x @ W^T (+ bias) for the "fp8_block" layout of
kernels/quant_formats.py (weight float8_e4m3fn [N, K], float32 scales [ceil(N/BN), ceil(K/BK)],
(BN, BK) = (block_n, group_size), normally (128, 128)). x is quantized per token and per BK-column
group to E4M3 with scale = amax / 448, exactly as `quantize_act_fp8`; products accumulate in float32
and each K group's partial sum is scaled by x_scale[m, g] * w_scale[n // BN, g].

Two launches on every path: one quantization kernel, then the product.
- M = 1 (FP8_GEMV_MAX_M): the quantization kernel writes x already dequantized, q * scale in float32
  (exactly the reference's fake-quantized x), and a GEMV on CUDA cores streams the weight: fp8 ->
  float32 converts, the weight scale of each K group folded into x, so each weight element costs one
  convert and one FMA. (Quantizing inside the GEMV, one group per x tile, needs a group reduction
  and a broadcast back in every K step; on an H100 that was 1.5-3x slower than this extra launch.)
- M > 1: the quantization kernel writes fp8 x and its scales, then a tiled GEMM with FP8 tl.dot
  (Hopper tensor cores), one dot per K group scaled into the float32 accumulator; up to 16 rows it
  runs 16 x 32 tiles, so N / 32 programs stream the weight (H100 sweep, benchmarks/bench_w8.py: the
  best CUDA-core GEMV tile at M = 4 was 1.25-1.7x slower than these tiles at M = 16).

N and K need not be multiples of the block: partial groups are zero-padded (as the reference pads),
scale rows are gathered per output column. Quantization uses IEEE division (`div_rn`; Triton's `/`
is approximate on GPUs) and rounds onto the E4M3 grid in float32 arithmetic (`e4m3_round`, round
half to even) before the cast, so the cast is exact however it is lowered (Triton's interpreter
truncates): fp8 x and scales are bit-identical to `quantize_act_fp8` run on CPU (on CUDA, torch's
amax / 448 can be one ulp off the IEEE quotient). Graph-safe: no host syncs, sizes depend only on
shapes.
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
from ftransformers.kernels.triton_int8_gemm import rint_f32

FP8_GEMV_MAX_M = 1


@triton.jit
def e4m3_round(y):
    # float32 |y| <= 448 -> the float32 value of RTNE(y) on the E4M3 grid (3 mantissa bits, min exp -6).
    e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3)
    inv_ulp = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # exact reciprocal
    r = rint_f32(tl.abs(y) * inv_ulp) * ulp
    return tl.where(y < 0, r * -1.0, r)  # -0.0 for tiny negatives, as torch (-r would be 0 - r)


@triton.jit
def fp8_scale(amax):
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-10)


@triton.jit
def quant_fp8(x, scale):
    # x float32, scale broadcastable to x -> float8e4nv RTNE(x / scale) clamped to [-448, 448]
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    return e4m3_round(y).to(tl.float8e4nv)


@cached_launch
@triton.jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
    GROUP_K: tl.constexpr, GROUPS: tl.constexpr, FAKE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # Program (row, j) quantizes groups [j*GROUPS, (j+1)*GROUPS) of one row: tile [GROUPS, GROUP_K].
    # FAKE: q_ptr is float32 and gets q * scale (no scales written).
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = offs_g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(tl.abs(x), axis=1))  # [GROUPS]
    q = quant_fp8(x, s[:, None])
    if FAKE:
        tl.store(q_ptr + row * stride_qm + k, q.to(tl.float32) * s[:, None], mask=k < K)
    else:
        tl.store(q_ptr + row * stride_qm + k, q, mask=k < K)
        tl.store(s_ptr + row * stride_sm + offs_g, s, mask=offs_g < num_groups)


def quant_act_fp8(x: torch.Tensor, group: int = 128, fake: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (float8_e4m3fn [M, K], float32 scale [M, ceil(K/group)]),
    as `quantize_act_fp8`; fake: (float32 q * scale [M, K], an empty scale tensor)."""
    m, k = x.shape
    ng = cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float32 if fake else torch.float8_e4m3fn, device=x.device)
    s = torch.empty(0 if fake else m, ng, dtype=torch.float32, device=x.device)
    if m:
        groups = min(8, next_pow2(ng))
        _quant_fp8_kernel[(m, cdiv(ng, groups))](
            x, q, s, k, ng, x.stride(0), q.stride(0), s.stride(0), GROUP_K=group, GROUPS=groups, FAKE=fake,
            **pdl_launch(x.device),
        )
    return q, s


@cached_launch
@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_wsn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr, SCALE_N: tl.constexpr, LATE_SUM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # y[m, n] = sum_k xf[m, k] * w[n, k] * ws[n // SCALE_N, k // GROUP_K], xf the float32 fake-quantized
    # x, for rows n of [pid*BLOCK_N, (pid+1)*BLOCK_N) (one scale row: SCALE_N % BLOCK_N == 0).
    # LATE_SUM: products accumulate elementwise in [BM, BN, BK] and are reduced once at the end.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    ws_row = ws_ptr + (pid * BLOCK_N // SCALE_N) * stride_wsn
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        ws = tl.load(ws_row + (k0 + offs_k) // GROUP_K, mask=mask_k, other=0.0)  # [BK], cached
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        prod = (x * ws[None, :])[:, None, :] * w.to(tl.float32)[None, :, :]
        if LATE_SUM:
            acc3 += prod
        else:
            acc += tl.sum(prod, axis=2)
    if LATE_SUM:
        acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@cached_launch
@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # y = sum_g (a_g @ w_g^T) * as[m, g] * ws[n // SCALE_N, g]; BLOCK_K == the scale group.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N read a valid row (wrapped) and are never stored: no masks on the hot loads.
    rows_m = offs_m % M
    rows_n = offs_n % N
    a_ptrs = a_ptr + rows_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    as_ptrs = as_ptr + rows_m * stride_asm
    ws_ptrs = ws_ptr + (rows_n // SCALE_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(tl.cdiv(K, BLOCK_K)):
        mask_k = (offs_k < K - g * BLOCK_K)[None, :]
        a = tl.load(a_ptrs, mask=mask_k, other=0.0)
        w = tl.load(w_ptrs, mask=mask_k, other=0.0)
        a_s = tl.load(as_ptrs + g)
        w_s = tl.load(ws_ptrs + g)
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    late_sum: bool = False
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


def fp8_gemv_config(m: int, n: int, k: int) -> Fp8GemvConfig:
    """CUDA cores: 8 weight rows x 1024 columns (8 KB of fp8) per step, the best default of the H100
    sweep (within 15% of the best per shape on Qwen3 qkv and DeepSeek q_a+kv_a)."""
    bm = next_pow2(m)
    return Fp8GemvConfig(bm, 8, min(1024 // bm, max(16, next_pow2(k))))


def fp8_gemm_config(m: int, n: int, k: int) -> Fp8GemmConfig:
    if m <= 16:
        return Fp8GemmConfig(16, 32, 1, 4, 4)
    if m <= 64:
        return Fp8GemmConfig(64 if m > 32 else 32, 64, 8, 4, 4)
    if m <= 256:
        return Fp8GemmConfig(64, 128, 8, 4, 4)
    return Fp8GemmConfig(128, 128, 8, 8, 3)


def fp8_block_gemm(
    xq: torch.Tensor,  # float8_e4m3fn [M, K]
    xs: torch.Tensor,  # float32 [M, ceil(K/group)]
    qw: QuantizedWeight,
    out: torch.Tensor,  # [M, N]
    bias: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """The tensor-core GEMM on already quantized activations (fp8_block_linear's large-M path)."""
    m, k = xq.shape
    w, ws = qw.qweight, qw.scales
    n = w.shape[0]
    cfg = config or fp8_gemm_config(m, n, k)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        xq, xs, w, ws, bias if bias is not None else ws, out, m, n, k,
        xq.stride(0), xs.stride(0), w.stride(0), ws.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=qw.group_size,
        GROUP_M=cfg.group_m, SCALE_N=qw.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(xq.device),
    )  # fmt: skip
    return out


def fp8_block_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    qw: QuantizedWeight,  # fmt "fp8_block"
    bias: torch.Tensor | None = None,  # [N]
    config: Fp8GemvConfig | Fp8GemmConfig | None = None,
) -> torch.Tensor:  # [..., N] x.dtype
    if qw.fmt != "fp8_block" or qw.perm is not None:
        raise ValueError(f"fp8_block_linear needs an 'fp8_block' weight without perm, got {qw.fmt!r}")
    w, ws = qw.qweight, qw.scales
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    cfg = config or (fp8_gemv_config(m, n, k) if m <= FP8_GEMV_MAX_M else fp8_gemm_config(m, n, k))
    if isinstance(cfg, Fp8GemvConfig) and qw.block_n % cfg.block_n == 0:
        assert m <= cfg.block_m, (m, cfg)
        xf, _ = quant_act_fp8(x2, qw.group_size, fake=True)  # float32 [M, K]
        _fp8_gemv_kernel[(cdiv(n, cfg.block_n),)](
            xf, w, ws, bias if bias is not None else ws, y, m, n, k,
            xf.stride(0), w.stride(0), ws.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_K=qw.group_size, SCALE_N=qw.block_n, LATE_SUM=cfg.late_sum,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl_launch(xf.device),
        )  # fmt: skip
        return y.view(*lead, n)
    xq, xs = quant_act_fp8(x2, qw.group_size)
    gemm_cfg = cfg if isinstance(cfg, Fp8GemmConfig) else fp8_gemm_config(m, n, k)
    return fp8_block_gemm(xq, xs, qw, y, bias, gemm_cfg).view(*lead, n)
