"""int4 weight x 16-bit activation products at decode sizes (1-16 rows) on mma.sync, in Gluon:
y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the "int4" layout of kernels/quant_formats.py.

The weight side is kernels/gluon_w4_mma_tiles.py's (as the MoE kernels'): one LOP3 turns a word into two 16-bit A
operands (offset + code, exact), K is permuted logically inside a chunk of KC so a thread's words of a row are
adjacent in memory, and the codes' offset and zero leave through scale * (acc - (offset + zero) * sum(x)).

The B operand's NCOL = 8 (16 at 9-16 rows) columns are (row of x, K span) pairs: TOK = M padded to a
power of two, S = max(1, 8 / TOK) spans a chunk, column c = (row c // S, span c % S), x there and zero
outside the span. C[n, c] is one row's partial sum over one span, so a span must lie inside one
quantization group (GROUP % (KC / S) == 0) and the scale and zero apply once per chunk and column. At
one row this is the MoE kernels' eight-span form; at 8-16 rows every column is a row of x over the
whole chunk. The x sums of each column come from a second mma with an all-ones A (tensor cores, no
loads, already in C's layout). Where that leaves chunks under 128 elements (DEQUANT_MAX_SPANS), the weights
are decoded with their scales and zeros before the mma instead (`_chunk_dequant`), and spans may cross groups.

Layouts (mma_v2, batched, warps_per_cta = [W, 1, 1]; each warp its own A, B, C):
  words [W, ROWS, 4, RW] (gluon_w4_mma_tiles.layouts' w_l, as every layout here): memory word RW t + r of a row's
  chunk.
  x [W, NCOL, KC] in memory order: lane (t, column) holds its column's 8 RW contiguous elements from
  8 RW t (16-byte loads); reshaped [.., t, r, h, i] and permuted to logical k = 8 (4r + t) + 2i + h it
  is B's register layout (no data movement). Memory element e of a chunk lies in span e // (KC / S), so at
  1-4 rows a lane loads x only where that is its column's span (SPAN_MASKED_X: masked 16-byte loads; the
  other lanes issue no request) and each row of x leaves L1 once a chunk, not S times. The kernel is bound
  by L1/TEX at these sizes (docs/performance.md, session 21): on the H200 the masked loads took DeepSeek-V3
  o from 27.5 to 23.1 us at one row and Qwen3-8B gate_up from 21.9 to 18.7
  (benchmarks/results/w4a16_mma_rule_s41_h200.*).

Two ways to split the work (MmaLinearConfig.split):
  split 0: a program takes ROWS rows of W from n0; its W warps each take K / W of K in chunks, summed at
    the end through padded shared memory (`_warp_sum`). Every program reads all of x from L2: N / ROWS x M
    x K x 2 bytes, as many as the weight's at 16 rows and 32 rows a warp.
  split s >= 1: a program takes W x ROWS rows (warp w the w-th ROWS) over K / s of K; its warps load the
    same x chunk, so L1 can serve all but the first, and x leaves L2 s x N / (W ROWS) times instead. The s
    programs of a row tile publish float32 partials [s, M, N] and the last one out (kernels/tickets.py's
    protocol) adds them in split order (deterministic) and stores y.
Then the S spans of each row of x are added and y stored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ftransformers.kernels.gluon_mla_decode import _cta_barrier, pdl_enter
from ftransformers.kernels.gluon_w4_mma_tiles import (
    MAGIC,
    _b_tile,
    _chunk,
    _load_x,
    _pair,
    layouts,
    mma_capable,
    word_offsets,
)
from ftransformers.kernels.launch import cached_launch, maxnreg_option
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.tickets import split_scratch

MAX_ROWS = 16
# The cross-warp sum of the split-0 form through `_warp_sum`'s padded shared memory (False: gl.sum's own
# exchange; kept for benchmarks/bench_w4a16_mma.py --ab-warp-sum)
PADDED_WARP_SUM = True
# At 1-4 rows (S > 1 spans a chunk) column c of B is x only inside span c % S: a lane loads x only there (a
# masked load, no memory request elsewhere) instead of the whole chunk and zeroing S - 1 of S spans after it.
# False restores the full loads (for an A/B)
SPAN_MASKED_X = True
# Each form's register cap (`register_cap`, the launch option maxnreg) and, at two rows, every weight here
# (`takes`). False: ptxas's own register counts and the GEMV at two rows on weights under LARGE (for an A/B)
REGISTER_CAPS = True
# The first chunk's words are loaded before the PDL wait (they are constant), and `triton_w4a16.w4a16_reads_ahead`
# says so for the rows taken here, so the RMSNorm or attention stage 2 before the product triggers early (pdl.py).
# False: loaded after the wait, no early trigger (for an A/B)
PRELOAD_WORDS = True


def tokens_and_spans(m: int, group: int = 128) -> tuple[int, int]:
    """(TOK, S): rows of x padded to a power of two, and K spans a chunk (TOK * S = NCOL = max(8, TOK); 16 where
    SMALL_GROUP_COLUMNS and 8 / TOK spans of one group would make a chunk under 128 elements)."""
    tok = 1 << max(0, (m - 1).bit_length())
    if SMALL_GROUP_COLUMNS and tok <= 8 and group * (8 // tok) < 128:
        return tok, 16 // tok
    return tok, max(1, 8 // tok)


# A span lies in one quantization group, so at group 32 and 4-8 rows of x (2-1 spans a chunk) a chunk is 64-32
# elements, and each lane loads its words 8 or 4 bytes at a time: Kimi-K2's dense int4 products (g32) at 8 rows took
# twice AWQ's g128 time in a DeepSeek-V3 step (session 66, tl_dsv3_w4a16{,g32}_b8_s66_h200.*: 547 against 277 us on
# the critical path). With 16 columns (twice the spans) the chunks double: in that step (3 layers, g32, H200,
# ab_smallgroup_dsv3_w4a16g32_s66_h200.*) B=8 took 1.860 against 2.016 ms (the products 389 against 545 us on the
# critical path), B=4 level (1.413 against 1.403; 346 against 380 us).
SMALL_GROUP_COLUMNS = True
# Where a span of one group still leaves chunks under 128 elements (group 32 at 9-16 rows: 32) and a chunk holds up
# to this many spans, decode the weights with their scales and zeros before the mma instead (`_chunk_dequant`), so a
# span may cross groups and the chunk grows to `dequant_chunk` (128 at group 32). The product rounds to x's dtype once
# a weight, as a bf16 dequantized weight does. 0: never. Kimi-K2's format in a 3-layer DeepSeek-V3 step (H200, session
# 67, ab_dequant{,2}_dsv3_w4a16g32_s67_h200.*), at up to 8 spans: B=16 2.687 against 2.922 ms (the dense products
# 331 against 575 us on the critical path), B=8 1.812 against 1.834 (16 columns of 2 spans, chunks of 64), B=4 level
# (chunks of 128 already). At 2 spans the 8-row form under its 128-register cap spills offline (52 bytes, Triton 3.9),
# so 1 span: the 16-row gain. At 1 against 0 (ab_dequant_default_*): B=16 2.652 against 2.920 ms, B=32 level (4.499
# against 4.494: no product of 9-16 rows there).
DEQUANT_MAX_SPANS = 1


@gluon.jit
def _warp_sum(tot, W: gl.constexpr, ROWS: gl.constexpr, NCOL: gl.constexpr):
    # tot [W, ROWS, NCOL] summed over the warps through shared memory whose rows of 16 columns are padded to 24
    # words, so that by bank arithmetic the C fragments' 8-byte stores meet no conflict and the row-contiguous
    # loads 2-way at most (rows of 8 need no padding). gl.sum's own exchange had 8.5-way conflicts at 16 rows
    # (88% of its shared wavefronts excess, benchmarks/results/ncu_w4_l1_dense_dsv3_o_16_h100.txt); a
    # swizzle tried first, 50% on its stores (ncu_w4_warpsum_dense_dsv3_o_16_h100.txt). Partials are added
    # warp by warp, in a fixed order.
    if NCOL == 16:
        lay: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[16, 8]], [W, ROWS, NCOL], [2, 1, 0])
    else:
        lay: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    red = gl.allocate_shared_memory(gl.float32, [W, ROWS, NCOL], lay)
    red.store(tot)
    _cta_barrier()
    back: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32 // NCOL, NCOL], [1, W, 1], [2, 1, 0])
    y = red.slice(0, 1).load(back)
    for w in gl.static_range(1, W):
        y += red.slice(w, 1).load(back)
    return gl.sum(y, axis=0)  # [1, ROWS, NCOL] -> [ROWS, NCOL]


@gluon.jit
def _store_y(y, y_ptr, bias_ptr, n_idx, tok, M, stride_ym, HAS_BIAS: gl.constexpr):
    # y [.., TOK] float32 at rows n_idx (broadcast over tok) and rows of x tok < M
    if HAS_BIAS:
        y = y + gl.load(bias_ptr + n_idx).to(gl.float32)
    gl.store(y_ptr + tok.to(gl.int64) * stride_ym + n_idx, y.to(y_ptr.dtype.element_ty), mask=tok < M)


@gluon.jit
def _split_store_y(y, y_ptr, bias_ptr, part_ptr, cnt_ptr, n_idx, tok, M, N, stride_ym, HAS_BIAS: gl.constexpr,
                   SPLIT: gl.constexpr):  # fmt: skip
    # y [.., TOK] float32, this program's share of K at rows n_idx: stored (SPLIT 1), or published as a partial
    # [SPLIT, M, N] float32 at program_id(1), the last of row tile program_id(0)'s SPLIT programs adding them in
    # split order (deterministic) and resetting its ticket counter
    if SPLIT == 1:
        _store_y(y, y_ptr, bias_ptr, n_idx, tok, M, stride_ym, HAS_BIAS)
    else:
        part = part_ptr + tok.to(gl.int64) * N + n_idx
        last, total = publish_and_sum(y, part, M * N, tok < M, 0.0, cnt_ptr + gl.program_id(0), gl.program_id(1),
                                      SPLIT)  # fmt: skip
        if last:
            _store_y(total, y_ptr, bias_ptr, n_idx, tok, M, stride_ym, HAS_BIAS)


@gluon.jit
def publish_and_sum(acc, part, plane, mask, other, counter, index, SPLIT: gl.constexpr):
    """kernels/tickets.py's publish_and_sum in Gluon, for a program's float32 `acc` in any layout: store it at
    part + index * plane (where `mask`; `other` 0.0 with a mask, None without), take an acq_rel ticket on `counter`;
    the program holding the last ticket resets the counter and adds the SPLIT partials in split order (the same sum
    whichever ends last). Returns (is_last, the sum; `acc` itself on the other programs)."""
    gl.store(part + index * plane, acc, mask=mask)
    _cta_barrier()  # every warp's partial is stored before the release ticket
    last = gl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1
    total = acc
    if last:
        gl.store(counter, 0)
        total = gl.load(part, mask=mask, other=other, cache_modifier=".cg")
        for sp in gl.static_range(1, SPLIT):  # from L2, where the tickets made them visible
            total += gl.load(part + sp * plane, mask=mask, other=other, cache_modifier=".cg")
    return last, total


@gluon.jit
def _word_t(w_l: gl.constexpr):
    # [1, 1, 4, 1] in w_l: the lane quarter t of a chunk's words RW t .. RW t + RW - 1
    l3: gl.constexpr = gl.SliceLayout(3, w_l)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 0), 3)


@gluon.jit
def _chunk_dequant(q, x, sw, zw, magic, tot, DT: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr,
                   NCOL: gl.constexpr, RW: gl.constexpr, S: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
                   b_l: gl.constexpr, ZEROED: gl.constexpr = False):  # fmt: skip
    # tot [W, ROWS, NCOL] += A.B over one chunk, A = (offset + code - (offset + zero)) * scale decoded per word before
    # the mma (sw, zw [W, ROWS, 4, RW] DT: each word's scale and offset + zero; a lane's RW words lie in one group),
    # so a span need not lie in one group. offset + code - (offset + zero) is exact; the product rounds once to DT.
    qw = gl.reshape(gl.permute(q, (0, 1, 3, 2)), [W, ROWS, 4 * RW])
    q2 = gl.join(qw, qw)
    s1 = gl.reshape(gl.permute(sw, (0, 1, 3, 2)), [W, ROWS, 4 * RW])
    s2 = gl.join(s1, s1)
    z1 = gl.reshape(gl.permute(zw, (0, 1, 3, 2)), [W, ROWS, 4 * RW])
    z2 = gl.join(z1, z1)
    m2 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [q2 * 0 + magic], dtype=gl.int32, is_pure=True, pack=1)
    c = gl.join(gl.join((_pair(q2, m2, 0, DT) - z2) * s2, (_pair(q2, m2, 1, DT) - z2) * s2),
                gl.join((_pair(q2, m2, 2, DT) - z2) * s2, (_pair(q2, m2, 3, DT) - z2) * s2))  # fmt: skip
    c = gl.permute(c, (0, 1, 2, 5, 4, 3))  # as _a_tile's: logical k = 8 (4r + t) + 2i + h
    a = gl.convert_layout(gl.reshape(c, [W, ROWS, 32 * RW]), a_l, assert_trivial=True)
    return mma_v2(a, _b_tile(x, b_l, W, NCOL, RW, S, ZEROED), tot)


@cached_launch
@gluon.jit
def _w4a16_mma_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N,
    stride_xm, stride_qn, stride_sn, stride_ym,
    HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
    TOK: gl.constexpr, S: gl.constexpr, ROWS: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr,
    PADDED_SUM: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, w_l: gl.constexpr,
    x_l: gl.constexpr, MASK_X: gl.constexpr = False, PRELOAD: gl.constexpr = False, USE_PDL: gl.constexpr = False,
    DEQUANT: gl.constexpr = False,
):  # fmt: skip
    # SPLIT 0: y[m, n] for m < M, n in [n0, n0 + ROWS); warp w over K [w KS, (w + 1) KS), KS = CHUNKS * KC.
    # SPLIT >= 1: warp w's rows [n0 + w ROWS, n0 + (w + 1) ROWS) over K [k0, k0 + KS), k0 = program_id(1) KS
    RW: gl.constexpr = KC // 32
    KS: gl.constexpr = CHUNKS * KC
    NCOL: gl.constexpr = TOK * S
    SPAN: gl.constexpr = KC // S
    DT: gl.constexpr = x_ptr.dtype.element_ty
    WROWS: gl.constexpr = ROWS if SPLIT > 0 else 0  # a warp's step in rows of W
    WK: gl.constexpr = 0 if SPLIT > 0 else KS  # and in K
    if SPLIT > 0:
        n0 = gl.program_id(0) * (W * ROWS)
        k0 = gl.program_id(1) * KS
    else:
        n0 = gl.program_id(0) * ROWS
        k0 = 0

    # words [W, ROWS, 4, RW]: row n0 + w WROWS + row, word (k0 + w WK) / 8 + RW t + r of the chunk
    ww, wrow, word = word_offsets(w_l, W, ROWS, RW)
    q_ptrs = q_ptr + (n0 + ww * WROWS + wrow).to(gl.int64) * stride_qn + k0 // 8 + ww * (WK // 8) + word
    if PRELOAD:  # the first chunk's words are constant: requested before the wait (kernels/pdl.py)
        q = gl.load(q_ptrs)
    pdl_enter(USE_PDL)
    if not PRELOAD:
        q = gl.load(q_ptrs)

    # x [W, NCOL, KC]: row min(c // S, M - 1) (padding columns repeat the last row; never stored)
    x2: gl.constexpr = gl.SliceLayout(2, x_l)
    xw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, x2)), 1), 2)
    xc = gl.expand_dims(gl.expand_dims(gl.arange(0, NCOL, layout=gl.SliceLayout(0, x2)), 0), 2)
    xk = gl.expand_dims(gl.expand_dims(gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(0, x_l))), 0), 0)
    x_ptrs = x_ptr + gl.minimum(xc // S, M - 1).to(gl.int64) * stride_xm + k0 + xw * WK + xk
    ZEROED: gl.constexpr = MASK_X and S > 1
    # [1, NCOL, KC]: memory element e of a chunk is in span e // SPAN (contiguous runs of SPAN >= 8 elements,
    # so the masked loads keep their 16-byte vectors)
    x_mask = (xk // SPAN) == (xc % S)

    # scales / zeros [W, ROWS, NCOL] in C's layout: row n0 + w WROWS + row, group of column c's span start
    m2: gl.constexpr = gl.SliceLayout(2, mma)
    mw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, m2)), 1), 2)
    mrow = gl.expand_dims(gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, m2)), 0), 2)
    mcol = gl.expand_dims(gl.expand_dims(gl.arange(0, NCOL, layout=gl.SliceLayout(0, gl.SliceLayout(0, mma))), 0), 0)
    s_rows = (n0 + mw * WROWS + mrow).to(gl.int64) * stride_sn
    if S > 1:
        span_k = k0 + mw * WK + (mcol % S) * SPAN
    else:  # one group for every column: [W, 1, 1], so a thread loads a row's scale and zero once, not per column
        span_k = k0 + mw * WK

    ones = gl.full([W, 16, KC], 1.0, DT, a_l)
    tot = gl.zeros([W, ROWS, NCOL], gl.float32, mma)
    if DEQUANT:  # each word's group: [W, ROWS, 4, 1], a lane's RW words in one (KC / 4 divides GROUP)
        s_rows4 = (n0 + ww * WROWS + wrow).to(gl.int64) * stride_sn
        k4 = k0 + ww * WK + _word_t(w_l) * (KC // 4)
        ones_w = gl.full([W, ROWS, 4, RW], 1.0, DT, w_l)
    x = _load_x(x_ptrs, x_mask, ZEROED)
    for c in range(CHUNKS):
        q_c, x_c = q, x
        if CHUNKS > 1:  # the next chunk's words and x are requested before this chunk's mmas
            q = gl.load(q_ptrs + gl.minimum(c + 1, CHUNKS - 1) * (KC // 8))
            x = _load_x(x_ptrs + gl.minimum(c + 1, CHUNKS - 1) * KC, x_mask, ZEROED)
        if DEQUANT:
            g4 = s_rows4 + (k4 + c * KC) // GROUP
            sw = gl.load(s_ptr + g4).to(DT) * ones_w
            if HAS_ZERO:
                zw = (gl.load(z_ptr + g4).to(gl.float32) + offset).to(DT) * ones_w
            else:
                zw = (ones_w.to(gl.float32) * (offset + 8.0)).to(DT)
            tot = _chunk_dequant(q_c, x_c, sw, zw, magic, tot, DT, W, ROWS, NCOL, RW, S, mma, a_l, b_l, ZEROED)
        else:
            g = (span_k + c * KC) // GROUP
            tot = _chunk(q_c, x_c, s_ptr + s_rows + g, z_ptr + s_rows + g, ones, magic, offset, tot, HAS_ZERO, DT,
                         W, ROWS, NCOL, RW, S, mma, a_l, b_l, ZEROED)  # fmt: skip

    if SPLIT == 0:
        if PADDED_SUM:
            y = _warp_sum(tot, W, ROWS, NCOL)  # [ROWS, NCOL]
        else:
            y = gl.sum(tot, axis=0)
        if S > 1:
            y = gl.sum(gl.reshape(y, [ROWS, TOK, S]), axis=2)  # [ROWS, TOK]
        rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, y.type.layout)), 1)
        toks = gl.expand_dims(gl.arange(0, TOK, layout=gl.SliceLayout(0, y.type.layout)), 0)
        _store_y(y, y_ptr, bias_ptr, n0 + rows, toks, M, stride_ym, HAS_BIAS)
    else:
        y = tot  # [W, ROWS, NCOL]
        if S > 1:
            y = gl.sum(gl.reshape(y, [W, ROWS, TOK, S]), axis=3)  # [W, ROWS, TOK]
        y3: gl.constexpr = y.type.layout
        yw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, y3))), 1), 2)
        yr = gl.expand_dims(gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, y3))), 0), 2)
        toks = gl.expand_dims(gl.expand_dims(gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(0, y3))), 0), 0)
        n_idx = n0 + yw * ROWS + yr  # [W, ROWS, 1]
        _split_store_y(y, y_ptr, bias_ptr, part_ptr, cnt_ptr, n_idx, toks, M, N, stride_ym, HAS_BIAS, SPLIT)


@dataclass(frozen=True)
class MmaLinearConfig:
    """ROWS rows of W a warp (16, 32 or 64), W warps a program, chunks of at most KC. split 0: the warps
    split K (a program takes ROWS rows over all of K); split s >= 1: the warps split N (a program takes W x
    ROWS rows and shares x among its warps) and s programs split K (module docstring)."""

    rows: int = 32
    warps: int = 8
    kc: int = 256
    split: int = 0
    maxnreg: int = 0  # registers a thread ptxas may use (a launch option); 0: its own choice

    def tile(self) -> int:
        """Rows of W a program takes."""
        return self.rows * (self.warps if self.split else 1)

    def k_share(self, k: int) -> int:
        """The K a warp runs over."""
        return k // (self.split or self.warps)


SWEEP = [MmaLinearConfig(rows, warps, kc) for rows in (16, 32) for warps in (4, 8, 16) for kc in (128, 256, 512)]
# 64 rows a warp halve the x a program reads per weight row (x comes from L2 once per program); chunks of 128
# keep them unspilled (sm_90, Triton 3.6: 248 registers at 16 rows of x, 166 at 2-8)
SWEEP += [MmaLinearConfig(64, warps, 128) for warps in (4, 8)]
# warps over N sharing x, programs over K
SWEEP += [
    MmaLinearConfig(rows, warps, 128, split) for rows in (16, 32) for warps in (4, 8) for split in (1, 2, 4, 8, 16)
]


# Weights from 2^25 elements (Qwen3-8B's MLP, DeepSeek-V3's o and q_b) are "large" (`takes`); from 2^24
# "medium" (Qwen3-8B's qkv and o, DeepSeek-V3's shared-expert gate_up)
LARGE = 1 << 25
MEDIUM = 1 << 24
# Programs of 8 warps that run in one wave (the H100's and H200's 132 SMs, one such program an SM at 9-16 rows)
WAVE = 132


def default_config(m: int, n: int, k: int) -> MmaLinearConfig:
    """The form `form` picks for M rows of x and an [N, K] weight, with its `register_cap`."""
    cfg = form(m, n, k)
    return replace(cfg, maxnreg=register_cap(m, cfg))


def register_cap(m: int, cfg: MmaLinearConfig) -> int:
    """Registers a thread ptxas may use for this form at M rows (0: its own choice). Left to itself ptxas
    gives most forms far fewer registers than still fit their programs an SM; with the cap it uses them for
    loads in flight. From the H200 (benchmarks/results/w4a16_mma_caps{,_small,_mid}_s42_h200.*: every default
    config at 1-16 rows on ten weights, int4 g128, capped at 0 / 96 / 128 / 168 / 255, in one process; each
    kernel's registers, spills and programs an SM as that device's ptxas built it), us against uncapped:
    - 168 on 32 rows, 4 warps, chunks of 256 (141 registers uncapped; three programs an SM either way):
      Qwen3-8B gate_up 17.5 / 18.0 against 18.5 / 18.4 at 1 / 2 rows;
    - 128 on the other 32-row forms of 8 or 16 warps (100-105 registers uncapped, the same programs an SM at
      128, ptxas spilling 0-2 bytes there): Qwen3-8B down 11.0 / 11.0 / 11.3 / 11.5 against 12.0 / 12.1 / 12.5
      / 12.5 at 1-4 rows, 14.3 against 15.8-15.9 at 6-8; DeepSeek-V3 o 27.2-27.3 against 27.9-28.0 at 3-4 rows,
      27.8 / 28.5 against 28.5 / 29.0 at 6 / 8 (168 took 32-34 there, one program an SM);
    - 255 on the split forms (ptxas takes 148-206 and one program an SM): Qwen3-8B o 6.8-7.9 against
      7.8-8.6 at 3-8 rows, 9.4 / 10.4 against 10.1 / 11.0 at 12 / 16; DeepSeek-V3 shared gate_up 9.7-10.9
      against 11.5-12.1, 12.6 / 13.5 against 13.6 / 14.8; Qwen3-8B qkv 12.3 / 13.6 against 13.6 / 14.9;
    - 128 on the 16-row forms at 1-8 rows (61-71 registers uncapped, 92-102 capped): Qwen3-30B-A3B o 4.1-5.0
      against 5.2-5.7, qkv 4.5-4.8 against 5.1-5.3 at 1-4 rows (5.9 against 5.7 at 8), DeepSeek-V3 shared down
      4.9 / 5.1 against 5.6 / 5.7 at 1 / 2 rows, Qwen3-8B o 6.9 against 8.2, qkv 8.0 / 8.1 against 9.1 / 9.2
      at 1 / 2 rows (9.5 / 9.8 against 9.3 / 9.4 at 3 / 4, the cap's worst);
    - none where ptxas already takes what fits (64 rows a warp: 168 at 1-8 rows, 247 at 9-16; the deep
      one- and two-row form, 220-226) or where the caps measured no better or worse (16-row forms at 9-16
      rows: Qwen3-30B-A3B qkv 7.9 against 9.7 at 168, DeepSeek-V3 shared down 12.8 against 9.8)."""
    if not REGISTER_CAPS:
        return 0
    if cfg.split:
        return 255
    if cfg.rows == 16:
        return 128 if m <= 8 else 0
    if cfg.rows == 32 and cfg.warps == 4:
        return 168 if cfg.kc == 256 else 0
    return 128 if cfg.rows == 32 else 0


def form(m: int, n: int, k: int) -> MmaLinearConfig:
    """Large weights at 1-4 rows (x loaded on its spans only, SPAN_MASKED_X), from the H200 sweep
    (benchmarks/results/w4a16_mma_spanmask_s41_h200.{json,log}, int4 g128 asym at 1, 2 and 4 rows), us:
    - wide weights (N / 64 >= 256) at 3-4 rows, or with K < 4096 at any: 64 rows a warp, 4 warps, chunks of 128
      (Qwen3-8B gate_up at 4 rows 21.2 against 22.4 for 32 rows; DeepSeek-V3 q_b at 1 / 2 / 4 rows 8.4 / 8.7 /
      8.9 against 9.7 / 9.9 / 10.1);
    - other wide weights (Qwen3-8B gate_up at 1-2 rows): 32 rows, 4 warps, chunks of 256 (18.4 / 18.4 against
      20.7 / 21.0 for 64 rows);
    - deep ones (K / 4 >= 4096: DeepSeek-V3 o): 32 rows, 4 warps of 512-wide chunks at 1-2 rows (22.8 / 24.8
      against 27.3 / 27.5 for 8 warps of 128), 8 warps of 128 at 3-4 (28.0 against 34.3 for chunks of 256);
    - narrow ones (N / 32 < 256: Qwen3-8B down): 32 rows, 16 warps, chunks of 128 (11.9 / 12.4 / 12.6 at 1 / 2
      / 4 rows against 12.4 / 12.4 / 14.8 for 8 warps of 256; at one row chunks of 256 took 11.4, but 512
      threads cap ptxas at 128 registers and it spills 40 bytes there, tests/test_gluon_mma_compile.py).
    Elsewhere from the H100 sweep (benchmarks/results/w4a16_mma_v1_h100.{json,log}, int4 g128 asym at 1, 4 and
    16 rows, before the span-masked x): at every swept point `takes` sends here, this rule lands on the fastest
    of the 18 configs or within 2% (not where it does not: Qwen3-30B-A3B qkv at 16 rows 10.3 against 9.0 us for
    32 rows a warp). Large weights at 5-8 rows: 32 rows a warp; 4 warps where that still leaves 256 programs,
    else 8 (Qwen3-8B down 15.9 / 16.3 / 20.5; DeepSeek-V3 o at 4 and 16 rows 32.2 / 46.5 against 33.8 / 58.8
    for 4). Smaller weights: 16 rows, 4 warps at 256 programs, else 8, chunks of 128
    (Qwen3-30B-A3B qkv / o at 4 rows: 6.0 / 5.9 us). 64 rows a warp where x's reads from L2 weigh most
    (benchmarks/results/w4a16_mma_rows64_h100.{json,log}): 5-8 rows on wide weights, 4 warps (Qwen3-8B
    gate_up at 8 rows 28.1 us against 30.6 for the next config and 34.6 for 32 rows, 4 warps), and 9-16 rows
    on deep ones, 8 warps (DeepSeek-V3 o at 16 rows 39.8 against 46.8); not at 4 rows or on Qwen3-8B down,
    where they were not faster. At 9-16 rows, re-swept with `_warp_sum`
    (benchmarks/results/w4a16_mma_padsum_h100.*): 64 rows a warp on deep or wide weights, 8 warps (4 where
    K < 4096; at 12 / 16 rows DeepSeek-V3 o 35.3 / 36.1 us, Qwen3-8B gate_up 32.0 / 33.3 against 33.3 / 35.1
    for 32 rows, 4 warps, DeepSeek-V3 q_b 15.8 / 16.7 against 16.6 / 17.8), else 32 rows, 16 warps (Qwen3-8B
    down 17.4 / 18.5 against 22.3 / 22.7 for 8; 512 threads cap ptxas at 128 registers, so it spills 16
    bytes, and is still the fastest swept).
    Medium weights take the form whose warps split N (benchmarks/results/w4a16_mma_split_medium_h100.*):
    32 rows a warp, 8 warps (256 rows a program); at 9-16 rows K split into the most programs that still run
    in one wave (Qwen3-8B qkv 24 tiles x 4: 14.3 us against 16.4 for the 16-row form; o and DeepSeek-V3's
    shared gate_up 16 x 8: 10.8 / 14.7 against 10.9 / 16.4); at 3-8 rows K in 8 where K >= N (Qwen3-8B o 8.5
    / 8.9 against 9.2 / 9.2 at 4 / 8 rows, shared gate_up 12.8 / 12.5 against 14.9 / 14.5), not where K < N
    (Qwen3-8B qkv 10.7 / 11.2 against 10.1 / 10.1)."""
    if n * k >= LARGE:
        if m > 8:
            if n % 64 == 0 and (k >= 16384 or n // 64 >= 256):
                return MmaLinearConfig(rows=64, warps=8 if k >= 4096 else 4, kc=128)
            return MmaLinearConfig(rows=32, warps=16, kc=128)
        if wide_weight(n) and (m > 2 or k < 4096):
            return MmaLinearConfig(rows=64, warps=4, kc=128)
        if m <= 4 and not wide_weight(n):
            if k // 4 >= 4096:  # deep
                return MmaLinearConfig(32, 4, 512) if m <= 2 else MmaLinearConfig(32, 8, 128)
            if n // 32 < 256:  # narrow
                return MmaLinearConfig(rows=32, warps=16, kc=128)
        return MmaLinearConfig(rows=32, warps=4 if n // 32 >= 256 else 8, kc=256)
    if n * k >= MEDIUM and n % 256 == 0 and m > 2 and (m > 8 or k >= n):
        split = 8
        while split > 1 and (m > 8 and n // 256 * split > WAVE or k % (128 * split)):
            split //= 2
        return MmaLinearConfig(rows=32, warps=8, kc=128, split=split)
    return MmaLinearConfig(rows=16, warps=4 if n // 16 >= 256 else 8, kc=128)


def wide_weight(n: int) -> bool:
    """N splits into at least 256 tiles of 64 rows (Qwen3-8B's gate_up, DeepSeek-V3's q_b)."""
    return n % 64 == 0 and n // 64 >= 256


def takes(m: int, n: int, k: int, has_zero: bool) -> bool:
    """Whether w4a16_linear runs this product here rather than on its CUDA-core GEMV (1-2 rows) or codes
    kernel (3-16 rows), from the same-process comparison in benchmarks/results/w4a16_mma_v1_h100.{json,log}.
    Large weights at 2-16 rows: 1.2-1.8x faster (Qwen3-8B down 16.3 against 27.9 us at 4 rows, DeepSeek-V3 o
    32.2 against 57.6); at one row with zero points (DeepSeek-V3 o 28.5 against 39.2, Qwen3-8B down 15.8
    against 17.2), and symmetric ones only on wide weights: on the H200 with the span-masked x
    (benchmarks/results/w4a16_mma_spanmask_s41_h200.*) Qwen3-8B gate_up 17.9 against the GEMV's 21.5 us and
    DeepSeek-V3 q_b 9.7 (32 rows a warp; 64 took 8.4 asymmetric) against 13.0, while on deep or narrow ones the
    symmetric GEMV is as fast or faster (DeepSeek-V3 o 22.6 against 22.5, Qwen3-8B down 10.3 against 12.5).
    Smaller weights at 3-4 rows in that sweep (Qwen3-30B-A3B qkv 6.0 against 7.5 us): at 1-2 rows the GEMV is
    faster (4.5-4.9 against 5.5-5.9), at 16 the codes kernel (8.3 against 9.0); 5-8 rows are below.
    Past 8 rows on DeepSeek-V3's q_b (24576 x 1536), where the codes kernel was as fast or faster (17.5 /
    17.6 against 17.7 / 18.5 us at 12 / 16 rows; benchmarks/results/w4a16_mma_rule64_h100.*), only since
    `_warp_sum` and 64 rows a warp there (15.8 / 16.7 against 17.7 / 17.8; w4a16_mma_padsum_h100.*).
    From benchmarks/results/w4a16_mma_split_medium_h100.*: medium weights at 3-16 rows (`default_config`; at
    4 / 8 / 16 rows Qwen3-8B qkv 10.1 / 10.1 / 14.3 us against 15.0 / 15.2 / 15.9, o 8.5 / 8.9 / 10.8 against
    11.6 / 11.9 / 12.4, DeepSeek-V3 shared gate_up 12.8 / 12.5 / 14.7 against 17.3 / 17.3 / 17.8); not at 2
    rows, where neither form wins on all four medium weights. Small weights at 3-8 rows (5-8 rows pad x to the
    same 8 columns as 4: Qwen3-30B-A3B qkv 6.0 / 6.2 against 7.6 at 5 / 8 rows, o 6.1 / 6.0 against 7.3,
    DeepSeek-V3 shared down 6.8 / 7.0 against 10.2 / 10.4). At two rows every weight, with the register caps
    (`register_cap`; benchmarks/results/w4a16_mma_caps{,_small}_s42_h200.*, against the GEMV in one process):
    Qwen3-30B-A3B qkv 4.8 / 4.4 us (asymmetric / symmetric) against 5.8 / 5.6, o 4.1 / 4.1 against 4.8 / 4.4,
    DeepSeek-V3 shared down 5.1 / 5.8 against 7.5 / 7.3, Qwen3-8B qkv 8.1 against 10.0, o 7.0 against 7.2,
    DeepSeek-V3 shared gate_up 11.2 against 12.5 (asymmetric); at one row the GEMV stays as fast or faster
    (Qwen3-30B-A3B qkv 4.3 against 4.6, Qwen3-8B o 5.9 against 6.9)."""
    if n * k >= LARGE:
        return 2 <= m <= MAX_ROWS or (m == 1 and (has_zero or wide_weight(n)))
    if m == 2 and REGISTER_CAPS:
        return True
    if n * k >= MEDIUM:
        return 3 <= m <= MAX_ROWS
    return 3 <= m <= 8


def chunk_k(ks: int, group: int, spans: int, most: int) -> int:
    """The largest chunk KC <= most (a power of two >= 32) dividing ks whose span KC / spans is whole words
    (>= 8) and divides the group; 0 if none."""
    kc = most
    while kc >= 32:
        if ks % kc == 0 and kc // spans >= 8 and group % (kc // spans) == 0:
            return kc
        kc //= 2
    return 0


def supported(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: MmaLinearConfig) -> bool:
    """Whether the kernel takes x [M, K] @ W^T for this int4 qweight [N, K // 8] and cfg: CUDA compute
    capability >= 8.0, bf16 / fp16 x, 1 <= M <= 16, N a multiple of ROWS, a chunk for K / W."""
    if not mma_capable(x) or x.dtype not in MAGIC:
        return False
    return fits(x.shape[0], qweight.shape[0], x.shape[1], group, cfg)


def fits(m: int, n: int, k: int, group: int, cfg: MmaLinearConfig) -> bool:
    """The shape part of `supported`: 1 <= M <= 16, N a multiple of a program's rows, a chunk for a warp's K."""
    _, spans = tokens_and_spans(max(m, 1), group)
    return (1 <= m <= MAX_ROWS and n % cfg.tile() == 0 and k % (cfg.split or cfg.warps) == 0
            and chunk_k(cfg.k_share(k), group, spans, cfg.kc) > 0)  # fmt: skip


def w4a16_mma(
    x: torch.Tensor,  # [M, K] bf16 / fp16, unit stride along K, 1 <= M <= 16
    qweight: torch.Tensor,  # int32 [N, K // 8]
    scales: torch.Tensor,  # [N, K // G]
    zeros: torch.Tensor | None,  # uint8 [N, K // G] or None (zero 8)
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    cfg: MmaLinearConfig | None = None,
) -> torch.Tensor:  # [M, N] x.dtype
    m, k = x.shape
    n = qweight.shape[0]
    cfg = cfg or default_config(m, n, k)
    assert supported(x, qweight, group, cfg), (tuple(x.shape), group, cfg)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = n // cfg.tile()
    cnt, part = None, None
    if cfg.split > 1:  # unsplit where no ticket counters can be had (a capture before the pool exists)
        split, cnt, part = split_scratch(x.device, "w4a16_mma", tiles, cfg.split, m, n)
        cfg = replace(cfg, split=split)
    _w4a16_mma_kernel[(tiles, max(1, cfg.split))](
        *kernel_args(x, qweight, scales, zeros, bias, y, part, cnt),
        **constexprs(m, k, group, zeros is not None, bias is not None, cfg), num_warps=cfg.warps,
        **maxnreg_option(cfg.maxnreg), **pdl_launch(x.device),
    )  # fmt: skip
    return y


def kernel_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                bias: torch.Tensor | None, y: torch.Tensor, part: torch.Tensor | None,
                cnt: torch.Tensor | None) -> tuple:  # fmt: skip
    """The positional arguments of the dense int4 kernels here and in gluon_w4a16_wgmma (x_ptr .. stride_ym), for
    unit-stride rows; absent tensors stand in as others (never read)."""
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1
    assert zeros is None or zeros.stride(1) == 1
    magic, offset = MAGIC[x.dtype]
    return (x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
            part if part is not None else y, cnt if cnt is not None else qweight, magic, offset, x.shape[0],
            qweight.shape[0], x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0))  # fmt: skip


def dequant_chunk(ks: int, group: int, spans: int, most: int) -> int:
    """The chunk of the form that decodes weights with their scales before the mma (DEQUANT): `chunk_k`'s at 4 spans
    (the largest KC <= most dividing ks whose lane runs of KC / 4 elements lie in one group), where its `spans` spans
    are whole words (>= 8 elements; a smaller chunk's would not be either); 0 if none."""
    kc = chunk_k(ks, group, 4, most)
    return kc if kc // spans >= 8 else 0


def constexprs(m: int, k: int, group: int, has_zero: bool, has_bias: bool, cfg: MmaLinearConfig) -> dict:
    """The kernel's compile-time arguments for M rows of x, K, the group and cfg (supported shapes)."""
    tok, spans = tokens_and_spans(m, group)
    ks = cfg.k_share(k)
    kc = chunk_k(ks, group, spans, cfg.kc)
    dq = dequant_chunk(ks, group, spans, cfg.kc) if kc < 128 and spans <= DEQUANT_MAX_SPANS else 0
    dequant = dq > kc  # only where the decoded form's chunk is the larger
    kc = dq if dequant else kc
    return dict(HAS_ZERO=has_zero, HAS_BIAS=has_bias, GROUP=group, KC=kc, CHUNKS=ks // kc, TOK=tok, S=spans,
                DEQUANT=dequant,
                ROWS=cfg.rows, W=cfg.warps, SPLIT=cfg.split, PADDED_SUM=PADDED_WARP_SUM, MASK_X=SPAN_MASKED_X,
                PRELOAD=PRELOAD_WORDS,
                **layouts(cfg.warps, cfg.rows, kc))  # fmt: skip
