"""int4 weight x 16-bit activation products at 1-16 rows on Hopper's wgmma, the weights as register operands:
y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the "int4" layout of kernels/quant_formats.py.

`w4a16_linear` sends int4 products of 9-16 rows here for the weights of `engine_config`'s bounds (K <= 4096, N x K
<= 40 Mi elements), where the H200 measured it faster than the mma.sync kernel (session 44; docs/performance.md);
tests/test_gluon_w4a16_wgmma.py (compute capability 9.x) checks it against quant_linear_ref,
tests/test_gluon_wgmma_compile.py its offline sm_90 build, and benchmarks/bench_w4a16_mma.py `--wgmma` times it
beside the mma.sync kernel. Why it exists: kernels/gluon_w4a16_mma.py keeps x as mma.sync B
operands in registers, loaded by every warp (at 9-16 rows as many bytes from L2 as the weight's, and at 16 rows
64 registers a thread of x), and its 64-row forms run one 8-warp program an SM at 247 registers: 29-44% of copy
bandwidth at 16 rows on the H200 (docs/performance.md, session 42). The Triton codes kernel
(triton_w4a16_codes) puts the weights on wgmma's M but through shared memory, a round trip and barriers each
tile. Here:

- The product is y^T = W x^T: a program's BM = 64 x TILES rows of W are wgmma's M (one warpgroup, 4 warps,
  warp w holding rows 16 w to 16 w + 15 of each 64-row tile), x^T its N = NP columns (8 at 1-8 rows, 16 at 9-16;
  padding columns repeat the last row of x and are never stored).
- x is read once a program: its K share [NP, KS] goes to shared memory at the start, in logical K order, with
  each chunk's column sums beside it, so the loop has no barrier and no load of x.
- The weights go from global memory to registers and, through gluon_w4_mma_tiles' LOP3 (`_pair`: offset + code,
  exact in 16 bits), straight into wgmma's A register fragment. K is permuted inside a chunk of KC (a power of
  two dividing the group, 32-128) so that a thread's RW = KC / 32 words of a row are adjacent in memory:
  logical k = h + 2t + 8i + 32r holds memory element e = i + 4h + 8(RW t + r) (lane t = lane % 4, word r of
  the thread's run, nibble pair i of the word, half h of the pair). x is stored in the same logical order.
- A chunk lies inside one quantization group, so its accumulator leaves through
  scale * (acc - (offset + zero) * colsum), as in the mma.sync kernels.
- Splits of K: SPLIT programs per row tile publish float32 partials [SPLIT, M, N]; the last one out (an acq_rel
  ticket, kernels/tickets.py's protocol) adds them in split order and stores y.

Built (the H200's Triton 3.6 and ptxas, as offline with Triton 3.9): 16 rows, 2 tiles, chunks of 128: 127
registers, 16-byte word loads, 16 m64n16k16 wgmmas a chunk, no spills; 1 tile 79 registers. Overlapping a chunk's
wgmmas with the next chunk's decode (two accumulators by turns) made ptxas serialize every wgmma (C7513), so the
loop waits for each chunk's. Measured on the H200 (session 44), it stays far from the copy floor: 16-44% at 12-16
rows, 41% at best on Qwen3-8B gate_up at one row (the mma.sync kernel 74%). Words 2 or 3 chunks ahead
(`words_ahead`) gave no consistent gain: the median shape's time 0.96-1.01x of one ahead, the best 0.84x, the worst
1.42x (Qwen3-8B down on 2 tiles, where 167 registers against 127 cost programs an SM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ftransformers.kernels.gluon_mla_decode import _cta_barrier, pdl_enter
from ftransformers.kernels.gluon_w4_mma_tiles import MAGIC, _capability, _pair
from ftransformers.kernels.gluon_w4a16_mma import _split_store_y, kernel_args
from ftransformers.kernels.launch import cached_launch
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.tickets import split_scratch, ticket_counters

MAX_ROWS = 16
# w4a16_linear (without a config) sends an int4 product of ENGINE_MIN_ROWS to 16 rows here (0: never), on
# `engine_config`, for weights of K <= ENGINE_MAX_K and N x K <= ENGINE_MAX_NK elements, on ENGINE_TILES 64-row
# tiles a program. H200, session 44 (bench_w4a16_mma.py --wgmma, 9-16 rows, three runs), 1 tile against the
# mma.sync kernel: 0.71-0.95x the time on Qwen3-30B-A3B qkv, Qwen3-8B qkv and o, DeepSeek-V3 q_b and shared down;
# 0.99-1.05x on Qwen3-30B-A3B o; 1.1-1.6x on the larger weights (K 4096 x N 24576, K >= 7168). In whole decode
# steps at B = 16 (ab_decode.py, 4 rounds, graph replay, route on against ENGINE_MIN_ROWS 0 in one process):
# Qwen3-8B W4A16 3.813 against 3.930 ms (another process: 3.798 against 3.902, and 4.184 with every shape sent
# here); Qwen3-30B-A3B 7.790 against 7.935, and 7.862 with its o projection left on the mma.sync kernel
ENGINE_MIN_ROWS = 9
ENGINE_MAX_K = 4096
ENGINE_MAX_NK = 40 << 20
ENGINE_TILES = 1
# shared memory a program may take for x and its column sums (`shared_bytes`): 2 programs an SM at 80 KB (228 KB)
MAX_X_BYTES = 80 * 1024


@dataclass(frozen=True)
class WgmmaLinearConfig:
    """TILES 64-row tiles of W a program (one warpgroup), chunks of at most KC, SPLIT programs along K, whether
    the scales and zeros are loaded a chunk ahead, and how many chunks of words are in flight ahead."""

    tiles: int = 2
    kc: int = 128
    split: int = 1
    # a chunk's scales and zeros loaded one chunk ahead, with its words. Off: after its wgmmas (a row's scales of
    # consecutive chunks share cache lines, so only the first is a DRAM round trip); on took 167 registers against
    # 127 at 16 rows, 2 tiles (offline ptxas)
    scales_ahead: bool = False
    # chunks of words requested ahead of the one being multiplied (1-3): each costs a thread RW x TILES registers
    words_ahead: int = 1

    def rows(self) -> int:
        return 64 * self.tiles


# programs the split aims for (two an SM on the H100's and H200's 132), and the shared memory for x it leaves a
# program (so that several run on an SM)
AIM_PROGRAMS = 264
AIM_X_BYTES = 32 * 1024
# x's chunks whose loads _stage_x puts in flight together (at most; the largest divisor of the chunks)
STAGE_CHUNKS = 4
MIN_SHARE = 512  # K a program takes at least (float32 partials of a split cost split x M x N x 8 bytes of traffic)


def default_config(m: int, n: int, k: int, group: int, tiles: int = 2, kc: int = 128) -> WgmmaLinearConfig:
    """A starting point for the benchmark, not a measured rule: TILES (1 where it does not divide N) and KC as
    given, and K split in the fewest powers of two (K shares of at least MIN_SHARE) that give AIM_PROGRAMS programs
    with x's share within AIM_X_BYTES; else the largest split that `fits` (the result may not fit: callers check)."""
    if n % (64 * tiles):
        tiles = 1
    best = WgmmaLinearConfig(tiles, kc, 1)
    split = 1
    while k % split == 0 and k // split >= MIN_SHARE:
        cfg = WgmmaLinearConfig(tiles, kc, split)
        if fits(m, n, k, group, cfg):
            best = cfg
            ks = k // split
            x_bytes = shared_bytes(columns(m), ks, chunk(ks, group, kc))
            if n // cfg.rows() * split >= AIM_PROGRAMS and x_bytes <= AIM_X_BYTES:
                break
        split *= 2
    return best


