"""The int4 decode on mma.sync shared by the Gluon MoE kernels (kernels/gluon_moe_w4_mma.py) and the dense products
(kernels/gluon_w4a16_mma.py, gluon_w4a16_wgmma.py): their layouts, the LOP3 decode into A operand registers, the B
tile of x over K spans, and one chunk's scaled sum.

One LOP3 makes two 16-bit operands, (q >> 4i) & 0x000F000F | 0x43004300 = (128 + nibble i, 128 + nibble i + 4)
(fp16: 0x64006400, 1024 + code), and one m16n8k16 mma takes eight weights a thread. Products (128 + c) x are exact
in float32; the code offset and zero leave through scale * (acc - (128 + zero) * sum(x)) per group (the codes
kernel's identity, kernels/triton_w4a16_codes.py; its float32 cancellation leaves ~1e-5 of the result).

Register layouts (mma_v2, batched: warps_per_cta = [W, 1, 1], each warp its own A, B and C):
  A [W, ROWS, KC] with k_width 8: a thread holds 8 consecutive (logical) k of rows r and r + 8; lanes
  t = 0..3 of a quad hold k 8t.., and registers repeat every 32 k. Logical k is not memory order:
  logical k = 8 (4 r + t) + 2 i + h holds memory k = 8 (RW t + r) + i + 4 h (RW = KC / 32 words a thread
  a row), so a thread's RW words of a row are adjacent in memory (16-byte loads), the LOP3 pair (nibble
  i, nibble i + 4) is one 32-bit A register (logical k 2i, 2i + 1), and lane t's span is memory
  [t KC / 4, (t + 1) KC / 4).
  x, the B operand, is loaded in memory order [W, NCOL, KC]: lane (t, column) holds the 8 RW contiguous
  elements from 8 RW t, where it loads them only where they lie in its column's span of the S spans a chunk
  (masked 16-byte loads: x leaves L1 once a chunk, not S times; the callers' SPAN_MASKED_X), then reshaped and
  permuted in registers to the logical order (no data movement). With 8 columns of 8 spans (the MoE's one token a
  pair) lane t's span is columns 2t and 2t + 1: C's own columns.
  The x sums of each column come from a second mma with an all-ones A, already in C's layout.
  C [W, ROWS, NCOL]: lane t holds columns 2t, 2t + 1 of rows r and r + 8 (of each 8 columns).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

MAGIC = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}


def _log2(n: int) -> int:
    assert n > 0 and n & (n - 1) == 0, n
    return n.bit_length() - 1


def layouts(warps: int, rows: int, kc: int) -> dict:
    """The kernels' layouts for W = warps, ROWS = rows a warp (16 or 32) and chunks of KC = kc (>= 128, a
    power of two), RW = KC / 32: words [W, ROWS, 4 (t), RW (r)] int32 = memory word RW t + r of a row's chunk;
    x [W, 8 (column), KC] in memory order, lane (t, column) holding the 8 RW contiguous elements from 8 RW t
    (16-byte loads; kernels/gluon_w4a16_mma.py's NCOL > 8 columns wrap into registers)."""
    rw = kc // 32
    lw = _log2(warps)
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8])
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i] for i in range(_log2(rw))] + [[0, 8 << i, 0, 0] for i in range(_log2(rows // 8))],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range(lw)],
        block_bases=[],
        shape=[warps, rows, 4, rw],
    )
    return {
        "mma": mma,
        "a_l": gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8),
        "b_l": gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8),
        "w_l": words,
        "x_l": gl.BlockedLayout([1, 1, kc // 4], [1, 8, 4], [warps, 1, 1], [2, 1, 0]),
    }


@gluon.jit
def _pair(q2, magic2, i: gl.constexpr, DT: gl.constexpr):
    # q2 [..., 2] int32 words joined with themselves -> [..., 2] DT (offset + nibble i, offset + nibble i + 4):
    # one shift and one LOP3 give both halves of a 32-bit register (pack = 2: element 0 the low half)
    if i == 0:
        asm: gl.constexpr = "lop3.b32 $0, $1, 0x000F000F, $3, 0xEA;"
    elif i == 1:
        asm: gl.constexpr = "{ .reg .b32 t; shr.u32 t, $1, 4; lop3.b32 $0, t, 0x000F000F, $3, 0xEA; }"
    elif i == 2:
        asm: gl.constexpr = "{ .reg .b32 t; shr.u32 t, $1, 8; lop3.b32 $0, t, 0x000F000F, $3, 0xEA; }"
    else:
        asm: gl.constexpr = "{ .reg .b32 t; shr.u32 t, $1, 12; lop3.b32 $0, t, 0x000F000F, $3, 0xEA; }"
    return gl.inline_asm_elementwise(asm, "=r,r,r,r,r", [q2, magic2], dtype=DT.value, is_pure=True, pack=2)


@gluon.jit
def _a_tile(q, magic, DT: gl.constexpr, a_l: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr, RW: gl.constexpr):
    # q [W, ROWS, 4, RW] words -> [W, ROWS, 32 RW] DT A operand, logical k = 8 (4r + t) + 2i + h
    qw = gl.reshape(gl.permute(q, (0, 1, 3, 2)), [W, ROWS, 4 * RW])
    q2 = gl.join(qw, qw)
    # the magic through an opaque mov: left as a kernel argument, ptxas re-reads it from the constant bank
    # before each use (~15% more instructions) instead of keeping one register
    m2 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [q2 * 0 + magic], dtype=gl.int32, is_pure=True, pack=1)
    c = gl.join(gl.join(_pair(q2, m2, 0, DT), _pair(q2, m2, 1, DT)),
                gl.join(_pair(q2, m2, 2, DT), _pair(q2, m2, 3, DT)))  # [W, ROWS, 4 RW, h, i bit 0, i bit 1]
    c = gl.permute(c, (0, 1, 2, 5, 4, 3))  # fmt: skip
    return gl.convert_layout(gl.reshape(c, [W, ROWS, 32 * RW]), a_l, assert_trivial=True)


@gluon.jit
def _b_tile(x, b_l: gl.constexpr, W: gl.constexpr, NCOL: gl.constexpr, RW: gl.constexpr, S: gl.constexpr,
            ZEROED: gl.constexpr = False):  # fmt: skip
    # x [W, NCOL, 32 RW] memory order -> [W, 32 RW, NCOL] B operand in logical k order, zero outside each
    # column's span c % S (memory word RW t + r is in span (RW t + r) // (4 RW / S)); ZEROED: x was loaded
    # with zeros there already (SPAN_MASKED_X)
    x6 = gl.reshape(x, [W, NCOL, 4, RW, 2, 4])  # [., t, r, h, i]: memory k = 8 (RW t + r) + 4h + i
    b = gl.reshape(gl.permute(x6, (0, 3, 2, 5, 4, 1)), [W, 32 * RW, NCOL])  # k = 8 (4r + t) + 2i + h
    b = gl.convert_layout(b, b_l, assert_trivial=True)
    if S > 1 and not ZEROED:
        k = gl.arange(0, 32 * RW, layout=gl.SliceLayout(1, gl.SliceLayout(0, b_l)))
        span = (RW * ((k // 8) % 4) + k // 32) // (4 * RW // S)
        col = gl.arange(0, NCOL, layout=gl.SliceLayout(0, gl.SliceLayout(0, b_l)))
        hit = gl.expand_dims(gl.expand_dims(span, 1) == gl.expand_dims(col % S, 0), 0)  # [1, 32 RW, NCOL]
        b = gl.where(hit, b, 0.0).to(x.dtype)
    return b


@gluon.jit
def _load_x(ptrs, mask, ZEROED: gl.constexpr):
    # one chunk of x [W, NCOL, KC]: only each column's span where ZEROED (zeros elsewhere), else all of it
    if ZEROED:
        return gl.load(ptrs, mask=mask, other=0.0)
    return gl.load(ptrs)


@gluon.jit
def _chunk(q, x, s_ptrs, z_ptrs, ones, magic, offset, tot, HAS_ZERO: gl.constexpr, DT: gl.constexpr, W: gl.constexpr,
           ROWS: gl.constexpr, NCOL: gl.constexpr, RW: gl.constexpr, S: gl.constexpr, mma: gl.constexpr,
           a_l: gl.constexpr, b_l: gl.constexpr, ZEROED: gl.constexpr = False):  # fmt: skip
    # tot [W, ROWS, NCOL] += scale * (A.B - (offset + zero) * column sums) over one chunk
    b = _b_tile(x, b_l, W, NCOL, RW, S, ZEROED)
    acc = mma_v2(_a_tile(q, magic, DT, a_l, W, ROWS, RW), b, gl.zeros([W, ROWS, NCOL], gl.float32, mma))
    # all 16 rows of ones @ B are the column sums; max over them moves one to every row of C's layout
    sums = gl.max(mma_v2(ones, b, gl.zeros([W, 16, NCOL], gl.float32, mma)), axis=1)
    scale = gl.load(s_ptrs).to(gl.float32)
    if HAS_ZERO:
        zz = gl.load(z_ptrs).to(gl.float32) + offset
    else:
        zz = offset + 8.0
    return tot + scale * (acc - zz * gl.expand_dims(sums, 1))


@gluon.jit
def word_offsets(w_l: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr, RW: gl.constexpr):
    # words [W, ROWS, 4, RW] in w_l: [W,1,1,1] warp, [1,ROWS,1,1] row, [1,1,4,RW] word RW t + r of a chunk
    l3: gl.constexpr = gl.SliceLayout(3, w_l)
    l2: gl.constexpr = gl.SliceLayout(2, l3)
    ww = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, l2)), 1), 2), 3)
    wrow = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, l2)), 0), 2), 3)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
    r = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, w_l))))
    word = gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 0), 3) * RW
    return ww, wrow, word + gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 0), 0), 0)



@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def mma_capable(t: torch.Tensor) -> bool:
    """Whether t lives on a CUDA GPU with mma.sync m16n8k16 for 16-bit operands (compute capability >= 8.0)."""
    return t.device.type == "cuda" and _capability(t.device.index or 0)[0] >= 8
