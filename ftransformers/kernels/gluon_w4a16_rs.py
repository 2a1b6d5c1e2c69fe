"""int4 weight x 16-bit activation products at 1-128 rows on Hopper, the weights decoded in the wgmma's own warps as
its register A operand (an "RS" wgmma), fed by a TMA producer warp: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the
"int4" layout of kernels/quant_formats.py, W[n, k] = (code - zero[n, g]) * scale[n, g].

Why: the other int4 kernels either decode W into shared memory for wgmma's B operand (gluon_w4a16_ws: 2 bytes of
shared-memory stores an element, and at 128-row tiles that producer sets the pace, docs/performance.md session 78), or
load the words straight into registers and wait for each chunk's wgmma (gluon_w4a16_wgmma: 16-44% of copy bandwidth at
9-16 rows), or use mma.sync (gluon_w4a16_mma: x as B operands in every warp's registers). Here:

- The product is y^T = W x^T: a program's BN = 16 x CW rows of W (CW consumer warps, one or two warpgroups) are
  wgmma's M, x^T its N = NP >= M columns (a power of two, 8-128); x's rows past M are TMA's zero fill, never stored.
- One producer warp streams each K tile by TMA into a ring of STAGES stages: x's [NP, BK] box (memory order, the
  wgmma's B operand as it lands) and W's words [BN, BK / 8] as they lie in memory, both counted on the stage's
  `ready` barrier. No register of the producer holds data; it only waits for `empty` and issues copies.
- The consumer reads its words from shared memory and decodes them straight into A's register fragment. A thread of
  wgmma's A holds k = 16 s + 8 u + 2 t + (0, 1) of its rows (t = lane % 4), that is byte t of word 2 s + u: so the
  four lanes of a quad read the same 16 bytes (a broadcast), and each makes its pair with one PRMT (byte t of the word
  and of the word >> 4 into the two halves), one LOP3 (offset + nibble, exact), and two packed 16-bit FMAs (minus
  offset + zero, exact; times the scale, rounded once, as a 16-bit copy of W would be). K needs no permutation.
- A K tile lies inside one quantization group (GROUP % BK == 0): one scale and zero a row a tile, loaded by the
  consumer one tile ahead.
- The accumulator [BN, NP] runs over the program's whole K. With `scale_after` (the engine's form) A holds code - zero
  (exact) and each tile's wgmmas go into a fresh float32 sum, waited, then added times the row's scale: one packed FMA
  a pair fewer, and no weight rounded to 16 bits. Without it the scale is decoded in (as a 16-bit copy of W would be
  rounded), and IN_FLIGHT = 1 may leave one tile's wgmmas in flight while the next tile is decoded: only to 32 columns
  (`fits`), as at 64-128 it gave wrong results on the H200 (session 79), and it was no faster. Its SASS shows the next
  tile's A decoded into the registers the HGMMAs in flight still read (docs/performance.md, session 79).
- Splits of K: SPLIT programs per row tile publish float32 partials [SPLIT, M, N]; the last one out (an acq_rel ticket,
  kernels/tickets.py's protocol) adds them in split order and stores y (gluon_w4a16_mma._split_store_y).

Measured on the H200 (session 79, benchmarks/bench_w4a16_rs.py; docs/performance.md): with three one-warpgroup
programs an SM (`regs` 3, 3 stages) it runs Qwen3-8B's int4 gate_up at 32 rows in 27.0 us (the kernels before: 42.4;
cuBLAS on the bf16 weight 50.3) and DeepSeek-V3's o at 64 rows in 57.4 (82.6), at 26-48% of copy bandwidth; a
Qwen3-8B W4A16 decode step at B=32 went 5.620 -> 4.268 ms. At 1-16 rows the mma.sync kernel stays faster (at one row
17.0 against 24.1 us on Qwen3-8B gate_up). Nsight Compute at 32 rows (8 stages then: two programs an SM by shared
memory) put 46% of the warps' stall cycles at CTA barriers (the consumer's one a tile, and the producer warpgroup's
three idle warps) and issued 0.44 instructions a cycle a scheduler. Two consumer warpgroups a program (`warps` 8),
half the reads of x from L2 a weight row, were slower at every shape measured.

tests/test_gluon_w4a16_rs.py checks it against quant_linear_ref on a Hopper GPU, tests/test_gluon_rs_compile.py its
offline sm_90 build; benchmarks/bench_w4a16_rs.py times its configs beside the engine's kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ftransformers.kernels.gluon_mla_decode import _cta_barrier, pdl_enter
from ftransformers.kernels.gluon_w4_mma_tiles import MAGIC, _capability
from ftransformers.kernels.gluon_w4a16_mma import _split_store_y
from ftransformers.kernels.gluon_w4a16_ws import _GL_DTYPE, _tma_load
from ftransformers.kernels.launch import cached_launch, next_pow2
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.tickets import split_scratch

MAX_ROWS = 128
MAX_SHARED = 200 * 1024  # a program's ring at most (of the H100's / H200's 227 KB an SM)
PRODUCER_REGS = 40  # the producer warp's registers (setmaxnreg): it holds no data


@dataclass(frozen=True)
class RsConfig:
    """CW consumer warps (4: one warpgroup, 64 rows of W; 8: two, 128 rows), K tiles of BK, a ring of STAGES stages,
    SPLIT programs along K, and IN_FLIGHT tiles of wgmmas left in flight (0 or 1)."""

    warps: int = 4
    bk: int = 128
    stages: int = 4
    split: int = 1
    # 1: a tile's wgmmas left in flight while the next is decoded. Only to 32 columns (`fits`): on the H200 it gave
    # wrong results (NaN) at 64 and 128 (ptxas puts the next A in the registers the wgmmas in flight read), and no
    # gain where it was right (session 79)
    in_flight: int = 0
    regs: int = 2  # programs an SM the registers allow (`maxnreg`)
    # each tile's wgmmas on code - zero into a fresh accumulator, waited, then added times each row's float32 scale:
    # one packed FMA a pair fewer (no weight is rounded to 16 bits), the tile's wgmmas never left in flight
    scale_after: bool = False

    def rows(self) -> int:
        return 16 * self.warps

    def shared_bytes(self, np_: int) -> int:  # the ring: x's box and W's words a stage
        return self.stages * (np_ * self.bk * 2 + self.rows() * self.bk // 2)


# programs default_config aims for (two an SM of the H100's / H200's 132), the fewest K tiles a part, and the shared
# memory it gives a program's ring (two programs an SM)
AIM_PROGRAMS = 264
MIN_PART_TILES = 4
RING_BYTES = 96 * 1024


def default_config(m: int, n: int, k: int, group: int, warps: int = 4, bk: int = 128) -> RsConfig:
    """A starting point for the benchmark, not a measured rule: two programs an SM with one consumer warpgroup, one
    with two; as many stages (2-8) as the SM's share of RING_BYTES x 2 holds, and K split in the fewest powers of two
    that give AIM_PROGRAMS / 2 programs per program an SM, each part at least MIN_PART_TILES K tiles."""
    bk = min(bk, group)
    cfg = RsConfig(warps, bk, 2, 1, regs=2 if warps == 4 else 1)
    ring = RING_BYTES * 2 // cfg.regs
    stages = max(2, min(8, ring // replace(cfg, stages=1).shared_bytes(columns(m))))
    k_tiles, tiles, split = k // bk, max(1, n // cfg.rows()), 1
    aim = AIM_PROGRAMS // 2 * cfg.regs
    while tiles * split < aim and k_tiles % (2 * split) == 0 and k_tiles // (2 * split) >= MIN_PART_TILES:
        split *= 2
    return replace(cfg, stages=stages, split=split)


# w4a16_linear (without a config) sends an int4 product of ENGINE_MIN_ROWS to 64 rows here (0: never) for weights of
# at least ENGINE_MIN_NK elements, and of 65 to ENGINE_MAX_ROWS rows for weights of at least ENGINE_MIN_NK_WIDE, on
# `engine_config`. H200, session 79 (bench_w4a16_rs.py), against the kernels w4a16_linear took before:
# - to 64 rows, three programs an SM on ENGINE_STAGES stages (rs_stages_s79_h200.*; 72 KB of ring a program): Qwen3-8B
#   gate_up (100M elements) at 32 / 64 rows 27.4 / 32.6 us against 42.5 / 47.6, its down (50M) 20.1 / 33.6 against
#   26.4 / 32.2, its qkv (25M) 11.3 / 15.9 against 19.4 / 17.7, DeepSeek-V3 o (117M) 42.2 / 57.2 against 54.2 / 82.3,
#   its dense gate_up (264M) 73.1 / 98.4 against 109.5 / 137.1. At 16 rows the kernels before won on DeepSeek-V3 o
#   and Qwen3-8B down (32.8 / 16.8 us against 39.1 / 19.6), at 1-8 rows everywhere (the mma kernel: 17.0 against 24.1
#   us on Qwen3-8B gate_up at one row);
# - 65-128 rows, two programs an SM (rs_after_s79_h200.*): Qwen3-8B gate_up at 128 rows 63.3 us against 83.6,
#   DeepSeek-V3 o 88.0 against 100.5, its dense gate_up 163.4 against 217.4; Qwen3-8B down (53.1 against 46.9) and
#   the smaller weights lost there.
ENGINE_MIN_ROWS = 17
ENGINE_MAX_ROWS = 128
MAX_SHARED = 200 * 1024  # a program's ring at most (of the H100's / H200's 227 KB an SM)
ENGINE_MIN_NK = 24 << 20
ENGINE_MIN_NK_WIDE = 96 << 20
ENGINE_STAGES = 3


def engine_config(m: int, n: int, k: int, group: int) -> RsConfig | None:
    """The config w4a16_linear runs M rows of an int4 [N, K] weight with here, or None (the rule above): each K
    tile's scale applied after its wgmmas, three programs an SM on ENGINE_STAGES stages up to 64 columns (two at 128,
    on default_config's stages), default_config's split."""
    if not ENGINE_MIN_ROWS or not ENGINE_MIN_ROWS <= m <= ENGINE_MAX_ROWS or group % 128:
        return None
    if n * k < (ENGINE_MIN_NK if m <= 64 else ENGINE_MIN_NK_WIDE):
        return None
    # cached (eager calls repeat few shapes; the search cost ~15 us a call), keyed on the values A/Bs set too
    return _engine_config(m, n, k, group, (ENGINE_STAGES, AIM_PROGRAMS, MIN_PART_TILES, RING_BYTES))


@functools.lru_cache(maxsize=4096)
def _engine_config(m: int, n: int, k: int, group: int, rule: tuple) -> RsConfig | None:
    cfg = replace(default_config(m, n, k, group), scale_after=True)
    if columns(m) <= 64:
        cfg = replace(cfg, regs=3, stages=ENGINE_STAGES)
    return cfg if fits(m, n, k, group, cfg) else None


def columns(m: int) -> int:
    """wgmma's N for M rows of x: the power of two >= M, at least 8."""
    return max(8, next_pow2(m))