def engine_config(m: int, n: int, k: int, group: int) -> WgmmaLinearConfig | None:
    """The config w4a16_linear runs M rows of an int4 [N, K] weight with here (`default_config` with ENGINE_TILES
    tiles), or None: rows outside ENGINE_MIN_ROWS..16 (all while it is 0), K over ENGINE_MAX_K or N x K over
    ENGINE_MAX_NK, groups that do not hold chunks of 128 (the measured ones: chunks of 64 were slower), or a shape
    that config does not fit."""
    if not ENGINE_MIN_ROWS or not ENGINE_MIN_ROWS <= m <= MAX_ROWS or k > ENGINE_MAX_K or n * k > ENGINE_MAX_NK:
        return None
    if group % 128:
        return None
    cfg = default_config(m, n, k, group, ENGINE_TILES)
    return cfg if fits(m, n, k, group, cfg) else None


def columns(m: int) -> int:
    """wgmma's N for M rows of x: 8 up to 8 rows, else 16."""
    return 8 if m <= 8 else 16


def chunk(ks: int, group: int, most: int) -> int:
    """The largest chunk KC <= most (a power of two >= 32) dividing both K's share ks and the group; 0 if none."""
    kc = most
    while kc >= 32:
        if ks % kc == 0 and group % kc == 0:
            return kc
        kc //= 2
    return 0


