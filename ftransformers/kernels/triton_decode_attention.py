"""Paged decode attention (one new query token per sequence) in Triton, GQA-aware.

Layout of the work: program (head block, KV split, sequence). A head block is up to BLOCK_H query
heads of ONE KV head's group, so each KV row is loaded once per head block and fed to a
[BLOCK_H, BLOCK_N] tensor-core dot.

Splits. `num_kv_splits` is fixed per launch (a host decision from the batch size, so a launch can
be captured in a CUDA graph); each sequence's tokens are cut on the device into contiguous splits of
`split_len = max(cdiv(seq_len, num_kv_splits) rounded up to BLOCK_N, min_split_len)` tokens, and the
programs of splits past the end return at once. Stage 1 writes per split the normalised output and
base-2 log-sum-exp; `_decode_stage2_kernel` merges them. A row covered by ONE split (or none: a
padded CUDA-graph row, zeros) is finished by stage 1, which writes the output itself; stage 2 skips
it, and is not launched at all when `num_kv_splits == 1`. Nothing here reads host data. (Merging the
splits inside stage 1, the last split out doing it, was measured slower with PDL on the H100:
benchmarks/results/attention_merge_ab_h100.log, fusions_ab_h100.log.)

Fused rope (`rope=DecodeRope(...)`, the triton backend's decode path for Qwen3 / Llama-style layers):
stage 1 also does what kernels/triton_rope_store.py does in its own launch otherwise: per-head q/k
RMSNorm, neox rotary and the new token's K/V store. Each program rotates its own query heads; the
program whose split holds position seq_len - 1 rotates the new k, stores k and v, and seeds its online
softmax with that token (score q . k_new, weight 1, value v_new) instead of reading it back (k and v
as tiles of identical rows in q's layout, NEW_TOKEN_TILE). One launch a layer less at every batch size.

PDL (kernels/pdl.py): stage 1 reads the batch metadata (seq_lens, req_pool_indices, the first tile of
req_to_token; with rope also positions, out_cache_loc and the constant cos|sin cache) before its wait,
stage 2 seq_lens; no kernel of a decode step writes those tensors.

Optional "PE" part (MLA through this generic kernel): the score is q . k + q_pe . k_pe with k_pe read
from a second view; `kernels/triton_mla_attention.py` has the dedicated MLA decode kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ftransformers.kernels.cluster import (
    cluster_arrive,
    cluster_launch,
    cluster_sync,
    cluster_wait,
    ld_cluster_f32,
    smem_addr,
    st_shared_f32,
)
from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import early_trigger_on, l2_prefetch, pdl_enter, pdl_launch, pdl_trigger, prefetch_lines
from ftransformers.kernels.stamps import StampSink, tl_stamp
from ftransformers.kernels.triton_decode_new_token import seed_new_token
from ftransformers.kernels.triton_rope_store import norm_rope

# With the fused rope (DecodeRope), stage 1 reads its first K/V tile before the PDL wait
# (`set=triton_decode_attention.PRELOAD_FIRST_TILE=0` in benchmarks/ab_decode.py reads it after, for an A/B)
PRELOAD_FIRST_TILE = True
# Stage 2 triggers the next kernel's launch before its PDL wait (pdl.py, "Early trigger"), so that the o
# projection's programs become resident, and read ahead of their own wait, while stage 1 runs: 0 never, 1 where
# the caller says the o projection reads ahead (decode_attention_fwd's early_trigger), 2 always
EARLY_TRIGGER = 1
# With the fused rope, stage 1 handles the new token's k and v as [BLOCK_H, D] tiles of identical rows, in the layout
# q's tile has, so that k's norm and its score against each query head reduce within a warp (as q's norm does)
# instead of across the warps of a [D] vector: 7 CTA barriers between q's rotation and the first tile instead of 16,
# 9 fewer in all, and no more registers (offline sm_90 compile, Triton 3.6). H200, bf16 graph replay
# (benchmarks/results/ab_newtile_*_s52_h200.log): Qwen3-30B-A3B B=1 2.398 -> 2.379 ms (decode attention's critical
# path 288 -> 267 us a step), B=8 7.864 -> 7.849; Qwen3-8B B=1 4.176 -> 4.145, B=64 6.039 -> 6.062 (2 rounds, within
# their spread). False: the vector form (an A/B)
NEW_TOKEN_TILE = True
# With the fused rope, the new token's seed (triton_decode_new_token.py: k's norm and rotation, the k / v store, its
# score) behind a branch on whether the program's split holds it, instead of masked in every program, so that the
# programs of the other splits skip it (196 registers against 190, no spills, offline sm_90 compile). With the first
# tile read before the wait (PRELOAD), stage 1 also hints the second tile's K / V lines into L2 right after its wait
# (PREFETCH_SECOND_TILE), so that the loop's loads of that tile hit L2: two 128-byte lines a row, 2 x BLOCK_N hints.
# H200, session 56, graph replay, base against both (benchmarks/results/ab_{branch,bp}_*_s56_h200.log): Qwen3-30B-A3B
# bf16 B=1 ctx 4096 2.462 -> 2.442, 2.490 -> 2.443 and 2.465 -> 2.441 ms in three processes (stage 1's critical path
# 327-331 -> 306-310 us a step; each toggle alone 317), ctx 2048 2.396 -> 2.382, ctx 512 (clusters, the branch alone)
# 2.305 -> 2.298; B=8 ctx 4096 8.581 / 8.608 (its rounds overlap; stage 1 1190 -> 1154 us); B=32 (the branch alone: no
# preload past GQA_PRELOAD_MAX_BS) stage 1 level (3640 / 3650 us); W4A16 ctx 512 1.611 -> 1.603; Qwen3-8B B=1 ctx 4096
# 4.360 -> 4.340. Stage 1's stamps at 4K: its last tile in at 5.38 us past the first wait, 4.86 with the branch, 4.61
# with both. False, False: the masked seed and no hint (an A/B)
NEW_TOKEN_BRANCH = True
PREFETCH_SECOND_TILE = True
# Stage 2's launch: a program's tile holds at most COMBINE_TILE elements (splits x CHUNK_DV floats), over
# COMBINE_WARPS warps (module constants for benchmarks' `set=`). H200, session 45 (benchmarks/diag_mla_phases.py,
# three runs; benchmarks/results/diag_mla_{knobs,again,prefetch}_s45_h200.log): 4096 against 8192, MLA decode at
# batch 1 x 32K (128 splits), us a layer behind a torch op: 16 heads 18.57-18.97 against 19.43-19.55, 8 heads
# 16.54-17.54 against 17.77-18.09; batch 4 x 32K and batch 1 x 4K within +-0.3; Qwen3-30B-A3B bf16 steps level
# (ab_combine_30b_bf16_s45_h200.log). 8 warps or 2048 were slower. One warp (session 55): the merge over splits
# reduces within the warp (no CTA barrier), 156-158 registers and no spills (offline sm_90 compile). H200
# (benchmarks/results/{ab_combine1_*,diag_mla_w2}_s55_h200.log): Qwen3-30B-A3B bf16 ctx 4096 B=1 2.528 -> 2.493 ms
# (stage 2's critical path 113 -> 79 us a step), B=8 8.654 -> 8.593; Qwen3-8B B=1 level (4.323 / 4.326); MLA batch
# 1 x 32K 16 heads 17.43 -> 16.77 us a layer, 8 heads 16.04 -> 15.48, 16 heads batch 4 44.62 -> 42.99. 2 warps level
COMBINE_TILE = 4096
COMBINE_WARPS = 1
# stamps (kernels/stamps.py) of stage 2, a program: entry, after the PDL wait, its output stored
COMBINE_STAMP_SLOTS = tl.constexpr(3)
# stamps of stage 1, a program: entry, after the PDL wait, q normed and rotated, the new token's k / v stored and
# its score in the softmax, the first tile in the softmax, the last tile in; with clusters then every peer's state
# published (past the cluster barrier) and the output stored (past the last barrier); without them the split's
# partial stored (slot 6, unstamped where a row's only split stores its output itself) and the program's end
STAGE1_STAMP_SLOTS = tl.constexpr(8)
STAGE1_PHASES = ("entry", "after wait", "q normed+roped", "new k/v stored", "tile 0 in", "last tile in",
                 "peers published", "stored")
# A diagnostic hook (benchmarks/ab_decode.py --stamps): a StampSink (kernels/stamps.py) that gives every stage-1
# launch its own stamps; None: no stamps compiled
STAGE1_STAMP_SINK: StampSink | None = None


@triton.jit
def _split_len(seq_len, num_kv_splits, min_split_len, ALIGN: tl.constexpr):
    # an even share rounded up to ALIGN, at least min_split_len (a multiple of ALIGN)
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_kv_splits), ALIGN) * ALIGN, min_split_len)


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    # one tile's base-2 scores qk [BLOCK_H, BLOCK_N] (masked ones -inf) and values v [BLOCK_N, BLOCK_DV] into
    # the running max m_i, sum l_i and output acc
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@cached_launch
@triton.jit
def _decode_stage1_kernel(
    Q, QPE, K, KPE, V, O, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
    KNEW, VNEW, positions, cos_sin, QW, KW, out_cache_loc,
    sm_scale, group, num_kv_splits, min_split_len, heads_per_kv_blocks, eps_q, eps_k,
    s_q_t, s_q_h, s_qpe_t, s_qpe_h,
    s_k_n, s_k_h, s_kpe_n, s_kpe_h, s_v_n, s_v_h, s_r2t,
    s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, s_o_t, s_o_h,
    s_kn_t, s_kn_h, s_vn_t, s_vn_h, s_cs,
    D: tl.constexpr, DPE: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, SHARED_KV: tl.constexpr,
    DIRECT: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr, PRELOAD: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, smem_off=0, CLUSTER: tl.constexpr = 1, GROUP_H: tl.constexpr = 1,
    stamps=None, STAMPS: tl.constexpr = False, NEW_TILE: tl.constexpr = False, NEW_BRANCH: tl.constexpr = False,
    PF_SECOND: tl.constexpr = False, PF_LINES: tl.constexpr = 1, PF_STRIDE: tl.constexpr = 64,
):  # fmt: skip
    # NEW_TILE / NEW_BRANCH (with ROPE): NEW_TOKEN_TILE / NEW_TOKEN_BRANCH
    # PF_SECOND (with PRELOAD): PREFETCH_SECOND_TILE, PF_LINES 128-byte lines of PF_STRIDE elements a K / V row
    # SHARED_KV (MLA): V is K's own leading DV columns, so one [BLOCK_N, BLOCK_D] tile serves both dots
    # DIRECT: a row of one split (or none: a padded CUDA-graph row, zeros) is written to O here
    # ROPE: Q and KNEW / VNEW are the new token's raw projections (q [B, H, D], k [B, H_kv, D], v); this
    #   kernel does what kernels/triton_rope_store.py would (per-head RMSNorm when QK_NORM, neox rotary
    #   over the [P, D] cos|sin cache, K/V store at out_cache_loc): every program norms and rotates its
    #   own heads of q, and the program holding position seq_len - 1 norms and rotates k, stores k and
    #   v in the pool (head block 0 of the KV head) and starts its online softmax from that token
    #   instead of reading it back from the pool. D == BLOCK_D (a power of two).
    # PDL: the batch metadata (seq_lens, req_pool_indices, req_to_token, positions, out_cache_loc) is
    # written before the step by host copies and torch ops, never by a kernel of the step, and the
    # cos|sin cache is constant, so they are read before the wait
    # PRELOAD (with ROPE, GQA): the first tile's K and V are read before the wait too. The pool's slots of
    # positions below seq_len - 1 hold earlier steps' tokens (no kernel of this step writes them; the new token's,
    # stored by this kernel, is never read back), so the tile's HBM round trip overlaps the predecessor.
    # CLUSTER > 1 (kernels/cluster.py): the CLUSTER splits of a (head block, sequence) are one cluster of consecutive
    #   programs along axis 0 (num_kv_splits == CLUSTER) and merge through distributed shared memory at the end
    #   (_cluster_merge), so no partials and no stage 2. Every program then runs to the end, an empty split too.
    # STAMPS: STAGE1_PHASES into stamps [programs, STAGE1_STAMP_SLOTS, 2] (a diagnostic, kernels/stamps.py)
    stamp_id = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    if STAMPS:
        tl_stamp(stamps, stamp_id, 0, STAGE1_STAMP_SLOTS)
    if CLUSTER > 1:
        pid_hb, split_id, b = tl.program_id(0) // CLUSTER, tl.program_id(0) % CLUSTER, tl.program_id(2)
    else:
        pid_hb, split_id, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    req = tl.load(req_pool_indices + b)  # issued with seq_len: one round trip less before the KV loads
    split_len = _split_len(seq_len, num_kv_splits, min_split_len, BLOCK_N)
    start = split_id * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_n = tl.arange(0, BLOCK_N)
    r2t_row = req_to_token + req * s_r2t
    loc = tl.load(r2t_row + start + offs_n, mask=start + offs_n < end, other=0)  # the first tile's KV slots
    HALF: tl.constexpr = BLOCK_D // 2
    offs_half = tl.arange(0, HALF)
    kv_head = pid_hb // heads_per_kv_blocks
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    if ROPE:
        new_pos = tl.load(positions + b).to(tl.int64)
        new_slot = tl.load(out_cache_loc + b).to(tl.int64)
        cos = tl.load(cos_sin + new_pos * s_cs + offs_half)
        sin = tl.load(cos_sin + new_pos * s_cs + HALF + offs_half)
    if PRELOAD:
        first_ok = start + offs_n < end - (end == seq_len).to(tl.int32)  # positions below seq_len - 1
        k_first = tl.load(K + loc[None, :] * s_k_n + kv_head * s_k_h + offs_d[:, None],
                          mask=first_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
        v_first = tl.load(V + loc[:, None] * s_v_n + kv_head * s_v_h + offs_dv[None, :],
                          mask=first_ok[:, None] & dv_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        second = start + BLOCK_N + offs_n
        loc = tl.load(r2t_row + second, mask=second < end, other=0)  # the second tile's KV slots
    pdl_enter(USE_PDL)
    if PF_SECOND:  # loc: the second tile's slots (0 past the split: a valid slot, as a hint's address must be)
        lines = tl.arange(0, PF_LINES) * PF_STRIDE
        l2_prefetch(K + loc[:, None] * s_k_n + kv_head * s_k_h + lines[None, :], True)
        l2_prefetch(V + loc[:, None] * s_v_n + kv_head * s_v_h + lines[None, :], True)
    if STAMPS:
        tl_stamp(stamps, stamp_id, 1, STAGE1_STAMP_SLOTS)
    local = (pid_hb % heads_per_kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # index in the group
    h_mask = local < group
    heads = kv_head * group + local  # [BLOCK_H]
    if CLUSTER == 1:  # noqa: SIM102 (a constexpr test first: the early return exists only without clusters)
        if end <= start:
            if DIRECT:
                if split_id == 0:  # seq_len 0
                    tl.store(O + b * s_o_t + heads[:, None] * s_o_h + offs_dv[None, :],
                             tl.zeros([BLOCK_H, BLOCK_DV], O.dtype.element_ty),
                             mask=h_mask[:, None] & dv_mask[None, :])  # fmt: skip
            return

    if ROPE:
        q1, q2 = norm_rope(Q + b * s_q_t + heads[:, None] * s_q_h, QW, eps_q, cos[None, :], sin[None, :],
                            offs_half[None, :], h_mask[:, None], HALF, QK_NORM)  # fmt: skip
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), [BLOCK_H, BLOCK_D]).to(Q.dtype.element_ty)
    else:
        q = tl.load(Q + b * s_q_t + heads[:, None] * s_q_h + offs_d[None, :],
                    mask=h_mask[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_H, BLOCK_D]
    if BLOCK_DPE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(QPE + b * s_qpe_t + heads[:, None] * s_qpe_h + offs_pe[None, :],
                      mask=h_mask[:, None] & (offs_pe[None, :] < DPE), other=0.0)  # [BLOCK_H, BLOCK_DPE]
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    if STAMPS:
        tl_stamp(stamps, stamp_id, 2, STAGE1_STAMP_SLOTS)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    loop_end = end
    if ROPE:
        has_new = end == seq_len  # this split holds the new token, position seq_len - 1
        if CLUSTER > 1:
            has_new = has_new & (start < end)  # not an empty split past the end
        store = has_new & (pid_hb % heads_per_kv_blocks == 0)
        if NEW_BRANCH:
            if has_new:
                m_i, l_i, acc = seed_new_token(
                    q, m_i, l_i, acc, has_new, store, KNEW, VNEW, K, V, KW, eps_k, cos, sin, new_slot, kv_head, b,
                    qk_scale, s_kn_t, s_kn_h, s_vn_t, s_vn_h, s_k_n, s_k_h, s_v_n, s_v_h,
                    D, DV, BLOCK_H, BLOCK_D, BLOCK_DV, QK_NORM, NEW_TILE)  # fmt: skip
        else:
            m_i, l_i, acc = seed_new_token(
                q, m_i, l_i, acc, has_new, store, KNEW, VNEW, K, V, KW, eps_k, cos, sin, new_slot, kv_head, b,
                qk_scale, s_kn_t, s_kn_h, s_vn_t, s_vn_h, s_k_n, s_k_h, s_v_n, s_v_h,
                D, DV, BLOCK_H, BLOCK_D, BLOCK_DV, QK_NORM, NEW_TILE)  # fmt: skip
        loop_end = end - has_new.to(tl.int32)
    if STAMPS:
        tl_stamp(stamps, stamp_id, 3, STAGE1_STAMP_SLOTS)
    first = start
    if PRELOAD:  # the first tile, read before the wait
        qk = tl.dot(q, k_first.to(q.dtype), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
        qk = tl.where(first_ok[None, :], qk * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v_first, m_i, l_i, acc, DOT_PREC)
        first = start + BLOCK_N
    if STAMPS:
        tl_stamp(stamps, stamp_id, 4, STAGE1_STAMP_SLOTS)
    for start_n in range(first, loop_end, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < loop_end
        if SHARED_KV:
            v = tl.load(K + loc[:, None] * s_k_n + kv_head * s_k_h + offs_d[None, :],
                        mask=n_mask[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_N, BLOCK_D]
            k = tl.trans(v)
        else:
            k = tl.load(K + loc[None, :] * s_k_n + kv_head * s_k_h + offs_d[:, None],
                        mask=n_mask[None, :] & (offs_d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
        if BLOCK_DPE > 0:
            kpe = tl.load(KPE + loc[None, :] * s_kpe_n + kv_head * s_kpe_h + offs_pe[:, None],
                          mask=n_mask[None, :] & (offs_pe[:, None] < DPE), other=0.0)
            qk += tl.dot(qpe, kpe.to(qpe.dtype), input_precision=DOT_PREC)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        if not SHARED_KV:
            v = tl.load(V + loc[:, None] * s_v_n + kv_head * s_v_h + offs_dv[None, :],
                        mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PREC)
        nxt = pos + BLOCK_N
        loc = tl.load(r2t_row + nxt, mask=nxt < end, other=0)  # [BLOCK_N] the next tile's KV slots

    if STAMPS:
        tl_stamp(stamps, stamp_id, 5, STAGE1_STAMP_SLOTS)
    if CLUSTER > 1:
        _cluster_merge(acc, m_i, l_i, start < end, split_id, smem_off, O + b * s_o_t + kv_head * group * s_o_h,
                       (pid_hb % heads_per_kv_blocks) * BLOCK_H, group, s_o_h, DV, BLOCK_H, BLOCK_DV, GROUP_H, CLUSTER,
                       stamps, stamp_id, STAMPS)  # fmt: skip
    else:
        hd_mask = h_mask[:, None] & dv_mask[None, :]
        o_ptr = O + b * s_o_t + heads[:, None] * s_o_h + offs_dv[None, :]
        if (tl.cdiv(seq_len, split_len) == 1) & DIRECT:  # the row's only split: final output
            tl.store(o_ptr, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=hd_mask)
        else:
            mid_o_ptr = mid_o + b * s_mo_b + heads[:, None] * s_mo_h + split_id * s_mo_s + offs_dv[None, :]
            tl.store(mid_o_ptr, acc / l_i[:, None], mask=hd_mask)
            # log-sum-exp in base 2 of this split's scores
            tl.store(mid_lse + b * s_ml_b + heads * s_ml_h + split_id, m_i + tl.log2(l_i), mask=h_mask)
        if STAMPS:
            tl_stamp(stamps, stamp_id, 6, STAGE1_STAMP_SLOTS)
    if STAMPS:
        tl_stamp(stamps, stamp_id, 7, STAGE1_STAMP_SLOTS)


def cluster_scratch_bytes(block_h: int, block_dv: int) -> int:
    """Shared bytes _cluster_merge publishes a CTA: m and l of each head, then the head block's [BLOCK_H, BLOCK_DV]
    unnormalised output, float32."""
    return (2 * block_h + block_h * block_dv) * 4


@triton.jit
def _cluster_merge(
    acc, m_i, l_i, valid, rank, smem_off, O_group, first_local, group, s_o_h,
    DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, GROUP_H: tl.constexpr, CLUSTER: tl.constexpr,
    stamps=None, stamp_id=0, STAMPS: tl.constexpr = False,
):  # fmt: skip
    # acc [BLOCK_H, BLOCK_DV] (unnormalised), m_i / l_i [BLOCK_H]: this split's online softmax state (NaN or garbage
    # where not `valid`: an empty split). Each CTA publishes its state in its shared memory, then finishes
    # 1 / CLUSTER of the first GROUP_H heads' outputs (flattened; the block's other heads are past the group) from
    # every peer's, one peer after another in registers: sum_j w_j acc_j / sum_j w_j l_j with w_j = exp2(m_j - max m)
    # (zeros where no split holds a token). O_group: O's row of the KV head's first query head; first_local: this
    # head block's first index in the group.
    m_i = tl.where(valid, m_i, float("-inf"))
    l_i = tl.where(valid, l_i, 0.0)
    acc = tl.where(valid, acc, 0.0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    base = smem_addr(smem_off)
    st_shared_f32(base + offs_h * 4, m_i)
    st_shared_f32(base + (BLOCK_H + offs_h) * 4, l_i)
    st_shared_f32(base + (2 * BLOCK_H + offs_h[:, None] * BLOCK_DV + offs_dv[None, :]) * 4, acc)
    cluster_sync()
    if STAMPS:
        tl_stamp(stamps, stamp_id, 6, STAGE1_STAMP_SLOTS)
    E: tl.constexpr = GROUP_H * BLOCK_DV // CLUSTER
    idx = rank * E + tl.arange(0, E)
    h = idx // BLOCK_DV
    d = idx % BLOCK_DV
    top = tl.full([E], float("-inf"), tl.float32)
    den = tl.zeros([E], tl.float32)
    num = tl.zeros([E], tl.float32)
    for j in tl.static_range(CLUSTER):  # online: the running max and sums rescaled by each peer's
        peer = tl.full([E], j, tl.int32)
        m_j = ld_cluster_f32(base + h * 4, peer)
        l_j = ld_cluster_f32(base + (BLOCK_H + h) * 4, peer)
        a_j = ld_cluster_f32(base + (2 * BLOCK_H + h * BLOCK_DV + d) * 4, peer)
        new = tl.maximum(top, m_j)
        safe = tl.where(new == float("-inf"), 0.0, new)
        keep = tl.exp2(top - safe)
        w = tl.exp2(m_j - safe)
        den = den * keep + w * l_j
        num = num * keep + w * a_j
        top = new
    cluster_arrive()  # done reading the peers: the barrier's wait, before leaving, overlaps the store below
    out = num / tl.where(den > 0, den, 1.0)
    local = first_local + h
    tl.store(O_group + local * s_o_h + d, out.to(O_group.dtype.element_ty), mask=(local < group) & (d < DV))
    cluster_wait()  # no CTA leaves while a peer may still read its shared memory


@cached_launch
@triton.jit
def _decode_stage2_kernel(
    mid_o, mid_lse, O, seq_lens, num_kv_splits, min_split_len,
    s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, s_o_t, s_o_h,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_DV: tl.constexpr, ALIGN: tl.constexpr, DIRECT: tl.constexpr,
    USE_PDL: tl.constexpr = False, EARLY_TRIGGER: tl.constexpr = False, stamps=None, STAMPS: tl.constexpr = False,
):  # fmt: skip
    # all splits of one (sequence, head, CHUNK_DV slice) in one tile: a single round trip to memory
    pdl_trigger(EARLY_TRIGGER)
    # PDL: seq_lens (metadata, never written by a kernel of the step) is read before the wait
    b, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    program = c + tl.num_programs(2) * (h + tl.num_programs(1) * b)
    if STAMPS:
        tl_stamp(stamps, program, 0, COMBINE_STAMP_SLOTS)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    pdl_enter(USE_PDL)
    if STAMPS:
        tl_stamp(stamps, program, 1, COMBINE_STAMP_SLOTS)
    split_len = _split_len(seq_len, num_kv_splits, min_split_len, ALIGN)
    if DIRECT:
        n_live = tl.where(split_len >= seq_len, 0, num_kv_splits)  # 0: stage 1 wrote this row (or its zeros)
    else:
        n_live = num_kv_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = c * CHUNK_DV + tl.arange(0, CHUNK_DV)
    valid = (offs_s < n_live) & (offs_s * split_len < seq_len)  # non-empty splits
    lse = tl.load(mid_lse + b * s_ml_b + h * s_ml_h + offs_s, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(valid, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)  # [BLOCK_S]
    o = tl.load(mid_o + b * s_mo_b + h * s_mo_h + offs_s[:, None] * s_mo_s + offs_dv[None, :],
                mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_S, CHUNK_DV]
    denom = tl.sum(w, 0)
    # seq_len 0 (a padded CUDA-graph row) has no split: write zeros, not NaN
    acc = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    live = (offs_dv * 0 + n_live) > 0  # a tensor compare: n_live may be a plain int (DIRECT off)
    tl.store(O + b * s_o_t + h * s_o_h + offs_dv, acc.to(O.dtype.element_ty), mask=(offs_dv < DV) & live)
    if STAMPS:
        tl_stamp(stamps, program, 2, COMBINE_STAMP_SLOTS)


def decode_scratch(batch: int, num_heads: int, v_head_dim: int, max_splits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K scratch: partial outputs [B, H, S, D_v] and log-sum-exps [B, H, S], float32."""
    mid_o = torch.empty(batch, num_heads, max_splits, v_head_dim, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch, num_heads, max_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def combine_launch(B: int, H: int, DV: int, num_kv_splits: int) -> tuple[tuple[int, int, int], int, int]:
    """Stage 2's grid (sequence, head, DV chunk), its split block and its DV chunk (COMBINE_TILE elements a tile)."""
    block_s = max(2, next_pow2(num_kv_splits))
    chunk_dv = min(max(16, next_pow2(DV)), max(16, COMBINE_TILE // block_s))
    return (B, H, cdiv(DV, chunk_dv)), block_s, chunk_dv


def decode_combine(
    mid_o: torch.Tensor,  # [>=B, H, >=num_kv_splits, D_v] float32, from a stage-1 launch
    mid_lse: torch.Tensor,  # [>=B, H, >=num_kv_splits]
    out: torch.Tensor,  # [B, H, D_v]
    seq_lens: torch.Tensor,  # [B]
    num_kv_splits: int,
    min_split_len: int,
    align: int,
    direct: bool = True,  # stage 1 wrote the rows of one split itself: skip them
    early_trigger: bool = False,  # the next kernel reads ahead of its wait (EARLY_TRIGGER above)
    stamps: torch.Tensor | None = None,  # diagnostics: [programs, COMBINE_STAMP_SLOTS, 2] (kernels/stamps.py)
) -> torch.Tensor:
    """Stage 2: merge each row's non-empty splits (same split rule as stage 1) into `out`."""
    B, H, DV = out.shape
    grid, block_s, chunk_dv = combine_launch(B, H, DV, num_kv_splits)
    _decode_stage2_kernel[grid](
        mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        DV=DV, BLOCK_S=block_s, CHUNK_DV=chunk_dv, ALIGN=align, DIRECT=direct, num_warps=COMBINE_WARPS,
        **pdl_launch(mid_o.device, early=early_trigger_on(EARLY_TRIGGER, early_trigger)),
        **({"stamps": stamps, "STAMPS": True} if stamps is not None else {}),
    )  # fmt: skip
    return out


class DecodeRope(NamedTuple):
    """The new token's un-roped projections and what turns them into stored, roped K/V (a decode
    step's triton_rope_store.rope_store, done inside stage 1)."""

    k: torch.Tensor  # [B, H_kv, D], raw k of the new token (last dim contiguous)
    v: torch.Tensor  # [B, H_kv, D_v]
    positions: torch.Tensor  # [B]
    cos_sin_cache: torch.Tensor  # [P, D] float32 cos | sin (neox, rotary_dim == D)
    out_cache_loc: torch.Tensor  # [B] pool slots of the new token
    q_norm_weight: torch.Tensor | None = None  # [D] per-head RMSNorm (Qwen3), with k's
    k_norm_weight: torch.Tensor | None = None
    eps_q: float = 1e-6
    eps_k: float = 1e-6


def can_fuse_rope(head_dim: int, v_head_dim: int, cos_sin_cache: torch.Tensor) -> bool:
    """Stage 1 takes the norm, rope and store for power-of-two head dims with rotary over all of it."""
    pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return pow2 and head_dim == v_head_dim and cos_sin_cache.shape[-1] == head_dim


def decode_attention_fwd(
    q: torch.Tensor,  # [B, H, D] (raw q of the new token when `rope` is given)
    k_buf: torch.Tensor,  # [N, H_kv, D] (any strides on the first two dims)
    v_buf: torch.Tensor,  # [N, H_kv, D_v]
    out: torch.Tensor,  # [B, H, D_v]
    req_to_token: torch.Tensor,  # [R, L]
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B], tokens to attend (including the new one, already stored)
    mid_o: torch.Tensor,  # [>=B, H, >=num_kv_splits, D_v] float32 scratch
    mid_lse: torch.Tensor,  # [>=B, H, >=num_kv_splits] float32 scratch
    num_kv_splits: int,
    sm_scale: float,
    q_pe: torch.Tensor | None = None,  # [B, H, D_pe] (MLA rope part)
    kpe_buf: torch.Tensor | None = None,  # [N, H_kv, D_pe]
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    min_split_len: int = 0,  # rounded up to block_n; 0 = block_n
    direct: bool = True,  # False: every row goes through the partials and stage 2 (the pre-2026-11 behaviour)
    rope: DecodeRope | None = None,  # norm + rope q and the new k, store k/v, here (seq_lens count it)
    preload: bool | None = None,  # the first K/V tile before the PDL wait (with `rope` only); None: PRELOAD_FIRST_TILE
    early_trigger: bool = False,  # the kernel after this call reads ahead of its PDL wait (stage 2's EARLY_TRIGGER)
    cluster: int = 1,  # > 1: num_kv_splits == cluster splits merged in a thread-block cluster (cluster_supported)
) -> torch.Tensor:
    B, H, D = q.shape
    H_kv, DV = k_buf.shape[1], v_buf.shape[-1]
    group = H // H_kv
    assert H % H_kv == 0 and q.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    if rope is not None:
        assert q_pe is None and can_fuse_rope(D, DV, rope.cos_sin_cache), (D, DV, rope.cos_sin_cache.shape)
        assert rope.k.stride(-1) == 1 and rope.v.stride(-1) == 1 and rope.cos_sin_cache.stride(-1) == 1
        assert (rope.q_norm_weight is None) == (rope.k_norm_weight is None)
    assert cluster > 1 or (mid_o.shape[2] >= num_kv_splits and mid_o.shape[0] >= B)  # a cluster needs no partials
    block_h = max(16, min(block_h, next_pow2(group)))
    blocks_per_kv = cdiv(group, block_h)
    min_split_len = cdiv(max(min_split_len, 1), block_n) * block_n
    dpe = 0 if q_pe is None else q_pe.shape[-1]
    if q_pe is None:
        q_pe, kpe_buf = q, k_buf  # unused placeholders
    assert kpe_buf is not None
    grid = (H_kv * blocks_per_kv, num_kv_splits, B)
    shared_kv = (
        v_buf.data_ptr() == k_buf.data_ptr() and v_buf.stride() == k_buf.stride() and DV == D
    )  # MLA: c_kv is both key (with k_pe) and value
    if rope is None:  # placeholders, never read
        knew, vnew, pos, cs, qw, kw, new_loc, eps_q, eps_k = q, q, seq_lens, q, q, q, seq_lens, 0.0, 0.0
    else:
        knew, vnew, pos, cs, new_loc = rope.k, rope.v, rope.positions, rope.cos_sin_cache, rope.out_cache_loc
        qw = rope.q_norm_weight if rope.q_norm_weight is not None else cs
        kw = rope.k_norm_weight if rope.k_norm_weight is not None else cs
        eps_q, eps_k = float(rope.eps_q), float(rope.eps_k)
    preload = (PRELOAD_FIRST_TILE if preload is None else preload) and rope is not None
    pdl = pdl_launch(q.device)  # the launch's PDL arguments; empty where PDL is off (CPU, --disable-pdl)
    assert not preload or (dpe == 0 and not shared_kv), "the first-tile preload is for GQA with fused rope"
    block_dv = max(16, next_pow2(DV))
    args = (
        q, q_pe, k_buf, kpe_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        knew, vnew, pos, cs, qw, kw, new_loc,
        sm_scale, group, num_kv_splits, min_split_len, blocks_per_kv, eps_q, eps_k,
        q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_buf.stride(0), k_buf.stride(1), kpe_buf.stride(0), kpe_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        knew.stride(0), knew.stride(1), vnew.stride(0), vnew.stride(1), cs.stride(0),
    )  # fmt: skip
    consts = dict(
        D=D, DPE=dpe, DV=DV,
        BLOCK_D=max(16, next_pow2(D)), BLOCK_DPE=0 if dpe == 0 else max(16, next_pow2(dpe)),
        BLOCK_DV=block_dv, BLOCK_H=block_h, BLOCK_N=block_n,
        DOT_PREC=_dot_precision(q.dtype), SHARED_KV=shared_kv, DIRECT=direct,
        ROPE=rope is not None, QK_NORM=rope is not None and rope.q_norm_weight is not None, PRELOAD=preload,
        NEW_TILE=NEW_TOKEN_TILE and rope is not None, NEW_BRANCH=NEW_TOKEN_BRANCH and rope is not None,
        PF_SECOND=PREFETCH_SECOND_TILE and preload and bool(pdl),  # after a PDL wait, on a GPU
        **prefetch_lines(D, k_buf.element_size()),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    sink = STAGE1_STAMP_SINK
    if sink is not None:  # a diagnostic run: this launch's own stamps
        consts.update(stamps=sink.take(grid[0] * grid[1] * grid[2], int(STAGE1_STAMP_SLOTS)), STAMPS=True)
    if cluster > 1:  # the splits merge in their cluster: no partials, no stage 2
        group_h = min(block_h, next_pow2(group))  # the heads of a block that may be in the group
        assert num_kv_splits == cluster and (group_h * block_dv) % cluster == 0, (num_kv_splits, cluster, group_h)
        scratch = cluster_scratch_bytes(block_h, block_dv)
        grid = (H_kv * blocks_per_kv, 1, B)  # clusters; cluster_launch multiplies axis 0 by the cluster size
        cluster_launch(_decode_stage1_kernel, grid, cluster, scratch, *args, **consts, smem_off=0, CLUSTER=cluster,
                       GROUP_H=group_h, **pdl)  # fmt: skip
        return out
    _decode_stage1_kernel[grid](*args, **consts, **pdl)
    if num_kv_splits > 1 or not direct:
        decode_combine(mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len, block_n, direct, early_trigger)
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_buf: torch.Tensor,  # [N, H_kv, D]
    v_buf: torch.Tensor,  # [N, H_kv, D_v]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    q_pe: torch.Tensor | None = None,
    kpe_buf: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, H, D_v] float32
    """Plain PyTorch, float32: softmax(q k^T * scale) v per sequence over its first seq_len slots."""
    B, H, _ = q.shape
    group = H // k_buf.shape[1]
    out = torch.empty(B, H, v_buf.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(B):
        locs = req_to_token[req_pool_indices[b], : int(seq_lens[b])]
        k = k_buf[locs].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_buf[locs].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,shd->hs", q[b].float(), k)
        if q_pe is not None and kpe_buf is not None:
            s = s + torch.einsum("hd,shd->hs", q_pe[b].float(), kpe_buf[locs].float().repeat_interleave(group, dim=1))
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(s * sm_scale, dim=-1), v)
    return out
