"""Fused MoE with 8-bit experts ("fp8_block" or "int8" layouts of kernels/quant_formats.py), in Triton.
Semantics are `quant_moe_ref`: x quantized before the gate-up GEMM, SiLU(gate) * up rounded to
hidden.dtype and quantized again before the down GEMM (fp8: per token and per K group of 128,
scale = amax / 448; int8: per token, scale = amax / 127), each expert's output rounded to
hidden.dtype, times its routing weight, summed over the top-k in float32.

Two paths, as for 16-bit experts (kernels/triton_fused_moe.py), both CUDA-graph safe: the pair path
for T*K <= PAIR_MAX_PAIRS (one decode token) or a W8PairConfig, else the aligned path.

- Pair path: no alignment. `_pair_gate_up_kernel` (one program per (I-block, pair)) streams the
  expert's gate and up rows on CUDA cores and writes act [T*K, I]; `_pair_down_sum_kernel` (one
  program per (D-block, token)) sums the token's K expert outputs straight into out [T, D]. int8:
  each program quantizes its activation row itself (an amax pass over the row, a few KB from
  L1/L2, then int32 products): two launches. fp8: a quantization kernel first writes the row
  already dequantized (q * scale, float32) before each of the two GEMVs, so the weight costs one
  convert and one FMA (its group scale folded into x): four launches, as in triton_fp8_gemm's
  decode path, where quantizing inside the GEMV was far slower. Weak spot: on an H100 (Qwen3-30B-A3B,
  one token) int8 took 37.7 us against 34.4 us for the bf16 pair path, far from its 12.8 us byte
  floor, so one int8 token now goes to kernels/triton_moe_w8_token.py instead, and one fp8 token's down
  projection to that module's down kernel.
- Aligned path: x quantized by one kernel, `moe_align` sorts pairs into expert blocks of BLOCK_M rows,
  then grouped GEMMs with fp8 / int8 tl.dot: gate-up with SiLU * up fused in the epilogue (fp8: each
  K group's dot scaled into a float32 accumulator; int8: int32 accumulation, scales in the epilogue),
  act quantized, down GEMM times the routing weight, then `moe_sum`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.tiling import aligned_rows, aligned_tile
from ftransformers.kernels.triton_fp8_gemm import quant_act_fp8
from ftransformers.kernels.triton_fused_moe import PAIR_MAX_PAIRS, MoEConfig, moe_align, moe_sum
from ftransformers.kernels.triton_int8_gemm import int8_scale, quant_act_int8, quant_int8
from ftransformers.kernels.triton_moe_w8_token import fp8_down_config, moe_w8_token, token_down
from ftransformers.kernels.triton_moe_w8_token import takes as token_takes
from ftransformers.kernels.triton_moe_w8_token import takes_down as token_takes_down
from ftransformers.kernels.triton_w8_row import pow2_dividing

W8_FORMATS = ("fp8_block", "int8")
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@cached_launch
@triton.jit
def _w8_moe_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs, max_padded, up_offset, up_rows,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
    SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, K_TILES: tl.constexpr, ROUND_TY: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # C[pair, n] = A[pair // A_DIV] @ B[e, n]^T with 8-bit A and B; FUSE_SILU: rows n (gate) and
    # up_rows + n (up) -> silu(gate) * up. FP8: BLOCK_K is the scale group, scales per K tile.
    # Products are rounded to ROUND_TY (hidden.dtype) before SiLU / the routing weight.
    pdl_enter(USE_PDL)
    pid_m, pid_n = aligned_tile(max_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):  # past the used row blocks
        return
    pair, row_ok, expert = aligned_rows(sorted_ptr, expert_ids_ptr, pid_m, num_pairs, BLOCK_M)  # [BM]
    a_row = pair // A_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    as_ptrs = as_ptr + a_row * stride_asm
    bs_base = bs_ptr + expert * stride_bse
    if FP8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for kt in range(K_TILES):
        k_ok = offs_k < K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            a_s = tl.load(as_ptrs + kt, mask=row_ok, other=0.0)[:, None]
            b_s = tl.load(bs_base + (offs_n // SCALE_N) * stride_bsn + kt, mask=n_ok, other=0.0)[None, :]
            acc += tl.dot(a, b) * a_s * b_s
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        if FUSE_SILU:
            b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                bu_s = tl.load(bs_base + ((up_rows + offs_n) // SCALE_N) * stride_bsn + kt, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * a_s * bu_s[None, :]
            else:
                acc_up = tl.dot(a, b_up, acc_up, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if FP8:
        out = acc
        out_up = acc_up
    else:
        a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)[:, None]
        out = acc.to(tl.float32) * a_s * tl.load(bs_base + offs_n * stride_bsn, mask=n_ok, other=0.0)[None, :]
        out_up = (
            acc_up.to(tl.float32)
            * a_s
            * tl.load(bs_base + (up_rows + offs_n) * stride_bsn, mask=n_ok, other=0.0)[None, :]
        )
    out = out.to(ROUND_TY).to(tl.float32)
    if FUSE_SILU:
        out_up = out_up.to(ROUND_TY).to(tl.float32)
        out = out / (1.0 + tl.exp(-out)) * out_up
    if MUL_WEIGHT:
        out = out * tl.load(w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _row_gemv_w8(
    x_row, w_ptrs, ws_ptrs, w2_ptrs, ws2_ptrs, K, n_ok,
    TWO: tl.constexpr, FP8: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, LATE_SUM: tl.constexpr,
):  # fmt: skip
    # One activation row times BLOCK_N 8-bit weight rows (w_ptrs [BN, 1] row pointers) and, if TWO, a
    # second row set (w2_ptrs) -> float32 [BN] each. fp8: x_row is the float32 fake-quantized row and
    # ws_ptrs + g the rows' shared scale of K group g. int8: x_row is 16-bit, quantized here (amax
    # pass first); ws_ptrs [BN] point at the rows' scales. LATE_SUM: elementwise [BN, BK]
    # accumulators, reduced once at the end.
    offs_k = tl.arange(0, BLOCK_K)
    acc_ty = tl.float32 if FP8 else tl.int32
    if LATE_SUM:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=acc_ty)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=acc_ty)
    else:
        acc = tl.zeros([BLOCK_N], dtype=acc_ty)
        acc2 = tl.zeros([BLOCK_N], dtype=acc_ty)
    if not FP8:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        xs = int8_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        w_ok = n_ok[:, None] & k_ok[None, :]
        if FP8:
            x = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0)
            xw = x * tl.load(ws_ptrs + (k0 + offs_k) // GROUP_K, mask=k_ok, other=0.0)
            prod = tl.load(w_ptrs + k0 + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32) * xw[None, :]
            if TWO:
                xw2 = x * tl.load(ws2_ptrs + (k0 + offs_k) // GROUP_K, mask=k_ok, other=0.0)
                prod2 = tl.load(w2_ptrs + k0 + offs_k[None, :], mask=w_ok, other=0.0).to(tl.float32) * xw2[None, :]
        else:
            xq = quant_int8(tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32), xs).to(tl.int32)
            prod = tl.load(w_ptrs + k0 + offs_k[None, :], mask=w_ok, other=0).to(tl.int32) * xq[None, :]
            if TWO:
                prod2 = tl.load(w2_ptrs + k0 + offs_k[None, :], mask=w_ok, other=0).to(tl.int32) * xq[None, :]
        if LATE_SUM:
            acc += prod
            if TWO:
                acc2 += prod2
        else:
            acc += tl.sum(prod, axis=1)
            if TWO:
                acc2 += tl.sum(prod2, axis=1)
    if LATE_SUM:
        out = tl.sum(acc, axis=1).to(tl.float32)
        out2 = tl.sum(acc2, axis=1).to(tl.float32)
    else:
        out = acc.to(tl.float32)
        out2 = acc2.to(tl.float32)
    if not FP8:
        out = out * xs * tl.load(ws_ptrs, mask=n_ok, other=0.0)
        out2 = out2 * xs * tl.load(ws2_ptrs, mask=n_ok, other=0.0)
    return out, out2


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, act_ptr, ids_ptr, N, K, num_pairs, up_rows,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_am,
    TOP_K: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE_SUM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # act[pair, n] = silu(x[t] @ w13[e, n]) * (x[t] @ w13[e, up_rows + n]), t = pair // TOP_K. Pair
    # fastest in the grid, so an expert's rows are read by neighbouring programs (L2 reuse).
    # fp8: SCALE_N % BLOCK_N == 0 and up_rows % BLOCK_N == 0, so each row set shares one scale row.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pair = pid % num_pairs
    pid_n = pid // num_pairs
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    ws_base = ws_ptr + expert * stride_wse
    if FP8:
        gate_s = ws_base + (pid_n * BLOCK_N // SCALE_N) * stride_wsn
        up_s = ws_base + ((up_rows + pid_n * BLOCK_N) // SCALE_N) * stride_wsn
    else:
        gate_s = ws_base + offs_n * stride_wsn
        up_s = ws_base + (up_rows + offs_n) * stride_wsn
    gate, up = _row_gemv_w8(
        x_row, w_rows, gate_s, w_rows + up_rows * stride_wn, up_s, K, n_ok,
        True, FP8, GROUP_K, BLOCK_N, BLOCK_K, LATE_SUM,
    )  # fmt: skip
    gate = gate.to(act_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(act_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _pair_down_sum_kernel(
    act_ptr, w_ptr, ws_ptr, out_ptr, ids_ptr, tw_ptr, N, K, num_tokens,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE_SUM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # out[t, n] = sum_k tw[t, k] * round(act[t*TOP_K + k] @ w2[e_k, n]^T), float32 sum. Token fastest.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    t = pid % num_tokens
    pid_n = pid // num_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = t * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        ws_base = ws_ptr + expert * stride_wse
        if FP8:
            ws_rows = ws_base + (pid_n * BLOCK_N // SCALE_N) * stride_wsn
        else:
            ws_rows = ws_base + offs_n * stride_wsn
        w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        y, _ = _row_gemv_w8(
            act_ptr + pair.to(tl.int64) * stride_am, w_rows, ws_rows, w_rows, ws_rows, K, n_ok,
            False, FP8, GROUP_K, BLOCK_N, BLOCK_K, LATE_SUM,
        )  # fmt: skip
        acc += y.to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(tw_ptr + pair)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class W8PairConfig:
    """Tiles of the pair path: gate-up (N over I, K over D) and down+sum (N over D, K over I). The
    defaults were the fastest of six swept on an H100 (Qwen3-30B-A3B, int8, one token: 37.7 us)."""

    up_n: int = 8
    up_k: int = 512
    down_n: int = 4
    down_k: int = 512
    late_sum: bool = False
    up_warps: int = 4
    up_stages: int = 2
    down_warps: int = 4
    down_stages: int = 2


def default_w8_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """Tiles by expected rows per expert; K tiles of 128 (the fp8 scale group). H100, Qwen3-30B-A3B
    experts: at T = 8 the 16-row tiles were within 1% of the best swept; at T = 512 64 x 64 gate-up
    tiles beat 128 x 128 by 1.6x (291 vs 482 us, fp8)."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        return MoEConfig(16, 64, 128, 64, 128, 1, 4, 4)
    if rows <= 128:
        return MoEConfig(64, 64, 128, 128, 128, 8, 4, 4)
    return MoEConfig(128, 128, 128, 128, 128, 8, 8, 3)