def fits(m: int, n: int, k: int, group: int, cfg: WgmmaLinearConfig) -> bool:
    """The shape part of `supported`: 1 <= M <= 16, N a multiple of a program's rows, K split evenly into whole
    chunks, and x's share within MAX_X_BYTES."""
    if not 1 <= m <= MAX_ROWS or n % cfg.rows() or cfg.split < 1 or k % cfg.split or not 1 <= cfg.words_ahead <= 3:
        return False
    ks = k // cfg.split
    kc = chunk(ks, group, cfg.kc)
    return kc > 0 and shared_bytes(columns(m), ks, kc) <= MAX_X_BYTES


def shared_bytes(np_: int, ks: int, kc: int) -> int:
    """A program's shared memory: x's K share (16-bit, NP columns) and each chunk's float32 column sums."""
    return np_ * ks * 2 + np_ * (ks // kc) * 4


def supported(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: WgmmaLinearConfig) -> bool:
    """Whether the kernel takes x [M, K] @ W^T for this int4 qweight [N, K // 8]: a Hopper GPU (compute
    capability 9.x, wgmma), bf16 / fp16 x, and `fits`."""
    if x.device.type != "cuda" or x.dtype not in MAGIC or _capability(x.device.index or 0)[0] != 9:
        return False
    return fits(x.shape[0], qweight.shape[0], x.shape[1], group, cfg)


def runs_now(x: torch.Tensor, qweight: torch.Tensor, group: int, cfg: WgmmaLinearConfig) -> bool:
    """`supported`, and launchable now: a split config needs its ticket counters, which a CUDA-graph capture
    cannot allocate (the engine's warm-up runs allocate them first); without them it runs unsplit, where that fits.
    w4a16_linear asks this, and takes the mma.sync kernel otherwise."""
    if not supported(x, qweight, group, cfg):
        return False
    m, k = x.shape
    if cfg.split == 1 or fits(m, qweight.shape[0], k, group, replace(cfg, split=1)):
        return True
    return ticket_counters(x.device, "w4a16_wgmma", qweight.shape[0] // cfg.rows()) is not None


def layouts(tiles: int, kc: int, np_: int) -> dict:
    """The accumulator's wgmma layout [BM, NP], A's register fragment [BM, KC] and the words' layout [BM, 4 (t),
    RW (r)] that decodes into it with no data movement (module docstring)."""
    rw = kc // 32
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, np_, 16])
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(rw.bit_length() - 1)] + [[8, 0, 0]]
        + [[64 << i, 0, 0] for i in range(tiles.bit_length() - 1)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64 * tiles, 4, rw],
    )  # fmt: skip
    return {"mma": mma, "a_l": gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2), "w_l": words}


@gluon.jit
def chunk_words(w_l: gl.constexpr, BM: gl.constexpr, RW: gl.constexpr):
    # index tensors of a chunk's words [BM, 4 (t), RW (r)] in w_l: row [BM, 1, 1], memory word RW t + r [1, 4, RW]
    l2: gl.constexpr = gl.SliceLayout(2, w_l)
    wrow = gl.expand_dims(gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, l2)), 1), 2)
    wt = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, l2)), 0), 2)
    wr = gl.expand_dims(gl.expand_dims(gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(0, w_l))), 0), 0)
    return wrow, wt * RW + wr


@gluon.jit
def _a_fragment(q, magic, DT: gl.constexpr, a_l: gl.constexpr, BM: gl.constexpr, RW: gl.constexpr):
    # q [BM, 4 (t), RW (r)] words -> [BM, 32 RW] DT A operand, logical k = h + 2t + 8i + 32r
    q2 = gl.join(q, q)
    # the magic through an opaque mov (as gluon_w4_mma_tiles._a_tile: one register, not the constant bank)
    m2 = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [q2 * 0 + magic], dtype=gl.int32, is_pure=True, pack=1)
    c = gl.join(gl.join(_pair(q2, m2, 0, DT), _pair(q2, m2, 1, DT)),
                gl.join(_pair(q2, m2, 2, DT), _pair(q2, m2, 3, DT)))  # [BM, t, r, h, i bit 0, i bit 1]
    c = gl.permute(c, (0, 2, 5, 4, 1, 3))  # [BM, r, i bit 1, i bit 0, t, h]
    return gl.convert_layout(gl.reshape(c, [BM, 32 * RW]), a_l, assert_trivial=True)