def fits(m: int, n: int, k: int, group: int, cfg: RsConfig) -> bool:
    """The shape part of `supported`: 1 <= M <= MAX_ROWS, N a multiple of a program's rows, K tiles inside a group,
    K split into whole tiles, and the ring within one SM's shared memory."""
    if not 1 <= m <= MAX_ROWS or cfg.warps not in (4, 8) or n % cfg.rows() or cfg.in_flight not in (0, 1):
        return False
    if cfg.bk % 32 or group % cfg.bk or k % group or cfg.split < 1 or (k // cfg.bk) % cfg.split:
        return False
    # the registers `maxnreg` leaves a consumer thread: two warpgroups take a program an SM, three programs an SM
    # leave too few for wgmma's N past 64 (offline ptxas: C7602 at 80 a thread)
    if cfg.regs not in (1, 2, 3) or (cfg.warps == 8 and cfg.regs > 1) or (cfg.regs == 3 and columns(m) > 64):
        return False
    if cfg.in_flight and columns(m) > 32:
        return False
    return cfg.shared_bytes(columns(m)) <= MAX_SHARED


def supported(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: RsConfig) -> bool:
    """Whether the kernel takes x [M, K] @ W^T for this int4 qweight [N, K // 8]: a Hopper GPU (wgmma, TMA), bf16 /
    fp16 x with unit stride along K, 16-byte aligned bases and row strides (TMA), and `fits`."""
    if x.device.type != "cuda" or x.dtype not in MAGIC or x.stride(1) != 1 or qweight.stride(1) != 1:
        return False
    if _capability(x.device.index or 0)[0] != 9:
        return False
    if x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16 or qweight.data_ptr() % 16 or qweight.stride(0) % 4:
        return False
    return qweight.shape[1] * 8 == x.shape[1] and fits(x.shape[0], qweight.shape[0], x.shape[1], group, cfg)


def layouts(warps: int, bk: int, np_: int) -> dict:
    """The accumulator's wgmma layout [BN, NP], A's register fragment [BN, BK], and the words' layout [BN, 4 (t),
    BK / 8 (word)] whose decoded pairs are that fragment with no data movement: lane 4 r + t holds rows r and r + 8 of
    its warp's 16 and, of each word, the pair at k = 8 w + 2 t (module docstring)."""
    bw = bk // 8
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, np_, 16])
    words = gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0]] + [[0, 0, 1 << i] for i in range(bw.bit_length() - 1)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)],
        block_bases=[],
        shape=[16 * warps, 4, bw],
    )  # fmt: skip
    return {"mma": mma, "a_l": gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2), "w_l": words}


