"""4-bit weight x 16-bit activation GEMM: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the "int4", "mxfp4"
and "nvfp4" layouts of kernels/quant_formats.py, dequantizing W in registers (no 16-bit copy of W).

int4 with 16-bit x at decode sizes goes first to kernels/gluon_w4a16_mma.py (mma.sync, the weights
decoded straight into operand registers) where its `takes` says it measured faster (and before that, at 9-16 rows
on the weights of its `engine_config`, to the wgmma kernel kernels/gluon_w4a16_wgmma.py; at 17-128 rows on large
weights, to kernels/gluon_w4a16_rs.py, which decodes them as wgmma's register operand); elsewhere three
kernels, chosen by `w4a16_config` from M, the format and the weight size:

- `_w4a16_gemv_kernel` (decode, M <= 2, or <= 4 on small weights; two words a thread): CUDA cores. Tensors are
  [word, n, m, nibble]; each thread owns word columns of a K tile for all its n, m and the 8 nibbles,
  so qweight (4-byte words, coalesced along K), x (one 16-byte vector per word and row) and the
  scales meet in one register layout with no shared-memory round trip. Per weight element it costs
  one LOP3 and one FMA per row (int4) or three integer ops and one FMA per row (FP4). int4 weights loaded
  by the engine carry `QuantizedWeight.scale_zero` (`gemv_scale_zero`), which the GEMV reads instead of
  the scales and zeros: a thread's 4 rows of a group in one 16-byte load.
- `triton_w4a16_codes` (int4, 3 <= M <= 64): tensor cores on the raw codes, scales applied per group
  after the dot, split K with a last-one-out sum (its module docstring); at 17-64 rows its decoded form, each tile
  decoded with its scale before one dot (`decoded_config`).
- `_w4a16_gemm_kernel` (FP4 with M > 2, int4 groups the codes kernel cannot take, prefill): tensor
  cores (mma / wgmma). The weight tile is dequantized per nibble, interleaved in registers into K order
  ([BLOCK_N, BLOCK_K], 16-byte shared stores) and fed to tl.dot with float32 accumulation; x and
  qweight tiles are pipelined through shared memory.

Dequantization without int-to-float conversions (a quarter-rate instruction on H100):

- int4: a nibble masked in place (bits 4e..4e+3 of the word, or of word >> 12 for nibbles 5..7) read
  as float32 is the subnormal code * 16^e * 2^-149. The GEMV multiplies x by 2^(100 - 4e) instead
  (products code * x * 2^-49) and subtracts zero * sum(x) once per word and row; the GEMM scales the
  subnormal by 2^(126 - 4e) and forms code * scale - zero * scale in one FMA.
- FP4 (E2M1): the nibble shifted to bits 31..28, arithmetic-shifted right by 6 and masked leaves the
  sign at bit 31 and exponent / mantissa at bits 24..22: the float32 e2m1 * 2^-126 (+-0.5 lands on a
  subnormal). The GEMV multiplies x by 2^64, the GEMM the weight by 2^63 * (scale * 2^63).
- Plain fp32 mul / fma keep subnormals (Triton emits no .ftz for them); results are scaled back in
  float32. Invariants: |x| < 2^28, FP4 scales < 2^64, int4 scales < 2^100.

Scales (and zeros) are loaded per word (8 columns), so any group size G with G % 8 == 0 works; nvfp4's
E4M3 and mxfp4's E8M0 scales are decoded from their bits. `SPLIT_K > 1` writes float32 partials
[SPLIT_K, M, N] summed by torch afterwards (deterministic; no atomics). Graph-safe: no host syncs,
sizes depend on shapes only. `perm` (GPTQ act-order) gathers x's columns before the kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ftransformers.kernels import gluon_w4a16_mma as mma_path
from ftransformers.kernels import gluon_w4a16_rs as rs_path
from ftransformers.kernels import gluon_w4a16_wgmma as wgmma_path
from ftransformers.kernels import gluon_w4a16_ws as ws_path
from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import FOUR_BIT_FORMATS, SCALE_ZERO_ROWS, QuantizedWeight, scale_zero_copy
from ftransformers.kernels.tiling import grouped_tile
from ftransformers.kernels.triton_w4a16_codes import (
    CODES_MAX_M,
    codes_config,
    codes_supported,
    decoded_config,
    split_programs,
    w4a16_codes,
)

GEMV_MAX_M = 4
# The GEMV's first K tile of words loaded before the PDL wait (its PRELOAD; benchmarks/ab_decode.py
# `set=triton_w4a16.PRELOAD_FIRST_TILE=0` turns it off for an A/B)
PRELOAD_FIRST_TILE = True
# The GEMV reads a weight's scales and zeros from its QuantizedWeight.scale_zero copy where it has one
# (`set=triton_w4a16.USE_SCALE_ZERO=0` reads the row-major scales and zeros instead, for an A/B)
USE_SCALE_ZERO = True
# int4 words a GEMV thread loads at once for each row (1, or 2 as one 8-byte load where the layout allows,
# gemv_words); the default K tile keeps one load a thread and row: 1024 * GEMV_WORDS over GEMV_WARPS warps.
# GEMV_BLOCK_K (0: that default) sets the int4 K tile instead, up to K's next power of two. Two words: the
# GEMVs of a Qwen3-30B-A3B W4A16 step took 381.9 us on its critical path against 433.3 (B=1), step 2.598
# against 2.645 ms at B=2; Qwen3-8B 2.664 against 2.699 ms at B=1, 2.947 against 3.021 at B=2 (H100,
# benchmarks/results/ab_words{2,3}_*_h100.*). A 4096-wide tile on K = 4096, or 2 warps: no faster.
GEMV_WORDS = 2
# The same for FP4 (mxfp4, nvfp4): words a thread, K tile 1024 * FP4_GEMV_WORDS. Two words: Qwen3-30B-A3B B=1 graph
# replay 1.981 against 2.068 ms (mxfp4), 2.047 against 2.147 (nvfp4); B=2 3.067 / 3.166, 3.233 / 3.329 (H100,
# benchmarks/results/ab_fp4_30b_{mxfp4,nvfp4}_h100.json)
FP4_GEMV_WORDS = 2
GEMV_BLOCK_K = 0
GEMV_WARPS = 4
# Rows a GEMV program (0: 8 on large weights, N x K >= 2^25, 4 on the others; a module name for ab_decode's `set=`).
# The H100's choices held on the H200 (session 71, Qwen3-30B-A3B W4A16 step at B=1, replay ms): 1.567 against 1.615
# with 8 rows, 1.640 with 2, 1.711 on 2 warps of 1024-wide tiles (ab_gemv_tiles_30b_w4a16_s71_h200.*).
GEMV_BLOCK_N = 0
# With the words' preload, the GEMV also loads its first tile of the scale_zero copy before the PDL wait. On two
# words (qkv's whole K in that tile): Qwen3-30B-A3B W4A16 B=1 1.854 / 1.836 ms against 1.880 / 1.864 without,
# B=2 2.601 against 2.617, Qwen3-8B B=1 2.696 / 2.705 against 2.686 / 2.712 (H100, ab_szpre{,2}_*_h100.*).
# Session 23 measured it on one word (1024-wide tiles) slower, 2.142 against 2.126.
GEMV_PRELOAD_SZ = True
# Up to this many rows the dequantizing GEMM runs decode-shaped: one row tile of max(16, M) rows, K split where
# the column tiles are few (decode_split)
DECODE_MAX_M = 64
DECODE_MIN_TILES = 128  # column tiles from which a decode-shaped dequantizing product is not split (~ H100 SMs)
# Large int4 weights (N x K >= 2^25) take the codes kernel up to this many rows, the decode-shaped dequantizing tiles
# (64 x 128, `decode_split`) past them; smaller ones the codes kernel up to its CODES_MAX_M = 64. H200, session 67, at
# 64 rows (w4a16_mid_rows64_s67_h200.*, AWQ-style g128), us, codes kernel against these tiles: DeepSeek-V3 o 104.0
# against 95.9, dense gate_up 188.0 against 162.5, Qwen3-8B gate_up 69.1 against 53.5, down 52.2 against 42.6; the
# smaller weights the other way (Qwen3-8B qkv 21.5 against 22.8, Qwen3-30B-A3B qkv 13.3 against 16.4). In whole W4A16
# steps with every weight's bound at 32 (ab_codes32_*_w4a16_s67_h200.*): Qwen3-8B B=48 / 64 6.781 / 7.147 against
# 7.379 / 7.747 ms, DeepSeek-V3 (3 layers) level (6.836 / 7.649 against 6.846 / 7.675), Qwen3-30B-A3B, whose dense
# weights are all small, slower (13.291 / 13.678 against 12.907 / 13.398): hence large weights only. Kimi-K2's group 32
# at 64 rows gained more (DeepSeek-V3 o 88.5 against 152.0 us, w4a16_mid_g32_rows_s67_h200.*).
CODES_MAX_ROWS_LARGE = 32
# int4 products of 17-64 rows of 16-bit x on weights whose groups hold K tiles of 64 take the codes kernel's decoded
# form (`decoded_config`); False: the rule before it (the codes form, or the dequantizing GEMM on large weights past
# CODES_MAX_ROWS_LARGE rows), for an A/B (`set=triton_w4a16.DECODED=0`). W4A16 steps, replay ms, on against off
# (H200, session 68, ab_decoded_{8b,dsv3,30b}_w4a16_s68_h200.*): Qwen3-8B B=48 / 64 5.639 / 6.127 against 6.677 /
# 7.081 (and 7.173 / 7.577 with the codes form on every weight), B=24 / 32 level (5.407 / 5.593 against 5.389 /
# 5.628); DeepSeek-V3 (3 layers) B=24-64 0.5-1.6% faster (B=48 6.837 against 6.949); Qwen3-30B-A3B, whose dense
# weights are all small, within 1.3% either way (B=24 8.195 against 8.306, B=48 12.950 against 12.871)
DECODED = True
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_FMT_ID = {"int4": 0, "mxfp4": 1, "nvfp4": 2}
_FP4_GROUP = {"mxfp4": 32, "nvfp4": 16}
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_TWO_23: tl.constexpr = tl.constexpr(2.0**23)
_TWO_49: tl.constexpr = tl.constexpr(2.0**49)
_TWO_M49: tl.constexpr = tl.constexpr(2.0**-49)
_TWO_62: tl.constexpr = tl.constexpr(2.0**62)
_TWO_63: tl.constexpr = tl.constexpr(2.0**63)
_TWO_64: tl.constexpr = tl.constexpr(2.0**64)
_TWO_120: tl.constexpr = tl.constexpr(2.0**120)


@triton.jit
def _scale_f32(s, FMT: tl.constexpr):
    """Raw scales -> float32: int4 any float dtype; mxfp4 E8M0 bytes; nvfp4 E4M3 bytes (uint8 view)."""
    if FMT == 0:
        return s.to(tl.float32)
    u = s.to(tl.int32)
    if FMT == 1:  # 2^(e - 127); e = 0 is 2^-127, a float32 subnormal
        return tl.where(u == 0, 0x00400000, u << 23).to(tl.float32, bitcast=True)
    # E4M3 sign / 4-bit exponent / 3-bit mantissa at float32 positions: value * 2^-120 (subnormals too)
    bits = ((u & 0x7F) << 20) | ((u & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * _TWO_120


@triton.jit
def _int4_codes(q, j4, nib_mask):
    # int32 words [BW, BN, 1, 1] -> [BW, BN, 1, 8] float32 code_j * 16^e * 2^-149: nibble j masked in place at
    # bits 4e of q (j < 5) or of q >> 12 (j >= 5), its bits read as a subnormal
    return (tl.where(j4 < 5, q, q >> 12) & nib_mask).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_top(qs):
    # int32 with an E2M1 nibble at bits 31..28 -> float32 e2m1 * 2^-126: the arithmetic shift by 6 puts its sign at
    # 31 and its exponent and mantissa at 24..22, the mask 0x81C00000 keeps those (+-0.5 is the subnormal 2^-127)
    return ((qs >> 6) & -0x7E400000).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_codes(q, j4):
    # int32 words [BW, BN, 1, 1] -> [BW, BN, 1, 8] float32 e2m1_j * 2^-126, nibble j shifted to bits 31..28
    return _e2m1_top(tl.where(j4 < 7, q << (28 - 4 * j4), q))


@cached_launch
@triton.jit(do_not_specialize=["unit"])
def _w4a16_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, b_ptr, y_ptr, sz_ptr, M, N, K, unit,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_ys, stride_ym, stride_szg,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRELOAD: tl.constexpr = False, PACKED: tl.constexpr = False, SZ_ROWS: tl.constexpr = 1,
    WORDS: tl.constexpr = 1, PRELOAD_SZ: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # Tensors are [W, N, M, J]: word w of the K tile, output row n, x row m, nibble j. Lanes and warps run
    # along W only; a thread holds all N, M and J of its word column, so x (one 16-byte vector per word and
    # row), q and the scales meet in one layout without shuffles. `unit` (== 1, never specialized) hides
    # q's contiguity so that its load takes that one-word-per-thread layout too.
    # PRELOAD: the first K tile's words (constant: no kernel writes them) are loaded before the PDL wait, so that
    # they stream in while the predecessor finishes; each iteration then loads the next tile's words ahead.
    # PACKED (int4, 16-bit scales): scales and zeros come from sz_ptr, QuantizedWeight.scale_zero's int32
    # [N / SZ_ROWS, K / G, SZ_ROWS] of scale bits | zero << 16 (stride_szg = SZ_ROWS K / G), so that a thread's
    # rows of a group are one vector load for each SZ_ROWS (instead of a scale and a zero load per row).
    # WORDS == 2: q is the int64 view of the words (stride_qn in int64 elements); W runs over pairs of
    # words, one 8-byte load a thread and row, with the pair's 16 activations in two 16-byte vectors and one
    # scale (and zero) for both words (the group is a multiple of 16; FP4's 16 and 32 are).
    # PRELOAD_SZ (with PRELOAD and PACKED): the scale_zero copy's first K tile, constant too, is loaded before the
    # wait as well, and each iteration loads the next tile's ahead like the words.
    BW: tl.constexpr = BLOCK_K // (8 * WORDS)
    KW = K // (8 * WORDS)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w4 = tl.arange(0, BW)[:, None, None, None]
    n4 = offs_n[None, :, None, None]
    mask_n4 = n4 < N
    q_ptrs = q_ptr + n4 * stride_qn + w4 * unit  # [BW, BN, 1, 1]
    STEP: tl.constexpr = SPLIT_K * BLOCK_K
    sz_rows = sz_ptr + (n4 // SZ_ROWS) * stride_szg + n4 % SZ_ROWS  # [1, BN, 1, 1]
    if PRELOAD:
        q_next = tl.load(q_ptrs + pid_k * BW, mask=mask_n4 & (pid_k * BW + w4 < KW), other=0)
    if PRELOAD_SZ:
        grp_next = (pid_k * BLOCK_K + w4 * (8 * WORDS)) // GROUP
        sz_next = tl.load(sz_rows + grp_next * SZ_ROWS, mask=mask_n4 & (pid_k * BW + w4 < KW), other=0)
    pdl_enter(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    j4 = tl.arange(0, 8)[None, None, None, :]
    mask_m4 = offs_m[None, None, :, None] < M
    x_ptrs = x_ptr + offs_m[None, None, :, None] * stride_xm + w4 * (8 * WORDS) + j4  # [BW, 1, BM, 8]
    s_rows = s_ptr + n4 * stride_sn
    z_rows = z_ptr + n4 * stride_zn
    if FMT == 0:
        # nibble j is bits 4e.. of q (j < 5) or of q >> 12 (j >= 5); as float32 bits, code * 16^e * 2^-149
        e4 = tl.where(j4 < 5, j4, j4 - 3)
        nib_mask = 0xF << (4 * e4)
        x_mul = ((227 - 4 * e4) << 23).to(tl.float32, bitcast=True)  # 2^(100 - 4e)
    if FMT == 2:
        gs = tl.load(gs_ptr + n4, mask=mask_n4, other=0.0)
    acc = tl.zeros([BW, BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, STEP):
        if EVEN_K:
            mask_q = mask_n4
            mask_x = mask_m4
        else:
            mask_w4 = (k0 // (8 * WORDS) + w4) < KW
            mask_q = mask_n4 & mask_w4
            mask_x = mask_m4 & mask_w4
        x = tl.load(x_ptrs + k0, mask=mask_x, other=0.0).to(tl.float32)
        if PRELOAD:
            q = q_next
            k_next = (k0 + STEP) // (8 * WORDS)
            q_next = tl.load(q_ptrs + k_next, mask=mask_n4 & (k_next + w4 < KW), other=0)
        else:
            q = tl.load(q_ptrs + k0 // (8 * WORDS), mask=mask_q, other=0)
        grp = (k0 + w4 * (8 * WORDS)) // GROUP
        if PACKED:
            if PRELOAD_SZ:
                sz = tl.reshape(sz_next, [BW, BLOCK_N, 1])
                grp_next = (k0 + STEP + w4 * (8 * WORDS)) // GROUP
                sz_next = tl.load(sz_rows + grp_next * SZ_ROWS, mask=mask_n4 & (k_next + w4 < KW), other=0)
            else:
                sz = tl.reshape(tl.load(sz_rows + grp * SZ_ROWS, mask=mask_q, other=0), [BW, BLOCK_N, 1])
            if s_ptr.dtype.element_ty == tl.bfloat16:
                scale = (sz << 16).to(tl.float32, bitcast=True)
            else:
                scale = sz.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            scale = tl.reshape(_scale_f32(tl.load(s_rows + grp, mask=mask_q, other=0), FMT), [BW, BLOCK_N, 1])
        if FMT == 2:
            scale = scale * tl.reshape(gs, [1, BLOCK_N, 1])
        if WORDS == 2:  # q's low half is the pair's first word, its high half the second, against the next 8 x
            x2 = tl.load(x_ptrs + k0 + 8, mask=mask_x, other=0.0).to(tl.float32)
        if FMT == 0:
            if WORDS == 2:
                da = _int4_codes(q.to(tl.int32), j4, nib_mask)
                db = _int4_codes((q >> 32).to(tl.int32), j4, nib_mask)
                t = tl.sum((x * x_mul) * da, axis=3) + tl.sum((x2 * x_mul) * db, axis=3)  # [BW, BN, BM]
                xsum = (tl.sum(x, axis=3) + tl.sum(x2, axis=3)) * _TWO_M49  # [BW, 1, BM]
            else:
                t = tl.sum((x * x_mul) * _int4_codes(q, j4, nib_mask), axis=3)  # [BW, BN, BM]
                xsum = tl.sum(x, axis=3) * _TWO_M49  # [BW, 1, BM]
            if PACKED:
                zero = ((sz >> 16) & 0xFF).to(tl.float32)
            elif HAS_ZEROS:
                zero = tl.reshape(tl.load(z_rows + grp, mask=mask_q, other=0).to(tl.float32), [BW, BLOCK_N, 1])
            else:
                zero = 8.0
            acc += scale * t
            acc -= (scale * zero) * xsum
        else:
            if WORDS == 2:
                t = tl.sum((x * _TWO_64) * _e2m1_codes(q.to(tl.int32), j4), axis=3)
                t += tl.sum((x2 * _TWO_64) * _e2m1_codes((q >> 32).to(tl.int32), j4), axis=3)
            else:
                t = tl.sum((x * _TWO_64) * _e2m1_codes(q, j4), axis=3)
            acc += scale * t  # 2^-62 * scale * sum_j x_j e2m1_j
    out = tl.sum(acc, axis=0) * (_TWO_49 if FMT == 0 else _TWO_62)  # [BN, BM]
    if HAS_BIAS:  # added once, by the first K split (a tensor mask: Triton 3.9's interpreter takes no scalar & tensor)
        first = (offs_n < N) & (tl.zeros_like(offs_n) + pid_k == 0)
        out += tl.load(b_ptr + offs_n, mask=first, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@triton.jit
def _nibble_value(q, qh, J: tl.constexpr, scale, zero_scale, FMT: tl.constexpr):
    """Dequantized nibble J of each word of q, float32. int4: q & mask read as float32 is the subnormal
    code * 16^e * 2^-149 (nibble J at bits 4e of q, or of qh = q >> 12 for J >= 5); one multiply makes it
    code * 2^-23 and one FMA gives code * scale - zero * scale, with `scale` multiplied by 2^23.
    FP4: e2m1 * 2^-126 (see _w4a16_gemv_kernel), with `scale` multiplied by 2^63."""
    if FMT == 0:
        if J < 5:
            v = (q & (0xF << (4 * J))).to(tl.float32, bitcast=True) * (2.0 ** (126 - 4 * J))
        else:
            v = (qh & (0xF << (4 * J - 12))).to(tl.float32, bitcast=True) * (2.0 ** (138 - 4 * J))
        v = v * scale - zero_scale
    else:
        if J < 7:
            q = q << (28 - 4 * J)
        # nibble at bits 31..28 (sign, e1, e0, m) -> sign at 31 (arithmetic shift), e1 e0 m at 24..22
        v = (_e2m1_top(q) * _TWO_63) * scale
    return v


@cached_launch
@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_ys, stride_ym,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
    BW: tl.constexpr = BLOCK_K // 8  # words per row of a K tile
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BW)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :]  # [BN, BW]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if FMT == 2:
        gs = tl.load(gs_ptr + offs_n, mask=mask_n, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        if EVEN_K:
            mask_q = mask_n[:, None]
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
        else:
            mask_q = mask_n[:, None] & ((k0 // 8 + offs_w) < K // 8)[None, :]
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
        q = tl.load(q_ptrs + k0 // 8, mask=mask_q, other=0)
        # scales and zeros are gathered as [BW, BN] and transposed: lanes then run along the words, and
        # the dequantized tile reaches shared memory in 16-byte stores
        grp = ((k0 + offs_w * 8) // GROUP)[:, None]  # scale column of each word
        mask_t = tl.trans(mask_q)
        scale = tl.trans(_scale_f32(tl.load(s_ptr + offs_n[None, :] * stride_sn + grp, mask=mask_t, other=0), FMT))
        if FMT == 0:
            if HAS_ZEROS:
                zero = tl.trans(tl.load(z_ptr + offs_n[None, :] * stride_zn + grp, mask=mask_t, other=0).to(tl.float32))
            else:
                zero = 8.0
            zero_scale = zero * scale
            scale = scale * _TWO_23
        else:
            zero_scale = 0.0
            if FMT == 2:
                scale = scale * gs[:, None]
            scale = scale * _TWO_63
        qh = q >> 12
        v0 = _nibble_value(q, qh, 0, scale, zero_scale, FMT)
        v1 = _nibble_value(q, qh, 1, scale, zero_scale, FMT)
        v2 = _nibble_value(q, qh, 2, scale, zero_scale, FMT)
        v3 = _nibble_value(q, qh, 3, scale, zero_scale, FMT)
        v4 = _nibble_value(q, qh, 4, scale, zero_scale, FMT)
        v5 = _nibble_value(q, qh, 5, scale, zero_scale, FMT)
        v6 = _nibble_value(q, qh, 6, scale, zero_scale, FMT)
        v7 = _nibble_value(q, qh, 7, scale, zero_scale, FMT)
        # [BN, BK] in K order (k = 8 w + j), interleaved in registers
        w = tl.interleave(tl.interleave(tl.interleave(v0, v4), tl.interleave(v2, v6)),
                          tl.interleave(tl.interleave(v1, v5), tl.interleave(v3, v7)))  # fmt: skip
        if IEEE:  # float32 operands (or the CPU interpreter, whose 16-bit dot is wrong)
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    if HAS_BIAS:  # added once: by the first K split
        first = mask_n & (tl.zeros_like(offs_n) + pid_k == 0)
        acc += tl.load(b_ptr + offs_n, mask=first, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def decode_split(N: int, K: int, block_n: int, block_k: int, programs: int = 512) -> int:
    """K split of a decode-shaped (one row tile) dequantizing product. Deep, narrow weights (Qwen3-8B's
    down, DeepSeek-V3's o: 64-112 column tiles over 12-16K) leave most SMs idle: those split into the
    fewest of 2, 4, 8 parts that gives `programs` programs, keeping at least two K tiles per part. From
    `DECODE_MIN_TILES` column tiles up the product runs unsplit: on the H100 a split there cost more
    (partials and their sum) than it gained (benchmarks/results/w4a16_fp4_split_h100.json)."""
    tiles = cdiv(N, block_n)
    allowed = [s for s in (2, 4, 8) if cdiv(K, block_k) >= 2 * s]
    if tiles >= DECODE_MIN_TILES or not allowed:
        return 1
    return next((s for s in allowed if tiles * s >= programs), allowed[-1])


def w4a16_config(M: int, N: int, K: int, fmt: str, group: int = 128, codes: bool = True) -> dict[str, int]:
    """Tiles for an [M, K] x [N, K]^T product with a 4-bit weight (fmt and its group size).

    From the H100 sweeps kept in benchmarks/results/w4a16_h100.json and w4a16_codes_sweep2_h100.json. Up
    to 2 rows, and up to 4 on weights under 2^25 elements: the CUDA-core kernel, two words a thread
    (GEMV_WORDS, FP4_GEMV_WORDS: one warp per 32 word pairs of a 2048-wide K tile), 4 warps, 4 output rows
    per program on small weights, 8 on large. int4 with 3
    to 64 rows and 16-bit x (`codes`): the codes kernel (kernels/triton_w4a16_codes.py: scales after the
    dot, split K), 1.0-2.4x the dequantizing GEMM there; on large weights only up to CODES_MAX_ROWS_LARGE
    rows, where the H200 measured the decode-shaped tiles faster past it; from 17 rows, where a group holds K tiles
    of 64, the codes kernel's decoded form instead (`decoded_config`, `DECODED`; past 64 rows in row tiles, its
    `rows_config`: 1.15-5.2x the dequantizing tiles of the last sentence at 96-256 rows, 1.16-1.44x at 8192 on the
    H200, session 75).
    FP4 (and those int4 products) up to DECODE_MAX_M rows: one tensor-core row tile of max(16, M) rows, narrow and
    deep on small weights (more programs) up to 32 rows, wide on large ones and past 32 rows, K split where the
    column tiles are fewer than the SMs (`decode_split`, aiming at 512 programs, 256 past 32 rows; float32 partials
    summed after the kernel). From the H100 sweep at 24-64 rows
    (benchmarks/results/w4a16_mid4_h100.json): 1.1-3.7x the 64 x 128 x 128 tiles it ran before on Qwen3 weights,
    except Qwen3-8B's gate_up in nvfp4 at 24-32 rows (76 against 71-74 us). Past 64 rows (FP4, float32 x, int4
    groups of 32): 128 x 128 tiles to 128 rows, 256 x 128 past them (two warpgroups share each dequantized weight
    tile)."""
    decoded = decoded_config(M, N, K, group) if codes and fmt == "int4" and DECODED else None
    if decoded is not None:
        return decoded
    large = N * K >= (1 << 25)
    codes_rows = CODES_MAX_ROWS_LARGE if large else CODES_MAX_M
    codes_cfg = codes_config(M, N, K, group) if codes and fmt == "int4" and 2 < M <= codes_rows else None
    if codes_cfg is not None:
        return codes_cfg
    if M <= 2 or (M <= GEMV_MAX_M and not large):
        words = GEMV_WORDS if fmt == "int4" else FP4_GEMV_WORDS
        bk = min(GEMV_BLOCK_K, next_pow2(K)) if GEMV_BLOCK_K and fmt == "int4" else 1024 * words
        return {"GEMV": 1, "BLOCK_M": next_pow2(M), "BLOCK_N": GEMV_BLOCK_N or (8 if large else 4), "BLOCK_K": bk,
                "SPLIT_K": 1, "WORDS": words, "num_warps": GEMV_WARPS, "num_stages": 2}  # fmt: skip
    if M <= DECODE_MAX_M:
        bn, bk = (64, 128) if large or M > 32 else (16, 256)
        split = decode_split(N, K, bn, bk, split_programs(M))
        return {"GEMV": 0, "BLOCK_M": max(16, next_pow2(M)), "BLOCK_N": bn, "BLOCK_K": bk,
                "SPLIT_K": split, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}  # fmt: skip
    bm, bn, bk, warps, stages = (128, 128, 64, 8, 4) if M <= 128 else (256, 128, 64, 8, 3)
    return {"GEMV": 0, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "GROUP_M": 8,
            "num_warps": warps, "num_stages": stages}  # fmt: skip


def w4a16_reads_ahead(qw: QuantizedWeight, rows: int) -> bool:
    """Whether w4a16_linear on `rows` rows of the 2-D weight qw reads constant words ahead of the PDL wait: the
    GEMV its first K tile (PRELOAD_FIRST_TILE), the mma kernel its first chunk (gluon_w4a16_mma.PRELOAD_WORDS).
    Then the kernel before it gains by triggering early (pdl.py, "Early trigger"), as the words stream in while
    that kernel still waits. Not behind GPTQ act order's permutation of x (a torch op, launched without PDL,
    then comes between)."""
    if qw.qweight.dim() != 2 or qw.perm is not None or not pdl_launch(qw.qweight.device):
        return False
    if mma_rows_config(qw, rows) is not None:
        return mma_path.PRELOAD_WORDS
    if not PRELOAD_FIRST_TILE or not 1 <= rows <= GEMV_MAX_M:
        return False
    return w4a16_config(rows, qw.out_features, qw.in_features, qw.fmt, qw.group_size).get("GEMV") == 1


def mma_rows_config(qw: QuantizedWeight, rows: int) -> mma_path.MmaLinearConfig | None:
    """The dense int4 mma kernel's config where w4a16_linear (with no config given) runs `rows` rows of qw there:
    int4, taken by its `takes` rule and fitting its default config's shape; else None. (The kernel also needs a
    CUDA device and 16-bit x, `mma_path.supported`.)"""
    if qw.fmt != "int4" or not mma_path.takes(rows, qw.out_features, qw.in_features, qw.zeros is not None):
        return None
    cfg = mma_path.default_config(rows, qw.out_features, qw.in_features)
    return cfg if mma_path.fits(rows, qw.out_features, qw.in_features, qw.group_size, cfg) else None


def gemv_scale_zero(qw: QuantizedWeight) -> torch.Tensor | None:
    """QuantizedWeight.scale_zero for a weight whose one- and two-row products run on the GEMV (int4 with
    16-bit scales, not taken by the mma kernel at one row); None for the others, which never read it."""
    if mma_path.takes(1, qw.out_features, qw.in_features, qw.zeros is not None):
        return None
    return scale_zero_copy(qw)


def gemv_words(qw: QuantizedWeight, want: int, block_k: int) -> tuple[torch.Tensor, int]:
    """The words as a GEMV-form kernel reads them (this module's GEMV, the token MoE kernels of
    triton_moe_w4_gemv, on [N, K / 8] or [E, N, K / 8] words) and the words a thread loads at once for each
    row: the int64 view (two words an element, strides halved) when asked and possible (every K tile and group a
    whole number of 16-element pairs, words contiguous along K with even outer strides and an 8-byte aligned start;
    any 4-bit format); else the int32 words, one."""
    q = qw.qweight
    if (want == 2 and qw.group_size % 16 == 0 and block_k % 16 == 0 and q.stride(-1) == 1
            and all(st % 2 == 0 for st in q.stride()[:-1]) and q.data_ptr() % 8 == 0):  # fmt: skip
        return q.view(torch.int64), 2
    return q, 1


def _check(x: torch.Tensor, qw: QuantizedWeight) -> None:
    if qw.fmt not in FOUR_BIT_FORMATS:
        raise ValueError(
            f"w4a16_linear: format {qw.fmt!r} is not a 4-bit weight format ({', '.join(FOUR_BIT_FORMATS)})"
        )
    if qw.qweight.dim() != 2:
        raise ValueError(f"w4a16_linear: needs a 2-D weight, got qweight of shape {tuple(qw.qweight.shape)}")
    N, K, G = qw.out_features, qw.in_features, qw.group_size
    if qw.fmt in _FP4_GROUP and G != _FP4_GROUP[qw.fmt]:
        raise ValueError(f"w4a16_linear: {qw.fmt} has group size {_FP4_GROUP[qw.fmt]}, got {G}")
    if K % 8 or G % 8 or K % G:
        raise ValueError(f"w4a16_linear: in_features {K} must be a multiple of 8 and of the group size {G}")
    if tuple(qw.qweight.shape) != (N, K // 8) or tuple(qw.scales.shape) != (N, K // G):
        raise ValueError(f"w4a16_linear: qweight {tuple(qw.qweight.shape)} / scales {tuple(qw.scales.shape)} "
                         f"do not match [{N}, {K}] with group {G}")  # fmt: skip
    if qw.fmt == "nvfp4" and qw.global_scale is None:
        raise ValueError("w4a16_linear: nvfp4 needs global_scale")
    if x.shape[-1] != K:
        raise ValueError(f"w4a16_linear: x has {x.shape[-1]} features, the weight {K}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"w4a16_linear: x dtype {x.dtype} not in bfloat16 / float16 / float32")


def w4a16_linear(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    qw: QuantizedWeight,  # 2-D "int4" / "mxfp4" / "nvfp4"
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
) -> torch.Tensor:  # [..., N], x.dtype
    _check(x, qw)
    lead = x.shape[:-1]
    x = x.reshape(-1, qw.in_features)
    if qw.perm is not None:
        x = x.index_select(1, qw.perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = qw.out_features
    if M == 0:
        return x.new_empty(*lead, N)
    cfg_wg = wgmma_path.engine_config(M, N, K, qw.group_size) if config is None and qw.fmt == "int4" else None
    if cfg_wg is not None and wgmma_path.runs_now(x, qw.qweight, qw.group_size, cfg_wg):  # 9-16 rows (its module)
        y = wgmma_path.w4a16_wgmma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, cfg_wg)
        return y.reshape(*lead, N)
    cfg_rs = rs_path.engine_config(M, N, K, qw.group_size) if config is None and qw.fmt == "int4" else None
    if cfg_rs is not None and rs_path.supported(x, qw.qweight, qw.group_size, cfg_rs):  # 17-128 rows (its module)
        return rs_path.w4a16_rs(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, cfg_rs).reshape(*lead, N)
    cfg_ws = ws_path.engine_config(M, N, K) if config is None and qw.fmt == "int4" else None
    if cfg_ws is not None and ws_path.supported(x, qw.qweight, qw.group_size, cfg_ws):  # prefill sizes (its module)
        return ws_path.w4a16_ws(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, cfg_ws).reshape(*lead, N)
    cfg_mma = mma_rows_config(qw, M) if config is None else None
    if cfg_mma is not None and mma_path.supported(x, qw.qweight, qw.group_size, cfg_mma):
        y = mma_path.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, cfg_mma)
        return y.reshape(*lead, N)
    cfg = dict(config or w4a16_config(M, N, K, qw.fmt, qw.group_size, x.dtype != torch.float32))
    if cfg.get("WS"):  # the warp-specialised kernel (kernels/gluon_w4a16_ws.py)
        ws_cfg = ws_path.from_dict(cfg)
        if qw.fmt != "int4" or not ws_path.supported(x, qw.qweight, qw.group_size, ws_cfg):
            raise ValueError(
                f"w4a16_linear: the warp-specialised kernel takes int4 on a Hopper GPU, 16-bit x and K tiles inside a "
                f"group; got {qw.fmt}, {x.dtype} on {x.device}, group {qw.group_size}, {ws_cfg}"
            )
        return ws_path.w4a16_ws(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, ws_cfg).reshape(*lead, N)
    if cfg.get("CODES"):
        if not codes_supported(M, K, qw.group_size, qw.fmt, x.dtype, cfg["BLOCK_K"], bool(cfg.get("DEQUANT"))):
            got = f"{qw.fmt}, {x.dtype}, M={M}, group {qw.group_size}, BLOCK_K {cfg['BLOCK_K']}"
            raise ValueError(
                f"w4a16_linear: the codes kernel takes int4, 16-bit x, <= {CODES_MAX_M} rows and BLOCK_K dividing the "
                f"group; got {got}"
            )
        return w4a16_codes(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, cfg).reshape(*lead, N)
    split_k, gemv, group_m = cfg.pop("SPLIT_K"), cfg.pop("GEMV"), cfg.pop("GROUP_M", 1)
    q, words = gemv_words(qw, cfg.pop("WORDS", 1), cfg["BLOCK_K"]) if gemv else (qw.qweight, 1)
    s, z, gs = qw.scales, qw.zeros, qw.global_scale
    if qw.fmt == "nvfp4":
        s = s.view(torch.uint8)
    assert qw.qweight.stride(1) == 1 and s.stride(1) == 1 and (z is None or z.stride(1) == 1)
    if split_k > 1:
        y = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(1, M, N, dtype=x.dtype, device=x.device)
    # s stands in for the absent optional tensors (never read)
    args = (x, q, s, s if z is None else z, s if gs is None else gs, s if bias is None else bias, y, M, N, K)
    strides = (x.stride(0), q.stride(0), s.stride(0), z.stride(0) if z is not None else 0, y.stride(0), y.stride(1))
    flags = {"FMT": _FMT_ID[qw.fmt], "GROUP": qw.group_size, "HAS_ZEROS": z is not None, "HAS_BIAS": bias is not None,
             "SPLIT_K": split_k, "EVEN_K": K % cfg["BLOCK_K"] == 0}  # fmt: skip
    pdl = pdl_launch(x.device)
    if gemv:
        assert M <= cfg["BLOCK_M"], (M, cfg)
        sz = qw.scale_zero if USE_SCALE_ZERO else None
        if sz is not None:
            assert qw.fmt == "int4" and sz.shape[1:] == (K // qw.group_size, SCALE_ZERO_ROWS) and sz.is_contiguous()
        _w4a16_gemv_kernel[(cdiv(N, cfg["BLOCK_N"]), split_k)](
            *args[:7], s if sz is None else sz, *args[7:], 1, *strides, 0 if sz is None else sz.stride(0),
            **flags, **cfg, PRELOAD=PRELOAD_FIRST_TILE, PACKED=sz is not None, SZ_ROWS=SCALE_ZERO_ROWS, WORDS=words,
            PRELOAD_SZ=GEMV_PRELOAD_SZ and PRELOAD_FIRST_TILE and sz is not None, **pdl,
        )  # fmt: skip
    else:
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), split_k)
        ieee = x.dtype == torch.float32 or _INTERPRET
        _w4a16_gemm_kernel[grid](*args, *strides, **flags, GROUP_M=group_m, IEEE=ieee, **cfg, **pdl)
    out = y[0] if split_k == 1 else y.sum(0).to(x.dtype)
    return out.reshape(*lead, N)
