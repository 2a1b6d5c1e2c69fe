"""Fused MoE over 4-bit experts (int4 / mxfp4 / nvfp4 layouts of kernels/quant_formats.py), in Triton.

Same two paths as kernels/triton_fused_moe.py (pairs = the T*K (token, slot) entries, pair = t*K + k),
weights dequantized in registers only; CUDA-graph safe (sizes depend only on T, K, E; no host sync).

Pair path (T*K <= W4_PAIR_MAX_PAIRS): `_pair_gate_up_w4_kernel`, one program per (I-block, pair),
writes act[pair] = silu(gate) * up rounded to hidden.dtype (held in float32 "planes", plane j = the
elements 8w + j, so the down kernel reads each plane with 16-byte loads and converts nothing);
`_pair_down_sum_w4_kernel`, one program per (D-block, token), sums w[t, k] * (act[t*K + k] @ w2[e_k]^T)
over its K slots in float32 straight into [T, D]. GEMVs on CUDA cores over [BLOCK_N, BLOCK_K / 8]
tiles of 32-bit words (16-byte loads along K): the 8 nibbles of a word are unrolled (a constant shift
each) against x[8w + j] (hidden read as int32 pairs of 16-bit values); nibble products are summed per
group, then scaled once per (row, group).

Aligned path: `moe_align` of the bf16 module, then grouped GEMMs whose B tiles [BLOCK_K, BLOCK_N] are
dequantized to hidden.dtype in registers (the 8 nibbles joined in-thread, then reshaped) before
tl.dot (gate-up with fused SiLU*up; down with the routing weight), and the bf16 module's `moe_sum`.

Decoding and the GEMV tiles: kernels/w4_tiles.py.

A few tokens go to kernels/triton_moe_w4_gemv.py first, wherever its `takes` says (int4 up to INT4_MAX_TOKENS
with D <= 4096; FP4 up to FP4_MAX_TOKENS, FP4_WIDE_MAX_TOKENS past D = 4096; the measurements are beside those
names): the dense GEMV's register layout, no shared-memory round trip for x, the down kernel summing every slot
of a token in one program.

Other int4 experts at decode sizes go to kernels/gluon_moe_w4_mma.py (the pair path's contract on
mma.sync) wherever its `takes` says: from 2 tokens up to 384 pairs (48 tokens at top-8), and on D > 4096 from
one token to 512 pairs (the measurements are beside its bounds).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels import gluon_moe_w4_mma as mma_path
from ftransformers.kernels import triton_moe_w4_gemv as token_path
from ftransformers.kernels.launch import cached_launch, cdiv, maxnreg_option, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import FOUR_BIT_FORMATS, QuantizedWeight
from ftransformers.kernels.tickets import publish_and_sum, split_scratch
from ftransformers.kernels.tiling import aligned_rows, aligned_tile
from ftransformers.kernels.triton_fused_moe import MoEConfig, default_config, moe_align, moe_sum
from ftransformers.kernels.triton_fused_moe_codes import codes_block_k, moe_gemm_codes, to_16bit
from ftransformers.kernels.triton_w4a16_codes import decoded_block_k
from ftransformers.kernels.w4_tiles import (
    FMT_ID,
    P63,
    gemv_tile,
    group_scale,
    group_sums,
    masked_load,
    nibble,
    weight_args,
    x_planes,
    x_words,
)

# Up to this many (token, slot) pairs fused_moe_w4 takes the pair path: on the H100 it beat the aligned
# path at every T <= 16 with top-8 for both Qwen3-30B-A3B and DeepSeek-V3 shapes and every format
# (benchmarks/results/moe_w4_h100.json, "pair" vs "aligned" columns).
W4_PAIR_MAX_PAIRS = 128
# The aligned path runs int4 experts on the codes kernel for row blocks of up to this many rows (with the codes tiles
# of default_w4_config): decode-shaped 16, and since session 75 the 64-row blocks of 17-128 pairs an expert
# (Qwen3-30B-A3B int4 at 1024 tokens 737.5 -> 605.1 us on the H200, benchmarks/results/w4a16_prefill2_s75_h200.*).
# Where DECODED_FROM_BLOCK_M also takes a block (64 rows since session 76) the decoded form runs, else raw codes; on
# raw codes 128-row blocks were slower than the dequantizing kernel (at 8192 tokens 3712.6 us against 2784.3).
CODES_MAX_BLOCK_M = 64
# Row blocks from which int4 experts run the codes kernel's decoded form instead (each tile decoded with its scale
# and zero into the wgmma's A operand, as the dense products past 16 rows do; kernels/triton_fused_moe_codes.py),
# 128-row blocks on 128-column tiles. H200, int4 experts at 1024 and 8192 tokens, without -> with it (the dequantizing
# kernel on 128-row blocks before; benchmarks/results/moe_decoded{2,_ds}_s76_h200.*): Qwen3-30B-A3B 586.2 -> 433.5
# and 2797.2 -> 2245.7 us, DeepSeek-V3 6603.4 -> 4924.8 and 25317.0 -> 18732.4 (20159.5 on a 256-column down).
DECODED_FROM_BLOCK_M = 64
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class W4PairConfig:
    """Pair-path tiles: gate-up (N over I, K over D) and down+sum (N over D, K over I). BLOCK_K is
    capped at the contracted size (rounded up to a power of two) and raised to at least one group."""

    up_n: int = 8
    up_k: int = 512
    down_n: int = 8
    down_k: int = 256
    up_warps: int = 4
    down_warps: int = 2
    stages: int = 3
    down_split: int = 1  # programs per (token, D block), each over TOP_K / down_split slots (a divisor)
    up_maxnreg: int = 0  # register cap per thread for each kernel (ptxas maxnreg); 0 = the compiler's choice
    down_maxnreg: int = 0


def default_w4_pair_config(num_tokens: int, hidden_size: int, fmt: str = "int4") -> W4PairConfig:
    """From the H100 sweeps (moe_w4_h100.json, moe_w4_split_h100.json): gate-up prefers 1024-wide K
    tiles; the FP4 down kernel (and int4's at DeepSeek width) 512-wide ones. At one or two tokens the
    down kernel is split over slot groups (8 at T=1, 4 at T=2), with 16-row tiles at D <= 4096: Qwen3-30B's
    int4 MoE at T=1 went from 26.5-28.9 to 18.2 us."""
    down_k = 512 if fmt != "int4" or hidden_size > 4096 else 256
    if num_tokens > 2:
        return W4PairConfig(up_k=1024, down_k=down_k)
    split = 8 if num_tokens == 1 else 4
    if hidden_size > 4096:
        return W4PairConfig(up_k=1024, down_k=down_k, down_split=split)
    return W4PairConfig(up_k=1024, down_n=16, down_k=down_k, down_warps=2 if down_k == 256 else 4, down_split=split)


def default_w4_config(num_tokens: int, num_experts: int, top_k: int, group_size: int, codes: bool = False) -> MoEConfig:
    """The bf16 tiles, with K tiles at least one quantization group long. `codes` (int4 experts on the codes
    kernel): blocks of <= CODES_MAX_BLOCK_M rows get 64-column gate-up and 128-column down tiles, whose weight tiles
    feed the wgmma's 64-row A operand (H100, Qwen3-30B-A3B int4 at 32 tokens, benchmarks/results/moe_w4_codes_h100.json:
    357 -> 177 us against the 32 / 64 bf16 tiles); larger blocks (the decoded form, DECODED_FROM_BLOCK_M) 128-column
    tiles for both."""
    cfg = default_config(num_tokens, num_experts, top_k)
    up_k, down_k = max(cfg.up_k, group_size), max(cfg.down_k, group_size)
    up_n, down_n, stages = cfg.up_n, cfg.down_n, cfg.num_stages
    if codes and cfg.block_m <= CODES_MAX_BLOCK_M:
        up_n, down_n, stages = 64, 128, 3
    elif codes and cfg.block_m >= DECODED_FROM_BLOCK_M:
        up_n, down_n, stages = 128, 128, 3
    return MoEConfig(cfg.block_m, up_n, up_k, down_n, down_k, cfg.group_m, cfg.num_warps, stages)


@cached_launch
@triton.jit
def _pair_gate_up_w4_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, magic, act_ptr, ids_ptr, N, K, num_pairs,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_ge,
    FMT: tl.constexpr, HAS_ZERO: tl.constexpr, X_F16: tl.constexpr, ACT_BF16: tl.constexpr, EVEN: tl.constexpr,
    GROUP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # act[pair, n] = silu(x[t] @ w13[e, n]) * (x[t] @ w13[e, N + n]), t = pair // TOP_K, e = ids[pair],
    # rounded to hidden's dtype. x_ptr: the int32 view of hidden (stride_xm in int32s). act_ptr: float32
    # [num_pairs, 8, N/8], element (j, w) = act[8w + j] (E2M1: times 2^63), the down kernel's planes.
    pdl_enter(USE_PDL)
    BKW: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP
    WPG: tl.constexpr = GROUP // 8
    pid = tl.program_id(0)
    pair = pid % num_pairs
    pid_n = pid // num_pairs
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    magic = magic.to(tl.uint32, bitcast=True)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = tl.arange(0, BKW)
    g = tl.arange(0, NG)
    q_ptrs = q_ptr + expert * stride_qe + offs_n[:, None].to(tl.int64) * stride_qn + w[None, :]  # [BN, BKW]
    s_off = expert * stride_se + offs_n[:, None].to(tl.int64) * stride_sn + g[None, :]  # [BN, NG]
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm + w * 4  # [BKW]
    gs_g = 0.0
    gs_u = 0.0
    if FMT == 2:
        gs_g = masked_load(gs_ptr + expert * stride_ge + offs_n, n_ok, EVEN)[:, None]
        gs_u = masked_load(gs_ptr + expert * stride_ge + N + offs_n, n_ok, EVEN)[:, None]
    up_q = N * stride_qn
    up_s = N * stride_sn
    acc_g = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
    for kt in range(K_TILES):
        w_ok = kt * BKW + w < K // 8
        g_ok = kt * NG + g < K // GROUP
        xs, sx = x_words(x_ptrs + kt * (BLOCK_K // 2), w_ok, FMT, X_F16, EVEN)
        sxg = group_sums(sx, FMT, BLOCK_N, NG, WPG)
        q_mask = n_ok[:, None] & w_ok[None, :]
        s_mask = n_ok[:, None] & g_ok[None, :]
        qp = q_ptrs + kt * BKW
        so = s_off + kt * NG
        acc_g += gemv_tile(qp, q_mask, s_ptr + so, z_ptr + so, s_mask, gs_g, xs, sxg, magic,
                            FMT, HAS_ZERO, EVEN, BLOCK_N, NG, WPG)  # fmt: skip
        acc_u += gemv_tile(qp + up_q, q_mask, s_ptr + so + up_s, z_ptr + so + up_s, s_mask, gs_u, xs, sxg, magic,
                            FMT, HAS_ZERO, EVEN, BLOCK_N, NG, WPG)  # fmt: skip
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    act = to_16bit(act, tl.bfloat16 if ACT_BF16 else tl.float16).to(tl.float32)
    if FMT != 0:
        act = act * P63
    plane = N // 8
    tl.store(act_ptr + pair.to(tl.int64) * N + (offs_n % 8) * plane + offs_n // 8, act, mask=n_ok)


@cached_launch
@triton.jit
def _pair_down_sum_w4_kernel(
    act_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, magic, out_ptr, ids_ptr, tw_ptr, part_ptr, ticket_ptr, N, K,
    num_tokens, plane, stride_qe, stride_qn, stride_se, stride_sn, stride_ge, stride_om,
    FMT: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # out[t, n] = sum_k tw[t, k] * (act[t*TOP_K + k] @ w2[e_k, n]), float32 across the slots; act_ptr:
    # the gate-up kernel's float32 planes [T*TOP_K, 8, K/8]; plane = K / 8 (an argument, so that its
    # divisibility is known and the plane loads are 16 bytes wide).
    # SPLIT > 1 (few tokens: more programs in flight): program (t, s, n-block) sums slots
    # [s*TOP_K/SPLIT, (s+1)*TOP_K/SPLIT) into part[s, t, n-block] (float32); the last of the SPLIT
    # programs of (t, n-block) to take a ticket adds the SPLIT partials in order and writes out.
    pdl_enter(USE_PDL)
    BKW: tl.constexpr = BLOCK_K // 8
    NG: tl.constexpr = BLOCK_K // GROUP
    WPG: tl.constexpr = GROUP // 8
    SLOTS: tl.constexpr = TOP_K // SPLIT
    pid = tl.program_id(0)
    t = pid % num_tokens
    pid_s = (pid // num_tokens) % SPLIT
    pid_n = pid // (num_tokens * SPLIT)
    magic = magic.to(tl.uint32, bitcast=True)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = tl.arange(0, BKW)
    g = tl.arange(0, NG)
    q_rows = offs_n[:, None].to(tl.int64) * stride_qn + w[None, :]  # [BN, BKW]
    s_rows = offs_n[:, None].to(tl.int64) * stride_sn + g[None, :]  # [BN, NG]
    a_ptrs = act_ptr + (t * TOP_K).to(tl.int64) * K + w  # [BKW]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        slot = pid_s * SLOTS + j
        expert = tl.load(ids_ptr + t * TOP_K + slot).to(tl.int64)
        gs = 0.0
        if FMT == 2:
            gs = masked_load(gs_ptr + expert * stride_ge + offs_n, n_ok, EVEN)[:, None]
        part = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
        for kt in range(K_TILES):
            w_ok = kt * BKW + w < K // 8
            g_ok = kt * NG + g < K // GROUP
            xs, sx = x_planes(a_ptrs + slot * K + kt * BKW, plane, w_ok, EVEN)
            sxg = group_sums(sx, FMT, BLOCK_N, NG, WPG)
            so = expert * stride_se + s_rows + kt * NG
            part += gemv_tile(q_ptr + expert * stride_qe + q_rows + kt * BKW, n_ok[:, None] & w_ok[None, :],
                               s_ptr + so, z_ptr + so, n_ok[:, None] & g_ok[None, :], gs, xs, sxg, magic,
                               FMT, HAS_ZERO, EVEN, BLOCK_N, NG, WPG)  # fmt: skip
        acc += tl.load(tw_ptr + t * TOP_K + slot) * tl.sum(part, axis=1)
    if SPLIT > 1:
        part_row = part_ptr + t.to(tl.int64) * N + offs_n  # part [SPLIT, T, N]
        counter = ticket_ptr + t * tl.cdiv(N, BLOCK_N) + pid_n
        last, total = publish_and_sum(acc, part_row, pid_s, num_tokens * N, n_ok, counter, SPLIT)
        if last:
            tl.store(
                out_ptr + t.to(tl.int64) * stride_om + offs_n, to_16bit(total, out_ptr.dtype.element_ty), mask=n_ok
            )
    else:
        out = to_16bit(acc, out_ptr.dtype.element_ty)
        tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, out, mask=n_ok)


@triton.jit
def _dequant(q, J: tl.constexpr, magic, scale, zz, FMT: tl.constexpr):
    # Nibble J of q as its float32 weight (scale, zz from group_scale; E2M1 in two exact 2^63 steps).
    if FMT == 0:
        return (nibble(q, J, magic, FMT) - zz) * scale
    return (nibble(q, J, magic, FMT) * P63) * scale


@triton.jit
def _dequant_tile(q_ptrs, q_mask, s_ptrs, z_ptrs, s_mask, gs, magic, FMT: tl.constexpr, HAS_ZERO: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    # q_ptrs / s_ptrs [BKW, BN] (scales gathered per word) -> B tile [BLOCK_K, BLOCK_N] in DTYPE,
    # k = 8 * w + j. The 8 nibbles are joined in-thread, highest index bit first, so that the
    # reshape of [BKW, 2, 2, 2] puts nibble j at 8 * w + j.
    q = tl.load(q_ptrs, mask=q_mask, other=0).to(tl.uint32, bitcast=True)
    scale, zz = group_scale(s_ptrs, z_ptrs, gs, s_mask, FMT, HAS_ZERO, False)
    e0 = tl.join(_dequant(q, 0, magic, scale, zz, FMT), _dequant(q, 4, magic, scale, zz, FMT))
    e1 = tl.join(_dequant(q, 2, magic, scale, zz, FMT), _dequant(q, 6, magic, scale, zz, FMT))
    o0 = tl.join(_dequant(q, 1, magic, scale, zz, FMT), _dequant(q, 5, magic, scale, zz, FMT))
    o1 = tl.join(_dequant(q, 3, magic, scale, zz, FMT), _dequant(q, 7, magic, scale, zz, FMT))
    b = tl.join(tl.join(e0, e1), tl.join(o0, o1))  # [BKW, BN, 2, 2, 2]: bits 2, 1, 0 of j
    b = tl.reshape(tl.permute(b, (0, 2, 3, 4, 1)), [BLOCK_K, BLOCK_N])
    return to_16bit(b, DTYPE)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 products of the same rounded operands (the CPU interpreter's bf16 dot is wrong)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@cached_launch
@triton.jit
def _moe_gemm_w4_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, magic, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs, max_padded, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_ge, stride_cm,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    FMT: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # C[pair, n] = A[pair // A_DIV] @ W[e, n]^T over one expert-aligned block of sorted rows;
    # FUSE_SILU: rows n (gate) and N + n (up) -> silu(gate) * up; MUL_WEIGHT: times the routing weight.
    pdl_enter(USE_PDL)
    BKW: tl.constexpr = BLOCK_K // 8
    WPG: tl.constexpr = GROUP // 8
    pid_m, pid_n = aligned_tile(max_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):  # past the used row blocks
        return
    pair, row_ok, expert = aligned_rows(sorted_ptr, expert_ids_ptr, pid_m, num_pairs, BLOCK_M)  # [BM]
    magic = magic.to(tl.uint32, bitcast=True)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.arange(0, BKW)
    a_ptrs = a_ptr + (pair // A_DIV)[:, None] * stride_am + offs_k[None, :]
    q_ptrs = q_ptr + expert * stride_qe + offs_n[None, :].to(tl.int64) * stride_qn + w[:, None]  # [BKW, BN]
    s_rows = expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn  # [1, BN]
    gs_g = 0.0
    gs_u = 0.0
    if FMT == 2:
        gs_g = tl.load(gs_ptr + expert * stride_ge + offs_n, mask=n_ok, other=0.0)[None, :]
        if FUSE_SILU:
            gs_u = tl.load(gs_ptr + expert * stride_ge + N + offs_n, mask=n_ok, other=0.0)[None, :]
    dt = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(K_TILES):
        w_ok = kt * BKW + w < K // 8
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < K - kt * BLOCK_K), other=0.0)
        q_mask = w_ok[:, None] & n_ok[None, :]
        qp = q_ptrs + kt * BKW
        so = s_rows + ((kt * BKW + w) // WPG)[:, None]  # [BKW, BN]: each word's group
        b = _dequant_tile(qp, q_mask, s_ptr + so, z_ptr + so, q_mask, gs_g, magic, FMT, HAS_ZERO,
                          BLOCK_K, BLOCK_N, dt)  # fmt: skip
        acc = _dot(a, b, acc, IEEE)
        if FUSE_SILU:
            so = so + N * stride_sn
            b = _dequant_tile(qp + N * stride_qn, q_mask, s_ptr + so, z_ptr + so, q_mask, gs_u, magic, FMT, HAS_ZERO,
                              BLOCK_K, BLOCK_N, dt)  # fmt: skip
            acc_up = _dot(a, b, acc_up, IEEE)
        a_ptrs += BLOCK_K
    if FUSE_SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    c = to_16bit(acc, c_ptr.dtype.element_ty)
    tl.store(c_ptrs, c, mask=row_ok[:, None] & n_ok[None, :])


def _check(qw: QuantizedWeight, name: str, n: int, k: int) -> None:
    if qw.fmt not in FOUR_BIT_FORMATS:
        raise ValueError(f"fused_moe_w4: {name} has format {qw.fmt!r}; valid: {', '.join(FOUR_BIT_FORMATS)}")
    e, g = qw.qweight.shape[0], qw.group_size
    if qw.qweight.dim() != 3 or tuple(qw.qweight.shape[1:]) != (n, k // 8) or qw.perm is not None:
        raise ValueError(f"fused_moe_w4: {name} qweight {tuple(qw.qweight.shape)} is not [E, {n}, {k // 8}]")
    if g % 8 or g & (g - 1) or k % g or tuple(qw.scales.shape) != (e, n, k // g):
        raise ValueError(f"fused_moe_w4: {name} scales {tuple(qw.scales.shape)} do not fit group {g}, K {k}")
    gs = qw.global_scale
    if qw.fmt == "nvfp4" and (gs is None or gs.dtype != torch.float32 or tuple(gs.shape) != (e, n)):
        raise ValueError(f"fused_moe_w4: {name} nvfp4 needs float32 global_scale [E, {n}]")
    if qw.zeros is not None and (qw.zeros.shape != qw.scales.shape or qw.zeros.stride() != qw.scales.stride()):
        raise ValueError(f"fused_moe_w4: {name} zeros must have the shape and strides of the scales")
    if any(t is not None and t.stride(-1) != 1 for t in (qw.qweight, qw.scales, qw.zeros, gs)):
        raise ValueError(f"fused_moe_w4: {name} tensors need unit stride along the last dim")


def _block_k(want: int, k: int, group: int) -> int:
    return max(group, min(want, next_pow2(k)))


def _pair_path(hidden, w13, w2, weights, ids, cfg: W4PairConfig) -> torch.Tensor:
    return pair_down(pair_gate_up(hidden, w13, ids, cfg), hidden, w2, weights, ids, cfg)


def pair_gate_up(hidden, w13, ids, cfg: W4PairConfig) -> torch.Tensor:
    """The pair path's first kernel: float32 planes [T*K, I] of silu(gate) * up (see the module doc)."""
    d = hidden.shape[1]
    num_pairs, top_k, inter = ids.numel(), ids.shape[1], w13.out_features // 2
    act = torch.empty(num_pairs, inter, dtype=torch.float32, device=hidden.device)  # planes [T*K, 8, I/8]
    x = (hidden if hidden.stride(0) % 2 == 0 else hidden.contiguous()).view(torch.int32)  # [T, D/2] pairs
    bk = _block_k(cfg.up_k, d, w13.group_size)
    _pair_gate_up_w4_kernel[(num_pairs * cdiv(inter, cfg.up_n),)](
        x, *weight_args(w13)[:5], act, ids, inter, d, num_pairs, x.stride(0), *weight_args(w13)[5:],
        FMT=FMT_ID[w13.fmt], HAS_ZERO=w13.zeros is not None, X_F16=hidden.dtype == torch.float16,
        ACT_BF16=hidden.dtype == torch.bfloat16, EVEN=d % bk == 0 and inter % cfg.up_n == 0,
        GROUP=w13.group_size, TOP_K=top_k, BLOCK_N=cfg.up_n, BLOCK_K=bk, K_TILES=cdiv(d, bk),
        num_warps=cfg.up_warps, num_stages=cfg.stages, **maxnreg_option(cfg.up_maxnreg),
        **pdl_launch(x.device),
    )  # fmt: skip
    return act