# One pair of a word, as one 32-bit register of two 16-bit weights ($0; pack 2: each operand is given twice, and
# $1 / $3 / $5 / $7 / $9 are read): $1 the word, $3 the lane's PRMT selector (byte t of the word to bits 0-7, byte t of
# word >> 4 to bits 16-23), $5 -(offset + zero) twice, $7 the scale twice, $9 the magic. LOP3 makes (offset + nibble
# 2t, offset + nibble 2t + 1) exact; FMA by one adds -(offset + zero) (exact: small integers); FMA by the scale with a
# -0 addend rounds the product once. The scale-after form (_CODE_*) stops before the scale: code - zero, exact.
_CODE_BODY = """{ .reg .b32 s, p, one;
mov.b32 one, ONE;
shr.u32 s, $1, 4; prmt.b32 p, $1, s, $3; lop3.b32 p, p, 0x000F000F, $9, 0xEA;
FMA $0, p, one, $5; }"""
_PAIR_BODY = """{ .reg .b32 s, p, one, nzero;
mov.b32 one, ONE; mov.b32 nzero, 0x80008000;
shr.u32 s, $1, 4; prmt.b32 p, $1, s, $3; lop3.b32 p, p, 0x000F000F, $9, 0xEA;
FMA p, p, one, $5; FMA $0, p, $7, nzero; }"""
_BF16 = {"ONE": "0x3F803F80", "FMA": "fma.rn.bf16x2"}
_F16 = {"ONE": "0x3C003C00", "FMA": "fma.rn.f16x2"}


