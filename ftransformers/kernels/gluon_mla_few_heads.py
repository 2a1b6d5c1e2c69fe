"""MLA decode (absorbed weights) on Hopper for few heads a GPU, in Gluon: the tokens as the wgmma M.

`gluon_mla_decode.py` puts 64 heads on the wgmma M and pads a block of fewer with zero queries, so at 8
or 16 heads a GPU (DeepSeek-V3 and Kimi-K2 at tensor parallel 8) its wgmmas do 4-8x the needed work,
and at batch 1, where each program streams a split of one sequence, that compute bounds it (H100,
batch 1 x 32K: 23.8-25 us against a 12.6 us byte floor). Here the product is transposed: a 64-token
latent tile is the M of both dots and the program's HN heads (8, 16 or 32) their N.

- Scores S^T [BLOCK_N tokens, HN] = [c_kv | k_pe] q^T: A is the tile in shared memory (K-major), B the
  queries (HN rows of 576, loaded once).
- Online softmax over the tokens (axis 0 of the accumulator: across lanes and the four warps).
- O^T [L, HN] += c_kv^T P^T: A is the same tile read M-major (a transposed shared-memory operand of
  wgmma, which 16-bit types allow), B is P^T through shared memory (BLOCK_N x HN, 2-4 KB).

One compute warpgroup does both dots (m64nHN wgmmas: the tile is read twice from shared memory, ~1100
cycles a tile at 16 heads against ~5600 for its 72 KB to arrive at one SM's share of DRAM bandwidth),
and the load partition of `gluon_mla_decode` (`latent_loads`: 16-byte cp.async of the paged rows into a
two-stage ring, each stage's `ready` mbarrier counting every load thread) feeds it. Same contract as the
other MLA stage-1 kernels: one program per (HN heads, KV split, sequence); a row of one split is
finished here, others leave a normalised partial output and its base-2 log-sum-exp for
`decode_combine`.

Tile 0 is copied by the kernel's own warps (before the PDL wait where it may, below), and the queries are
loaded by the compute warpgroup, so the first copies are in flight before the queries arrive (the load
partition starts at tile 1).

More heads run as several blocks (`block_h`), several programs reading each tile: the backend runs 32 and
64 heads as two blocks of half up to batch 4 (`triton_backend.mla_block_h`), with at most 64 KV splits; on an H200
only below a context that depends on the batch size (`triton_backend.MLA_ONE_BLOCK_FROM`).

Measured (H100, benchmarks/bench_attention.py, batch 1 x 32K, us against the 64-head kernel's, with the
backend's launch rules): 8 heads 20.1 against 24.1 (62% of copy bandwidth), 16 heads 21.8 against 25.0
(58%), 32 heads 23.9 against 29.6 (53%), 64 heads 28.5 against 33.5 (44%); at 8-32 heads faster at every
batch (1-64) and context (4K-32K) measured, at 64 heads up to batch 4.

Tile 0 is copied before the PDL wait where it ends before the new token (EARLY_TILES; its rows are earlier
steps', which no kernel of the step writes). In bench_attention's chain of layers that overlaps the previous
layer's stage 2; in a decode step, since the absorbing W_UK product became a PDL kernel at 1-4 rows
(triton_mla_bmm) and the latent's store moved into the rope kernel (models/deepseek_v3.ROPE_STORES_LATENT),
it overlaps that product (session 57; 40ea4b1 had first tried it where only the benchmark's chain could gain).

Where the time goes at batch 1 (H200, session 58, benchmarks/diag_mla_phases.py with DIAG): at 16 heads x 32K the
stream alone takes 13.3 of the kernel's 15.4 us a layer, and the 32K more of a 64K context cost 9.4 us, 95% of copy
bandwidth; the rest, ~6.1 us, is fixed a layer: 2.3-2.7 us from the wait to tile 0 in the softmax, the 1.2 us
epilogue and 1.9-2.7 us of stage 2 after the last store. At 64 heads (two blocks of 32) the compute bounds it.
Measured there and not kept (docs/performance.md, session 58): the splits merged by stage 1's own programs, each
waiting on a row counter for the others (c4a49d4 has it; 15.1 -> 16.0 us at 16 heads: the waiting programs hold every
SM, so the next layer's programs no longer start beside the merge as they do beside stage 2), the split's output
stored from the accumulator's layout (level), and the load partition's first tile held until the queries are in
(slower). Session 61 (2e9aec8 has it): 64 heads a program as two compute warpgroups of 32 on each stage, slower at
64 and 128 heads (64 heads, B=1 x 32K: 26.5 us against 23.6). Side by side the two warpgroups take 1.4x one's time
a tile: with the tokens as the M, each reads the whole tile from shared memory for both products.

Shared memory (16 heads, bf16): q 18 KB + 2 x 72 KB latent + 2 KB P + the epilogue's layout change.
Needs L = 512, R = 64, 16-bit dtypes, compute capability 9.x and at most 32 heads a program.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ftransformers.kernels.gluon_mla_decode import (
    _copy_tile,
    _cta_barrier,
    _load_slots,
    _tile_before_new_token,
    latent_loads,
    pdl_enter,
    stage1_args,
)
from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.stamps import gl_stamp
from ftransformers.kernels.triton_decode_attention import decode_combine
from ftransformers.kernels.triton_mla_attention import FEW_HEADS_LIMIT

# stamps (kernels/stamps.py) of stage 1, a program: entry, after the PDL wait, tile 0's copies issued, the queries
# in shared memory, tile 0 landed, the last tile's product done, the split's output stored
STAMP_SLOTS = gl.constexpr(7)
MAX_HEADS = FEW_HEADS_LIMIT  # the widest wgmma N here: O^T [512, 32] is 128 float32 registers a thread
BLOCK_N = 64  # tokens per tile: the wgmma M
NUM_WARPS = 4  # the compute partition: one warpgroup
LOAD_WARPS = NUM_WARPS  # the kernel's own warps copy tile 0 with the load partition's count of arrivals
LOAD_REGS = 40
LOAD_ROWS = 8  # latent rows per cp.async call in the load partition
# The split's first EARLY_TILES tiles (0-2: the two stages) copied before the PDL wait where they end before the new
# token (0: tile 0 copied right after the wait). H200, session 57 (benchmarks/results/diag_mla_early_s57_h200.log), us
# a layer, 0 / 1 / 2 early tiles, in bench_attention's chain of layers and behind the absorbing W_UK product as in a
# decode step (its own time taken off): 16 heads B=1 x 32K chain 16.75 / 16.10 / 17.14, behind W_UK 17.63 / 16.71 /
# 18.66; 8 heads 15.24 / 15.03 / 16.23 and 15.90 / 15.58 / 17.40; 16 heads B=1 x 64K 25.79 / 25.53 / 26.62, x 4K 7.16
# / 6.89 / 6.96, B=4 x 32K 42.31 / 41.98 / 43.12; behind a torch op (nothing to overlap) level at 1, slower at 2
EARLY_TILES = 1
# Registers a thread at launch (maxnreg()); 0: 248, the SM's whole register file for the program's 8 warps, so that no
# other kernel's program can share the SM with it. Its warpgroups need 256 + 40 a thread after their setmaxnreg
# (37.9K registers), which a launch at 152 holds (offline sm_90 compile: no spills), leaving the SM's other 26.6K
# registers to the programs of the kernels around it (the previous layer's stage 2, the absorbing product), so that
# its programs start, and copy their first tile, while those still run. H200, session 57, us a layer, 248 against 152
# (benchmarks/results/diag_mla_regs_s57_h200.log; bench_attention's chain / behind W_UK): 16 heads B=1 x 32K 16.03 /
# 16.74 against 15.43 / 16.59, 8 heads 14.92 / 15.62 against 13.91 / 14.71, B=4 x 32K 42.69 / 43.57 against 42.58 /
# 43.37, B=1 x 4K level (7.43 / 7.44); 184 registers level with 248; DeepSeek-V3 at 16 heads, 3 layers, B=1 ctx 32K,
# graph replay 1.245 against 1.244 ms
LAUNCH_REGS = 152
# timing experiments only, wrong results: 1 = the stream alone (no wgmma, no softmax; the same barriers), 2 = the
# compute alone (no copies past the first two tiles: latent_loads' DIAG 1)
DIAG = 0


def heads_block(num_heads: int) -> int:
    """The wgmma N for this many heads a GPU: 8, 16 or 32 (a block of fewer is padded with zero queries)."""
    if num_heads > MAX_HEADS:
        raise ValueError(f"the few-heads MLA kernel takes at most {MAX_HEADS} heads, not {num_heads}")
    return max(8, next_pow2(num_heads))


@gluon.jit
def _store_split_t(acc, m_i, l_i, O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads,
                   s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
                   L: gl.constexpr, HN: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):  # fmt: skip
    # acc [L, HN] unnormalised (O^T), m_i / l_i [HN] this split's running max and sum (base 2); written
    # along L (16-byte vectors) after a layout change; heads past num_heads are not stored
    st_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, o_layout))[None, :]
    out = gl.convert_layout(out, st_layout)
    rows = gl.arange(0, L, layout=gl.SliceLayout(1, st_layout))
    heads = pid_h * HN + gl.arange(0, HN, layout=gl.SliceLayout(0, st_layout))
    mask = (heads < num_heads)[None, :]
    if gl.cdiv(seq_len, split_len) == 1:  # the row's only split: final output
        gl.store(O + b * s_o_b + heads[None, :] * s_o_h + rows[:, None], out.to(O.dtype.element_ty), mask=mask)
    else:
        gl.store(mid_o + b * s_mo_b + heads[None, :] * s_mo_h + split_id * s_mo_s + rows[:, None], out, mask=mask)
        heads_s = pid_h * HN + gl.arange(0, HN, layout=gl.SliceLayout(0, s_layout))
        gl.store(mid_lse + b * s_ml_b + heads_s * s_ml_h + split_id, m_i + gl.log2(l_i), mask=heads_s < num_heads)


@gluon.jit
def _compute_t(Q_NOPE, Q_ROPE, q_nope, q_rope, kvn, kvr, p_smem, ready, empty, O, mid_o, mid_lse, b, pid_h,
               split_id, seq_len, split_len, num_heads, start, end, num_tiles, sm_scale,
               s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, stamps, program,
               L: gl.constexpr, R: gl.constexpr, HN: gl.constexpr, BLOCK_N: gl.constexpr,
               STAMPS: gl.constexpr, DIAG: gl.constexpr):  # fmt: skip
    # The default partition (one warpgroup): per tile, wait for its stage, S^T, the online softmax over
    # the tile's tokens, P^T through shared memory, O^T += c_kv^T P^T; then hand the stage back.
    dtype: gl.constexpr = kvn.dtype
    # the program's queries, once, into shared memory (the B operand of every tile's scores) while the
    # load partition already copies; heads past num_heads (a block padded to HN) are zeros
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # [heads, L] 16-byte vectors
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [heads, R]
    heads_l = pid_h * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, ld_l))
    heads_r = pid_h * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, ld_r))
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, ld_l))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ld_r))
    q_nope.store(gl.load(Q_NOPE + b * s_qn_b + heads_l[:, None] * s_qn_h + offs_l[None, :],
                         mask=(heads_l < num_heads)[:, None], other=0.0))  # fmt: skip
    q_rope.store(gl.load(Q_ROPE + b * s_qr_b + heads_r[:, None] * s_qr_h + offs_r[None, :],
                         mask=(heads_r < num_heads)[:, None], other=0.0))  # fmt: skip
    fence_async_shared()  # generic-proxy stores, before the wgmmas read them
    _cta_barrier()  # every warp's share of q
    if STAMPS:
        gl_stamp(stamps, program, 3, STAMP_SLOTS)
    # S^T [BLOCK_N, HN] and O^T [L, HN] share the m64nHN accumulator layout (so do their head vectors)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HN, 16])
    o_layout: gl.constexpr = s_layout
    rows_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m_i = gl.full([HN], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([HN], gl.float32, gl.SliceLayout(0, s_layout))
    acc = gl.zeros([L, HN], gl.float32, o_layout)
    for it in range(num_tiles):
        st = it % 2
        kv_n = kvn.index(st)
        mbarrier.wait(ready.index(st), (it // 2) & 1)  # every load thread's copies of tile it landed
        if STAMPS and it == 0:
            gl_stamp(stamps, program, 4, STAMP_SLOTS)
        fence_async_shared()  # cp.async writes are generic-proxy; wgmma reads through the async proxy
        if DIAG != 1:
            s = gl.zeros([BLOCK_N, HN], gl.float32, s_layout)
            s = warpgroup_mma(kv_n, q_nope.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma(kvr.index(st), q_rope.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            live = start + it * BLOCK_N + rows_s < end  # tokens past the split
            qk = gl.where(live[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(qk, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(qk - m_new[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _cta_barrier()  # all of P^T before the wgmma reads it
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
            acc = warpgroup_mma(kv_n.permute((1, 0)), p_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        _cta_barrier()  # every warp done with P^T and this stage
        mbarrier.arrive(empty.index(st))
    if STAMPS:
        gl_stamp(stamps, program, 5, STAMP_SLOTS)
    _store_split_t(acc, m_i, l_i, O, mid_o, mid_lse, b, pid_h, split_id, seq_len, split_len, num_heads,
                   s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h, L, HN, s_layout, o_layout)  # fmt: skip
    if STAMPS:
        gl_stamp(stamps, program, 6, STAMP_SLOTS)


@cached_launch
@gluon.jit
def mla_decode_stage1_few_heads(
    Q_NOPE, Q_ROPE, KV, O, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
    sm_scale, num_kv_splits, min_split_len, num_heads,
    s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_kv, s_r2t, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
    L: gl.constexpr, R: gl.constexpr, HN: gl.constexpr, BLOCK_N: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, LOAD_ROWS: gl.constexpr, EARLY_TILES: gl.constexpr,
    USE_PDL: gl.constexpr = False, stamps=None, STAMPS: gl.constexpr = False, DIAG: gl.constexpr = 0,
):  # fmt: skip
    pid_h = gl.program_id(0)
    split_id = gl.program_id(1)
    b = gl.program_id(2)
    program = pid_h + gl.num_programs(0) * (split_id + gl.num_programs(1) * b)
    if STAMPS:
        gl_stamp(stamps, program, 0, STAMP_SLOTS)
    # PDL: before the wait, the batch metadata (written before the step) and, with EARLY_TILES, the split's first
    # tiles' copies where they end before the new token: rows of earlier steps' tokens, which no kernel of the step
    # writes (a tile holding the new token's row, which this step stores, is copied after the wait)
    seq_len = gl.load(seq_lens + b).to(gl.int32)
    req = gl.load(req_pool_indices + b)
    dtype: gl.constexpr = KV.dtype.element_ty
    sl_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    sl_r: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
    split_len = gl.maximum(gl.cdiv(gl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N, min_split_len)
    start = split_id * split_len
    end = gl.minimum(start + split_len, seq_len)
    r2t_row = req_to_token + req * s_r2t
    kvn = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], sl_l)
    kvr = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], sl_r)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # the first FIRST tiles are copied by the kernel's own warps (into stages 0 .. FIRST - 1)
    FIRST: gl.constexpr = EARLY_TILES if EARLY_TILES > 0 else 1
    slot_t: gl.constexpr = req_to_token.dtype.element_ty
    first_slots = gl.allocate_shared_memory(slot_t, [FIRST * BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=LOAD_WARPS * 32)  # one noinc cp.async arrival a load thread
        mbarrier.init(empty.index(i), count=1)
    if EARLY_TILES > 0:
        _load_slots(r2t_row, first_slots, start, end, FIRST * BLOCK_N)
        for t in gl.static_range(EARLY_TILES):
            if _tile_before_new_token(t, start, end, seq_len, split_id, True, BLOCK_N):
                _copy_tile(KV, first_slots, s_kv, kvn, kvr, ready, t, L, R, BLOCK_N, LOAD_ROWS)
    pdl_enter(USE_PDL)
    if STAMPS:
        gl_stamp(stamps, program, 1, STAMP_SLOTS)
    sl_ql: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HN, L], dtype)
    sl_qr: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HN, R], dtype)
    sl_p: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HN], dtype)
    slot_buf = gl.allocate_shared_memory(slot_t, [BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if end <= start:
        if split_id == 0:  # seq_len 0 (a padded CUDA-graph row): zeros, not garbage
            ld_z: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
            heads_z = pid_h * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, ld_z))
            cols_z = gl.arange(0, L, layout=gl.SliceLayout(0, ld_z))
            gl.store(O + b * s_o_b + heads_z[:, None] * s_o_h + cols_z[None, :],
                     gl.zeros([HN, L], O.dtype.element_ty, ld_z), mask=(heads_z < num_heads)[:, None])  # fmt: skip
        return
    if EARLY_TILES == 0:
        _load_slots(r2t_row, first_slots, start, end, FIRST * BLOCK_N)
    for t in gl.static_range(FIRST):  # the first tiles not copied before the wait
        if (start + t * BLOCK_N < end) & ~_tile_before_new_token(t, start, end, seq_len, split_id, t < EARLY_TILES,
                                                                BLOCK_N):  # fmt: skip
            _copy_tile(KV, first_slots, s_kv, kvn, kvr, ready, t, L, R, BLOCK_N, LOAD_ROWS)
    if STAMPS:
        gl_stamp(stamps, program, 2, STAMP_SLOTS)
    q_nope = gl.allocate_shared_memory(dtype, [HN, L], sl_ql)
    q_rope = gl.allocate_shared_memory(dtype, [HN, R], sl_qr)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HN], sl_p)
    num_tiles = gl.cdiv(end - start, BLOCK_N)
    gl.warp_specialize(
        [
            (_compute_t, (Q_NOPE, Q_ROPE, q_nope, q_rope, kvn, kvr, p_smem, ready, empty, O, mid_o, mid_lse, b, pid_h,
                          split_id, seq_len, split_len, num_heads, start, end, num_tiles, sm_scale,
                          s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
                          stamps, program, L, R, HN, BLOCK_N, STAMPS, DIAG)),
            (latent_loads, (KV, r2t_row, s_kv, kvn, kvr, slot_buf, ready, empty, start, end, num_tiles,
                            L, R, BLOCK_N, LOAD_WARPS, LOAD_ROWS, DIAG // 2, FIRST)),  # tiles before FIRST: above
        ],
        [LOAD_WARPS],
        [LOAD_REGS],
    )  # fmt: skip


def maxnreg() -> int:
    """Registers a thread at launch (the load partition gives back all but LOAD_REGS, and the compute warpgroup takes
    256): LAUNCH_REGS, or (0) all an SM has for one program."""
    return LAUNCH_REGS or min(248, 65536 // ((NUM_WARPS + LOAD_WARPS) * 32) // 8 * 8)


def mla_decode_few_heads(
    q_nope: torch.Tensor,  # [B, H, L], H <= MAX_HEADS
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
    block_h: int | None = None,  # heads a program: all (None, or >= H), else heads_block(block_h) a program
    stamps: tuple[torch.Tensor, torch.Tensor] | None = None,  # diagnostics: stage 1's [programs, STAMP_SLOTS, 2]
    # and stage 2's (kernels/stamps.py; triton_decode_attention.COMBINE_STAMP_SLOTS)
) -> torch.Tensor:
    """Stage 1 here, then `decode_combine` for rows of several splits; returns `out`."""
    B, H, L = q_nope.shape
    hn = heads_block(H) if block_h is None or block_h >= H else heads_block(block_h)
    min_split_len = cdiv(max(min_split_len, 1), BLOCK_N) * BLOCK_N
    args = stage1_args(q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
                       num_kv_splits, sm_scale, min_split_len)  # fmt: skip
    mla_decode_stage1_few_heads[(cdiv(H, hn), num_kv_splits, B)](
        *args,
        L=L, R=q_rope.shape[-1], HN=hn, BLOCK_N=BLOCK_N, LOAD_WARPS=LOAD_WARPS, LOAD_REGS=LOAD_REGS,
        LOAD_ROWS=LOAD_ROWS, EARLY_TILES=EARLY_TILES, DIAG=DIAG, num_warps=NUM_WARPS, maxnreg=maxnreg(),
        **pdl_launch(q_nope.device), **({"stamps": stamps[0], "STAMPS": True} if stamps is not None else {}),
    )  # fmt: skip
    if num_kv_splits > 1:
        decode_combine(mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len, BLOCK_N,
                       stamps=None if stamps is None else stamps[1])  # fmt: skip
    return out