def _quant_act(x: torch.Tensor, qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_act_fp8(x, qw.group_size) if qw.fmt == "fp8_block" else quant_act_int8(x)


def _scales(qw: QuantizedWeight) -> torch.Tensor:
    # fp8 [E, NB, KB]; int8 [E, N] viewed as [E, N, 1] so both index (e, row, group)
    return qw.scales if qw.fmt == "fp8_block" else qw.scales.reshape(qw.scales.shape[0], -1, 1)


def w8_moe_gemm(
    a: torch.Tensor,  # 8-bit [rows, K], rows = T (a_div = top_k) or T*top_k (a_div = 1)
    a_scale: torch.Tensor,  # fp8 [rows, ceil(K/128)]; int8 [rows]
    qw: QuantizedWeight,  # [E, N or 2N, K]
    out: torch.Tensor,  # [T*top_k, N] hidden.dtype (gate-up) or float32 (down)
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post: torch.Tensor,
    a_div: int,
    cfg: MoEConfig,
    fuse_silu: bool,
    round_dtype: torch.dtype,
    weights: torch.Tensor | None = None,  # [T*top_k] float32
) -> torch.Tensor:
    n, k = out.shape[1], a.shape[1]
    b, bs = qw.qweight, _scales(qw)
    fp8 = qw.fmt == "fp8_block"
    block_n, block_k = (cfg.up_n, cfg.up_k) if fuse_silu else (cfg.down_n, cfg.down_k)
    block_k = qw.group_size if fp8 else block_k
    max_padded = sorted_ids.numel()
    grid = ((max_padded // cfg.block_m) * cdiv(n, block_n),)
    _w8_moe_gemm_kernel[grid](
        a, a_scale, b, bs, out, weights if weights is not None else a_scale, sorted_ids, expert_ids, num_post,
        n, k, out.shape[0], max_padded, n * b.stride(1), n,
        a.stride(0), a_scale.stride(0), b.stride(0), b.stride(1), bs.stride(0), bs.stride(1), out.stride(0),
        A_DIV=a_div, FUSE_SILU=fuse_silu, MUL_WEIGHT=weights is not None, FP8=fp8, SCALE_N=qw.block_n,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        K_TILES=cdiv(k, block_k), ROUND_TY=_TL_DTYPES[round_dtype],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(a.device),
    )  # fmt: skip
    return out


def _pair_tiles(qw: QuantizedWeight, block_n: int, block_k: int, k: int, *row_offsets: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K); fp8 needs BLOCK_N to divide the scale block and the row offsets."""
    bn = pow2_dividing(block_n, qw.block_n, *row_offsets) if qw.fmt == "fp8_block" else block_n
    return bn, min(block_k, next_pow2(k))


def _pair_gate_up(hidden: torch.Tensor, w13: QuantizedWeight, ids: torch.Tensor, pc: W8PairConfig) -> torch.Tensor:
    """The pair path's first kernel (fp8: behind x's quantization): act [T*K, I] in hidden's dtype."""
    d = hidden.shape[1]
    num_pairs, top_k = ids.numel(), ids.shape[1]
    inter = w13.qweight.shape[1] // 2
    fp8 = w13.fmt == "fp8_block"
    x = quant_act_fp8(hidden, w13.group_size, fake=True)[0] if fp8 else hidden  # fp8: float32 [T, D]
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)  # [T*K, I]
    bn, bk = _pair_tiles(w13, pc.up_n, pc.up_k, d, inter)
    s13 = _scales(w13)
    _pair_gate_up_kernel[(num_pairs * cdiv(inter, bn),)](
        x, w13.qweight, s13, act, ids, inter, d, num_pairs, inter,
        x.stride(0), w13.qweight.stride(0), w13.qweight.stride(1), s13.stride(0), s13.stride(1), act.stride(0),
        TOP_K=top_k, FP8=fp8, SCALE_N=w13.block_n, GROUP_K=w13.group_size, BLOCK_N=bn, BLOCK_K=bk,
        LATE_SUM=pc.late_sum, num_warps=pc.up_warps, num_stages=pc.up_stages,
        **pdl_launch(x.device),
    )  # fmt: skip
    return act


def _pair_path(
    hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor, ids: torch.Tensor,
    pc: W8PairConfig,
) -> torch.Tensor:  # fmt: skip
    t, d = hidden.shape
    top_k = ids.shape[1]
    inter = w13.qweight.shape[1] // 2
    fp8 = w13.fmt == "fp8_block"
    act = _pair_gate_up(hidden, w13, ids, pc)
    a = quant_act_fp8(act, w2.group_size, fake=True)[0] if fp8 else act  # fp8: float32 [T*K, I]
    out = torch.empty(t, d, dtype=hidden.dtype, device=hidden.device)  # [T, D]
    bn, bk = _pair_tiles(w2, pc.down_n, pc.down_k, inter)
    s2 = _scales(w2)
    _pair_down_sum_kernel[(t * cdiv(d, bn),)](
        a, w2.qweight, s2, out, ids, weights, d, inter, t,
        a.stride(0), w2.qweight.stride(0), w2.qweight.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        TOP_K=top_k, FP8=fp8, SCALE_N=w2.block_n, GROUP_K=w2.group_size, BLOCK_N=bn, BLOCK_K=bk,
        LATE_SUM=pc.late_sum, num_warps=pc.down_warps, num_stages=pc.down_stages,
        **pdl_launch(a.device),
    )  # fmt: skip
    return out


def fused_moe_w8(
    hidden: torch.Tensor,  # [T, D] bf16 / fp16
    w13: QuantizedWeight,  # [E, 2I, D]: rows [gate | up]
    w2: QuantizedWeight,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
    config: MoEConfig | W8PairConfig | None = None,
) -> torch.Tensor:  # [T, D] hidden.dtype
    """One token (config None): int8 in kernels/triton_moe_w8_token.py where it `takes` the call; fp8 the pair path's
    gate-up kernel, then that module's down kernel (`takes_down`). Else the pair path for a W8PairConfig (or
    T*K <= PAIR_MAX_PAIRS), else the aligned path."""
    if w13.fmt not in W8_FORMATS or w2.fmt != w13.fmt:
        raise ValueError(f"fused_moe_w8 needs fp8_block or int8 experts, got {w13.fmt!r} / {w2.fmt!r}")
    t, d = hidden.shape
    e, two_i, _ = w13.qweight.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, d)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    ids = topk_ids.contiguous()
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if config is None and token_takes(hidden, w13, w2):
        return moe_w8_token(hidden, w13, w2, weights, ids)
    if config is None and token_takes_down(hidden, w13, w2):  # one fp8 token: pair gate-up, then the token down
        return token_down(_pair_gate_up(hidden, w13, ids, W8PairConfig()), w2, weights, ids, fp8_down_config())
    if isinstance(config, W8PairConfig) or (config is None and t * top_k <= PAIR_MAX_PAIRS):
        return _pair_path(hidden, w13, w2, weights, ids, config if isinstance(config, W8PairConfig) else W8PairConfig())
    cfg = config if isinstance(config, MoEConfig) else default_w8_config(t, e, top_k)
    sorted_ids, expert_ids, num_post = moe_align(ids, e, cfg.block_m)
    xq, xs = _quant_act(hidden, w13)
    act = torch.empty(t * top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [T*K, I]
    w8_moe_gemm(xq, xs, w13, act, sorted_ids, expert_ids, num_post, top_k, cfg, True, hidden.dtype)
    aq, a_s = _quant_act(act, w2)
    # float32, so the top-k sum rounds once, as the reference's
    y = torch.empty(t * top_k, d, dtype=torch.float32, device=hidden.device)  # [T*K, D]
    w8_moe_gemm(aq, a_s, w2, y, sorted_ids, expert_ids, num_post, 1, cfg, False, hidden.dtype, weights)
    return moe_sum(y.view(t, top_k, d), torch.empty_like(hidden))