@gluon.jit
def _stage_x(x_ptr, xs, sums, k0, M, stride_xm, NP: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
             GROUPED: gl.constexpr):  # fmt: skip
    # xs [CHUNKS, NP, KC] <- x[min(col, M - 1), k0 + c KC + e] at logical k (module docstring); sums [CHUNKS, NP]
    # <- each chunk's column sums (float32). GROUPED chunks a step, unrolled so that their loads are in flight
    # together (one at a time put a round trip to L2 per chunk before the first wgmma; all at once, ptxas hoisted
    # them and took 167 registers for the kernel against 127)
    RW: gl.constexpr = KC // 32
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte runs of memory order
    col = gl.expand_dims(gl.arange(0, NP, layout=gl.SliceLayout(1, ld)), 1)
    e = gl.expand_dims(gl.arange(0, KC, layout=gl.SliceLayout(0, ld)), 0)
    ptrs = x_ptr + gl.minimum(col, M - 1).to(gl.int64) * stride_xm + k0 + e
    for c0 in range(0, CHUNKS, GROUPED):
        for j in gl.static_range(GROUPED):
            c = c0 + j
            x = gl.load(ptrs + c * KC)  # [NP, KC], memory element e = 8 (RW t + r) + 4h + i
            sums.index(c).store(gl.sum(x.to(gl.float32), axis=1))
            x6 = gl.reshape(x, [NP, 4, RW, 2, 4])  # [col, t, r, h, i]
            xs.index(c).store(gl.reshape(gl.permute(x6, (0, 2, 4, 1, 3)), [NP, KC]))  # [col, r, i, t, h]


@gluon.jit
def _group_scale(s_ptr, z_ptr, s_rows, k, offset, GROUP: gl.constexpr, HAS_ZERO: gl.constexpr):
    # [BM, 1] float32 scale and offset + zero of the group holding element k of each row
    g = k // GROUP
    scale = gl.load(s_ptr + s_rows + g).to(gl.float32)
    if HAS_ZERO:
        zz = gl.load(z_ptr + s_rows + g).to(gl.float32) + offset
    else:
        zz = gl.full(scale.shape, 8.0, gl.float32, scale.type.layout) + offset
    return scale, zz


