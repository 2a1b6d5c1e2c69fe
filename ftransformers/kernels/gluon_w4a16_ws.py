"""int4 weight x 16-bit activation products at prefill sizes on Hopper, warp-specialised: a producer partition decodes
the weight tiles into shared memory ahead of the consumer's asynchronous wgmmas. y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
for the "int4" layout of kernels/quant_formats.py, W[n, k] = (code - zero[n, g]) * scale[n, g].

Why: past 64 rows the Triton codes kernel's decoded form (kernels/triton_w4a16_codes.py) decodes each weight tile in
the warps that then wait for its wgmma, so the decode and the tensor cores take turns; sessions 75-76 measured every
tiling Triton's dot offers at 40-70% of the bf16 matmul rate on dense weights, where cuBLAS on a bf16 copy reaches
75-100% (docs/performance.md). Here the two run side by side, as Marlin-class kernels do:

- The consumer (the default partition, CONSUMER_WARPS = 8: two warpgroups) waits for a stage, issues y_tile +=
  x_tile @ W_tile^T as one asynchronous wgmma chain (A = x [BM, BK] and B = the decoded W [BN, BK]^T, both in
  128-byte-swizzled shared memory), keeps one tile's wgmmas in flight and hands the stage before back (`empty`). Its
  epilogue stores y through shared memory (x's ring where it holds the tile), adding the bias in 16-byte row vectors.
- The producer (a worker partition of PRODUCER_WARPS = 4 warps) fills stage i % STAGES once it is free: x's tile by
  TMA (its bytes expected on the stage's `ready` barrier; rows past M zero-filled) or, with `x_tma` off, by 16-byte
  cp.async (each thread's copies arrive on `ready` when they land); then the weight tile: words, scales and zeros read
  from global memory two tiles ahead into registers, decoded in PTX as the codes kernel's decoded form does (LOP3
  makes offset + code, one 16-bit FMA removes offset + zero exactly, one multiplies by the scale rounded to x's
  dtype: one rounding, as a 16-bit copy of the weight would have), stored to shared memory in K order, fenced for the
  async proxy and signalled on `ready` (one arrival).
- A K tile never crosses a quantization group (GROUP % BK == 0), so a tile has one scale and zero a row; K % BK == 0.
- Tiles are walked in bands of GROUP_M row tiles (`grouped_tile`'s order), so a weight tile's decode serves the band's
  row tiles from L2. A tile's K can be split into `split` parts, one program each: each stores its float32 partial
  tile, takes a ticket (kernels/tickets.py), and the last one out adds the parts in split order and stores y (so the
  sum does not depend on which part ends last). That lets products of few tiles (128-511 rows) fill one wave.
- The weight's words are read two tiles ahead into registers, or (`words_ahead`) through a ring in shared memory that
  16-byte cp.asyncs fill several tiles ahead: 128-row tiles' decode otherwise waits on the words' round trip.

Measured on the H200 (session 77, benchmarks/diag_w4a16_ws.py and bench_w4a16_prefill.py; docs/performance.md): the
default 256 x 128 x 64 tiles on 4 stages run Qwen3-8B's int4 gate_up at 8192 rows in 2916 us (82% of the matmul rate;
cuBLAS on the bf16 weight 2371, the codes kernel's decoded form 3380), and 1.1-1.5x the decoded form's best tiling
over Qwen3-8B's and Qwen3-30B-A3B's dense weights at 1024-8192 rows. Each half alone runs at cuBLAS's pace (`diag`
1, no decode: 2018 us; `diag` 2, no wgmma: 1950); together they contend (the wgmmas read both operands from shared
memory while the producer writes x and W there): both cost 44% over neither; in the cp.async form the decode without
its stores cost 10%, the stores without the decode 17%, both 57%.
x by cp.async instead of TMA was 10-25% slower; 8 producer warps, 3 stages and no wgmma left in flight level or slower;
128 x 256 tiles (twice the decode a FLOP) 1.2-1.5x slower.
At 128 rows (session 78, diag_words_s78_h200.*) a 128 x 128 tile's K tile takes 0.8 us against 0.4 of wgmma: the
producer alone takes 0.67 (0.54 with the words ring), the consumer alone 0.41; 8 producer warps were slower.

Shared memory: STAGES x (BM + BN) x BK x 2 bytes, plus BM x BN x 2 for the epilogue's tile of y where x's ring cannot
hold it (`WsConfig.shared_bytes`; the default 192 KB); one program an SM.
tests/test_gluon_w4a16_ws.py checks it against quant_linear_ref on a Hopper GPU; tests/test_gluon_ws_compile.py its
offline sm_90 build (both operands from shared memory, at most a few words spilled, no serialised wgmma).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ftransformers.kernels.gluon_mla_decode import _cp_async, _cta_barrier, pdl_enter
from ftransformers.kernels.gluon_w4_mma_tiles import MAGIC, _capability
from ftransformers.kernels.gluon_w4a16_mma import publish_and_sum
from ftransformers.kernels.launch import cached_launch, cdiv
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.tickets import split_scratch
from ftransformers.kernels.triton_w4a16_codes import _DQ_BF16, _DQ_F16  # the decoded form's PTX, $0-$7 as there

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (Triton 3.6's name: the second)
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
CONSUMER_WARPS = 8  # two warpgroups: 64 rows of x each
PRODUCER_WARPS = 4
# registers a producer thread (setmaxnreg; 256-column tiles need 152 with Triton 3.9's ptxas, 128-column ones 128); the
# consumer warps take the rest of the SM's 64K (184 at 8 + 4 warps)
PRODUCER_REGS = 128


@dataclass(frozen=True)
class WsConfig:
    """A program's tile: BM rows of x, BN rows of W (output columns), K tiles of BK, a ring of STAGES stages, and
    bands of GROUP_M row tiles."""

    bm: int = 256
    bn: int = 128
    bk: int = 64
    stages: int = 4
    group_m: int = 8
    producer_warps: int = PRODUCER_WARPS
    producer_regs: int = PRODUCER_REGS
    x_tma: bool = True  # x's tiles by TMA (one thread's copy, rows past M zero-filled); else 16-byte cp.async a thread
    in_flight: int = 1  # tiles of wgmmas left in flight (0: each tile's waited before its stage is handed back)
    split: int = 1  # K parts a tile (programs a tile; the last one out adds their float32 partials in split order)
    # the weight's words: 0 = read two tiles ahead into registers, else a ring of that many tiles in shared memory
    # (filled one fewer ahead; x by TMA only: x's cp.async arrivals would wait for the words' copies)
    words_ahead: int = 0
    # timing experiments only, wrong results: 1 = no decode (W's stages keep what they hold), 2 = no wgmma, 3 = the
    # decode without its stores, 4 = the stores without the decode
    diag: int = 0

    def reuses_ring(self) -> bool:  # the epilogue's tile of y in x's ring, where it fits (the ring is idle by then)
        return self.stages * self.bk >= self.bn

    def shared_bytes(self) -> int:  # the rings, and the epilogue's tile of y where x's ring cannot hold it
        ring = self.stages * (self.bm + self.bn) * self.bk + (0 if self.reuses_ring() else self.bm * self.bn)
        return ring * 2 + self.words_ahead * self.bn * self.bk // 2


MAX_SHARED = 220 * 1024  # of the H100's / H200's 227 KB a program, leaving room for barriers and the compiler's own


# w4a16_linear (without a config) sends int4 products of ENGINE_MIN_ROWS rows or more here (0: never), on a Hopper GPU:
# in 256 x 128 tiles where those number at least ENGINE_MIN_TILES, else in 128 x 128 tiles where those number at least
# SMALL_MIN_TILES. H200, session 77 (bench_w4a16_prefill.py, ws_dense2_s77_h200.*), against the codes kernel's decoded
# form: 1.1-1.5x at 1024-8192 rows; at 512 rows 1.28-1.46x on 80-96 tiles of 256 x 128 (Qwen3-30B-A3B / Qwen3-8B qkv)
# and 1.08-1.27x in 128 x 128 tiles where the larger number 64; on 32 large tiles (Qwen3-30B-A3B o at 512 rows) 0.70x,
# so not taken. Session 78 (ws_words_s78_h200.*) lowered the rows to 256: Qwen3-8B gate_up at 256 / 384 rows 112.5 /
# 192.3 us against 133.6 / 215.7, its qkv at 384 60.7 against 68.5, Qwen3-30B-A3B's qkv at 384 29.4 against 34.7.
ENGINE_MIN_ROWS = 256
ENGINE_MIN_TILES = 80
SMALL_MIN_TILES = 128
LARGE = WsConfig()
SMALL = WsConfig(128, 128, 64, 4)
# Products of FEW_MIN_ROWS to 511 rows that the rule above leaves (few tiles: Qwen3-8B's o and down, Qwen3-30B-A3B's o)
# run in one wave: of the FEW_TILES forms (the words ring on, x by TMA) and K splits of 1, 2, 4 or 8 that make
# FEW_MIN_PROGRAMS to FEW_PROGRAMS programs (one an SM of an H100 / H200: a program holds an SM), with at least
# FEW_MIN_K_TILES K tiles a part, the one of least `few_cost`. Its constants are fitted to the H200 (session 78,
# ws_few_s78_h200.*: within 7% of its 16 points of one wave or less, all split 2 or 4 ways; the unsplit cost is
# extrapolated): FEW_FIXED_US a launch, FEW_PART_US a KB of float32 partials (written, then added by the last one out),
# and each form's us a K tile a program. Fewer programs than a wave (under 100 of 132) lost to the codes kernel's
# decoded form there, as did two waves. In a step (ab_few_{8b,30b}_s78_h200.*) the rule made Qwen3-8B W4A16 at
# B=128 / 256 10.528 -> 10.010 / 17.018 -> 16.091 ms.
FEW_MIN_ROWS = 128
FEW_TILES = ((WsConfig(128, 64, 128, 3, words_ahead=6), 0.82), (WsConfig(128, 128, 128, 2, words_ahead=4), 1.37))
FEW_PROGRAMS = 132
FEW_MIN_PROGRAMS = 100
FEW_MIN_K_TILES = 4
FEW_FIXED_US = 5.0
FEW_PART_US = 0.037


def few_cost(cfg: WsConfig, k_tiles: int, per_k_tile_us: float) -> float:
    """Estimated us of a few-tile product in one wave: a launch, the split's partials, one program's walk of K."""
    partials_kb = cfg.split * cfg.bm * cfg.bn * 4 / 1024 if cfg.split > 1 else 0.0
    return FEW_FIXED_US + FEW_PART_US * partials_kb + cdiv(k_tiles, cfg.split) * per_k_tile_us


def engine_config(m: int, n: int, k: int) -> WsConfig | None:
    """The config w4a16_linear runs an int4 [M, K] x [N, K]^T product on here, or None (the rules above, by M, N and
    K alone; callers then check `supported`, which sees the group, the strides and the device)."""
    if ENGINE_MIN_ROWS and m >= ENGINE_MIN_ROWS:
        for cfg, least in ((LARGE, ENGINE_MIN_TILES), (SMALL, SMALL_MIN_TILES)):
            if cdiv(m, cfg.bm) * cdiv(n, cfg.bn) >= least:
                return cfg
    if not FEW_MIN_ROWS or not FEW_MIN_ROWS <= m < 512:
        return None
    # the search below is cached (eager calls repeat few shapes): keyed on the rule's values too, which A/Bs set
    return _few_config(m, n, k, (FEW_TILES, FEW_PROGRAMS, FEW_MIN_PROGRAMS, FEW_MIN_K_TILES, FEW_FIXED_US, FEW_PART_US))


@functools.lru_cache(maxsize=4096)
def _few_config(m: int, n: int, k: int, rule: tuple) -> WsConfig | None:
    # the few-tile form of least few_cost for the rule values of `rule` (the module's, when engine_config calls)
    best: tuple[float, WsConfig] | None = None
    for tile, per_k_tile_us in FEW_TILES:
        tiles, k_tiles = cdiv(m, tile.bm) * cdiv(n, tile.bn), k // tile.bk
        for split in (1, 2, 4, 8):
            cfg = replace(tile, split=split)
            if FEW_MIN_PROGRAMS <= tiles * split <= FEW_PROGRAMS and k_tiles >= split * FEW_MIN_K_TILES:
                cost = few_cost(cfg, k_tiles, per_k_tile_us)
                if best is None or cost < best[0]:
                    best = (cost, cfg)
    return best[1] if best else None


def from_dict(cfg: dict[str, int]) -> WsConfig:
    """A w4a16_linear config dict with WS set (BLOCK_M, BLOCK_N, BLOCK_K, STAGES[, GROUP_M, PW, PREGS, X_TMA,
    IN_FLIGHT, SPLIT_K, WORDS_AHEAD]) as a WsConfig."""
    return WsConfig(bm=cfg["BLOCK_M"], bn=cfg["BLOCK_N"], bk=cfg["BLOCK_K"], stages=cfg["STAGES"],
                    group_m=cfg.get("GROUP_M", 8), producer_warps=cfg.get("PW", PRODUCER_WARPS),
                    producer_regs=cfg.get("PREGS", PRODUCER_REGS), x_tma=bool(cfg.get("X_TMA", 1)),
                    in_flight=cfg.get("IN_FLIGHT", 1), split=cfg.get("SPLIT_K", 1),
                    words_ahead=cfg.get("WORDS_AHEAD", 0))  # fmt: skip


def as_dict(cfg: WsConfig) -> dict[str, int]:
    """cfg as the dict w4a16_linear takes (`config=`)."""
    return {"WS": 1, "BLOCK_M": cfg.bm, "BLOCK_N": cfg.bn, "BLOCK_K": cfg.bk, "STAGES": cfg.stages,
            "GROUP_M": cfg.group_m, "PW": cfg.producer_warps, "PREGS": cfg.producer_regs, "X_TMA": int(cfg.x_tma),
            "IN_FLIGHT": cfg.in_flight, "SPLIT_K": cfg.split, "WORDS_AHEAD": cfg.words_ahead}  # fmt: skip


def supported(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: WsConfig) -> bool:
    """Whether the kernel takes x [M, K] @ W^T for this int4 qweight [N, K // 8]: a Hopper GPU (compute capability
    9.x: wgmma, setmaxnreg), bf16 / fp16 x with unit stride along K, K tiles inside a group, and the ring fits."""
    if x.device.type != "cuda" or x.dtype not in MAGIC or x.stride(1) != 1:
        return False
    if _capability(x.device.index or 0)[0] != 9:
        return False
    k = x.shape[1]
    if cfg.x_tma and (x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16):
        return False  # TMA: a 16-byte aligned base and row stride
    if cfg.words_ahead and (not cfg.x_tma or qweight.data_ptr() % 16 or qweight.stride(0) % 4):
        return False  # the words' 16-byte cp.asyncs; x by TMA (the class's note)
    return group % cfg.bk == 0 and k % group == 0 and cfg.shared_bytes() <= MAX_SHARED and qweight.shape[1] * 8 == k


# a shared buffer seen as another shape and layout (Triton 3.9 names it reinterpret, 3.6 _reinterpret)
if hasattr(gl.shared_memory_descriptor, "reinterpret"):

    @gluon.jit
    def _as_tile(buf, DT: gl.constexpr, SHAPE: gl.constexpr, LAYOUT: gl.constexpr):
        return buf.reinterpret(DT, SHAPE, LAYOUT)

else:

    @gluon.jit
    def _as_tile(buf, DT: gl.constexpr, SHAPE: gl.constexpr, LAYOUT: gl.constexpr):
        return buf._reinterpret(DT, SHAPE, LAYOUT)


@gluon.jit
def _twice(v):
    # [BN] 16-bit -> [BN, 1] int32 holding v's bits in both halves
    b = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return gl.expand_dims(b | (b << 16), 1)


@gluon.jit
def _halves(t, DT: gl.constexpr):
    return t.to(gl.int16).to(DT, bitcast=True), (t >> 16).to(gl.int16).to(DT, bitcast=True)


@gluon.jit
def _decode(q, scale, nzoff, magic, DT: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    # q [BN, BK / 8] words, scale and nzoff = -(offset + zero) [BN] in DT -> [BN, BK] DT weights in K order
    asm: gl.constexpr = _DQ_BF16 if DT == gl.bfloat16 else _DQ_F16
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r,r,r,r", [q, q * 0 + _twice(nzoff), q * 0 + _twice(scale), q * 0 + magic],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    l0, h0 = _halves(p0, DT)
    l1, h1 = _halves(p1, DT)
    l2, h2 = _halves(p2, DT)
    l3, h3 = _halves(p3, DT)
    # [BN, BK / 8, c, b, a] holds nibble 4c + 2b + a of each word: k = 8 w + 4c + 2b + a once flattened
    w = gl.join(gl.join(gl.join(l0, h0), gl.join(l2, h2)), gl.join(gl.join(l1, h1), gl.join(l3, h3)))
    return gl.reshape(w, [BN, BK])


@gluon.jit
def _group_params(s_ptrs, z_ptrs, g, offset, HAS_ZEROS: gl.constexpr, DT: gl.constexpr):
    # [BN] scale and -(offset + zero) of group g in DT (both exact in DT for zeros 0..15 and offsets 128 / 1024)
    scale = gl.load(s_ptrs + g).to(DT)
    if HAS_ZEROS:
        nz = -(gl.load(z_ptrs + g).to(gl.float32) + offset)
    else:
        nz = gl.zeros_like(scale.to(gl.float32)) - (8.0 + offset)
    return scale, nz.to(DT)


@gluon.jit
def _producer(x_ptr, x_desc, q_ptr, s_ptr, z_ptr, xs, ws, qring, ready, empty, m0, n0, M, N, k0, k_tiles, magic,
              offset, stride_xm, stride_qn, stride_sn, stride_zn,
              GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, PW: gl.constexpr, X_TMA: gl.constexpr, QA: gl.constexpr,
              DIAG: gl.constexpr):  # fmt: skip
    # The producer partition (module docstring): stage i % STAGES gets x's K tile k0 + i (TMA or cp.async) and W's,
    # decoded
    DT: gl.constexpr = xs.dtype
    BW: gl.constexpr = BK // 8  # words of a row a tile
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // BW, BW], [PW, 1], [1, 0])  # [BM, BK]: 16-byte vectors
    q_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // BW, BW // 4], [PW, 1], [1, 0])  # [BN, BW]: 16 bytes
    rows_x = gl.minimum(m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, x_l)), M - 1)  # past M: row M - 1, not stored
    cols_x = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
    x_ptrs = x_ptr + gl.expand_dims(rows_x.to(gl.int64) * stride_xm, 1) + gl.expand_dims(cols_x + k0 * BK, 0)
    rows_q = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, q_l)), N - 1)  # past N: row N - 1, not stored
    cols_q = gl.arange(0, BW, layout=gl.SliceLayout(0, q_l))
    q_ptrs = q_ptr + gl.expand_dims(rows_q.to(gl.int64) * stride_qn, 1) + gl.expand_dims(cols_q + k0 * BW, 0)
    s_ptrs = s_ptr + rows_q.to(gl.int64) * stride_sn
    z_ptrs = z_ptr + rows_q.to(gl.int64) * stride_zn
    # scales and zeros of tiles i + 1 and i + 2 in registers while tile i is decoded (DRAM's round trip is longer than
    # a tile's wgmmas); the words too (QA = 0), or from a ring of QA tiles in shared memory that 16-byte cp.asyncs fill
    # QA - 1 tiles ahead, each thread copying the very words it reads back (so its own wait_group orders them)
    if QA > 0:
        for t in gl.static_range(QA - 1):
            _cp_async(qring.index(t), q_ptrs + gl.minimum(t, k_tiles - 1) * BW)
            async_copy.commit_group()
    else:
        q0 = gl.load(q_ptrs)
        q1 = gl.load(q_ptrs + gl.minimum(1, k_tiles - 1) * BW)
    s0, z0 = _group_params(s_ptrs, z_ptrs, k0 * BK // GROUP, offset, HAS_ZEROS, DT)
    t1 = gl.minimum(1, k_tiles - 1)
    s1, z1 = _group_params(s_ptrs, z_ptrs, (k0 + t1) * BK // GROUP, offset, HAS_ZEROS, DT)
    if DIAG == 4:
        w_first = _decode(gl.load(q_ptrs), s0, z0, magic, DT, BN, BK)
    for i in range(k_tiles):
        st = i % STAGES
        t2 = gl.minimum(i + 2, k_tiles - 1)
        if QA > 0:
            # into the slot of tile i - 1, read (into registers, and decoded) last iteration; then tile i has landed
            # once at most QA - 1 groups are left in flight
            _cp_async(qring.index((i + QA - 1) % QA), q_ptrs + gl.minimum(i + QA - 1, k_tiles - 1) * BW)
            async_copy.commit_group()
            async_copy.wait_group(QA - 1)
            q = qring.index(i % QA).load(q_l)
        else:
            q = q0
            q0 = q1
            q1 = gl.load(q_ptrs + t2 * BW)
        sc, nz = s0, z0
        s0, z0 = s1, z1
        s1, z1 = _group_params(s_ptrs, z_ptrs, (k0 + t2) * BK // GROUP, offset, HAS_ZEROS, DT)
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        if X_TMA:  # one arrival with the tile's bytes expected, then the copy's
            mbarrier.expect(ready.index(st), BM * BK * 2)
            _tma_load(x_desc, [m0, (k0 + i) * BK], ready.index(st), xs.index(st))
        else:
            _cp_async(xs.index(st), x_ptrs + i * BK)
            async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        if DIAG == 0 or DIAG == 2:
            ws.index(st).store(_decode(q, sc, nz, magic, DT, BN, BK))
        elif DIAG == 3:  # the decode without its stores (a condition the compiler cannot fold: K >= 0)
            w = _decode(q, sc, nz, magic, DT, BN, BK)
            if k_tiles < 0:
                ws.index(st).store(w)
        elif DIAG == 4:  # the stores without the decode: tile 0's weights every time
            ws.index(st).store(w_first)
        fence_async_shared()  # the decoded tile's generic-proxy stores, before the wgmma's async-proxy reads
        _cta_barrier()  # every producer thread's share of the tile
        mbarrier.arrive(ready.index(st))


@gluon.jit
def _consumer(xs, ws, c_smem, ready, empty, y_ptr, b_ptr, part_ptr, cnt_ptr, tile, part, m0, n0, M, N, k_tiles,
              stride_ym, part_rows, part_cols,
              HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
              CW: gl.constexpr, IN_FLIGHT: gl.constexpr, SPLIT: gl.constexpr, DIAG: gl.constexpr):  # fmt: skip
    # The default partition: the wgmmas, one tile's in flight, and the epilogue (split K: the last one out's)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, mma)
    for i in range(k_tiles):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)  # x's copies landed and W's tile is stored
        fence_async_shared()  # cp.async writes are generic-proxy; the wgmma reads through the async proxy
        if DIAG != 2:
            acc = warpgroup_mma(xs.index(st), ws.index(st).permute((1, 0)), acc, is_async=True)
        if IN_FLIGHT == 1:
            acc = warpgroup_mma_wait(1, deps=[acc])  # tile i - 1's wgmmas are done
            if i > 0:
                _cta_barrier()  # both warpgroups past tile i - 1
                mbarrier.arrive(empty.index((i - 1) % STAGES))
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
            _cta_barrier()
            mbarrier.arrive(empty.index(st))
    acc = warpgroup_mma_wait(0, deps=[acc])
    if SPLIT == 1:
        _store_y(acc, c_smem, y_ptr, b_ptr, m0, n0, M, N, stride_ym, HAS_BIAS, BM, BN, CW)
    else:
        # this part's float32 tile, in the accumulator's own layout, into partials [SPLIT, part_rows, part_cols] padded
        # to whole tiles (no masks: a mask over the tile cost the 128 x 128 form 340 bytes of spills); the last part
        # out adds them in split order and stores y
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        offs = gl.expand_dims(rows.to(gl.int64) * part_cols, 1) + gl.expand_dims(cols, 0)
        plane = part_rows.to(gl.int64) * part_cols
        last, total = publish_and_sum(acc, part_ptr + offs, plane, None, None, cnt_ptr + tile, part, SPLIT)
        if last:
            _store_y(total, c_smem, y_ptr, b_ptr, m0, n0, M, N, stride_ym, HAS_BIAS, BM, BN, CW)


@gluon.jit
def _store_y(acc, c_smem, y_ptr, b_ptr, m0, n0, M, N, stride_ym,
             HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, CW: gl.constexpr):  # fmt: skip
    # through shared memory, so that y leaves in 16-byte row vectors with few address registers; a bias is added to y
    # rounded to x's dtype (two roundings, where the codes kernel adds it in float32: within 16-bit tolerance)
    DT: gl.constexpr = c_smem.dtype
    c_smem.store(acc.to(DT))
    _cta_barrier()
    RB: gl.constexpr = 16  # rows a store
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [CW, 1], [1, 0]) if BN <= 256 else None
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_l))
    if HAS_BIAS:
        bias = gl.expand_dims(gl.load(b_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    for r in gl.static_range(BM // RB):
        rows = m0 + r * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, out_l))
        out = c_smem.slice(r * RB, RB).load(out_l)
        if HAS_BIAS:
            out = (out.to(gl.float32) + bias).to(DT)
        y_ptrs = y_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ym, 1) + gl.expand_dims(cols, 0)
        gl.store(y_ptrs, out, mask=gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0))


@cached_launch
@gluon.jit
def _w4a16_ws_kernel(
    x_ptr, x_desc, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N, K,
    stride_xm, stride_qn, stride_sn, stride_zn, stride_ym, part_rows, part_cols,
    GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    CW: gl.constexpr, PW: gl.constexpr, PREGS: gl.constexpr, X_TMA: gl.constexpr = False, IN_FLIGHT: gl.constexpr = 1,
    SPLIT: gl.constexpr = 1, QA: gl.constexpr = 0, DIAG: gl.constexpr = 0,
    USE_PDL: gl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # first (tests/test_pdl.py): nothing of another kernel's is read or written before it
    DT: gl.constexpr = x_ptr.dtype.element_ty
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    tile = gl.program_id(0) // SPLIT  # a tile's SPLIT programs are neighbours: they end at about the same time
    part = gl.program_id(0) % SPLIT
    pid = tile
    width = GROUP_M * num_n  # grouped_tile's bands (kernels/tiling.py)
    first_m = (pid // width) * GROUP_M
    band = gl.minimum(num_m - first_m, GROUP_M)
    m0 = (first_m + (pid % width) % band) * BM
    n0 = ((pid % width) // band) * BN
    k_all = K // BK
    per = gl.cdiv(k_all, SPLIT)  # K tiles a part (the host makes none empty)
    k0 = part * per
    k_tiles = gl.minimum(per, k_all - k0)
    xs = gl.allocate_shared_memory(DT, [STAGES, BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], DT))
    ws = gl.allocate_shared_memory(DT, [STAGES, BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], DT))
    c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], DT)
    if STAGES * BK >= BN:  # WsConfig.reuses_ring: x's ring is idle once the last wgmma is waited
        c_smem = _as_tile(xs, DT, [BM, BN], c_l)
    else:
        c_smem = gl.allocate_shared_memory(DT, [BM, BN], c_l)
    if QA > 0:  # the words' ring (the producer's own: no barriers)
        qring = gl.allocate_shared_memory(gl.int32, [QA, BN, BK // 8], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    else:
        qring = ws
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # x's arrival (TMA: the expect; cp.async: a noinc arrival a producer thread), then W's
        mbarrier.init(ready.index(s), count=2 if X_TMA else PW * 32 + 1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (xs, ws, c_smem, ready, empty, y_ptr, b_ptr, part_ptr, cnt_ptr, tile, part, m0, n0, M, N,
                         k_tiles, stride_ym, part_rows, part_cols, HAS_BIAS, BM, BN, STAGES, CW, IN_FLIGHT, SPLIT,
                         DIAG)),
            (_producer, (x_ptr, x_desc, q_ptr, s_ptr, z_ptr, xs, ws, qring, ready, empty, m0, n0, M, N, k0, k_tiles,
                         magic, offset, stride_xm, stride_qn, stride_sn, stride_zn, GROUP, HAS_ZEROS, BM, BN, BK,
                         STAGES, PW, X_TMA, QA, DIAG)),
        ],
        [PW],
        [PREGS],
    )  # fmt: skip


def effective_split(k_tiles: int, split: int) -> int:
    """The K parts a tile takes for `split` asked over k_tiles K tiles: at most one a K tile, and as many as leave no
    part empty (the kernel gives each part cdiv(k_tiles, parts) tiles, the last the rest)."""
    split = max(1, min(split, k_tiles))
    return cdiv(k_tiles, cdiv(k_tiles, split))


def maxnreg(cfg: WsConfig) -> int:
    """Registers a thread at launch: the SM's 64K over the consumer and producer warps, a multiple of 8 (the producer
    then gives back all but its `producer_regs` to the consumer warps)."""
    return 65536 // ((CONSUMER_WARPS + cfg.producer_warps) * 32) // 8 * 8


def constexprs(group: int, has_zeros: bool, has_bias: bool, cfg: WsConfig) -> dict:
    """The kernel's compile-time arguments."""
    return {"GROUP": group, "HAS_ZEROS": has_zeros, "HAS_BIAS": has_bias, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk,
            "STAGES": cfg.stages, "GROUP_M": cfg.group_m, "CW": CONSUMER_WARPS, "PW": cfg.producer_warps,
            "PREGS": cfg.producer_regs, "X_TMA": cfg.x_tma, "IN_FLIGHT": cfg.in_flight, "SPLIT": cfg.split,
            "QA": cfg.words_ahead, "DIAG": cfg.diag}  # fmt: skip


