"""Tensor-core int4 GEMM for few rows (decode, M <= CODES_MAX_M = 64) that scales after the dot: y = x @ W^T with
W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g], g = k // GROUP (the "int4" layout of
kernels/quant_formats.py).

Why: at 4-16 rows the dequantizing GEMM (`triton_w4a16._w4a16_gemm_kernel`) does a mask, two float ops
and a float32 -> 16-bit conversion per weight element, and it has too few programs on weights with
few output tiles. Here a K tile never crosses a group (GROUP % BLOCK_K == 0), so within a tile each
output column n has one scale and one zero, and

    sum_k x[m, k] W[n, k] = scale[n] * (sum_k x[m, k] (128 + code[n, k]) - (128 + zero[n]) * sum_k x[m, k]).

The 16-bit operand is 128 + code, made with one LOP3 per two weights: (q >> 4i) & 0x000F000F | 0x43004300
is the bf16 pair (128 + nibble i, 128 + nibble i + 4) of a word (fp16: 0x64006400, 1024 + code). Every
value 128..143 (1024..1039) is exact, so the products are exact in float32; the tile's sum is scaled
per column in float32 after the dot. The x-sum term cancels the 128 offset: a tile's float32 sums
are ~30x the column term they leave, so their rounding is ~1e-5 of the result (measured on the H100:
over the 1e-5 float32 tolerance). That is far under 16-bit rounding, so only 16-bit x takes this
kernel; float32 x takes the dequantizing kernels.

The decoded form (a config's DEQUANT, `decoded_config`: 17-64 rows) decodes each tile's weights with their scale and
zero before the dot, (128 + code - (128 + zero)) * scale in x's dtype, two packed 16-bit FMAs a pair in inline PTX
(`dequant_tile`; the first exact, the second rounding once, as a bf16 copy of the weight would), and accumulates one
dot a tile. The codes form's second dot (the x sums) and its scaled add a tile go, and Triton keeps the decoded tile
as wgmma's register A operand. The scale is rounded to x's dtype first (vLLM's Marlin path does the same with AWQ's
float16 scales in a bf16 model). At 33-64 rows on large weights it took a Qwen3-8B W4A16 step 13-16% under the rule
before it (session 68, docs/performance.md).

The product is y^T = W @ x^T: the weight tile is the dot's A operand (BLOCK_N rows, the wgmma M), x^T
its B operand. Split K: SPLIT_K programs per column tile each take every SPLIT_K-th K tile; with
tickets (kernels/tickets.py) they publish float32 partials and the last one out adds them in split
order and writes y (deterministic, one launch). Where no counters can be had (a CUDA graph capture
before the pool exists) it runs unsplit (`tickets.split_scratch`).

Measured on the H100 (benchmarks/results/w4a16_codes_*_h100.json). Kept: the scales loaded one tile
ahead and the x sums on the tensor cores; together, at the default tiles, 15-30% faster on three of
four probe shapes (Qwen3-8B gate_up 46.8 -> 39.7 us, down 36.3 -> 26.1, Qwen3-30B qkv 9.1 -> 7.5;
DeepSeek-V3 o 51.6 -> 54.1). Not kept: x @ W^T with the weight as the B operand (45% slower), codes
ordered so each LOP3 pair is adjacent with x gathered to match (10-50% slower), contiguous instead of
strided K runs per split and K tiles of 256-512 on a group-512 weight (no gain). The loop is bound by
its per-tile latency chain (the A operand's shared-memory round trip, barriers, the wgmma wait), not
by its instruction count or by DRAM: ~50% of copy bandwidth on large weights.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.tickets import publish_and_sum, split_scratch
from ftransformers.kernels.tiling import grouped_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CODES_MAX_M = 64  # rows the codes form takes (x's tile up to 64 rows); the decoded form takes more in row tiles
ROWS_PROGRAMS = 264  # what the decoded form's K split aims at past CODES_MAX_M rows: two programs an SM of 132
# The decoded form (a config's DEQUANT) decodes its pairs in PTX (`dequant_tile`); False: the same arithmetic in
# float32 ops (the interpreter's form; an A/B on the GPU)
DQ_ASM = True
# (magic pair, code offset) per x dtype: bf16 0x4300 = 128.0, fp16 0x6400 = 1024.0
MAGIC = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}


@triton.jit
def _pair_codes(q, i: tl.constexpr, magic, DT: tl.constexpr):
    # int32 words -> (offset + nibble i, offset + nibble i + 4) as DT; `magic` in a register so that
    # mask-and-or is one LOP3
    if i == 0:
        t = (q & 0x000F000F) | magic
    else:
        t = ((q >> (4 * i)) & 0x000F000F) | magic
    lo = t.to(tl.int16).to(DT, bitcast=True)
    hi = (t >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def code_tile(q, magic, DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # q [BN, BW] words -> [BN, BK] DT codes + offset in K order. Each join adds a trailing (in-thread)
    # axis: [BN, BW, j bit 2, j bit 1, j bit 0], nibble j at k = 8w + j.
    l0, h0 = _pair_codes(q, 0, magic, DT)
    l1, h1 = _pair_codes(q, 1, magic, DT)
    l2, h2 = _pair_codes(q, 2, magic, DT)
    l3, h3 = _pair_codes(q, 3, magic, DT)
    w = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


# The decoded form (DEQUANT): one block of PTX a word, 8 weights as 4 pairs of x's 16-bit type: LOP3 makes (offset +
# code) exact, FMA by one adds -(offset + zero) (exact: small integers), FMA by the scale with a -0 addend rounds the
# product once. $0-$3: pairs (nibble i, nibble i + 4), i = 0..3; $4: the word; $5: -(offset + zero) and $6: the
# scale, each twice in one register; $7: the magic. Every operand is 32-bit and one instance takes one word, so no
# layout Triton picks can pair a word with another's scale (pack 2 on 16-bit operands did, at some tiles).
_DQ_BODY = """{ .reg .b32 t<4>, one, nzero;
mov.b32 one, ONE; mov.b32 nzero, 0x80008000;
lop3.b32 t0, $4, 0x000F000F, $7, 0xEA;
shr.u32 t1, $4, 4; lop3.b32 t1, t1, 0x000F000F, $7, 0xEA;
shr.u32 t2, $4, 8; lop3.b32 t2, t2, 0x000F000F, $7, 0xEA;
shr.u32 t3, $4, 12; lop3.b32 t3, t3, 0x000F000F, $7, 0xEA;
FMA t0, t0, one, $5; FMA $0, t0, $6, nzero;
FMA t1, t1, one, $5; FMA $1, t1, $6, nzero;
FMA t2, t2, one, $5; FMA $2, t2, $6, nzero;
FMA t3, t3, one, $5; FMA $3, t3, $6, nzero; }"""
_DQ_BF16: tl.constexpr = tl.constexpr(_DQ_BODY.replace("ONE", "0x3F803F80").replace("FMA", "fma.rn.bf16x2"))
_DQ_F16: tl.constexpr = tl.constexpr(_DQ_BODY.replace("ONE", "0x3C003C00").replace("FMA", "fma.rn.f16x2"))


@triton.jit
def _twice(v):
    # [BN] DT -> [BN, 1] int32 holding v's 16 bits in both halves
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (b | (b << 16))[:, None]


@triton.jit
def _halves(t, DT: tl.constexpr):
    # int32 pairs -> (low half, high half) as DT
    return t.to(tl.int16).to(DT, bitcast=True), (t >> 16).to(tl.int16).to(DT, bitcast=True)


@triton.jit
def dequant_tile(q, scale, nzoff, magic, DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ASM: tl.constexpr):  # fmt: skip
    # q [BN, BW] words, scale and nzoff = -(offset + zero) [BN] in DT (one group a tile) -> [BN, BK] DT weights
    # (code - zero) * scale in K order, rounded once. ASM: the pairs decoded by _DQ_* in registers (two 16-bit FMAs
    # a pair); else the same arithmetic in float32 (the interpreter), bit for bit equal.
    if ASM:
        asm: tl.constexpr = _DQ_BF16 if DT == tl.bfloat16 else _DQ_F16
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm, "=r,=r,=r,=r,r,r,r,r", [q, _twice(nzoff), _twice(scale), q * 0 + magic],
            dtype=(tl.int32,) * 4, is_pure=True, pack=1,
        )  # fmt: skip
        l0, h0 = _halves(p0, DT)
        l1, h1 = _halves(p1, DT)
        l2, h2 = _halves(p2, DT)
        l3, h3 = _halves(p3, DT)
        w = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
        return tl.reshape(w, [BLOCK_N, BLOCK_K])  # as code_tile's: nibble j = 4h + i at k = 8w + j
    codes = code_tile(q, magic, DT, BLOCK_N, BLOCK_K).to(tl.float32)
    return ((codes + nzoff[:, None].to(tl.float32)) * scale[:, None].to(tl.float32)).to(DT)


@triton.jit
def group_params(s_ptrs, z_ptrs, g, n_ok, offset, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
    # [BN] float32 scale and (offset + zero) of group g
    scale = tl.load(s_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zoff = tl.load(z_ptrs + g, mask=n_ok, other=0).to(tl.float32) + offset
    else:
        zoff = tl.full([BLOCK_N], 8.0, tl.float32) + offset
    return scale, zoff


@cached_launch
@triton.jit
def _w4a16_codes_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, ticket_ptr, magic, offset, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_ym,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr, EVEN_N: tl.constexpr,
    USE_PDL: tl.constexpr = False, DEQUANT: tl.constexpr = False, DQ_ASM: tl.constexpr = False,
    GROUP_M: tl.constexpr = 1, ROW_TILES: tl.constexpr = False,
):  # fmt: skip
    # y [M, N] (x's dtype); part [SPLIT_K, M, N] float32. The product is y^T = W @ x^T: the weight tile
    # [BN, BK] is the A operand (BN rows: the wgmma M), x^T [BK, BM] the B operand; acc [BN, BM].
    # DEQUANT: the tile is decoded with its scale and zero before the dot (`dequant_tile`), so one dot a tile into
    # one running accumulator instead of the codes' dot, the sums' dot and a scaled add.
    # ROW_TILES (M > BLOCK_M): programs along axis 0 walk the (row tile, column tile) grid in bands of GROUP_M row
    # tiles (grouped_tile), so that a weight tile is reused from L2 by the row tiles of a band; else one row tile
    # (the decode case) and a program a column tile, with no tile arithmetic.
    pdl_enter(USE_PDL)
    BW: tl.constexpr = BLOCK_K // 8
    num_n = tl.cdiv(N, BLOCK_N)
    if ROW_TILES:
        pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), num_n, GROUP_M)
    else:
        pid_m = 0
        pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, BW)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    magic = magic.to(tl.int32)
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :]  # [BN, BW]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    s_ptrs = s_ptr + offs_n * stride_sn  # [BN]
    z_ptrs = z_ptr + offs_n * stride_zn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_step = SPLIT_K * BLOCK_K  # split pid_k takes every SPLIT_K-th K tile
    # the scale and zero of a tile are loaded one iteration ahead (their latency off the tile's chain)
    scale, zoff = group_params(s_ptrs, z_ptrs, pid_k * BLOCK_K // GROUP, n_ok, offset, HAS_ZEROS, BLOCK_N)
    ones = tl.full([BLOCK_N, BLOCK_K], 1.0, tl.float32 if IEEE else DT)
    prec: tl.constexpr = "ieee" if IEEE else "tf32"  # (16-bit operands ignore it)
    for k0 in range(pid_k * BLOCK_K, K, k_step):
        if EVEN_N:
            q = tl.load(q_ptrs + k0 // 8)
        else:
            q = tl.load(q_ptrs + k0 // 8, mask=n_ok[:, None], other=0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        scale_k, zoff_k = scale, zoff
        nxt = tl.minimum(k0 + k_step, K - BLOCK_K)
        scale, zoff = group_params(s_ptrs, z_ptrs, nxt // GROUP, n_ok, offset, HAS_ZEROS, BLOCK_N)
        if DEQUANT:
            w = dequant_tile(q, scale_k.to(DT), (-zoff_k).to(DT), magic, DT, BLOCK_N, BLOCK_K, DQ_ASM)
            if IEEE:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        else:
            w = code_tile(q, magic, DT, BLOCK_N, BLOCK_K)
            if IEEE:  # the CPU interpreter (whose 16-bit dot is wrong): float32 dots of the same exact values
                xd = x.to(tl.float32)
                wd = w.to(tl.float32)
            else:
                xd = x
                wd = w
            part = tl.dot(wd, tl.trans(xd), input_precision=prec)  # [BN, BM]
            # sum_k x[m, k] broadcast over the rows, on the tensor cores: a constant A operand needs no
            # shared-memory round trip, where a row reduction of x took shuffles and a barrier
            xs = tl.dot(ones, tl.trans(xd), input_precision=prec)  # [BN, BM]
            acc += (part - zoff_k[:, None] * xs) * scale_k[:, None]
    acc = tl.trans(acc)  # [BM, BN]
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        part_row = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        last, total = publish_and_sum(acc, part_row, pid_k, M * N, mask, ticket_ptr + pid_m * num_n + pid_n, SPLIT_K)
        if last:
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)


def codes_block_k(group: int) -> int:
    """The K tile of the codes kernels for a group size: 64, or 32 for group 32; 0 when none fits."""
    return 64 if group % 64 == 0 else 32 if group % 32 == 0 else 0


def decoded_block_k(group: int, K: int) -> int:
    """The decoded form's K tile: 128, or 64, whichever first divides both the group and K; 0 when neither does."""
    return next((b for b in (128, 64) if group % b == 0 and K % b == 0), 0)