@cached_launch
@gluon.jit
def _w4a16_wgmma_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, cnt_ptr, magic, offset, M, N,
    stride_xm, stride_qn, stride_sn, stride_ym,
    HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
    NP: gl.constexpr, TILES: gl.constexpr, SPLIT: gl.constexpr, GROUPED: gl.constexpr, SCALES_AHEAD: gl.constexpr,
    AHEAD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, w_l: gl.constexpr, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # y[m, n] for m < M, n in [n0, n0 + BM), over K [k0, k0 + KS); SPLIT > 1: partials and the last one out
    RW: gl.constexpr = KC // 32
    BM: gl.constexpr = 64 * TILES
    KS: gl.constexpr = CHUNKS * KC
    DT: gl.constexpr = x_ptr.dtype.element_ty
    n0 = gl.program_id(0) * BM
    k0 = gl.program_id(1) * KS

    # words [BM, 4, RW]: row n0 + row, word k0 / 8 + RW t + r of each chunk; the first AHEAD chunks' before the
    # wait (q, q1, q2: chunks c, c + 1, c + 2 of the loop; indices past the last chunk reload it, from L2)
    wrow, word = chunk_words(w_l, BM, RW)
    q_ptrs = q_ptr + (n0 + wrow).to(gl.int64) * stride_qn + k0 // 8 + word
    q = gl.load(q_ptrs)
    C1: gl.constexpr = 1 if CHUNKS > 1 else 0
    C2: gl.constexpr = 2 if CHUNKS > 2 else CHUNKS - 1
    if AHEAD >= 2:
        q1 = gl.load(q_ptrs + C1 * (KC // 8))
    if AHEAD >= 3:
        q2 = gl.load(q_ptrs + C2 * (KC // 8))
    pdl_enter(USE_PDL)

    xs_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NP, KC], DT)
    xs = gl.allocate_shared_memory(DT, [CHUNKS, NP, KC], xs_l)
    sums = gl.allocate_shared_memory(gl.float32, [CHUNKS, NP], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    _stage_x(x_ptr, xs, sums, k0, M, stride_xm, NP, KC, CHUNKS, GROUPED)
    fence_async_shared()  # generic-proxy stores, before the wgmmas read them
    _cta_barrier()  # every warp's share of x and the sums

    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    s_rows = gl.expand_dims((n0 + rows).to(gl.int64) * stride_sn, 1)  # [BM, 1]
    tot = gl.zeros([BM, NP], gl.float32, mma)
    zero = gl.zeros([BM, NP], gl.float32, mma)  # the accumulator each chunk's first wgmma ignores (use_acc=False)
    # one chunk's wgmmas at a time: A for the next chunk cannot be decoded while they run (ptxas serializes every
    # wgmma where a non-wgmma instruction defines wgmma input registers inside a wgmma pipeline stage, its C7513
    # advisory, which two accumulators by turns met offline); other programs on the SM overlap them
    scale, zz = _group_scale(s_ptr, z_ptr, s_rows, k0, offset, GROUP, HAS_ZERO)
    for c in range(CHUNKS):
        q_c, scale_c, zz_c = q, scale, zz
        nxt = gl.minimum(c + 1, CHUNKS - 1)
        if CHUNKS > 1:  # chunk c + AHEAD's words are requested before this chunk's product
            far = gl.minimum(c + AHEAD, CHUNKS - 1) * (KC // 8)
            if AHEAD == 1:
                q = gl.load(q_ptrs + far)
            elif AHEAD == 2:
                q, q1 = q1, gl.load(q_ptrs + far)
            else:
                q, q1, q2 = q1, q2, gl.load(q_ptrs + far)
        if SCALES_AHEAD:  # and its scales and zeros
            scale, zz = _group_scale(s_ptr, z_ptr, s_rows, k0 + nxt * KC, offset, GROUP, HAS_ZERO)
        a = _a_fragment(q_c, magic, DT, a_l, BM, RW)
        acc = warpgroup_mma(a, xs.index(c).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc, a = warpgroup_mma_wait(0, deps=[acc, a])  # A's registers stay live until the wgmma has read them
        if not SCALES_AHEAD:  # this chunk's, after its wgmmas (ptxas may still issue them earlier)
            scale_c, zz_c = _group_scale(s_ptr, z_ptr, s_rows, k0 + c * KC, offset, GROUP, HAS_ZERO)
        colsum = gl.expand_dims(sums.index(c).load(gl.SliceLayout(0, mma)), 0)  # [1, NP]
        tot += scale_c * (acc - zz_c * colsum)

    n_idx = gl.expand_dims(n0 + rows, 1)  # [BM, 1]
    toks = gl.expand_dims(gl.arange(0, NP, layout=gl.SliceLayout(0, mma)), 0)  # [1, NP]
    _split_store_y(tot, y_ptr, bias_ptr, part_ptr, cnt_ptr, n_idx, toks, M, N, stride_ym, HAS_BIAS, SPLIT)


def constexprs(m: int, k: int, group: int, has_zero: bool, has_bias: bool, cfg: WgmmaLinearConfig) -> dict:
    """The kernel's compile-time arguments for M rows of x, K, the group and cfg (shapes that `fits`)."""
    ks = k // cfg.split
    kc = chunk(ks, group, cfg.kc)
    np_ = columns(m)
    chunks = ks // kc
    return dict(HAS_ZERO=has_zero, HAS_BIAS=has_bias, GROUP=group, KC=kc, CHUNKS=chunks, NP=np_, TILES=cfg.tiles,
                SPLIT=cfg.split, GROUPED=math.gcd(chunks, STAGE_CHUNKS), SCALES_AHEAD=cfg.scales_ahead,
                AHEAD=cfg.words_ahead, **layouts(cfg.tiles, kc, np_))  # fmt: skip


def w4a16_wgmma(
    x: torch.Tensor,  # [M, K] bf16 / fp16, unit stride along K, 1 <= M <= 16
    qweight: torch.Tensor,  # int32 [N, K // 8]
    scales: torch.Tensor,  # [N, K // G]
    zeros: torch.Tensor | None,  # uint8 [N, K // G] or None (zero 8)
    group: int,
    bias: torch.Tensor | None = None,  # [N]
    cfg: WgmmaLinearConfig | None = None,
) -> torch.Tensor:  # [M, N] x.dtype
    m, k = x.shape
    n = qweight.shape[0]
    cfg = cfg or default_config(m, n, k, group)
    assert supported(x, qweight, group, cfg), (tuple(x.shape), group, cfg)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = n // cfg.rows()
    cnt, part, split = None, None, cfg.split
    if split > 1:  # unsplit where no ticket counters can be had (a capture before the pool exists)
        split, cnt, part = split_scratch(x.device, "w4a16_wgmma", tiles, split, m, n)
        if split != cfg.split and not fits(m, n, k, group, replace(cfg, split=split)):
            raise RuntimeError(f"w4a16_wgmma: no split-K scratch here and K {k} unsplit does not fit {cfg}")
    consts = constexprs(m, k, group, zeros is not None, bias is not None, replace(cfg, split=split))
    _w4a16_wgmma_kernel[(tiles, split)](
        *kernel_args(x, qweight, scales, zeros, bias, y, part, cnt), **consts, num_warps=4, **pdl_launch(x.device),
    )  # fmt: skip
    return y