def x_descriptor(x: torch.Tensor, cfg: WsConfig):  # -> TensorDescriptor
    """The TMA descriptor of x [M, K] in [BM, BK] boxes, the layout of the kernel's ring."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dt = _GL_DTYPE[x.dtype]
    return TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk], gl.NVMMASharedLayout.get_default_for([cfg.bm, cfg.bk], dt))


def w4a16_ws(
    x: torch.Tensor,  # [M, K] bf16 / fp16, unit stride along K
    qweight: torch.Tensor,  # int32 [N, K // 8]
    scales: torch.Tensor,  # [N, K // G]
    zeros: torch.Tensor | None,  # uint8 [N, K // G] or None (zero 8)
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    cfg: WsConfig | None = None,
) -> torch.Tensor:  # [M, N] x.dtype
    cfg = cfg or WsConfig()
    assert supported(x, qweight, group, cfg), (tuple(x.shape), group, cfg)
    assert qweight.stride(1) == 1 and scales.stride(1) == 1 and (zeros is None or zeros.stride(1) == 1)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    magic, offset = MAGIC[x.dtype]
    x_desc = x_descriptor(x, cfg) if cfg.x_tma else x
    m_tiles, n_tiles = cdiv(m, cfg.bm), cdiv(n, cfg.bn)
    split = effective_split(k // cfg.bk, cfg.split)
    split, counters, parts = split_scratch(x.device, "w4a16_ws", m_tiles * n_tiles, split, m_tiles * cfg.bm,
                                           n_tiles * cfg.bn)  # fmt: skip
    if split != cfg.split:
        cfg = replace(cfg, split=split)
    _w4a16_ws_kernel[(m_tiles * n_tiles * split,)](
        x, x_desc, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        parts if parts is not None else y, counters if counters is not None else qweight,
        magic, offset, m, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, y.stride(0), m_tiles * cfg.bm, n_tiles * cfg.bn,
        **constexprs(group, zeros is not None, bias is not None, cfg),
        num_warps=CONSUMER_WARPS, maxnreg=maxnreg(cfg), **pdl_launch(x.device),
    )  # fmt: skip
    return y