def _asm(body: str, names: dict[str, str]) -> str:
    for name, value in names.items():
        body = body.replace(name, value)
    return body


_PAIR_BF16: gl.constexpr = gl.constexpr(_asm(_PAIR_BODY, _BF16))
_PAIR_F16: gl.constexpr = gl.constexpr(_asm(_PAIR_BODY, _F16))
_CODE_BF16: gl.constexpr = gl.constexpr(_asm(_CODE_BODY, _BF16))
_CODE_F16: gl.constexpr = gl.constexpr(_asm(_CODE_BODY, _F16))


@gluon.jit
def _twice3(v):
    # [BN] 16-bit -> [BN, 1, 1] int32 holding v's bits in both halves
    b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return gl.expand_dims(gl.expand_dims(b | (b << 16), 1), 2)


@gluon.jit
def _tile_params(s_ptrs, z_ptrs, g, offset, HAS_ZEROS: gl.constexpr, DT: gl.constexpr):
    # group g's scale [BN] float32 and [BN, 1, 1] int32 the scale and -(offset + zero), each twice (exact in DT)
    scale = gl.load(s_ptrs + g).to(gl.float32)
    if HAS_ZEROS:
        nz = -(gl.load(z_ptrs + g).to(gl.float32) + offset)
    else:
        nz = gl.zeros_like(scale) - (8.0 + offset)
    return scale, _twice3(scale.to(DT)), _twice3(nz.to(DT))