def split_programs(M: int) -> int:
    """The programs a decode-shaped 4-bit product's K split aims at (this module's and triton_w4a16's
    decode_split): 512 (four per SM) up to 32 rows, 256 past them, where each program's x tile is larger."""
    return 512 if M <= 32 else 256


def codes_config(M: int, N: int, K: int, group: int) -> dict[str, int] | None:
    """Tiles for the codes kernel on an int4 [N, K] weight with this group size, or None where it does not
    apply (K tiles of 64, or 32 for group 32; more than CODES_MAX_M rows). From the H100 sweep
    (benchmarks/results/w4a16_codes_sweep2_h100.json): 64-row weight tiles; K split into the fewest of 1, 2, 4,
    8 parts that gives 512 programs (four per SM), e.g. 8 for Qwen3-30B's qkv and o, 2 for Qwen3-8B's gate_up.
    Past 16 rows x's tile is 32 or 64 rows, and past 32 rows the split aims at 256 programs (w4a16_mid3_h100.json:
    at 64 rows Qwen3-30B's qkv 14.1 us split 4 against 20.4 split 8, Qwen3-8B's gate_up 62.8 unsplit against
    75.5 split 2)."""
    bk = codes_block_k(group)
    if not bk or K % bk or M > CODES_MAX_M:
        return None
    tiles = cdiv(N, 64)
    split = next((s for s in (1, 2, 4) if tiles * s >= split_programs(M)), 8)
    return {"CODES": 1, "BLOCK_M": max(16, next_pow2(M)), "BLOCK_N": 64, "BLOCK_K": bk,
            "SPLIT_K": min(split, K // bk), "num_warps": 4, "num_stages": 3}  # fmt: skip


def decoded_config(M: int, N: int, K: int, group: int) -> dict[str, int] | None:
    """Tiles for the decoded form (DEQUANT) from 17 rows of x on an int4 [N, K] weight whose group holds K tiles of
    128 (or 64), or None; past CODES_MAX_M rows `rows_config`'s. At 17-64 rows, from the H200 (session 68,
    benchmarks/results/w4a16_decoded_s68_h200.*: 36 tiles at 32 and 64 rows against the codes form or the
    dequantizing GEMM the rule ran before, and cuBLAS on the bf16 weight):
    - wide large weights (N / 64 >= 256: Qwen3-8B gate_up): 128 x 128 tiles, 8 warps, K in 2 at up to 32 rows (43.3
      against 53.5 us; cuBLAS 49.8), 64 x 128, 4 warps, unsplit past them (45.0 against 53.6; cuBLAS 50.5);
    - other large weights (N x K >= 2^25, deep: Qwen3-8B down, DeepSeek-V3 o): 128 x 128, 8 warps, K in 4 (32 rows
      26.0 / 54.2 against 27.9 / 65.1; 64 rows 31.0 / 79.0 against 42.8 / 95.9);
    - smaller weights: 64 x 128, 4 warps, K split into the fewest of 1, 2, 4 parts giving 256 programs (Qwen3-8B qkv
      19.3 / 18.0 against 18.3 / 21.5 at 32 / 64 rows, Qwen3-30B-A3B qkv 9.7 / 13.7 against 11.4 / 13.5)."""
    bk = decoded_block_k(group, K)
    if not bk or M <= 16:
        return None
    if M > CODES_MAX_M:
        return rows_config(M, N, K, bk)
    tiles64 = cdiv(N, 64)
    if N * K >= 1 << 25 and tiles64 >= 256:
        bn, warps, split = (128, 8, 2) if M <= 32 else (64, 4, 1)
    elif N * K >= 1 << 25:
        bn, warps, split = 128, 8, 4
    else:
        bn, warps = 64, 4
        split = next((s for s in (1, 2) if tiles64 * s >= 256), 4)
    return {"CODES": 1, "DEQUANT": 1, "BLOCK_M": max(16, next_pow2(M)), "BLOCK_N": bn, "BLOCK_K": bk,
            "SPLIT_K": min(split, K // bk), "num_warps": warps, "num_stages": 3}  # fmt: skip


def rows_split(m_tiles: int, n_tiles: int, k_tiles: int, programs: int = ROWS_PROGRAMS) -> int:
    """The fewest K parts of 1, 2, 4, 8 that give `programs` programs, stopping where a part would keep fewer than
    four K tiles."""
    for s in (1, 2, 4):
        if m_tiles * n_tiles * s >= programs or k_tiles < 4 * s:
            return s
    return 8


def rows_config(M: int, N: int, K: int, bk: int) -> dict[str, int]:
    """The decoded form past CODES_MAX_M rows (mid-concurrency decode batches and prefill), in row tiles, K split
    toward ROWS_PROGRAMS programs (`rows_split`). From the H200 (session 75, benchmarks/results/
    w4a16_prefill2_s75_h200.*: 10 tile shapes on Qwen3-8B's and Qwen3-30B-A3B's dense int4 weights at 96-8192 rows,
    within 1.18x of the best everywhere; 1.15-5.2x the dequantizing GEMM's tiles the rule ran before at 96-256 rows,
    1.16-1.44x at 8192):
    - up to 256 rows: 64 x 64 tiles, 4 warps; 128 x 64 on deep or wide weights (K >= 8192 or N >= 16384: Qwen3-8B's
      down and gate_up);
    - past 256 rows: 256 x 128, 8 warps, where those tiles number ROWS_PROGRAMS or more, else 128 x 64, 4 warps."""
    if M <= 256:
        bm, bn, warps = (128, 64, 4) if K >= 8192 or N >= 16384 else (64, 64, 4)
    elif cdiv(M, 256) * cdiv(N, 128) >= ROWS_PROGRAMS:
        bm, bn, warps = 256, 128, 8
    else:
        bm, bn, warps = 128, 64, 4
    split = min(rows_split(cdiv(M, bm), cdiv(N, bn), K // bk), K // bk)
    return {"CODES": 1, "DEQUANT": 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "GROUP_M": 8,
            "num_warps": warps, "num_stages": 3}  # fmt: skip


def codes_supported(M: int, K: int, group: int, fmt: str, x_dtype: torch.dtype, block_k: int,
                    decoded: bool = False) -> bool:  # fmt: skip
    """Whether `w4a16_codes` takes this product: int4 weights, 16-bit x, K tiles inside a group, and at most
    CODES_MAX_M rows on the codes form (the decoded form takes any rows, in row tiles)."""
    rows_ok = decoded or M <= CODES_MAX_M
    return fmt == "int4" and rows_ok and group % block_k == 0 and K % block_k == 0 and x_dtype in MAGIC


def w4a16_codes(
    x: torch.Tensor,  # [M, K] bf16 / fp16, unit stride along K, M <= BLOCK_M
    qweight: torch.Tensor,  # int32 [N, K // 8]
    scales: torch.Tensor,  # [N, K // G]
    zeros: torch.Tensor | None,  # uint8 [N, K // G] or None (zero 8)
    group: int,
    bias: torch.Tensor | None,  # [N]
    cfg: dict[str, int],  # BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, DEQUANT, GROUP_M]
) -> torch.Tensor:  # [M, N] x.dtype
    M, K = x.shape
    N = qweight.shape[0]
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    assert group % bk == 0 and K % bk == 0 and x.stride(1) == 1 and x.dtype in MAGIC, (M, K, group, cfg)
    assert M <= bm or cfg.get("DEQUANT"), "the codes form takes one row tile"
    split = max(1, min(split, K // bk))
    tiles = cdiv(N, bn) * cdiv(M, bm)
    magic, offset = MAGIC[x.dtype]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    split, tickets, part = split_scratch(x.device, "w4a16_codes", tiles, split, M, N)
    dt = tl.float16 if x.dtype == torch.float16 else tl.bfloat16
    s, z = scales, zeros if zeros is not None else scales  # s stands in for absent tensors (never read)
    _w4a16_codes_kernel[(tiles, split)](
        x, qweight, s, z, s if bias is None else bias, y, y if part is None else part,
        qweight if tickets is None else tickets,
        magic, offset, M, N, K, x.stride(0), qweight.stride(0), s.stride(0), z.stride(0), y.stride(0),
        GROUP=group, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, DT=dt, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, SPLIT_K=split, IEEE=_INTERPRET, EVEN_N=N % bn == 0,
        DEQUANT=bool(cfg.get("DEQUANT")), DQ_ASM=DQ_ASM and not _INTERPRET, GROUP_M=cfg.get("GROUP_M", 1),
        ROW_TILES=M > bm,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch(x.device),
    )  # fmt: skip
    return y
