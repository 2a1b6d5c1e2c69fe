"""MLA decode (absorbed weights) on Hopper, in Gluon: stage 1 without the duplicated QK product, its
copies issued by a load partition.

Same contract as `triton_mla_attention._mla_decode_stage1_kernel` (one program per (64 heads, KV split,
sequence); a row of one split is finished here, others leave a normalised partial output and its
base-2 log-sum-exp for `decode_combine`). What Gluon lets us say that Triton does not:

- Two compute warpgroups (Triton lays a chained dot's warps along M, so with 64 heads both of its warpgroups
  computed all of the scores, and the 576-deep QK product ran twice). The scores S = q_nope c_kv^T + q_pe k_pe^T
  [64 heads, BLOCK_N tokens] are computed once:
  - SCORES_ONE_WG (the default): the first warpgroup computes S whole as m64n64 wgmmas and its online softmax,
    each row's columns within one warp (shuffles, no shared-memory round trip). It hands P and the rescale factor
    alpha to the second through shared memory (`p_full`; the second hands P back through `p_empty`). Each then
    forms half of O += P c_kv [64, 512], 256 latent columns and 128 float32 registers a thread. A tile's products
    read 224 KB of shared memory, against 296 KB in the split form below. H200, session 61, bench_attention:
    128 heads 35.0 -> 33.4 us at B=1 x 32K, 186.5 -> 170.7 at B=4 x 64K; 64 heads at B=4 x 32K 60.4 -> 57.7
    (62% of copy).
  - Otherwise the 8 warps stand as two warpgroups side by side along N (`warps_per_cta=[4, 2]`): each computes S
    for half the tokens as m64n32 wgmmas, the softmax's row reductions cross the two through shared memory, and
    each owns 256 columns of O as above.
- P goes through shared memory (8 KB a tile) so both warpgroups read all of it as the A operand.
- Warp specialisation: a partition of LOAD_WARPS warps gathers the latent rows (the cache is paged per
  token: no TMA) with 16-byte cp.async into a two-stage ring of 128-byte-swizzled tiles, each thread's
  copies arriving on the stage's `ready` mbarrier as they land; the compute warpgroups wait on `ready`
  and hand the stage back through `empty` once both are past its P V. The load partition runs on
  LOAD_REGS registers a thread, leaving the compute warps 232.
- EARLY_TILE (with the one-warpgroup scores): the kernel's 4 warps copy a split's first tile before the PDL
  wait where it ends before the new token (rows of earlier steps, which no kernel of the step writes; as
  gluon_mla_few_heads' EARLY_TILES, with the same helpers), and the load partition starts from tile 1. The
  queries are still loaded before the load partition starts: at batch 1 its copies would queue ahead of
  them. H200, session 62: 128 heads B=1 x 32K 33.1 -> 31.7 us, 64 heads B=1 x 64K 37.3 -> 36.1, level at B=4.

Measured (H100, benchmarks/bench_attention.py; docs/performance.md has the tables): the load partition
took batch 64 x 32K from 50% to 54-55% of copy bandwidth against the same schedule with the copies
issued by the compute warps. Slower, and not kept (commit dcbcafd has them): P V left in flight
behind the next tile's scores (41-48%: the stage it frees is refilled half a tile later), and ready
barriers per column part of a tile (no gain). At 128 heads MLA decode is as much matmul as copy (~240
FLOPs a cached byte on an H100): the compute path alone (DIAG 1) runs at ~67% of copy; the scores,
m64n32 wgmmas with both operands in shared memory, bound it (the split form). SCORES_ONE_WG is FlashMLA's
split of the work without its ping-pong of the warpgroups over alternate tiles, which would put one's softmax
under the other's products; the second warpgroup idles while the first computes the scores. DIAG 2 (no wgmma)
runs the split form.

Shared memory at the defaults (64 heads, 64 tokens, bf16): q 72 KB + 2 x 72 KB latent + 8 KB P +
slots and barriers = 225 KB of the H100's 227 KB. Needs L = 512, R = 64 (DeepSeek-V2/V3, Kimi-K2),
16-bit dtypes and compute capability 9.x; `mla_decode_fwd` takes the Triton kernel otherwise. Fewer
than 64 heads (a block's last) are padded with zero queries: the wgmmas do the work of 64, which the
copies hide while the kernel is bandwidth-bound (below ~64 heads on an H100).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ftransformers.kernels.launch import cached_launch, cdiv
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.triton_decode_attention import decode_combine

# Triton 3.6 (the device image) names the cp.async builtin async_copy_global_to_shared; newer ones async_load
# (and the CTA barrier thread_barrier, later barrier)
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_H = 64  # wgmma M: heads per program
BLOCK_N = 64  # tokens per tile
NUM_WARPS = 8  # the compute warps: two warpgroups (SCORES_ONE_WG: the default partition and a worker)
LOAD_WARPS = 4  # the load partition's warps (registers are handed out per warpgroup)
LOAD_REGS = 32  # its registers a thread (24 spills); the compute warps get the rest: 232 at 12 warps
LOAD_ROWS = 8  # latent rows per cp.async call in the load partition (bounds its address registers)
DIAG = 0  # timing experiments only, wrong results: 1 = no copies after the first tile, 2 = no wgmma
# ONE_WG: one warpgroup takes a tile's scores whole (m64n64, its softmax within its warps) and hands P to the other
# through shared memory; each then forms half of the 512 output columns (FlashMLA's split of the work, without its
# ping-pong). Registers a thread of the second warpgroup (the first takes what the launch leaves).
SCORES_ONE_WG = 1
HALF_REGS = 216
# ONE_WG: a split's first tile is copied before the PDL wait where it ends before the new token (as gluon_mla_few_heads'
# EARLY_TILES; session 62)
EARLY_TILE = 1


@gluon.jit
def pdl_enter(USE_PDL: gl.constexpr):
    # kernels/pdl.py's pdl_enter in Gluon: wait for the previous grid, then let the next one queue up
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _online_softmax(s, m_i, l_i, live, qk_scale):
    # one tile of the online softmax in base 2: live [BLOCK_N] masks tokens past the split
    qk = gl.where(live[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _store_cols(acc, l_i, O, mid_o, b, pid_h, split_id, seq_len, split_len, num_heads,
                s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, COL0: gl.constexpr, LC: gl.constexpr,
                BLOCK_H: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    # columns [COL0, COL0 + LC) of a split's output: acc [BLOCK_H, LC] unnormalised, l_i [BLOCK_H] its rows' sums
    # (o_layout's rows); the row's only split stores the final output, others a normalised partial; rows past
    # num_heads (a block padded to the wgmma M) are not stored
    o_rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    o_cols = COL0 + gl.arange(0, LC, layout=gl.SliceLayout(0, o_layout))
    o_mask = (o_rows < num_heads)[:, None]
    out = acc / l_i[:, None]
    if gl.cdiv(seq_len, split_len) == 1:
        gl.store(O + b * s_o_b + o_rows[:, None] * s_o_h + o_cols[None, :], out.to(O.dtype.element_ty), mask=o_mask)
    else:
        gl.store(mid_o + b * s_mo_b + o_rows[:, None] * s_mo_h + split_id * s_mo_s + o_cols[None, :], out,
                 mask=o_mask)  # fmt: skip


@gluon.jit
def _store_lse(m_i, l_i, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads, s_ml_b, s_ml_h,
               BLOCK_H: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    # a split of several: the log-sum-exp in base 2 of its scores (m_i / l_i the running max and sum, s_layout's rows)
    if gl.cdiv(seq_len, split_len) > 1:
        heads_s = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        gl.store(mid_lse + b * s_ml_b + heads_s * s_ml_h + split_id, m_i + gl.log2(l_i), mask=heads_s < num_heads)


@gluon.jit
def _scores(q_nope, q_rope, kv_n, kv_r, s):
    # S = q_nope c_kv^T + q_rope k_pe^T over one tile into the accumulator s (its value unused), left in flight
    s = warpgroup_mma(q_nope, kv_n.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_rope, kv_r.permute((1, 0)), s, is_async=True)


@gluon.jit
def latent_loads(KV, r2t_row, s_kv, kvn, kvr, slot_buf, ready, empty, start, end, num_tiles,
                 L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_WARPS: gl.constexpr,
                 LOAD_ROWS: gl.constexpr, DIAG: gl.constexpr, FIRST: gl.constexpr = 0):  # fmt: skip
    # The load partition. A tile's slots wait in shared memory (slot_buf) so each cp.async call takes
    # LOAD_ROWS rows and few address registers; tile i + 1's slots are read from global memory while
    # tile i's copies are issued. Stage i % 2 is filled once the compute partition frees it (empty);
    # each thread's copies arrive on the stage's ready barrier once they land
    # (cp.async.mbarrier.arrive.noinc: after all the thread's earlier copies). Tiles before FIRST were
    # copied by the caller (the same arrivals on the same barriers).
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [LOAD_WARPS, 1], [1, 0])  # [rows, L]
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # [rows, R]
    ld_i: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    idx = gl.arange(0, BLOCK_N, layout=ld_i)
    slot_buf.store(gl.load(r2t_row + gl.minimum(start + FIRST * BLOCK_N + idx, end - 1)))
    for it in range(FIRST, num_tiles):
        st = it % 2
        # past the last tile the positions clamp to the split's last token: read, never copied
        nxt = gl.load(r2t_row + gl.minimum(start + (it + 1) * BLOCK_N + idx, end - 1))
        _cta_barrier()  # slot_buf holds tile it (the partition's own barrier)
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        if DIAG != 1 or it < 2:  # (DIAG 1: the compute path alone, on whatever the stages hold)
            dst = kvn.index(st)
            for c in gl.static_range(BLOCK_N // LOAD_ROWS):
                rows = slot_buf.slice(c * LOAD_ROWS, LOAD_ROWS).load(gl.SliceLayout(1, ld_l)).to(gl.int64)
                _cp_async(dst.slice(c * LOAD_ROWS, LOAD_ROWS), KV + rows[:, None] * s_kv + offs_l[None, :])
            rows_r = slot_buf.load(gl.SliceLayout(1, ld_r)).to(gl.int64)
            _cp_async(kvr.index(st), KV + L + rows_r[:, None] * s_kv + offs_r[None, :])
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
        _cta_barrier()  # every thread has read slot_buf
        slot_buf.store(nxt)


@gluon.jit
def _load_slots(r2t_row, slots, start, end, N: gl.constexpr):
    # the KV slots of the split's first N tokens (clamped to its last) into shared memory, for every warp
    idx = gl.arange(0, N, layout=gl.BlockedLayout([1], [32], [4], [0]))
    slots.store(gl.load(r2t_row + gl.maximum(gl.minimum(start + idx, end - 1), 0)))
    _cta_barrier()


@gluon.jit
def _copy_tile(KV, slots, s_kv, kvn, kvr, ready, T: gl.constexpr,
               L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_ROWS: gl.constexpr):  # fmt: skip
    # tile T of the split into stage T by the kernel's 4 warps, as the load partition copies the later ones:
    # LOAD_ROWS rows a cp.async call, every thread's copies arriving on ready[T]
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [rows, L]
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [rows, R]
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    dst = kvn.index(T)
    for c in gl.static_range(BLOCK_N // LOAD_ROWS):
        rows = slots.slice(T * BLOCK_N + c * LOAD_ROWS, LOAD_ROWS).load(gl.SliceLayout(1, ld_l)).to(gl.int64)
        _cp_async(dst.slice(c * LOAD_ROWS, LOAD_ROWS), KV + rows[:, None] * s_kv + offs_l[None, :])
    rows_r = slots.slice(T * BLOCK_N, BLOCK_N).load(gl.SliceLayout(1, ld_r)).to(gl.int64)
    _cp_async(kvr.index(T), KV + L + rows_r[:, None] * s_kv + offs_r[None, :])
    async_copy.mbarrier_arrive(ready.index(T), increment_count=False)


@gluon.jit
def _tile_before_new_token(T: gl.constexpr, start, end, seq_len, split_id, ON: gl.constexpr, BLOCK_N: gl.constexpr):
    # tile T exists and ends before the new token (position seq_len - 1), so it holds only earlier steps' rows; a
    # runtime condition even when ON is off (branches folded away at compile time failed Triton 3.6's lowering)
    ok = (start + T * BLOCK_N < end) & ((end < seq_len) | (start + (T + 1) * BLOCK_N < seq_len))
    return ok & (split_id >= 0 if ON else split_id < 0)


@gluon.jit
def _compute(q_nope, q_rope, kvn, kvr, p_smem, ready, empty, O, mid_o, mid_lse, b, pid_h, split_id,
             seq_len, split_len, num_heads, start, end, num_tiles, sm_scale,
             s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
             L: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DIAG: gl.constexpr):  # fmt: skip
    # The default partition (both warpgroups): per tile, wait for its stage, the scores, the online
    # softmax, P through shared memory, P V; then hand the stage back.
    dtype: gl.constexpr = kvn.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, L], gl.float32, o_layout)
    for it in range(num_tiles):
        st = it % 2
        start_n = start + it * BLOCK_N
        kv_n = kvn.index(st)
        mbarrier.wait(ready.index(st), (it // 2) & 1)  # every load thread's copies of tile it landed
        fence_async_shared()  # cp.async writes are generic-proxy; wgmma reads through the async proxy
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        if DIAG != 2:
            s = _scores(q_nope, q_rope, kv_n, kvr.index(st), s)
        s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, start_n + cols_s < end, qk_scale)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        _cta_barrier()  # all of P, from both warpgroups, before either reads it
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        if DIAG != 2:
            acc = warpgroup_mma(p_smem, kv_n, acc, is_async=True)
        # waited here: a wgmma left in flight across the loop's back edge made Triton 3.6's ptxas
        # serialise every wgmma of the kernel, and refilling the stage later cost more than it gained
        acc = warpgroup_mma_wait(0, deps=[acc])
        _cta_barrier()  # both warpgroups done with P and this stage
        mbarrier.arrive(empty.index(st))
    _store_cols(acc, gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), O, mid_o, b, pid_h, split_id, seq_len,
                split_len, num_heads, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, 0, L, BLOCK_H, o_layout)  # fmt: skip
    _store_lse(m_i, l_i, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads, s_ml_b, s_ml_h, BLOCK_H,
               s_layout)  # fmt: skip


@gluon.jit
def _compute_scores(q_nope, q_rope, kvn, kvr, p_smem, a_smem, l_smem, ready, empty, p_full, p_empty, fin,
                    O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads, start, end, num_tiles,
                    sm_scale, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
                    L: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    # ONE_WG's first warpgroup: per tile, the scores [BLOCK_H, BLOCK_N] whole and their online softmax (a row's
    # columns within one warp), P and the rescale alpha into shared memory for the other warpgroup (p_full, once it
    # has released the previous P: p_empty), then its half of O += P V, columns [0, L / 2).
    dtype: gl.constexpr = kvn.dtype
    LH: gl.constexpr = L // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LH, 16])  # fmt: skip
    cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, LH], gl.float32, o_layout)
    for it in range(num_tiles):
        st = it % 2
        kv_n = kvn.index(st)
        mbarrier.wait(ready.index(st), (it // 2) & 1)
        fence_async_shared()
        s = _scores(q_nope, q_rope, kv_n, kvr.index(st), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout))
        s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, start + it * BLOCK_N + cols_s < end, qk_scale)
        mbarrier.wait(p_empty, (it & 1) ^ 1)  # the other warpgroup is past the previous P (a fresh barrier: parity 1)
        p_smem.store(p.to(dtype))
        a_smem.store(alpha)
        fence_async_shared()
        _cta_barrier()  # this warpgroup's P and alpha stored
        mbarrier.arrive(p_full)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_smem, kv_n.slice(0, LH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _cta_barrier()
        mbarrier.arrive(empty.index(st))
    l_smem.store(l_i)
    _cta_barrier()
    mbarrier.arrive(fin)
    _store_cols(acc, gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), O, mid_o, b, pid_h, split_id, seq_len,
                split_len, num_heads, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, 0, LH, BLOCK_H, o_layout)  # fmt: skip
    _store_lse(m_i, l_i, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads, s_ml_b, s_ml_h, BLOCK_H,
               s_layout)  # fmt: skip


@gluon.jit
def _compute_half(kvn, p_smem, a_smem, l_smem, ready, empty, p_full, p_empty, fin,
                  O, mid_o, b, pid_h, split_id, seq_len, split_len, num_heads, num_tiles,
                  s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s,
                  L: gl.constexpr, BLOCK_H: gl.constexpr):  # fmt: skip
    # ONE_WG's second warpgroup: per tile, once P and alpha are in (p_full), its half of O += P V, columns
    # [L / 2, L); then it releases P (p_empty) and the stage (empty).
    LH: gl.constexpr = L // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, LH, 16])  # fmt: skip
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([BLOCK_H, LH], gl.float32, o_layout)
    for it in range(num_tiles):
        st = it % 2
        mbarrier.wait(ready.index(st), (it // 2) & 1)
        mbarrier.wait(p_full, it & 1)
        fence_async_shared()
        acc = acc * a_smem.load(row_l)[:, None]
        acc = warpgroup_mma(p_smem, kvn.index(st).slice(LH, LH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _cta_barrier()
        mbarrier.arrive(p_empty)
        mbarrier.arrive(empty.index(st))
    mbarrier.wait(fin, 0)
    _store_cols(acc, l_smem.load(row_l), O, mid_o, b, pid_h, split_id, seq_len, split_len, num_heads,
                s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, LH, LH, BLOCK_H, o_layout)  # fmt: skip


@cached_launch
@gluon.jit
def mla_decode_stage1_gluon(
    Q_NOPE, Q_ROPE, KV, O, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
    sm_scale, num_kv_splits, min_split_len, num_heads,
    s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_kv, s_r2t, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
    L: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, LOAD_ROWS: gl.constexpr,
    USE_PDL: gl.constexpr = False, DIAG: gl.constexpr = 0, ONE_WG: gl.constexpr = False,
    HALF_REGS: gl.constexpr = 216, EARLY: gl.constexpr = False,
):  # fmt: skip
    pid_h = gl.program_id(0)
    split_id = gl.program_id(1)
    b = gl.program_id(2)
    # PDL: before the wait, the batch metadata (written before the step) and, with EARLY (ONE_WG), the split's first
    # tile's copy where it ends before the new token: rows of earlier steps' tokens, which no kernel of the step writes
    seq_len = gl.load(seq_lens + b).to(gl.int32)
    req = gl.load(req_pool_indices + b)
    dtype: gl.constexpr = KV.dtype.element_ty
    sl_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    sl_r: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
    sl_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    split_len = gl.maximum(gl.cdiv(gl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N, min_split_len)
    start = split_id * split_len
    end = gl.minimum(start + split_len, seq_len)
    r2t_row = req_to_token + req * s_r2t
    kvn = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], sl_l)
    kvr = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], sl_r)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    slot_t: gl.constexpr = req_to_token.dtype.element_ty
    first_slots = gl.allocate_shared_memory(slot_t, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=LOAD_WARPS * 32)  # one noinc cp.async arrival a load thread
        mbarrier.init(empty.index(i), count=2 if ONE_WG else 1)  # ONE_WG: both warpgroups' halves of P V
    if EARLY:  # (ONE_WG: the kernel's 4 warps copy tile 0 with the load partition's count of arrivals)
        _load_slots(r2t_row, first_slots, start, end, BLOCK_N)
        if _tile_before_new_token(0, start, end, seq_len, split_id, True, BLOCK_N):
            _copy_tile(KV, first_slots, s_kv, kvn, kvr, ready, 0, L, R, BLOCK_N, LOAD_ROWS)
    pdl_enter(USE_PDL)
    DW: gl.constexpr = 4 if ONE_WG else 8  # the default partition's warps
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [DW, 1], [1, 0])  # [rows, L] 16-byte vectors
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [DW, 1], [1, 0])  # [rows, R]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, DW // 4], instr_shape=[16, L // 2, 16]
    )
    if end <= start:
        if split_id == 0:  # seq_len 0 (a padded CUDA-graph row): zeros, not garbage
            o_rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
            o_cols = gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))
            gl.store(O + b * s_o_b + o_rows[:, None] * s_o_h + o_cols[None, :],
                     gl.zeros([BLOCK_H, L], O.dtype.element_ty, o_layout), mask=(o_rows < num_heads)[:, None])  # fmt: skip
        return

    if ONE_WG:  # tile 0 now where it was not copied before the wait (the kernel's 4 warps, as above)
        if not EARLY:
            _load_slots(r2t_row, first_slots, start, end, BLOCK_N)
        if ~_tile_before_new_token(0, start, end, seq_len, split_id, EARLY, BLOCK_N):
            _copy_tile(KV, first_slots, s_kv, kvn, kvr, ready, 0, L, R, BLOCK_N, LOAD_ROWS)
    # the program's queries, once, into shared memory (the wgmma A operand of every tile); a block past
    # num_heads (fewer heads than the wgmma M of 64, e.g. DeepSeek-V3 at tensor parallel 8) is zeros. Loaded
    # before the load partition starts: at batch 1 its copies queue ahead of these L2 hits otherwise (session 62)
    heads_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_l))
    heads_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_r))
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    q_nope = gl.allocate_shared_memory(
        dtype, [BLOCK_H, L], sl_l,
        gl.load(Q_NOPE + b * s_qn_b + heads_l[:, None] * s_qn_h + offs_l[None, :], mask=(heads_l < num_heads)[:, None],
                other=0.0),
    )  # fmt: skip
    q_rope = gl.allocate_shared_memory(
        dtype, [BLOCK_H, R], sl_r,
        gl.load(Q_ROPE + b * s_qr_b + heads_r[:, None] * s_qr_h + offs_r[None, :], mask=(heads_r < num_heads)[:, None],
                other=0.0),
    )  # fmt: skip
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sl_p)
    slot_buf = gl.allocate_shared_memory(slot_t, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    fence_async_shared()  # the queries' generic-proxy stores, before the first wgmma reads them
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    if ONE_WG:
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        p_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(p_full, count=1)
        mbarrier.init(p_empty, count=1)
        mbarrier.init(fin, count=1)
        fence_async_shared()
        gl.warp_specialize(
            [
                (_compute_scores, (q_nope, q_rope, kvn, kvr, p_smem, a_smem, l_smem, ready, empty, p_full, p_empty,
                                   fin, O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads, start,
                                   end, num_tiles, sm_scale, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
                                   L, BLOCK_H, BLOCK_N)),
                (_compute_half, (kvn, p_smem, a_smem, l_smem, ready, empty, p_full, p_empty, fin, O, mid_o, b, pid_h,
                                 split_id, seq_len, split_len, num_heads, num_tiles, s_o_b, s_o_h, s_mo_b, s_mo_h,
                                 s_mo_s, L, BLOCK_H)),
                (latent_loads, (KV, r2t_row, s_kv, kvn, kvr, slot_buf, ready, empty, start, end, num_tiles,
                                L, R, BLOCK_N, LOAD_WARPS, LOAD_ROWS, DIAG, 1)),  # tile 0: above
            ],
            [4, LOAD_WARPS],
            [HALF_REGS, LOAD_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_compute, (q_nope, q_rope, kvn, kvr, p_smem, ready, empty, O, mid_o, mid_lse, b, pid_h, split_id,
                            seq_len, split_len, num_heads, start, end, num_tiles, sm_scale,
                            s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, L, BLOCK_H, BLOCK_N, DIAG)),
                (latent_loads, (KV, r2t_row, s_kv, kvn, kvr, slot_buf, ready, empty, start, end, num_tiles,
                                L, R, BLOCK_N, LOAD_WARPS, LOAD_ROWS, DIAG)),
            ],
            [LOAD_WARPS],
            [LOAD_REGS],
        )  # fmt: skip


def maxnreg() -> int:
    """Registers a thread at launch: all of the SM's 64K over its threads (compute and load warps), a
    multiple of 8; the load partition then gives back all but LOAD_REGS to the compute warps."""
    return 65536 // ((NUM_WARPS + LOAD_WARPS) * 32) // 8 * 8


def stage1_args(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_buf: torch.Tensor, out: torch.Tensor,
                req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                mid_o: torch.Tensor, mid_lse: torch.Tensor, num_kv_splits: int, sm_scale: float,
                min_split_len: int) -> tuple:  # fmt: skip
    """The positional arguments of a Gluon MLA stage-1 kernel (this module's and gluon_mla_few_heads'):
    tensors, scalars, then strides, in their parameter order."""
    return (
        q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale, num_kv_splits, min_split_len, q_nope.shape[1],
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), latent_buf.stride(0),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
    )  # fmt: skip


def mla_decode(
    q_nope: torch.Tensor,  # [B, H, L]; a last block of fewer than BLOCK_H heads is padded
    q_rope: torch.Tensor,  # [B, H, R]
    latent_buf: torch.Tensor,  # [N, L + R], rows 16-element aligned
    out: torch.Tensor,  # [B, H, L]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    mid_o: torch.Tensor,  # [>=B, H, >=num_kv_splits, L] float32
    mid_lse: torch.Tensor,  # [>=B, H, >=num_kv_splits] float32
    num_kv_splits: int,
    sm_scale: float,
    min_split_len: int,  # rounded up to BLOCK_N; 0 = BLOCK_N
) -> torch.Tensor:
    """Stage 1 here, then `decode_combine` for rows of several splits (as `mla_decode_fwd` does with the
    Triton kernel); returns `out`."""
    B, H, L = q_nope.shape
    one_wg = bool(SCORES_ONE_WG) and DIAG != 2  # DIAG 2 (no wgmma) is the split form's
    min_split_len = cdiv(max(min_split_len, 1), BLOCK_N) * BLOCK_N
    args = stage1_args(q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
                       num_kv_splits, sm_scale, min_split_len)  # fmt: skip
    mla_decode_stage1_gluon[(cdiv(H, BLOCK_H), num_kv_splits, B)](
        *args,
        L=L, R=q_rope.shape[-1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, LOAD_WARPS=LOAD_WARPS, LOAD_REGS=LOAD_REGS,
        LOAD_ROWS=LOAD_ROWS, DIAG=DIAG, ONE_WG=one_wg, HALF_REGS=HALF_REGS, EARLY=one_wg and bool(EARLY_TILE),
        num_warps=4 if one_wg else NUM_WARPS,
        maxnreg=maxnreg(),
        **pdl_launch(q_nope.device),
    )  # fmt: skip
    if num_kv_splits > 1:
        decode_combine(mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len, BLOCK_N)
    return out
