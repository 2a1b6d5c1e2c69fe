"""Fused MoE in Triton: two paths, both CUDA-graph safe (sizes depend only on (T, K, E), no host sync).

Pairs are the T*K (token, slot) entries of `topk_ids`, numbered `pair = t * K + k`.

Pair path (a PairConfig, or T*K <= PAIR_MAX_PAIRS: one decode token): no alignment, no top-k sum
kernel. `pair_gate_up` runs one program per (I-block, pair) and writes
act[pair] = topk_weight * silu(gate) * up; `pair_down_sum` runs one program per (D-block, token) and
contracts over all K of its pairs at once (one fp32 accumulator), so out[t] = sum_k act[t*K+k] @ w2[e_k]^T
lands directly in [T, D]. Both are one-row GEMVs on CUDA cores (narrow N tiles, long K steps, float32
sums), the form that streams weights fastest at one row (kernels/triton_gemv.py). Programs for one
weight block are launched next to each other, so an expert hit by several tokens is re-read from L2.
With the default config the down projection runs in kernels/triton_moe_token_down.py instead (all slots
of a program's rows in one tile, routing and first K tile read before the PDL wait, no slot split).

Aligned path (more pairs): alignment sorts the pairs by expert (stable: ties keep pair order) and pads
each expert's run to a multiple of BLOCK_M, so every BLOCK_M block of sorted rows belongs to ONE
expert; grouped GEMMs run over those blocks and `moe_sum` adds the K rows of each token.
Padding rows hold the sentinel `T*K`.

    sorted_ids  [max_padded] int32     pair index or T*K (padding)
    expert_ids  [max_blocks] int32     expert of each block (E past the used blocks)
    num_post    [1] int32              rows actually used (sum of the padded runs)
with max_padded = T*K + min(E, T*K) * (BLOCK_M - 1) rounded up to BLOCK_M.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels import triton_moe_token_down as token_down
from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.tickets import publish_and_sum, split_scratch
from ftransformers.kernels.tiling import aligned_rows, aligned_tile

# Up to this many (token, slot) pairs fused_moe takes the pair path by default. On the H100
# (benchmarks/results/moe_pair_h100.json, experts only) it wins at one token of top-8: Qwen3-30B-A3B
# 34.4 vs 38.0 us, DeepSeek-V3 237.7 vs 250.5 us; from T=2 the aligned path ties or wins on DeepSeek
# (441 vs 448 us) and by T=16 on both.
PAIR_MAX_PAIRS = 8
# Every alignment program reads all pairs: linear in T (H100, E=128: 4.6 us at 1K pairs, 20 us at 8K,
# 178 us at 64K) while the torch sort path is flat (~145 us); past this many pairs the sort wins.
SORT_ALIGN_MIN_PAIRS = 1 << 15
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    up_n: int  # N tile over I for the fused gate-up GEMM (two accumulators: gate and up)
    up_k: int
    down_n: int  # N tile over D for the down GEMM
    down_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class PairConfig:
    """Tiles of the pair path: gate-up (N over I, K over D) and down+sum (N over D, K over I); K tiles
    are capped at the next power of two of the contracted size."""

    up_n: int = 4
    up_k: int = 1024
    down_n: int = 2
    down_k: int = 1024
    up_warps: int = 4
    up_stages: int = 4
    down_warps: int = 4
    down_stages: int = 4
    down_split: int = 1  # programs per (token, D block), each over TOP_K / down_split slots (a divisor)
    # the down projection in triton_moe_token_down (its module tiles, all slots a program, first K tile before the
    # PDL wait) where it takes the call; the down_* tiles above are then unused
    token_down: bool = False


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """Tiles by the expected rows per expert, from an H100 sweep (benchmarks/bench_moe.py): decode-shaped
    blocks of 16 rows and long K tiles while weights dominate, 64- then 128-row blocks for prefill."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        return MoEConfig(16, 32, 128, 64, 128, 1, 4, 4)
    if rows <= 128:
        return MoEConfig(64, 64, 64, 128, 64, 8, 4, 4)
    return MoEConfig(128, 128, 64, 256, 64, 8, 8, 3)