@gluon.jit
def _a_tile(q, sel, s2, nz2, magic, DT: gl.constexpr, a_l: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
            SCALE_AFTER: gl.constexpr):  # fmt: skip
    # q [BN, 1, BW] words (each lane of a quad the same), sel [1, 4, 1] -> A [BN, BK] DT, k = 8 w + 2 t + h: the
    # weights, or (SCALE_AFTER) code - zero
    if SCALE_AFTER:
        asm: gl.constexpr = _CODE_BF16 if DT == gl.bfloat16 else _CODE_F16
    else:
        asm: gl.constexpr = _PAIR_BF16 if DT == gl.bfloat16 else _PAIR_F16
    qb, sb = gl.broadcast(q, sel)
    qb, zb = gl.broadcast(qb, nz2)
    qb, cb = gl.broadcast(qb, s2)
    m2 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [qb * 0 + magic], dtype=gl.int32, is_pure=True, pack=1)
    c = gl.inline_asm_elementwise(
        asm, "=r,r,r,r,r,r,r,r,r,r,r", [gl.join(qb, qb), gl.join(sb, sb), gl.join(zb, zb), gl.join(cb, cb),
                                        gl.join(m2, m2)], dtype=DT.value, is_pure=True, pack=2,
    )  # fmt: skip
    c = gl.permute(c, (0, 2, 1, 3))  # [BN, BW, t, h]
    return gl.convert_layout(gl.reshape(c, [BN, BK]), a_l, assert_trivial=True)


