"""The aligned-path grouped GEMM of the 4-bit fused MoE for int4 experts, on raw codes: the MoE form of
kernels/triton_w4a16_codes.py (its docstring has the arithmetic and the measurements behind it).

Per expert-aligned block of BLOCK_M sorted (token, slot) rows and BLOCK_N output columns, each K tile
(inside one quantization group) is one dot of the codes tile (128 + code, one LOP3 per two weights)
with the rows, one dot of a constant ones tile with the rows (the row sums), and a per-column
scale / zero applied after the dot in float32. The weight is the dot's A operand (acc is [BN, BM]),
so neither the codes nor the ones pass through shared memory on their way in. Gate-up fuses
SiLU(gate) * up (both weight halves against the same rows); down multiplies by the routing weight.
`triton_fused_moe_w4.fused_moe_w4` takes this kernel for int4 experts whose group holds whole K tiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ftransformers.kernels import triton_w4a16_codes as dense_codes
from ftransformers.kernels.launch import cached_launch, cdiv
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.tiling import aligned_rows, aligned_tile
from ftransformers.kernels.triton_w4a16_codes import (
    MAGIC,
    code_tile,
    codes_block_k,
    decoded_block_k,
    dequant_tile,
    group_params,
)

# Triton's CPU interpreter truncates float32 -> bfloat16; round to nearest even by hand there.
_MANUAL_RNE = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def to_16bit(x, DTYPE: tl.constexpr):
    # float32 -> DTYPE (bf16 / fp16), rounded to nearest even (also in the interpreter)
    if _MANUAL_RNE and DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = b.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _codes_tile_dot(q_ptrs, s_ptrs, z_ptrs, g, n_ok, magic, offset, ad, xs, scale, zoff, K_STEP_G, acc,
                    HAS_ZEROS: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DEQUANT: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    # One K tile of one weight half added to acc [BN, BM]: returns (acc, next tile's scale and zero). DEQUANT: the
    # tile decoded with its scale and zero first (triton_w4a16_codes.dequant_tile), one dot into acc; else the
    # codes' dot, and the scale and zero applied after it through the row sums xs.
    nxt_scale, nxt_zoff = group_params(s_ptrs, z_ptrs, g + K_STEP_G, n_ok, offset, HAS_ZEROS, BLOCK_N)
    q = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
    if DEQUANT:
        w = dequant_tile(q, scale.to(DT), (-zoff).to(DT), magic, DT, BLOCK_N, BLOCK_K, ASM)
        if IEEE:
            return tl.dot(w.to(tl.float32), tl.trans(ad), acc, input_precision="ieee"), nxt_scale, nxt_zoff
        return tl.dot(w, tl.trans(ad), acc), nxt_scale, nxt_zoff
    w = code_tile(q, magic, DT, BLOCK_N, BLOCK_K)
    if IEEE:
        w = w.to(tl.float32)
    part = tl.dot(w, tl.trans(ad), input_precision="ieee" if IEEE else "tf32")
    return acc + (part - zoff[:, None] * xs) * scale[:, None], nxt_scale, nxt_zoff


@cached_launch
@triton.jit
def _moe_gemm_codes_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, magic, offset, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs, max_padded, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_cm,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False, DEQUANT: tl.constexpr = False, DQ_ASM: tl.constexpr = False,
):  # fmt: skip
    # C[pair, n] = A[pair // A_DIV] @ W[e, n]^T over one expert-aligned block of sorted rows (K % BLOCK_K
    # == 0, GROUP % BLOCK_K == 0); FUSE_SILU: rows n (gate) and N + n (up) -> silu(gate) * up;
    # MUL_WEIGHT: times the routing weight. Scales and zeros share strides (fused_moe_w4's _check).
    # DEQUANT: the decoded form (each tile decoded with its scale and zero, one dot a tile; no row sums).
    pdl_enter(USE_PDL)
    BW: tl.constexpr = BLOCK_K // 8
    pid_m, pid_n = aligned_tile(max_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):  # past the used row blocks
        return
    pair, row_ok, expert = aligned_rows(sorted_ptr, expert_ids_ptr, pid_m, num_pairs, BLOCK_M)  # [BM]
    magic = magic.to(tl.int32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_DIV)[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    q_ptrs = q_ptr + expert * stride_qe + offs_n[:, None].to(tl.int64) * stride_qn + tl.arange(0, BW)[None, :]
    s_ptrs = s_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn  # [BN]
    z_ptrs = z_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    up_q = N * stride_qn
    up_s = N * stride_sn
    TPG: tl.constexpr = GROUP // BLOCK_K  # K tiles per group
    ones = tl.full([BLOCK_N, BLOCK_K], 1.0, tl.float32 if IEEE else DT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    scale, zoff = group_params(s_ptrs, z_ptrs, 0, n_ok, offset, HAS_ZEROS, BLOCK_N)
    scale_u, zoff_u = scale, zoff
    if FUSE_SILU:
        scale_u, zoff_u = group_params(s_ptrs + up_s, z_ptrs + up_s, 0, n_ok, offset, HAS_ZEROS, BLOCK_N)
    for kt in range(K_TILES):
        ad = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        if IEEE:
            ad = ad.to(tl.float32)
        if DEQUANT:
            xs = acc  # unused
        else:
            xs = tl.dot(ones, tl.trans(ad), input_precision="ieee" if IEEE else "tf32")  # [BN, BM] row sums
        g = kt // TPG
        step = tl.where(kt + 1 < K_TILES, (kt + 1) // TPG - g, 0)  # the next tile's group, or this one
        acc, scale, zoff = _codes_tile_dot(q_ptrs + kt * BW, s_ptrs, z_ptrs, g, n_ok, magic, offset, ad, xs, scale,
                                           zoff, step, acc, HAS_ZEROS, DT, IEEE, BLOCK_N, BLOCK_K, DEQUANT,
                                           DQ_ASM)  # fmt: skip
        if FUSE_SILU:
            acc_up, scale_u, zoff_u = _codes_tile_dot(q_ptrs + up_q + kt * BW, s_ptrs + up_s, z_ptrs + up_s, g, n_ok,
                                                      magic, offset, ad, xs, scale_u, zoff_u, step, acc_up, HAS_ZEROS,
                                                      DT, IEEE, BLOCK_N, BLOCK_K, DEQUANT, DQ_ASM)  # fmt: skip
        a_ptrs += BLOCK_K
    acc = tl.trans(acc)  # [BM, BN]
    if FUSE_SILU:
        acc_up = tl.trans(acc_up)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, to_16bit(acc, c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_gemm_codes(
    a: torch.Tensor,  # [rows, K] bf16 / fp16, unit stride along K
    qweight: torch.Tensor,  # int32 [E, N or 2N, K // 8]
    scales: torch.Tensor,  # [E, N or 2N, K // G]
    zeros: torch.Tensor | None,  # uint8, the scales' shape and strides, or None (zero 8)
    group: int,
    out: torch.Tensor,  # [T*top_k, N]
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # moe_align's sorted_ids, expert_ids, num_post
    a_div: int,
    block_m: int,
    block_n: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    weights: torch.Tensor | None = None,  # [T*top_k] float32: the down GEMM (else gate-up, fused SiLU)
    ieee: bool = False,  # float32 dots (Triton's CPU interpreter)
    decoded: bool = False,  # the decoded form, K tiles of decoded_block_k(group, K)
) -> None:
    n, k = out.shape[1], a.shape[1]
    bk = decoded_block_k(group, k) if decoded else codes_block_k(group)
    assert bk and k % bk == 0 and a.stride(1) == 1 and a.dtype in MAGIC, (group, k, a.dtype)
    magic, offset = MAGIC[a.dtype]
    max_padded = align[0].numel()
    z = zeros if zeros is not None else scales
    _moe_gemm_codes_kernel[((max_padded // block_m) * cdiv(n, block_n),)](
        a, qweight, scales, z, magic, offset, out, weights if weights is not None else out, *align,
        n, k, out.shape[0], max_padded, a.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0),
        scales.stride(1), out.stride(0),
        A_DIV=a_div, FUSE_SILU=weights is None, MUL_WEIGHT=weights is not None, IEEE=ieee,
        HAS_ZEROS=zeros is not None, GROUP=group, DT=tl.float16 if a.dtype == torch.float16 else tl.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=group_m, K_TILES=k // bk,
        DEQUANT=decoded, DQ_ASM=decoded and dense_codes.DQ_ASM and not ieee,
        num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(a.device),
    )  # fmt: skip