# The gate-up tiles default_pair_config gives a token of hidden size <= 4096 (module names so that
# benchmarks/ab_decode.py's `set=` can change them in a whole model). The H100's choice held on the H200
# (Qwen3-30B-A3B bf16 B=1 2.459 ms; K tiles of 2048, 4 or 16 rows, 8 warps: 2.47-2.73;
# benchmarks/results/ab_pair_up_30b_bf16_h200.log). Two warps instead of four (session 55, after stage 2's gain on
# one warp): 2.492 -> 2.467 ms at ctx 4096, the gate-up's critical path 738 -> 710 us a step
# (ab_fewwarps_30b_bf16_ctx4096_s55_h200.log, ab_pairw_*_s55_h200.log)
PAIR_UP_N, PAIR_UP_K, PAIR_UP_WARPS, PAIR_UP_STAGES = 8, 1024, 2, 2


def default_pair_config(num_tokens: int, hidden_size: int) -> PairConfig:
    """Narrow N tiles and 1024-wide K steps, as for the dense one-row GEMV (kernels/triton_gemv.py);
    the best of the T=1 sweep on the H100 (moe_pair_h100.json): D=2048 up_n 8 / down_n 2, D=7168
    up_n 4 / down_n 4, two stages. The down kernel has T * down_split * D/down_n programs: split over
    4 slot groups at T=1, D=2048 (moe_split_bf16_h100.json: Qwen3-30B experts 35.0 -> 33.7 us; at T=2 no
    split was best; DeepSeek width not measured, so not split)."""
    if num_tokens * hidden_size <= 4096:
        return PairConfig(up_n=PAIR_UP_N, up_k=PAIR_UP_K, down_n=2, up_warps=PAIR_UP_WARPS, up_stages=PAIR_UP_STAGES,
                          down_stages=2, down_split=4 if num_tokens == 1 else 1, token_down=True)  # fmt: skip
    return PairConfig(up_n=4, down_n=4, up_stages=2, down_stages=2, token_down=True)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