def pair_down(act, hidden, w2, weights, ids, cfg: W4PairConfig) -> torch.Tensor:
    """The pair path's second kernel: [T, D] in hidden's dtype from pair_gate_up's planes."""
    t, d = hidden.shape
    top_k, inter = ids.shape[1], w2.in_features
    out = torch.empty(t, d, dtype=hidden.dtype, device=hidden.device)  # [T, D]
    bk = _block_k(cfg.down_k, inter, w2.group_size)
    n_blocks = cdiv(d, cfg.down_n)
    split = cfg.down_split if top_k % cfg.down_split == 0 else 1
    split, tickets, part = split_scratch(hidden.device, "moe_w4_down", t * n_blocks, split, t, d)
    _pair_down_sum_w4_kernel[(t * split * n_blocks,)](
        act, *weight_args(w2)[:5], out, ids, weights, act if part is None else part,
        ids if tickets is None else tickets, d, inter, t,
        inter // 8, *weight_args(w2)[5:], out.stride(0), FMT=FMT_ID[w2.fmt], HAS_ZERO=w2.zeros is not None,
        EVEN=inter % bk == 0 and d % cfg.down_n == 0, GROUP=w2.group_size, TOP_K=top_k, SPLIT=split,
        BLOCK_N=cfg.down_n, BLOCK_K=bk, K_TILES=cdiv(inter, bk), num_warps=cfg.down_warps,
        num_stages=cfg.stages, **maxnreg_option(cfg.down_maxnreg),
        **pdl_launch(act.device),
    )  # fmt: skip
    return out


