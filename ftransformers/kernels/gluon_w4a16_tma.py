"""int4 weight x 16-bit activation products at 1-16 rows on Hopper, the weights' words streamed by TMA through a
ring of shared memory: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the "int4" layout of kernels/quant_formats.py.

Why it exists. The two register-fed int4 kernels stay far from the copy floor at 8-16 rows on large weights
(docs/performance.md, sessions 41-50: 29-44% at 16 rows): gluon_w4a16_mma loads x into every warp's registers
(Nsight Compute put its L1/TEX pipe at 81-82% there, DRAM at 42-46%), and gluon_w4a16_wgmma, which reads x from
shared memory, loads its words straight into registers, so the bytes it has in flight are bounded by the
registers a thread can spare (a chunk or two ahead) and each chunk's DRAM round trip lands in its critical path.
Here the words never pass through the load/store unit on their way in: one thread issues a TMA box a chunk, STAGES
chunks ahead, and the bytes in flight are STAGES x the box, whatever the registers.

- A program is one warpgroup; its BM = 64 x TILES rows of W are wgmma's M, x^T its N = NP columns (8 at 1-8 rows,
  16 at 9-16; padding columns repeat the last row of x and are never stored): y^T = W x^T.
- The words of a chunk (BM rows x KC / 8 int32, one TMA box, no swizzle) land in ring slot c % STAGES on that
  slot's mbarrier. The first STAGES boxes, and the first three chunks' scales and zeros, are requested before
  the PDL wait: they are weights, which no kernel writes.
- x streams beside them: chunk c + 1 is stored to one of three shared slots in the logical K order of
  gluon_w4a16_wgmma (`put_x`, with its column sums) while chunk c is multiplied, from registers loaded two chunks
  earlier (a first version staged the program's whole K share of x before its first wgmma: 30.5 us on Qwen3-8B
  gate_up at 16 rows, 41% of copy, where splitting K less, and so more x a program, was slower still). The
  logical order lets a thread read its RW = KC / 32 words of a row as one 16-byte load and decode them by LOP3
  (`_a_fragment`) straight into wgmma's A registers. A slot of words is refilled (STAGES chunks on) once every
  thread has read it (a CTA barrier a chunk, which also publishes the next chunk's x).
- A chunk lies inside one quantization group: its accumulator leaves through scale * (acc - (offset + zero) *
  colsum), as in the other int4 kernels, with the scales and zeros loaded three chunks ahead; SPLIT programs
  along K publish float32 partials that the last one out adds in split order (kernels/tickets.py's protocol,
  gluon_w4a16_mma._split_store_y).

Shared memory a program (`shared_bytes`): the ring (STAGES x BM x KC / 2 bytes) and three chunks of x.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ftransformers.kernels.gluon_mla_decode import _cta_barrier, pdl_enter
from ftransformers.kernels.gluon_moe_w4_mma import MAGIC, _capability
from ftransformers.kernels.gluon_w4a16_mma import _split_store_y
from ftransformers.kernels.gluon_w4a16_wgmma import _a_fragment, columns, put_x, x_chunk_ptrs
from ftransformers.kernels.gluon_w4a16_wgmma import layouts as wgmma_layouts
from ftransformers.kernels.launch import cached_launch
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.tickets import split_scratch, ticket_counters

# Triton 3.6 (the device image) names the TMA load async_copy_global_to_shared; newer ones async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

MAX_ROWS = 16
# w4a16_linear sends an int4 product of ENGINE_MIN_ROWS to 16 rows here (0: never), on `engine_config`, for weights of
# N >= ENGINE_MIN_N and K <= ENGINE_MAX_K. H200, session 59 (bench_w4a16_tma.py, w4a16_tma_halves_s59_h200.*), at 16
# rows against the kernel w4a16_linear took before: Qwen3-8B gate_up 27.6 against 31.8 us (mma.sync), DeepSeek-V3
# q_b 12.3 against 13.4 (wgmma). Slower at 8 rows on every shape measured, and at 16 on DeepSeek-V3 o (K 16384),
# Qwen3-8B down (K 12288) and qkv (N 6144); level on Qwen3-30B-A3B qkv and DeepSeek-V3 shared gate_up
ENGINE_MIN_ROWS = 9
ENGINE_MIN_N = 16384
ENGINE_MAX_K = 4096
ENGINE_TILES = 2
ENGINE_STAGES = 3
MAX_SHARED = 200 * 1024  # a program's shared memory at most (`shared_bytes`; the H100 and H200 give 227 KB)
AIM_PROGRAMS = 264  # programs `default_config`'s split aims for: two an SM on 132 SMs
MIN_SHARE = 512  # K a program takes at least


@dataclass(frozen=True)
class TmaLinearConfig:
    """TILES 64-row tiles of W a program (one warpgroup), chunks of KC (a TMA box of 64 x TILES rows by KC / 8
    words), SPLIT programs along K, STAGES ring slots (chunks in flight ahead of the one being multiplied) and
    X_AHEAD chunks of x loaded ahead."""

    tiles: int = 2
    kc: int = 128
    split: int = 1
    stages: int = 4
    # chunks of x in flight ahead of the one being stored (1 or 2; module docstring)
    x_ahead: int = 1
    # each half of a chunk's K on its own accumulator: two wgmma chains half as long (chunks of 128)
    halves: bool = False

    def rows(self) -> int:
        return 64 * self.tiles


def shared_bytes(m: int, k: int, group: int, cfg: TmaLinearConfig) -> int:
    """A program's shared memory: the ring of words, x_ahead + 1 chunks of x with their column sums, the K
    share's scales and offset zeros (float32), and one mbarrier a slot."""
    np_ = columns(m)
    xs = (cfg.x_ahead + 1) * (np_ * cfg.kc * 2 + np_ * 4)
    scales = 2 * cfg.rows() * (k // cfg.split // group) * 4
    return cfg.stages * cfg.rows() * cfg.kc // 2 + xs + scales + 8 * cfg.stages


def fits(m: int, n: int, k: int, group: int, cfg: TmaLinearConfig) -> bool:
    """1 <= M <= 16, N a multiple of a program's rows, K split into whole groups, a chunk (32-128, dividing the
    group) a TMA box can carry, 2-8 stages, x 1-2 chunks ahead, and shared memory within MAX_SHARED."""
    if not 1 <= m <= MAX_ROWS or cfg.tiles not in (1, 2) or n % cfg.rows() or cfg.split < 1 or k % cfg.split:
        return False
    if cfg.kc not in (32, 64, 128) or group % cfg.kc or (k // cfg.split) % group:
        return False
    if not 2 <= cfg.stages <= 8 or cfg.x_ahead not in (1, 2) or (cfg.halves and cfg.kc != 128):
        return False
    return shared_bytes(m, k, group, cfg) <= MAX_SHARED


def default_config(m: int, n: int, k: int, group: int, tiles: int = 2, stages: int = 4) -> TmaLinearConfig:
    """A starting point for the benchmark, not a measured rule: TILES (1 where 2 do not divide N), chunks of 128
    (or the group), and K split in the fewest powers of two (shares of at least MIN_SHARE) that give AIM_PROGRAMS
    programs; else the largest split that fits (the result may not fit: callers check)."""
    if n % (64 * tiles):
        tiles = 1
    kc = min(128, group)
    best = TmaLinearConfig(tiles, kc, 1, stages)
    split = 1
    while k % split == 0 and k // split >= MIN_SHARE:
        cfg = TmaLinearConfig(tiles, kc, split, stages)
        if fits(m, n, k, group, cfg):
            best = cfg
            if n // cfg.rows() * split >= AIM_PROGRAMS:
                break
        split *= 2
    return best


def engine_config(m: int, n: int, k: int, group: int) -> TmaLinearConfig | None:
    """The config w4a16_linear runs M rows of an int4 [N, K] weight with here (`default_config` with ENGINE_TILES
    tiles and ENGINE_STAGES stages, halves on), or None: rows outside ENGINE_MIN_ROWS..16 (all while it is 0), N
    under ENGINE_MIN_N, K over ENGINE_MAX_K, groups that do not hold chunks of 128, or a shape that does not fit."""
    if not ENGINE_MIN_ROWS or not ENGINE_MIN_ROWS <= m <= MAX_ROWS or n < ENGINE_MIN_N or k > ENGINE_MAX_K:
        return None
    if group % 128:
        return None
    cfg = replace(default_config(m, n, k, group, ENGINE_TILES, ENGINE_STAGES), halves=True)
    return cfg if fits(m, n, k, group, cfg) else None


def runs_now(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: TmaLinearConfig) -> bool:
    """`supported`, and launchable now: a split config needs its ticket counters, which a CUDA-graph capture
    cannot allocate (the engine's warm-up runs allocate them first); without them it runs unsplit, where that fits.
    w4a16_linear asks this, and takes its other kernels otherwise."""
    if not supported(x, qweight, group, cfg):
        return False
    m, k = x.shape
    if cfg.split == 1 or fits(m, qweight.shape[0], k, group, replace(cfg, split=1)):
        return True
    return ticket_counters(x.device, "w4a16_tma", qweight.shape[0] // cfg.rows()) is not None


def supported(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: TmaLinearConfig) -> bool:
    """Whether the kernel takes x [M, K] @ W^T for this int4 qweight [N, K // 8]: a Hopper GPU (wgmma, TMA),
    bf16 / fp16 x, and `fits`."""
    if x.device.type != "cuda" or x.dtype not in MAGIC or _capability(x.device.index or 0)[0] != 9:
        return False
    return fits(x.shape[0], qweight.shape[0], x.shape[1], group, cfg)


def layouts(tiles: int, kc: int, np_: int) -> dict:
    """gluon_w4a16_wgmma's layouts, and the words' layout as a slot holds them, [BM, KC / 8]: the same registers,
    lanes and warps as its [BM, 4 (t), RW (r)] words layout, word RW t + r of a row."""
    rw = kc // 32
    out = wgmma_layouts(tiles, kc, np_)
    out["wh_l"] = wgmma_layouts(tiles, kc // 2, np_)["w_l"] if kc >= 64 else out["w_l"]  # half a chunk's words
    out["slot_l"] = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(rw.bit_length() - 1)] + [[8, 0]]
        + [[64 << i, 0] for i in range(tiles.bit_length() - 1)],
        lane_bases=[[0, rw], [0, 2 * rw], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64 * tiles, kc // 8],
    )  # fmt: skip
    return out


def ring_layout() -> gl.NVMMASharedLayout:
    """The ring slots' and the TMA box's shared layout: int32 words, no swizzle (a thread's 16 bytes of a row,
    8 rows a warp: 512 contiguous bytes at chunks of 128, conflict-free)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def _stage_scales(s_ptr, z_ptr, sc_sm, zz_sm, n0, g0, offset, stride_sn, BM: gl.constexpr, NG: gl.constexpr,
                  HAS_ZERO: gl.constexpr):  # fmt: skip
    # sc_sm, zz_sm [NG, BM] float32 <- the scales, and offset + zero (8 + offset without zeros), of groups
    # g0 .. g0 + NG - 1 of rows n0 .. n0 + BM - 1 (a group's row of the buffers at a time: their rank-1 layout)
    ld: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    off = (n0 + gl.arange(0, BM, layout=ld)).to(gl.int64) * stride_sn + g0
    for g in gl.static_range(NG):
        sc_sm.index(g).store(gl.load(s_ptr + off + g).to(gl.float32))
        if HAS_ZERO:
            zz_sm.index(g).store(gl.load(z_ptr + off + g).to(gl.float32) + offset)
        else:
            zz_sm.index(g).store(gl.full([BM], 8.0, gl.float32, ld) + offset)


@cached_launch
@gluon.jit
def _w4a16_tma_kernel(
    desc, x_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N, stride_xm, stride_sn,
    stride_ym,
    HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
    NP: gl.constexpr, TILES: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, X_AHEAD: gl.constexpr,
    HALVES: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, w_l: gl.constexpr, wh_l: gl.constexpr,
    slot_l: gl.constexpr, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # y[m, n] for m < M, n in [n0, n0 + BM), over K [k0, k0 + KS); SPLIT > 1: partials and the last one out
    RW: gl.constexpr = KC // 32
    KCW: gl.constexpr = KC // 8
    BM: gl.constexpr = 64 * TILES
    KS: gl.constexpr = CHUNKS * KC
    NG: gl.constexpr = KS // GROUP
    PER_GROUP: gl.constexpr = GROUP // KC
    XS: gl.constexpr = X_AHEAD + 1  # x's slots
    DT: gl.constexpr = x_ptr.dtype.element_ty
    C1: gl.constexpr = 1 if CHUNKS > 1 else 0  # chunks 1 and 2 (the last where there are fewer)
    C2: gl.constexpr = 2 if CHUNKS > 2 else CHUNKS - 1
    n0 = gl.program_id(0) * BM
    k0 = gl.program_id(1) * KS

    # the words: STAGES chunks in flight, the first before the PDL wait, as are the share's scales and zeros
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, BM, KCW], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()  # the barriers, before the TMA unit signals them
    for s in gl.static_range(STAGES):
        if s < CHUNKS:
            mbarrier.expect(ready.index(s), BM * KCW * 4)
            _tma_load(desc, [n0, k0 // 8 + s * KCW], ready.index(s), ring.index(s))
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # as `sums`: the rank of a row
    sc_sm = gl.allocate_shared_memory(gl.float32, [NG, BM], plain)
    zz_sm = gl.allocate_shared_memory(gl.float32, [NG, BM], plain)
    _stage_scales(s_ptr, z_ptr, sc_sm, zz_sm, n0, k0 // GROUP, offset, stride_sn, BM, NG, HAS_ZERO)
    pdl_enter(USE_PDL)

    # x: chunk c in slot c % XS (logical K order, column sums beside it), the next X_AHEAD in registers. Their loads
    # are issued after each chunk's fence: fence.proxy.async comes with a MEMBAR, which waits for the thread's
    # loads in flight
    xs_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NP, KC], DT)
    xs = gl.allocate_shared_memory(DT, [XS, NP, KC], xs_l)
    sums = gl.allocate_shared_memory(gl.float32, [XS, NP], plain)
    x_ptrs = x_chunk_ptrs(x_ptr, k0, M, stride_xm, NP, KC)
    put_x(gl.load(x_ptrs), xs.index(0), sums.index(0), NP, KC)
    fence_async_shared()  # generic-proxy stores, before the wgmmas read them
    _cta_barrier()  # every warp's chunk 0 of x, the scales and zeros
    xa = gl.load(x_ptrs + C1 * KC)
    xb = xa
    if X_AHEAD == 2:
        xb = gl.load(x_ptrs + C2 * KC)

    tot = gl.zeros([BM, NP], gl.float32, mma)
    zero = gl.zeros([BM, NP], gl.float32, mma)  # the accumulator each chunk's first wgmma ignores (use_acc=False)
    for c in range(CHUNKS):
        # chunk c + 1's x to its slot (last read by chunk c + 1 - XS's wgmmas, waited for)
        put_x(xa, xs.index((c + 1) % XS), sums.index((c + 1) % XS), NP, KC)
        slot = c % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        q = gl.convert_layout(gl.reshape(ring.index(slot).load(slot_l), [BM, 4, RW]), w_l, assert_trivial=True)
        fence_async_shared()  # chunk c + 1's x, before its wgmmas
        _cta_barrier()  # every thread has its words of the slot (refill it STAGES chunks on) and stored its x
        far = x_ptrs + gl.minimum(c + 1 + X_AHEAD, CHUNKS - 1) * KC
        if X_AHEAD == 2:
            xa = xb
            xb = gl.load(far)
        else:
            xa = gl.load(far)
        if c + STAGES < CHUNKS:
            mbarrier.expect(ready.index(slot), BM * KCW * 4)
            _tma_load(desc, [n0, k0 // 8 + (c + STAGES) * KCW], ready.index(slot), ring.index(slot))
        xc = xs.index(c % XS)
        if HALVES:  # two chains of KC / 32 wgmmas, a half of K each on its own accumulator (k < KC / 2: r < RW / 2)
            q_lo, q_hi = gl.split(gl.permute(gl.reshape(q, [BM, 4, 2, RW // 2]), (0, 1, 3, 2)))
            a_lo = _a_fragment(gl.convert_layout(q_lo, wh_l, assert_trivial=True), magic, DT, a_l, BM, RW // 2)
            a_hi = _a_fragment(gl.convert_layout(q_hi, wh_l, assert_trivial=True), magic, DT, a_l, BM, RW // 2)
            acc_lo = warpgroup_mma(a_lo, xc.slice(0, KC // 2, dim=1).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)  # fmt: skip
            acc_hi = warpgroup_mma(a_hi, xc.slice(KC // 2, KC // 2, dim=1).permute((1, 0)), zero, use_acc=False,
                                   is_async=True)  # fmt: skip
            acc_lo, acc_hi, a_lo, a_hi = warpgroup_mma_wait(0, deps=[acc_lo, acc_hi, a_lo, a_hi])
            acc = acc_lo + acc_hi
        else:
            a = _a_fragment(q, magic, DT, a_l, BM, RW)
            acc = warpgroup_mma(a, xc.permute((1, 0)), zero, use_acc=False, is_async=True)
            acc, a = warpgroup_mma_wait(0, deps=[acc, a])
        g = c // PER_GROUP
        scale = gl.expand_dims(sc_sm.index(g).load(gl.SliceLayout(1, mma)), 1)  # [BM, 1]
        zz = gl.expand_dims(zz_sm.index(g).load(gl.SliceLayout(1, mma)), 1)
        colsum = gl.expand_dims(sums.index(c % XS).load(gl.SliceLayout(0, mma)), 0)  # [1, NP]
        tot += scale * (acc - zz * colsum)

    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    n_idx = gl.expand_dims(n0 + rows, 1)  # [BM, 1]
    toks = gl.expand_dims(gl.arange(0, NP, layout=gl.SliceLayout(0, mma)), 0)  # [1, NP]
    _split_store_y(tot, y_ptr, bias_ptr, part_ptr, cnt_ptr, n_idx, toks, M, N, stride_ym, HAS_BIAS, SPLIT)


def constexprs(m: int, k: int, group: int, has_zero: bool, has_bias: bool, cfg: TmaLinearConfig) -> dict:
    """The kernel's compile-time arguments for M rows of x, K, the group and cfg (shapes that `fits`)."""
    chunks = k // cfg.split // cfg.kc
    np_ = columns(m)
    return dict(HAS_ZERO=has_zero, HAS_BIAS=has_bias, GROUP=group, KC=cfg.kc, CHUNKS=chunks, NP=np_, TILES=cfg.tiles,
                SPLIT=cfg.split, STAGES=cfg.stages, X_AHEAD=cfg.x_ahead, HALVES=cfg.halves,
                **layouts(cfg.tiles, cfg.kc, np_))  # fmt: skip


def descriptor(qweight: torch.Tensor, cfg: TmaLinearConfig):  # -> TensorDescriptor
    """The TMA descriptor of qweight [N, K // 8] int32 in boxes of one chunk: [64 x TILES rows, KC / 8 words]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(qweight, [cfg.rows(), cfg.kc // 8], ring_layout())


def w4a16_tma(
    x: torch.Tensor,  # [M, K] bf16 / fp16, unit stride along K, 1 <= M <= 16
    qweight: torch.Tensor,  # int32 [N, K // 8], unit stride along K
    scales: torch.Tensor,  # [N, K // G]
    zeros: torch.Tensor | None,  # uint8 [N, K // G] or None (zero 8)
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    cfg: TmaLinearConfig | None = None,
) -> torch.Tensor:  # [M, N] x.dtype
    m, k = x.shape
    n = qweight.shape[0]
    cfg = cfg or default_config(m, n, k, group)
    assert supported(x, qweight, group, cfg), (tuple(x.shape), group, cfg)
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1
    assert zeros is None or zeros.stride() == scales.stride()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = n // cfg.rows()
    split, cnt, part = split_scratch(x.device, "w4a16_tma", tiles, cfg.split, m, n)
    if split != cfg.split and not fits(m, n, k, group, replace(cfg, split=split)):
        raise RuntimeError(f"w4a16_tma: no split-K scratch here and K {k} unsplit does not fit {cfg}")
    cfg = replace(cfg, split=split)
    magic, offset = MAGIC[x.dtype]
    _w4a16_tma_kernel[(tiles, split)](
        descriptor(qweight, cfg), x, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, y, part if part is not None else y,
        cnt if cnt is not None else qweight,
        magic, offset, m, n, x.stride(0), scales.stride(0), y.stride(0),
        **constexprs(m, k, group, zeros is not None, bias is not None, cfg), num_warps=4, **pdl_launch(x.device),
    )  # fmt: skip
    return y