# The integer arguments are not specialized (Triton's equal-to-1 / divisible-by-16 rules): they are loop bounds and
# masks only, and max_blocks' divisibility by 16 follows the token count irregularly, so a server met new
# specializations under requests its start-up warmup had not compiled (docs/performance.md, session 74). The
# constexprs left change where the pairs (tokens x top-k) or their blocks cross a power of two: with a power-of-two
# top-k, at powers of two of the token count, which the warmup's ladder crosses on both sides.
@cached_launch
@triton.jit(do_not_specialize=["num_pairs", "num_experts", "max_padded", "max_blocks"])
def _align_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_experts, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr, MAX_BLOCKS_P2: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # One program per expert e. Each builds the whole histogram (cheap: ids are a few KB in L2), so it
    # knows where its padded run starts, then scatters its own pairs in pair order (stable), pads its
    # run and names its blocks. Runs are disjoint: no atomics, deterministic. The tail past the used
    # rows is filled by all programs, strided.
    pdl_enter(USE_PDL)
    e = tl.program_id(0)
    c_range = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c in range(0, num_pairs, CHUNK):
        m = c + c_range < num_pairs
        ids = tl.load(ids_ptr + c + c_range, mask=m, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_P2, mask=m)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded  # [E_P2] exclusive
    sel = tl.arange(0, E_P2) == e
    start = tl.sum(tl.where(sel, starts, 0), axis=0)
    count = tl.sum(tl.where(sel, counts, 0), axis=0)
    run = tl.sum(tl.where(sel, padded, 0), axis=0)
    total = tl.sum(padded, axis=0)
    seen = tl.sum(tl.zeros([1], dtype=tl.int32), axis=0)
    for c in range(0, num_pairs, CHUNK):
        m = c + c_range < num_pairs
        hit = (tl.load(ids_ptr + c + c_range, mask=m, other=0).to(tl.int32) == e) & m
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1 + seen
        tl.store(sorted_ptr + start + rank, c + c_range, mask=hit)
        seen += tl.sum(hit.to(tl.int32), axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)  # at most BLOCK_M - 1 padding rows
    tl.store(sorted_ptr + pad, tl.zeros([BLOCK_M], tl.int32) + num_pairs, mask=pad < start + run)
    blk = tl.arange(0, MAX_BLOCKS_P2)
    tl.store(expert_ids_ptr + start // BLOCK_M + blk, tl.zeros([MAX_BLOCKS_P2], tl.int32) + e,
             mask=blk < run // BLOCK_M)
    for p in range(total + e * CHUNK, max_padded, num_experts * CHUNK):
        tl.store(sorted_ptr + p + c_range, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=p + c_range < max_padded)
    for b in range(total // BLOCK_M + e * CHUNK, max_blocks, num_experts * CHUNK):
        tl.store(expert_ids_ptr + b + c_range, tl.zeros([CHUNK], tl.int32) + num_experts, mask=b + c_range < max_blocks)
    if e == 0:
        tl.store(num_post_ptr, total)


def align_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort-based alignment in torch ops (graph-safe: fixed sizes, no host sync)."""
    flat = topk_ids.reshape(-1).long()  # [N]
    n, dev = flat.numel(), flat.device
    max_padded = max_padded_rows(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # [N]
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    dest = (ends - padded)[sorted_e] + rank
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.int())
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_start, right=True).int()
    return sorted_ids, expert_ids, ends[-1:].int()


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_ids [max_padded], expert_ids [max_padded / block_m], num_post [1])."""
    n = topk_ids.numel()
    if n >= SORT_ALIGN_MIN_PAIRS:
        return align_reference(topk_ids, num_experts, block_m)
    max_padded = max_padded_rows(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)  # any integer dtype; the kernel compares in registers
    chunk = min(1024, max(128, next_pow2(n)))
    _align_kernel[(num_experts,)](
        ids, sorted_ids, expert_ids, num_post, n, num_experts, max_padded, max_padded // block_m,
        BLOCK_M=block_m, E_P2=next_pow2(num_experts), CHUNK=chunk,
        MAX_BLOCKS_P2=next_pow2(cdiv(n, block_m)), num_warps=4,
        **pdl_launch(ids.device),
    )
    return sorted_ids, expert_ids, num_post


@cached_launch
@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs, max_padded, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # C[pair, n] = A[pair // A_DIV, :] @ B[e, n, :]^T for the rows of one expert-aligned block.
    # FUSE_SILU: B rows [n] (gate) and [up_offset + n] (up) -> silu(gate) * up.
    pdl_enter(USE_PDL)
    pid_m, pid_n = aligned_tile(max_padded, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):  # past the used row blocks
        return
    pair, row_ok, expert = aligned_rows(sorted_ptr, expert_ids_ptr, pid_m, num_pairs, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(K_TILES):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:  # float32 operands (or the CPU interpreter, whose bf16 dot is wrong): exact products
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if FUSE_SILU:
            b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc_up = tl.dot(a.to(tl.float32), b_up.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if FUSE_SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_gemm(
    a: torch.Tensor,  # [rows, K] rows = T (A_DIV = top_k) or T*top_k (A_DIV = 1)
    b: torch.Tensor,  # [E, N or 2N, K]
    out: torch.Tensor,  # [T*top_k, N]
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post: torch.Tensor,
    a_div: int,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int = 1,
    num_warps: int = 4,
    num_stages: int = 4,
    fuse_silu: bool = False,
    weights: torch.Tensor | None = None,  # [T*top_k] float32
) -> torch.Tensor:
    n = out.shape[1]
    k = a.shape[1]
    if b.shape[1] != (2 * n if fuse_silu else n) or b.shape[2] != k:
        raise ValueError(f"weight {tuple(b.shape)} does not fit A {tuple(a.shape)} -> C {tuple(out.shape)}")
    max_padded = sorted_ids.numel()
    grid = ((max_padded // block_m) * cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, expert_ids, num_post,
        n, k, out.shape[0], max_padded, n * b.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        A_DIV=a_div, FUSE_SILU=fuse_silu, MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32 or _INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, K_TILES=cdiv(k, block_k),
        num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(a.device),
    )
    return out


@cached_launch
@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, tw_ptr, N, K, num_pairs, up_offset,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_am,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # act[pair, n] = w[pair] * silu(x[t] @ w13[e, n]) * (x[t] @ w13[e, up_offset + n]), t = pair // TOP_K.
    # One row, so a GEMV on CUDA cores: [BLOCK_N, BLOCK_K] weight tiles times the x row, summed over
    # K in float32. Pair fastest in the grid: programs sharing an N block (and so an expert's rows) run
    # together, and an expert hit by several tokens is re-read from L2.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pair = pid % num_pairs
    pid_n = pid // num_pairs
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm + offs_k * stride_xk  # [BK]
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(K_TILES):
        k_ok = offs_k < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        u = tl.load(w_ptrs + up_offset, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(g * x, axis=1)
        acc_up += tl.sum(u * x, axis=1)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    act = acc / (1.0 + tl.exp(-acc)) * acc_up * tl.load(tw_ptr + pair)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@cached_launch
@triton.jit
def _pair_down_sum_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, part_ptr, ticket_ptr, N, K, num_tokens,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    TOP_K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # out[t, n] = sum_k act[t*TOP_K + k] @ w2[e_k, n]^T, one float32 accumulator over (k, i); act
    # already carries the routing weight. The slots are unrolled, so their expert ids and weight
    # loads are independent of each other. Token fastest in the grid. SPLIT > 1: program (t, s,
    # n-block) takes slots [s*TOP_K/SPLIT, (s+1)*TOP_K/SPLIT) and the last one out of (t, n-block) adds
    # the SPLIT float32 partials in order (as in triton_fused_moe_w4's down kernel).
    pdl_enter(USE_PDL)
    SLOTS: tl.constexpr = TOP_K // SPLIT
    pid = tl.program_id(0)
    t = pid % num_tokens
    pid_s = (pid // num_tokens) % SPLIT
    pid_n = pid // (num_tokens * SPLIT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK]
    a_base = act_ptr + (t * TOP_K).to(tl.int64) * stride_am + offs_k  # [BK]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        slot = pid_s * SLOTS + j
        expert = tl.load(ids_ptr + t * TOP_K + slot).to(tl.int64)
        for k in range(K_TILES):
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_base + slot * stride_am + k * BLOCK_K, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_base + expert * stride_we + k * BLOCK_K * stride_wk, mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.sum(w * a[None, :], axis=1)
    out_ptrs = out_ptr + t.to(tl.int64) * stride_om + offs_n
    if SPLIT > 1:
        part_row = part_ptr + t.to(tl.int64) * N + offs_n  # part [SPLIT, T, N]
        counter = ticket_ptr + t * tl.cdiv(N, BLOCK_N) + pid_n
        last, total = publish_and_sum(acc, part_row, pid_s, num_tokens * N, n_ok, counter, SPLIT)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def pair_gate_up(
    hidden: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    topk_ids: torch.Tensor,  # [T, K] contiguous
    weights: torch.Tensor,  # [T*K] float32
    cfg: PairConfig,
) -> torch.Tensor:  # act [T*K, I], routing weight applied
    num_pairs, d = topk_ids.numel(), hidden.shape[1]
    inter = w13.shape[1] // 2
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    block_k = min(cfg.up_k, next_pow2(d))
    grid = (num_pairs * cdiv(inter, cfg.up_n),)
    _pair_gate_up_kernel[grid](
        hidden, w13, act, topk_ids, weights, inter, d, num_pairs, inter * w13.stride(1),
        hidden.stride(0), hidden.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        TOP_K=topk_ids.shape[1], BLOCK_N=cfg.up_n, BLOCK_K=block_k, K_TILES=cdiv(d, block_k),
        num_warps=cfg.up_warps, num_stages=cfg.up_stages,
        **pdl_launch(hidden.device),
    )  # fmt: skip
    return act


def pair_down_sum(
    act: torch.Tensor,  # [T*K, I] contiguous
    w2: torch.Tensor,  # [E, D, I]
    topk_ids: torch.Tensor,  # [T, K] contiguous
    out: torch.Tensor,  # [T, D]
    cfg: PairConfig,
) -> torch.Tensor:
    t, top_k = topk_ids.shape
    d, inter = w2.shape[1], w2.shape[2]
    block_k = min(cfg.down_k, next_pow2(inter))
    n_blocks = cdiv(d, cfg.down_n)
    split = cfg.down_split if top_k % cfg.down_split == 0 else 1
    split, tickets, part = split_scratch(act.device, "moe_down", t * n_blocks, split, t, d)
    _pair_down_sum_kernel[(t * split * n_blocks,)](
        act, w2, out, topk_ids, act if part is None else part, topk_ids if tickets is None else tickets, d, inter, t, act.stride(0),
        w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), TOP_K=top_k, SPLIT=split, BLOCK_N=cfg.down_n,
        BLOCK_K=block_k, K_TILES=cdiv(inter, block_k),
        num_warps=cfg.down_warps, num_stages=cfg.down_stages,
        **pdl_launch(act.device),
    )  # fmt: skip
    return out


@cached_launch
@triton.jit
def _moe_sum_kernel(
    x_ptr, out_ptr, D, TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False
):
    # x: [T, TOP_K, D] contiguous -> out [T, D], float32 accumulation.
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, K_P2)
    mask = (offs_k[:, None] < TOP_K) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + (t * TOP_K + offs_k[:, None]) * D + offs_d[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + t * D + offs_d, tl.sum(x.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty), mask=offs_d < D)


def moe_sum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # x: [T, K, D] contiguous; out: [T, D] contiguous
    t, k, d = x.shape
    block_d = min(1024, next_pow2(d))
    _moe_sum_kernel[(t, cdiv(d, block_d))](
        x, out, d, TOP_K=k, K_P2=next_pow2(k), BLOCK_D=block_d, **pdl_launch(x.device)
    )
    return out


def fused_moe(
    hidden: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    config: MoEConfig | PairConfig | None = None,
) -> torch.Tensor:  # [T, D]
    """The pair path for a PairConfig (or T*K <= PAIR_MAX_PAIRS), else the aligned path."""
    t, d = hidden.shape
    e, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, d)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    if isinstance(config, PairConfig) or (config is None and t * top_k <= PAIR_MAX_PAIRS):
        cfg = config if isinstance(config, PairConfig) else default_pair_config(t, d)
        ids = topk_ids.contiguous()
        act = pair_gate_up(hidden, w13, ids, weights, cfg)  # [T*K, I]
        out = torch.empty(t, d, dtype=hidden.dtype, device=hidden.device)  # [T, D]
        if cfg.token_down and token_down.takes(t, top_k):
            return token_down.moe_token_down(act, w2, ids, out)
        return pair_down_sum(act, w2, ids, out, cfg)
    cfg = config or default_config(t, e, top_k)
    sorted_ids, expert_ids, num_post = moe_align(topk_ids, e, cfg.block_m)
    act = torch.empty(t * top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [T*K, I]
    moe_gemm(
        hidden, w13, act, sorted_ids, expert_ids, num_post, top_k, cfg.block_m, cfg.up_n, cfg.up_k,
        cfg.group_m, cfg.num_warps, cfg.num_stages, fuse_silu=True,
    )
    y = torch.empty(t * top_k, d, dtype=hidden.dtype, device=hidden.device)  # [T*K, D]
    moe_gemm(
        act, w2, y, sorted_ids, expert_ids, num_post, 1, cfg.block_m, cfg.down_n, cfg.down_k,
        cfg.group_m, cfg.num_warps, cfg.num_stages, weights=weights,
    )
    return moe_sum(y.view(t, top_k, d), torch.empty_like(hidden))
