"""The pieces of the CUDA-core 4-bit GEMV kernels (the MoE pair path of kernels/triton_fused_moe_w4.py):
nibble decoding, group scales, activation loads and one [BLOCK_N, BLOCK_K / 8] tile of 32-bit words
against its activations. Loads and arithmetic are separate functions (decode_scale, tile_dot), so that
a kernel may issue a tile's loads ahead of its arithmetic (the one-launch kernel of commit 21f304d did).

Decoding, a shift and one or two logic ops per weight, no int->float conversion:
  int4   bits (1.0f | code << 19) = 1 + code/16, so (code - zero) * s = (f - (1 + zero/16)) * 16 s;
         with x: sum_j (c_j - z) s x_j = 16 s * (sum_j f_j x_j - (1 + z/16) * sum_j x_j).
  E2M1   magnitude bits to 22..24 (the exponent's two low bits and the top mantissa bit), sign to 31:
         an fp32 equal to value * 2^-126 exactly (code 1 is the subnormal 2^-127). It only ever meets
         operands pre-scaled by 2^63 (x in the GEMVs, the scale in both), so no product is subnormal.
  scales mxfp4 E8M0 e -> bits e << 23 = 2^(e-127); nvfp4 E4M3 bits -> fp32 bits (b & 0x7F) << 20 with
         the sign at 31 = value * 2^-120 (subnormals included), times global_scale.
The constant OR-ed in (`magic`) is a kernel argument: in a register, ptxas fuses mask-and-or into one
LOP3, which it does not for two immediates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.quant_formats import QuantizedWeight

FMT_ID = {"int4": 0, "mxfp4": 1, "nvfp4": 2}
MAGIC = {"int4": 0x3F800000, "mxfp4": -(2**31), "nvfp4": -(2**31)}  # 1.0f; the sign bit
P63 = tl.constexpr(9.223372036854775808e18)  # 2^63
P60 = tl.constexpr(1.152921504606846976e18)  # 2^60


@triton.jit
def nibble(q, J: tl.constexpr, magic, FMT: tl.constexpr):
    # q uint32 words -> nibble J as float32: int4 1 + code/16 (magic = 1.0f); E2M1 value * 2^-126
    # (magic = the sign bit).
    if FMT == 0:
        if J <= 4:
            m = q << (19 - 4 * J)
        else:
            m = q >> (4 * J - 19)
        bits = (m & 0x00780000) | magic
    else:
        if J <= 5:
            m = q << (22 - 4 * J)
        else:
            m = q >> (4 * J - 22)
        bits = (m & 0x01C00000) | ((q << (28 - 4 * J)) & magic)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def group_scale(s_ptrs, z_ptrs, gs, mask, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN: tl.constexpr):
    # Per (row, group): int4 (16 * scale, 1 + zero/16); E2M1 (scale * 2^63, unused).
    s = masked_load(s_ptrs, mask, EVEN)
    z = masked_load(z_ptrs, mask, EVEN) if HAS_ZERO else s
    return decode_scale(s, z, gs, FMT, HAS_ZERO)


@triton.jit
def decode_scale(s, z, gs, FMT: tl.constexpr, HAS_ZERO: tl.constexpr):
    # Loaded scales (and zeros) -> group_scale's pair.
    if FMT == 0:
        scale = s.to(tl.float32) * 16.0
        if HAS_ZERO:
            zz = ((z.to(tl.uint32) << 19) | 0x3F800000).to(tl.float32, bitcast=True)
        else:
            zz = tl.full(scale.shape, 1.5, tl.float32)
        return scale, zz
    e = s.to(tl.uint32)
    if FMT == 1:  # E8M0: 2^(e - 127); e = 0 is the subnormal 2^-127
        scale = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True) * P63
    else:  # E4M3 bits -> value * 2^-120, then * 2^120 in two exact steps
        bits = ((e & 0x7F) << 20) | ((e >> 7) << 31)
        scale = bits.to(tl.float32, bitcast=True) * P60 * P60 * gs * P63
    return scale, scale


@triton.jit
def masked_load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def x_pair(ptrs, mask, FMT: tl.constexpr, X_F16: tl.constexpr, EVEN: tl.constexpr):
    # int32 words holding two 16-bit activations -> (low, high) in float32, E2M1: times 2^63
    v = masked_load(ptrs, mask, EVEN).to(tl.uint32, bitcast=True)
    if X_F16:
        lo = (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (v >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (v << 16).to(tl.float32, bitcast=True)
        hi = (v & 0xFFFF0000).to(tl.float32, bitcast=True)
    if FMT != 0:
        lo = lo * P63
        hi = hi * P63
    return lo, hi


@triton.jit
def x_words(ptrs, mask, FMT: tl.constexpr, X_F16: tl.constexpr, EVEN: tl.constexpr):
    # ptrs [BKW]: int32 pair 0 of each word's 8 activations -> (x_0..x_7 [BKW] float32, sum_j x_j)
    x0, x1 = x_pair(ptrs, mask, FMT, X_F16, EVEN)
    x2, x3 = x_pair(ptrs + 1, mask, FMT, X_F16, EVEN)
    x4, x5 = x_pair(ptrs + 2, mask, FMT, X_F16, EVEN)
    x6, x7 = x_pair(ptrs + 3, mask, FMT, X_F16, EVEN)
    return (x0, x1, x2, x3, x4, x5, x6, x7), ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))


@triton.jit
def x_planes(ptrs, plane, mask, EVEN: tl.constexpr):
    # ptrs [BKW] into a [8, K/8] float32 act row (plane j = x[8w + j]) -> (x_0..x_7, sum_j x_j)
    x0 = masked_load(ptrs, mask, EVEN)
    x1 = masked_load(ptrs + plane, mask, EVEN)
    x2 = masked_load(ptrs + 2 * plane, mask, EVEN)
    x3 = masked_load(ptrs + 3 * plane, mask, EVEN)
    x4 = masked_load(ptrs + 4 * plane, mask, EVEN)
    x5 = masked_load(ptrs + 5 * plane, mask, EVEN)
    x6 = masked_load(ptrs + 6 * plane, mask, EVEN)
    x7 = masked_load(ptrs + 7 * plane, mask, EVEN)
    return (x0, x1, x2, x3, x4, x5, x6, x7), ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))


@triton.jit
def group_sums(sx, FMT: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr):
    # sx [BKW] -> [BN, NG] sums per group, reduced like the products (same layout, no second x load);
    # only int4 needs them.
    bkw: tl.constexpr = NG * WPG
    if FMT == 0:
        sums = tl.sum(tl.reshape(tl.broadcast_to(sx[None, :], [BLOCK_N, bkw]), [BLOCK_N, NG, WPG]), axis=2)
    else:
        sums = tl.zeros([BLOCK_N, NG], tl.float32)
    return sums


@triton.jit
def gemv_tile(q_ptrs, q_mask, s_ptrs, z_ptrs, s_mask, gs, xs, sxg, magic,
               FMT: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
               NG: tl.constexpr, WPG: tl.constexpr):  # fmt: skip
    # q_ptrs [BN, BKW] words, xs the 8 [BKW] activations of each word, sxg [BN, NG] sums of x per group
    # -> [BN, NG] float32 contributions of the tile.
    q = masked_load(q_ptrs, q_mask, EVEN).to(tl.uint32, bitcast=True)
    scale, zz = group_scale(s_ptrs, z_ptrs, gs, s_mask, FMT, HAS_ZERO, EVEN)
    return tile_dot(q, scale, zz, xs, sxg, magic, FMT, BLOCK_N, NG, WPG)


@triton.jit
def tile_dot(q, scale, zz, xs, sxg, magic, FMT: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr,
              WPG: tl.constexpr):  # fmt: skip
    # gemv_tile on loaded words q [BN, BKW] (uint32) and decoded scales [BN, NG].
    p = nibble(q, 0, magic, FMT) * xs[0][None, :]
    for j in tl.static_range(1, 8):
        p += nibble(q, j, magic, FMT) * xs[j][None, :]
    pg = tl.sum(tl.reshape(p, [BLOCK_N, NG, WPG]), axis=2)  # [BN, NG]
    if FMT == 0:
        return scale * (pg - zz * sxg)
    return scale * pg


def weight_args(qw: QuantizedWeight) -> tuple:
    """qweight, scales, zeros, global_scale, magic and the strides, as the kernels take them. Absent
    tensors alias the scales; FP8 scales travel as their uint8 bits (decoded in-kernel)."""
    s = qw.scales.view(torch.uint8) if qw.scales.dtype == torch.float8_e4m3fn else qw.scales
    z = qw.zeros if qw.zeros is not None else s
    gs, ge = (qw.global_scale, qw.global_scale.stride(0)) if qw.global_scale is not None else (s, 0)
    q = qw.qweight
    return q, s, z, gs, MAGIC[qw.fmt], q.stride(0), q.stride(1), s.stride(0), s.stride(1), ge