@gluon.jit
def _producer(x_desc, q_desc, xs, qs, ready, empty, n0, k0, k_tiles, BK: gl.constexpr, STAGES: gl.constexpr):
    # stage i % STAGES gets x's box [NP, BK] and W's words [BN, BK / 8] of K tile k0 + i, once the consumer freed it
    nbytes: gl.constexpr = xs.dtype.primitive_bitwidth // 8 * xs.shape[1] * xs.shape[2] + qs.shape[1] * qs.shape[2] * 4
    for i in range(k_tiles):
        st = i % STAGES
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(st), nbytes)
        _tma_load(x_desc, [0, (k0 + i) * BK], ready.index(st), xs.index(st))
        _tma_load(q_desc, [n0, (k0 + i) * (BK // 8)], ready.index(st), qs.index(st))


@gluon.jit
def _consumer(xs, qs, ready, empty, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N,
              stride_sn, stride_zn, stride_ym, n0, k0, k_tiles,
              GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, NP: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
              IN_FLIGHT: gl.constexpr, SCALE_AFTER: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
              w_l: gl.constexpr):  # fmt: skip
    # The default partition: per tile, its words decoded into A and y^T += A x^T (one tile's wgmmas in flight with
    # IN_FLIGHT), the stage handed back once its wgmmas are done; then the epilogue (split K: the last one out's)
    DT: gl.constexpr = xs.dtype
    q_l: gl.constexpr = gl.SliceLayout(1, w_l)  # [BN, BW]: the quad's lanes read the same words
    p_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, w_l))  # [BN]
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_l)))
    sel = gl.expand_dims(gl.expand_dims(t * 0x11 + (t + 4) * 0x1100, 0), 2)  # [1, 4, 1] PRMT selectors
    rows = gl.arange(0, BN, layout=p_l)
    s_ptrs = s_ptr + (n0 + rows).to(gl.int64) * stride_sn
    z_ptrs = z_ptr + (n0 + rows).to(gl.int64) * stride_zn
    sc, s2, nz2 = _tile_params(s_ptrs, z_ptrs, k0 * BK // GROUP, offset, HAS_ZEROS, DT)
    acc = gl.zeros([BN, NP], gl.float32, mma)
    zero = gl.zeros([BN, NP], gl.float32, mma)  # the accumulator a scale-after tile's first wgmma ignores
    # tile i - 1's A carried to its wait (IN_FLIGHT): meant to keep its registers from the next decode, which it does
    # not (the SASS reuses them; module docstring), hence `fits`' bound on that form
    a_prev = gl.zeros([BN, BK], DT, a_l)
    for i in range(k_tiles):
        st = i % STAGES
        sc_c, s_c, nz_c = sc, s2, nz2
        nxt = gl.minimum(i + 1, k_tiles - 1)
        sc, s2, nz2 = _tile_params(s_ptrs, z_ptrs, (k0 + nxt) * BK // GROUP, offset, HAS_ZEROS, DT)
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        q = gl.expand_dims(qs.index(st).load(q_l), 1)
        a = _a_tile(q, sel, s_c, nz_c, magic, DT, a_l, BN, BK, SCALE_AFTER)
        if SCALE_AFTER:  # this tile's sum of (code - zero) x, times each row's scale in float32
            part = warpgroup_mma(a, xs.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
            part, a = warpgroup_mma_wait(0, deps=[part, a])
            acc += gl.expand_dims(gl.convert_layout(sc_c, gl.SliceLayout(1, mma)), 1) * part
            _cta_barrier()
            mbarrier.arrive(empty.index(st))
        elif IN_FLIGHT == 1:
            acc = warpgroup_mma(a, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])  # tile i - 1's wgmmas are done: its A may go
            a_prev = a
            if i > 0:
                _cta_barrier()
                mbarrier.arrive(empty.index((i - 1) % STAGES))
        else:
            acc = warpgroup_mma(a, xs.index(st).permute((1, 0)), acc, is_async=True)
            acc, a = warpgroup_mma_wait(0, deps=[acc, a])
            _cta_barrier()
            mbarrier.arrive(empty.index(st))
    acc = warpgroup_mma_wait(0, deps=[acc])
    n_idx = gl.expand_dims(n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma)), 1)  # [BN, 1]
    toks = gl.expand_dims(gl.arange(0, NP, layout=gl.SliceLayout(0, mma)), 0)  # [1, NP]
    _split_store_y(acc, y_ptr, bias_ptr, part_ptr, cnt_ptr, n_idx, toks, M, N, stride_ym, HAS_BIAS, SPLIT)


@cached_launch
@gluon.jit
def _w4a16_rs_kernel(
    x_desc, q_desc, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N, K,
    stride_sn, stride_zn, stride_ym,
    GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, CW: gl.constexpr, BK: gl.constexpr,
    NP: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, IN_FLIGHT: gl.constexpr, SCALE_AFTER: gl.constexpr,
    PREGS: gl.constexpr,
    mma: gl.constexpr, a_l: gl.constexpr, w_l: gl.constexpr, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # first (tests/test_pdl.py): nothing of another kernel's is read or written before it
    BN: gl.constexpr = 16 * CW
    DT: gl.constexpr = y_ptr.dtype.element_ty
    n0 = gl.program_id(0) * BN
    k_tiles = K // BK // SPLIT
    k0 = gl.program_id(1) * k_tiles
    xs = gl.allocate_shared_memory(DT, [STAGES, NP, BK], x_desc.layout)
    qs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (xs, qs, ready, empty, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N,
                         stride_sn, stride_zn, stride_ym, n0, k0, k_tiles, GROUP, HAS_ZEROS, HAS_BIAS, BN, BK, NP,
                         STAGES, SPLIT, IN_FLIGHT, SCALE_AFTER, mma, a_l, w_l)),
            (_producer, (x_desc, q_desc, xs, qs, ready, empty, n0, k0, k_tiles, BK, STAGES)),
        ],
        [1],
        [PREGS],
    )  # fmt: skip