def _codes_ok(qw: QuantizedWeight, cfg: MoEConfig) -> bool:
    return qw.fmt == "int4" and codes_block_k(qw.group_size) > 0 and cfg.block_m <= CODES_MAX_BLOCK_M


def _decoded_ok(qw: QuantizedWeight, cfg: MoEConfig, k: int) -> bool:
    return qw.fmt == "int4" and decoded_block_k(qw.group_size, k) > 0 and cfg.block_m >= DECODED_FROM_BLOCK_M


def _moe_gemm_w4(
    a: torch.Tensor,  # [rows, K] rows = T (a_div = top_k) or T*top_k (a_div = 1), unit stride along K
    qw: QuantizedWeight,  # [E, N or 2N, K]
    out: torch.Tensor,  # [T*top_k, N]
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # moe_align's sorted_ids, expert_ids, num_post
    a_div: int,
    block_n: int,
    block_k: int,
    cfg: MoEConfig,
    weights: torch.Tensor | None = None,  # [T*top_k] float32: the down GEMM (else gate-up, fused SiLU)
    codes: bool = True,
) -> None:
    n, k = out.shape[1], a.shape[1]
    decoded = codes and _decoded_ok(qw, cfg, k)
    if decoded or (codes and _codes_ok(qw, cfg)):  # int4 on raw codes or decoded in PTX (its module)
        moe_gemm_codes(a, qw.qweight, qw.scales, qw.zeros, qw.group_size, out, align, a_div, cfg.block_m, block_n,
                       cfg.group_m, cfg.num_warps, cfg.num_stages, weights, ieee=_INTERPRET,
                       decoded=decoded)  # fmt: skip
        return
    bk = _block_k(block_k, k, qw.group_size)
    max_padded = align[0].numel()
    _moe_gemm_w4_kernel[((max_padded // cfg.block_m) * cdiv(n, block_n),)](
        a, *weight_args(qw)[:5], out, weights if weights is not None else out, *align,
        n, k, out.shape[0], max_padded, a.stride(0), *weight_args(qw)[5:], out.stride(0),
        A_DIV=a_div, FUSE_SILU=weights is None, MUL_WEIGHT=weights is not None, IEEE=_INTERPRET,
        FMT=FMT_ID[qw.fmt], HAS_ZERO=qw.zeros is not None, GROUP=qw.group_size, BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, K_TILES=cdiv(k, bk),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch(a.device),
    )  # fmt: skip


def aligned_config(t: int, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int, codes: bool = True) -> MoEConfig:
    """The aligned path's tiles fused_moe_w4 runs for T tokens without a config: the codes kernel's where the
    experts are int4 with a group it takes (and `codes`), else the dequantizing kernel's."""
    group = max(w13.group_size, w2.group_size)
    use_codes = codes and w13.fmt == "int4" and codes_block_k(group) > 0
    return default_w4_config(t, w13.qweight.shape[0], top_k, group, use_codes)


def fused_moe_w4(
    hidden: torch.Tensor,  # [T, D] bf16 / fp16
    w13: QuantizedWeight,  # [E, 2I, D], rows [gate | up]
    w2: QuantizedWeight,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    config: MoEConfig | W4PairConfig | mma_path.MmaMoEConfig | token_path.TokenGemvConfig | None = None,
    codes: bool = True,
) -> torch.Tensor:  # [T, D] hidden.dtype
    """quant_moe_ref's function: a few int4 or FP4 tokens on the GEMV-form kernels of
    kernels/triton_moe_w4_gemv.py where `token_path.takes` them (or for a TokenGemvConfig); else the int4 mma
    kernels (kernels/gluon_moe_w4_mma.py) where `mma_path.takes` the call (or for an MmaMoEConfig); else for
    T*K <= W4_PAIR_MAX_PAIRS the pair path (or for a W4PairConfig);
    else
    the aligned path, whose int4 GEMMs run on the codes kernel (kernels/triton_fused_moe_codes.py) where the group
    holds whole K tiles: decoded in blocks of DECODED_FROM_BLOCK_M rows and more, else on raw codes in blocks of
    <= CODES_MAX_BLOCK_M rows; unless `codes` is False (the dequantizing kernel and its tiles, for comparison)."""
    t, d = hidden.shape
    inter, top_k = w2.in_features, topk_ids.shape[1]
    _check(w13, "w13", 2 * inter, d)
    _check(w2, "w2", d, inter)
    if hidden.dtype not in (torch.bfloat16, torch.float16) or hidden.stride(1) != 1:
        raise ValueError(f"fused_moe_w4: hidden must be bf16 / fp16 with unit stride along D, got {hidden.dtype}")
    if t == 0:
        return hidden.new_empty(0, d)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    if isinstance(config, mma_path.MmaMoEConfig):
        return mma_path.moe_w4_mma(hidden, w13, w2, weights, topk_ids, config)
    if isinstance(config, token_path.TokenGemvConfig) or (config is None and token_path.takes(hidden, w13, w2, top_k)):
        return token_path.moe_w4_token(hidden, w13, w2, weights, topk_ids, config)
    if config is None and mma_path.takes(hidden, w13, w2, top_k):
        return mma_path.moe_w4_mma(hidden, w13, w2, weights, topk_ids)
    if isinstance(config, W4PairConfig) or (config is None and t * top_k <= W4_PAIR_MAX_PAIRS):
        cfg = config if isinstance(config, W4PairConfig) else default_w4_pair_config(t, d, w13.fmt)
        return _pair_path(hidden, w13, w2, weights, topk_ids.contiguous(), cfg)
    e = w13.qweight.shape[0]
    c = config or aligned_config(t, w13, w2, top_k, codes)
    align = moe_align(topk_ids, e, c.block_m)
    act = torch.empty(t * top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [T*K, I]
    _moe_gemm_w4(hidden, w13, act, align, top_k, c.up_n, c.up_k, c, codes=codes)
    y = torch.empty(t * top_k, d, dtype=hidden.dtype, device=hidden.device)  # [T*K, D]
    _moe_gemm_w4(act, w2, y, align, 1, c.down_n, c.down_k, c, weights, codes=codes)
    return moe_sum(y.view(t, top_k, d), torch.empty_like(hidden))
