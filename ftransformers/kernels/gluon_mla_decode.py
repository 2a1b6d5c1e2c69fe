"""MLA decode (absorbed weights) on Hopper, in Gluon: stage 1 without the duplicated QK product.

Same contract as `triton_mla_attention._mla_decode_stage1_kernel` (one program per (64 heads, KV split,
sequence); a row of one split is finished here, others leave a normalised partial output and its
base-2 log-sum-exp for `decode_combine`). What Gluon lets us say that Triton does not:

- Both dots keep their 8 warps as two warpgroups side by side along N (`warps_per_cta=[4, 2]`). The
  scores S = q_nope c_kv^T + q_pe k_pe^T [64 heads, BLOCK_N tokens]: each warpgroup computes half the
  tokens (Triton lays a chained dot's warps along M, so with 64 heads both warpgroups computed all of
  S, and the 576-deep QK product ran twice). The output O += P c_kv [64, 512]: each warpgroup owns
  256 latent columns, 128 float32 registers a thread.
- P goes through shared memory (8 KB a tile) so both warpgroups read all of it as the A operand.
- The latent tile is gathered row by row (the cache is paged per token: no TMA) with cp.async into a
  two-stage ring of 128-byte-swizzled tiles; tile i+1's copies and tile i+2's slot indices are in
  flight while tile i is computed. With PIPELINE, tile i's P V wgmma is not waited for at the end of
  its iteration but together with tile i+1's scores, so the two run back to back; tile i+1's copies
  are then issued once both warpgroups are past P V (i - 1), whose stage they overwrite.

Where the time goes (H100, benchmarks/bench_attention.py's diag_* variants): at batch 64 x 32K the
compute path alone runs at 72% of copy bandwidth and the copies alone at 93%; together ~50%. The
scores bound the compute path: m64n32 wgmmas read 3 KB of shared memory per 64K FLOPs. Wider score
tiles need 128 tokens in flight, which the 227 KB do not hold twice next to Q; FlashMLA's warp-
specialised ping-pong of the two warpgroups over alternate tiles is the known way past that.

Shared memory at the defaults (64 heads, 64 tokens, bf16): q 72 KB + 2 x 72 KB latent + 8 KB P =
224 KB of the H100's 227 KB. Needs L = 512, R = 64 (DeepSeek-V2/V3, Kimi-K2), heads a multiple of 64,
16-bit dtypes and compute capability 9.x; `mla_decode_fwd` takes the Triton kernel otherwise.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.triton_decode_attention import decode_combine

# Triton 3.6 (the device image) names the cp.async builtin async_copy_global_to_shared; newer ones async_load
# (and the CTA barrier thread_barrier, later barrier)
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_H = 64  # wgmma M: heads per program
BLOCK_N = 64  # tokens per tile
NUM_WARPS = 8  # two warpgroups
DIAG = 0  # timing experiments only, wrong results: 1 = no copies after the first tile, 2 = no wgmma
PIPELINE = True  # P V of tile i waited with the QK of tile i + 1 (False: each tile's P V waited at its end)
WARP_SPECIALIZE = False  # copies issued by a separate load partition (mla_decode_stage1_gluon_ws)
LOAD_WARPS = 4  # the load partition's warps (registers are handed out per warpgroup)
LOAD_REGS = 32  # its registers a thread (24 spills); the compute warpgroups get the rest: 232 at 12 warps
LOAD_ROWS = 8  # latent rows per cp.async call in the load partition (bounds its address registers)
READY_PARTS = 1  # column parts of a tile, each with its own ready barrier (the scores start on part 0)


@gluon.jit
def pdl_enter(USE_PDL: gl.constexpr):
    # kernels/pdl.py's pdl_enter in Gluon: wait for the previous grid, then let the next one queue up
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _issue_tile(kvn, kvr, KV, s_kv, loc_n, loc_r, offs_l, offs_r, L: gl.constexpr):
    # cp.async of one latent tile: rows loc_* (int64 slots), c_kv -> kvn [BLOCK_N, L], k_pe -> kvr [BLOCK_N, R]
    _cp_async(kvn, KV + loc_n[:, None] * s_kv + offs_l[None, :])
    _cp_async(kvr, KV + L + loc_r[:, None] * s_kv + offs_r[None, :])
    async_copy.commit_group()


@gluon.jit
def _slots(r2t_row, pos, end):
    # positions past the split re-read its last token (a real slot: the copies need no mask)
    return gl.load(r2t_row + gl.minimum(pos, end - 1)).to(gl.int64)


@gluon.jit
def _scores(q_nope, q_rope, kv_n, kv_r, s_layout: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
            DIAG: gl.constexpr):  # fmt: skip
    # S = q_nope c_kv^T + q_pe k_pe^T [BLOCK_H, BLOCK_N], issued (not waited); zeros under DIAG 2
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    if DIAG != 2:
        s = warpgroup_mma(q_nope, kv_n.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope, kv_r.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _online_softmax(s, m_i, l_i, live, qk_scale):
    # one tile of the online softmax in base 2: live [BLOCK_N] masks tokens past the split
    qk = gl.where(live[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _store_split(acc, m_i, l_i, O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len,
                 s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
                 L: gl.constexpr, BLOCK_H: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    # acc [BLOCK_H, L] unnormalised, m_i / l_i the running max and sum (base 2) of this split's scores
    o_rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    if gl.cdiv(seq_len, split_len) == 1:  # the row's only split: final output
        gl.store(O + b * s_o_b + o_rows[:, None] * s_o_h + o_cols[None, :], out.to(O.dtype.element_ty))
    else:
        gl.store(mid_o + b * s_mo_b + o_rows[:, None] * s_mo_h + split_id * s_mo_s + o_cols[None, :], out)
        # log-sum-exp in base 2 of this split's scores
        heads_s = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        gl.store(mid_lse + b * s_ml_b + heads_s * s_ml_h + split_id, m_i + gl.log2(l_i))


@gluon.jit
def mla_decode_stage1_gluon(
    Q_NOPE, Q_ROPE, KV, O, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
    sm_scale, num_kv_splits, min_split_len,
    s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_kv, s_r2t, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
    L: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PIPELINE: gl.constexpr,
    USE_PDL: gl.constexpr = False, DIAG: gl.constexpr = 0,
):  # fmt: skip
    pid_h = gl.program_id(0)
    split_id = gl.program_id(1)
    b = gl.program_id(2)
    # PDL: the batch metadata (written before the step) is read before the wait
    seq_len = gl.load(seq_lens + b).to(gl.int32)
    req = gl.load(req_pool_indices + b)
    pdl_enter(USE_PDL)
    dtype: gl.constexpr = KV.dtype.element_ty
    # register layouts: the two dots (warpgroups side by side along N), and the gathers (16 B a thread)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])  # [rows, L] 16-byte vectors
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # [rows, R]
    sl_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    sl_r: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
    sl_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    split_len = gl.maximum(gl.cdiv(gl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N, min_split_len)
    start = split_id * split_len
    end = gl.minimum(start + split_len, seq_len)

    if end <= start:
        if split_id == 0:  # seq_len 0 (a padded CUDA-graph row): zeros, not garbage
            o_rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
            o_cols = gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))
            gl.store(O + b * s_o_b + o_rows[:, None] * s_o_h + o_cols[None, :],
                     gl.zeros([BLOCK_H, L], O.dtype.element_ty, o_layout))  # fmt: skip
        return

    # the program's queries, once, into shared memory (the wgmma A operand of every tile)
    heads_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_l))
    heads_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_r))
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    q_nope = gl.allocate_shared_memory(
        dtype, [BLOCK_H, L], sl_l, gl.load(Q_NOPE + b * s_qn_b + heads_l[:, None] * s_qn_h + offs_l[None, :])
    )
    q_rope = gl.allocate_shared_memory(
        dtype, [BLOCK_H, R], sl_r, gl.load(Q_ROPE + b * s_qr_b + heads_r[:, None] * s_qr_h + offs_r[None, :])
    )
    kvn = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], sl_l)
    kvr = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], sl_r)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sl_p)

    r2t_row = req_to_token + req * s_r2t
    rows_l = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_l))
    rows_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r))
    cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    num_tiles = gl.cdiv(end - start, BLOCK_N)

    _issue_tile(kvn.index(0), kvr.index(0), KV, s_kv, _slots(r2t_row, start + rows_l, end),
                _slots(r2t_row, start + rows_r, end), offs_l, offs_r, L)  # fmt: skip
    # tile 1's slots (clamped: a split of one tile reads its last token again and never uses them)
    next_l = _slots(r2t_row, start + BLOCK_N + rows_l, end)
    next_r = _slots(r2t_row, start + BLOCK_N + rows_r, end)
    fence_async_shared()  # the queries' generic-proxy stores, before the first wgmma reads them

    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, L], gl.float32, o_layout)
    if PIPELINE:  # tile 0's "P V (-1)": P = 0 against tile 0 (finite: loaded by then) adds nothing
        p_smem.store(gl.zeros([BLOCK_H, BLOCK_N], dtype, s_layout))
        fence_async_shared()
    for it in range(num_tiles):
        start_n = start + it * BLOCK_N
        cur_n = kvn.index(it % 2)
        async_copy.wait_group(0)  # tile it, the only copies in flight
        _cta_barrier()  # every thread's copies of tile it
        fence_async_shared()  # cp.async writes are generic-proxy; wgmma reads through the async proxy
        s = _scores(q_nope, q_rope, cur_n, kvr.index(it % 2), s_layout, BLOCK_H, BLOCK_N, DIAG)
        if PIPELINE:
            # P V of tile it - 1 issued behind this QK (no wgmma in flight across the loop's back edge:
            # ptxas serialises every wgmma of a kernel where one is)
            if DIAG != 2:
                acc = warpgroup_mma(p_smem, kvn.index(gl.maximum(it - 1, 0) % 2), acc, is_async=True)
            s, acc = warpgroup_mma_wait(0, deps=[s, acc])
            _cta_barrier()  # both warpgroups past P V (it - 1): P and stage (it + 1) % 2 are free
        if it + 1 < num_tiles and DIAG != 1:  # tile it + 1 into the other stage while this one is computed
            nxt = (it + 1) % 2
            _issue_tile(kvn.index(nxt), kvr.index(nxt), KV, s_kv, next_l, next_r, offs_l, offs_r, L)
            next_l = _slots(r2t_row, start_n + 2 * BLOCK_N + rows_l, end)
            next_r = _slots(r2t_row, start_n + 2 * BLOCK_N + rows_r, end)
        if not PIPELINE:
            s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, start_n + cols_s < end, qk_scale)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        _cta_barrier()  # all of P, from both warpgroups, before either reads it
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        if not PIPELINE:
            if DIAG != 2:
                acc = warpgroup_mma(p_smem, cur_n, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _cta_barrier()  # both warpgroups done with P and this stage before they are overwritten
    if PIPELINE and DIAG != 2:  # the last tile's P V
        acc = warpgroup_mma(p_smem, kvn.index((num_tiles - 1) % 2), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_split(acc, m_i, l_i, O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len,
                 s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, L, BLOCK_H, s_layout, o_layout)  # fmt: skip


@gluon.jit
def _ws_loads(KV, r2t_row, s_kv, kvn, kvr, slot_buf, ready, empty, start, end, num_tiles,
              L: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_WARPS: gl.constexpr,
              LOAD_ROWS: gl.constexpr, PARTS: gl.constexpr):  # fmt: skip
    # The load partition. A tile's slots wait in shared memory (slot_buf) so each cp.async call takes
    # LOAD_ROWS rows and few address registers; tile i + 1's slots are read from global memory while
    # tile i's copies are issued. Stage i % 2 is filled once the compute partition frees it (empty),
    # in PARTS column parts (k_pe with the last) in the order the scores read them; each thread's
    # copies of a part arrive on that part's ready barrier once they land (cp.async.mbarrier.arrive
    # .noinc: all the thread's earlier copies), so the scores start on part 0 while the rest streams in.
    PART: gl.constexpr = L // PARTS
    ld_l: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 // min(32, PART // 8), min(32, PART // 8)], [LOAD_WARPS, 1], [1, 0]
    )  # [rows, PART]
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOAD_WARPS, 1], [1, 0])  # [rows, R]
    ld_i: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    offs_l = gl.arange(0, PART, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    idx = gl.arange(0, BLOCK_N, layout=ld_i)
    slot_buf.store(gl.load(r2t_row + gl.minimum(start + idx, end - 1)))
    for it in range(num_tiles):
        st = it % 2
        # past the last tile the positions clamp to the split's last token: read, never copied
        nxt = gl.load(r2t_row + gl.minimum(start + (it + 1) * BLOCK_N + idx, end - 1))
        _cta_barrier()  # slot_buf holds tile it (the partition's own barrier)
        mbarrier.wait(empty.index(st), ((it // 2) & 1) ^ 1)  # a fresh barrier passes parity 1
        for part in gl.static_range(PARTS):
            dst = kvn.index(st).slice(part * PART, PART, dim=1)
            for c in gl.static_range(BLOCK_N // LOAD_ROWS):
                rows = slot_buf.slice(c * LOAD_ROWS, LOAD_ROWS).load(gl.SliceLayout(1, ld_l)).to(gl.int64)
                _cp_async(dst.slice(c * LOAD_ROWS, LOAD_ROWS),
                          KV + part * PART + rows[:, None] * s_kv + offs_l[None, :])  # fmt: skip
            if part == PARTS - 1:
                rows_r = slot_buf.load(gl.SliceLayout(1, ld_r)).to(gl.int64)
                _cp_async(kvr.index(st), KV + L + rows_r[:, None] * s_kv + offs_r[None, :])
            async_copy.mbarrier_arrive(ready.index(st * PARTS + part), increment_count=False)
        _cta_barrier()  # every thread has read slot_buf
        slot_buf.store(nxt)


@gluon.jit
def _ws_compute(q_nope, q_rope, kvn, kvr, p_smem, ready, empty, O, mid_o, mid_lse, b, pid_h, split_id,
                seq_len, split_len, start, end, num_tiles, sm_scale,
                s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
                L: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PIPELINE: gl.constexpr,
                PARTS: gl.constexpr, DIAG: gl.constexpr):  # fmt: skip
    # The default partition (both warpgroups): the dots and the softmax of mla_decode_stage1_gluon,
    # with the copies' waits replaced by the ready barriers and the stage hand-back by empty.
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
    if PIPELINE:  # tile 0's "P V (-1)": P = 0 against tile 0 (finite: loaded by then) adds nothing
        p_smem.store(gl.zeros([BLOCK_H, BLOCK_N], dtype, s_layout))
        fence_async_shared()
    for it in range(num_tiles):
        st = it % 2
        start_n = start + it * BLOCK_N
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        for part in gl.static_range(PARTS):  # the scores over each column part once it has landed
            mbarrier.wait(ready.index(st * PARTS + part), (it // 2) & 1)  # every load thread's copies
            fence_async_shared()  # cp.async writes are generic-proxy; wgmma reads through the async proxy
            if DIAG != 2:
                s = warpgroup_mma(q_nope.slice(part * (L // PARTS), L // PARTS, dim=1),
                                  kvn.index(st).slice(part * (L // PARTS), L // PARTS, dim=1).permute((1, 0)),
                                  s, use_acc=part > 0, is_async=True)  # fmt: skip
        if DIAG != 2:
            s = warpgroup_mma(q_rope, kvr.index(st).permute((1, 0)), s, is_async=True)
        if PIPELINE:
            if DIAG != 2:  # P V of tile it - 1 behind this QK
                acc = warpgroup_mma(p_smem, kvn.index(gl.maximum(it - 1, 0) % 2), acc, is_async=True)
            s, acc = warpgroup_mma_wait(0, deps=[s, acc])
            _cta_barrier()  # both warpgroups past P V (it - 1): P and stage (it + 1) % 2 are free
            mbarrier.arrive(empty.index((it + 1) % 2), pred=it > 0)
        else:
            s = warpgroup_mma_wait(0, deps=[s])
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, start_n + cols_s < end, qk_scale)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        _cta_barrier()  # all of P, from both warpgroups, before either reads it
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        if not PIPELINE:
            if DIAG != 2:
                acc = warpgroup_mma(p_smem, kvn.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _cta_barrier()  # both warpgroups done with P and this stage
            mbarrier.arrive(empty.index(st))
    if PIPELINE and DIAG != 2:  # the last tile's P V
        acc = warpgroup_mma(p_smem, kvn.index((num_tiles - 1) % 2), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_split(acc, m_i, l_i, O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len,
                 s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, L, BLOCK_H, s_layout, o_layout)  # fmt: skip


@gluon.jit
def mla_decode_stage1_gluon_ws(
    Q_NOPE, Q_ROPE, KV, O, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
    sm_scale, num_kv_splits, min_split_len,
    s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_kv, s_r2t, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
    L: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, PIPELINE: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, LOAD_ROWS: gl.constexpr, READY_PARTS: gl.constexpr,
    USE_PDL: gl.constexpr = False, DIAG: gl.constexpr = 0,
):  # fmt: skip
    """mla_decode_stage1_gluon with the copies in a load partition of LOAD_WARPS warps (warp
    specialisation): the compute warpgroups no longer issue them, wait for them per thread or meet at a
    CTA barrier for them; a stage is refilled as soon as both warpgroups hand it back."""
    pid_h = gl.program_id(0)
    split_id = gl.program_id(1)
    b = gl.program_id(2)
    seq_len = gl.load(seq_lens + b).to(gl.int32)
    req = gl.load(req_pool_indices + b)
    pdl_enter(USE_PDL)
    dtype: gl.constexpr = KV.dtype.element_ty
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    sl_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    sl_r: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
    sl_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    split_len = gl.maximum(gl.cdiv(gl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N, min_split_len)
    start = split_id * split_len
    end = gl.minimum(start + split_len, seq_len)
    if end <= start:
        if split_id == 0:  # seq_len 0 (a padded CUDA-graph row): zeros, not garbage
            o_rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
            o_cols = gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))
            gl.store(O + b * s_o_b + o_rows[:, None] * s_o_h + o_cols[None, :],
                     gl.zeros([BLOCK_H, L], O.dtype.element_ty, o_layout))  # fmt: skip
        return

    heads_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_l))
    heads_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_r))
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    q_nope = gl.allocate_shared_memory(
        dtype, [BLOCK_H, L], sl_l, gl.load(Q_NOPE + b * s_qn_b + heads_l[:, None] * s_qn_h + offs_l[None, :])
    )
    q_rope = gl.allocate_shared_memory(
        dtype, [BLOCK_H, R], sl_r, gl.load(Q_ROPE + b * s_qr_b + heads_r[:, None] * s_qr_h + offs_r[None, :])
    )
    kvn = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], sl_l)
    kvr = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], sl_r)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], sl_p)
    slot_buf = gl.allocate_shared_memory(
        req_to_token.dtype.element_ty, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    ready = gl.allocate_shared_memory(gl.int64, [2 * READY_PARTS, 1], mbarrier.MBarrierLayout())  # [stage, part]
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * READY_PARTS):
        mbarrier.init(ready.index(i), count=LOAD_WARPS * 32)  # one noinc cp.async arrival a load thread
    for i in gl.static_range(2):
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the queries' generic-proxy stores, before the first wgmma reads them
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    r2t_row = req_to_token + req * s_r2t
    gl.warp_specialize(
        [
            (_ws_compute, (q_nope, q_rope, kvn, kvr, p_smem, ready, empty, O, mid_o, mid_lse, b, pid_h, split_id,
                           seq_len, split_len, start, end, num_tiles, sm_scale,
                           s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, L, BLOCK_H, BLOCK_N, PIPELINE,
                           READY_PARTS, DIAG)),
            (_ws_loads, (KV, r2t_row, s_kv, kvn, kvr, slot_buf, ready, empty, start, end, num_tiles,
                         L, R, BLOCK_N, LOAD_WARPS, LOAD_ROWS, READY_PARTS)),
        ],
        [LOAD_WARPS],
        [LOAD_REGS],
    )  # fmt: skip


def ws_maxnreg() -> int:
    """Registers a thread at launch of the warp-specialised kernel: all of the SM's 64K over its threads
    (compute and load warps), a multiple of 8; the load partition then gives back all but LOAD_REGS."""
    return 65536 // ((NUM_WARPS + LOAD_WARPS) * 32) // 8 * 8


def mla_decode(
    q_nope: torch.Tensor,  # [B, H, L], H a multiple of BLOCK_H
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
    min_split_len = triton.cdiv(max(min_split_len, 1), BLOCK_N) * BLOCK_N
    args = (
        q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale, num_kv_splits, min_split_len,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), latent_buf.stride(0),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
    )  # fmt: skip
    consts = dict(L=L, R=q_rope.shape[-1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, PIPELINE=PIPELINE, DIAG=DIAG)
    pdl = pdl_launch(q_nope.device)
    grid = (H // BLOCK_H, num_kv_splits, B)
    if WARP_SPECIALIZE:
        mla_decode_stage1_gluon_ws[grid](*args, **consts, LOAD_WARPS=LOAD_WARPS, LOAD_REGS=LOAD_REGS,
                                         LOAD_ROWS=LOAD_ROWS, READY_PARTS=READY_PARTS, num_warps=NUM_WARPS, maxnreg=ws_maxnreg(), **pdl)  # fmt: skip
    else:
        mla_decode_stage1_gluon[grid](*args, **consts, num_warps=NUM_WARPS, **pdl)
    if num_kv_splits > 1:
        decode_combine(mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len, BLOCK_N)
    return out