def constexprs(m: int, group: int, has_zeros: bool, has_bias: bool, cfg: RsConfig) -> dict:
    """The kernel's compile-time arguments for M rows of x (a fresh dict; the layouts behind it are built once)."""
    return dict(_constexprs(columns(m), group, has_zeros, has_bias, cfg))


@functools.lru_cache(maxsize=1024)
def _constexprs(np_: int, group: int, has_zeros: bool, has_bias: bool, cfg: RsConfig) -> dict:
    return {"GROUP": group, "HAS_ZEROS": has_zeros, "HAS_BIAS": has_bias, "CW": cfg.warps, "BK": cfg.bk, "NP": np_,
            "STAGES": cfg.stages, "SPLIT": cfg.split, "IN_FLIGHT": cfg.in_flight, "SCALE_AFTER": cfg.scale_after,
            "PREGS": PRODUCER_REGS, **layouts(cfg.warps, cfg.bk, np_)}  # fmt: skip


def descriptors(x: torch.Tensor, qweight: torch.Tensor, cfg: RsConfig) -> tuple:
    """TMA descriptors of x [M, K] in [NP, BK] boxes (rows past M zero-filled) and of the words [N, K // 8] in
    [BN, BK // 8] boxes, in the layouts of the kernel's ring."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    np_ = columns(x.shape[0])
    x_l, q_l = _ring_layouts(np_, cfg.bk, x.dtype)
    return (TensorDescriptor.from_tensor(x, [np_, cfg.bk], x_l),
            TensorDescriptor.from_tensor(qweight, [cfg.rows(), cfg.bk // 8], q_l))  # fmt: skip


@functools.lru_cache(maxsize=64)
def _ring_layouts(np_: int, bk: int, dtype: torch.dtype) -> tuple:
    # x's box [NP, BK] (the default swizzle for wgmma's B) and the words' [BN, BK / 8] unswizzled
    x_l = gl.NVMMASharedLayout.get_default_for([np_, bk], _GL_DTYPE[dtype])
    return x_l, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def maxnreg(cfg: RsConfig) -> int:
    """Registers a thread at launch. The producer's warp takes a warpgroup of its own (setmaxnreg works by
    warpgroups), which gives back all but PRODUCER_REGS a thread to the consumer's: so a program holds
    maxnreg x (CW + 4) x 32 registers of the SM's 64K, and its consumer threads (maxnreg (CW + 4) - 4 PRODUCER_REGS) /
    CW, at most 256. `cfg.regs` programs an SM."""
    return 65536 // cfg.regs // ((cfg.warps + 4) * 32) // 8 * 8


def w4a16_rs(
    x: torch.Tensor,  # [M, K] bf16 / fp16, unit stride along K, 1 <= M <= 128
    qweight: torch.Tensor,  # int32 [N, K // 8]
    scales: torch.Tensor,  # [N, K // G]
    zeros: torch.Tensor | None,  # uint8 [N, K // G] or None (zero 8)
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    cfg: RsConfig | None = None,
) -> torch.Tensor:  # [M, N] x.dtype
    cfg = cfg or RsConfig()
    assert supported(x, qweight, group, cfg), (tuple(x.shape), group, cfg)
    assert scales.stride(1) == 1 and (zeros is None or zeros.stride(1) == 1)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = n // cfg.rows()
    split, cnt, part = split_scratch(x.device, "w4a16_rs", tiles, cfg.split, m, n)
    if split != cfg.split:
        cfg = replace(cfg, split=split)
    magic, offset = MAGIC[x.dtype]
    x_desc, q_desc = descriptors(x, qweight, cfg)
    _w4a16_rs_kernel[(tiles, split)](
        x_desc, q_desc, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        part if part is not None else y, cnt if cnt is not None else qweight, magic, offset, m, n, k,
        scales.stride(0), zeros.stride(0) if zeros is not None else 0, y.stride(0),
        **constexprs(m, group, zeros is not None, bias is not None, cfg),
        num_warps=cfg.warps, maxnreg=maxnreg(cfg), **pdl_launch(x.device),
    )  # fmt: skip
    return y
