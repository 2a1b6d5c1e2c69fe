"""Fused MoE in Triton: token/expert alignment, grouped GEMMs over expert-aligned row blocks, top-k sum.

Pairs are the T*K (token, slot) entries of `topk_ids`, numbered `pair = t * K + k`. Alignment sorts
them by expert (stable: ties keep pair order) and pads each expert's run to a multiple of BLOCK_M, so
every BLOCK_M block of sorted rows belongs to ONE expert. Padding rows hold the sentinel `T*K`.
All sizes depend only on (T, K, E, BLOCK_M): no host sync, so the launchers are CUDA-graph safe.

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

# The single-program alignment kernel is serial over pairs x experts (H100: ~7 us at 8 pairs; 45 us at
# 512 pairs x 256 and 86 us at 512 x 512); past this much work the sort-based torch ops (~75-90 us in a
# graph, flat in size) win.
SMALL_ALIGN_MAX_WORK = 1 << 18
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


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """Tiles by the expected rows per expert, from an H100 sweep (benchmarks/bench_moe.py): decode-shaped
    blocks of 16 rows and long K tiles while weights dominate, 64- then 128-row blocks for prefill."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        return MoEConfig(16, 32, 128, 64, 128, 1, 4, 4)
    if rows <= 128:
        return MoEConfig(64, 64, 64, 128, 64, 8, 4, 4)
    return MoEConfig(128, 128, 64, 256, 64, 8, 8, 3)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _align_small_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_experts, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr,
    PAIR_CHUNKS: tl.constexpr, PAD_CHUNKS: tl.constexpr, BLK_CHUNKS: tl.constexpr,
):
    # One program: histogram -> padded exclusive offsets -> stable scatter of pairs; pairs <= a few K.
    # Loop counts are constexpr bounds (bucketed by the launcher); the runtime sizes only mask.
    e_range = tl.arange(0, E_P2)
    c_range = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for ci in range(PAIR_CHUNKS):
        c = ci * CHUNK
        ids = tl.load(ids_ptr + c + c_range, mask=c + c_range < num_pairs, other=E_P2)
        counts += tl.sum((ids[:, None] == e_range[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_P2] inclusive
    starts = ends - padded
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    for pi in range(PAD_CHUNKS):
        p = pi * CHUNK
        tl.store(sorted_ptr + p + c_range, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=p + c_range < max_padded)
    for bi in range(BLK_CHUNKS):
        b = bi * CHUNK
        blk = (b + c_range) * BLOCK_M
        hit = (ends[None, :] <= blk[:, None]) & (e_range[None, :] < num_experts)
        tl.store(expert_ids_ptr + b + c_range, tl.sum(hit.to(tl.int32), axis=1), mask=b + c_range < max_blocks)
    tl.debug_barrier()
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for ci in range(PAIR_CHUNKS):
        c = ci * CHUNK
        ids = tl.load(ids_ptr + c + c_range, mask=c + c_range < num_pairs, other=E_P2)
        onehot = (ids[:, None] == e_range[None, :]).to(tl.int32)  # [CHUNK, E_P2]
        before = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]
        dest = tl.sum(onehot * (before + starts[None, :]), axis=1)
        tl.store(sorted_ptr + dest, c + c_range, mask=c + c_range < num_pairs)
        seen += tl.sum(onehot, axis=0)


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
    e_p2 = triton.next_power_of_2(num_experts + 1)
    if n * e_p2 > SMALL_ALIGN_MAX_WORK:
        return align_reference(topk_ids, num_experts, block_m)
    max_padded = max_padded_rows(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)  # any integer dtype; the kernel compares in registers
    chunk = max(1, min(32, 4096 // e_p2))
    bucket = max_padded_rows(triton.next_power_of_2(n), num_experts, block_m)  # fewer recompiles
    _align_small_kernel[(1,)](
        ids, sorted_ids, expert_ids, num_post, n, num_experts, max_padded, max_padded // block_m,
        BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, PAIR_CHUNKS=triton.cdiv(triton.next_power_of_2(n), chunk),
        PAD_CHUNKS=triton.cdiv(bucket, chunk), BLK_CHUNKS=triton.cdiv(bucket // block_m, chunk), num_warps=4,
    )
    return sorted_ids, expert_ids, num_post


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs, max_padded, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_TILES: tl.constexpr,
):
    # C[pair, n] = A[pair // A_DIV, :] @ B[e, n, :]^T for the rows of one expert-aligned block.
    # FUSE_SILU: B rows [n] (gate) and [up_offset + n] (up) -> silu(gate) * up.
    pid = tl.program_id(0)
    num_pid_m = max_padded // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_size
    pid_n = (pid % group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    row_ok = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
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
    grid = ((max_padded // block_m) * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, sorted_ids, expert_ids, num_post,
        n, k, out.shape[0], max_padded, n * b.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        A_DIV=a_div, FUSE_SILU=fuse_silu, MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32 or _INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, K_TILES=triton.cdiv(k, block_k),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, D, TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    # x: [T, TOP_K, D] contiguous -> out [T, D], float32 accumulation.
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, K_P2)
    mask = (offs_k[:, None] < TOP_K) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + (t * TOP_K + offs_k[:, None]) * D + offs_d[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + t * D + offs_d, tl.sum(x.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty), mask=offs_d < D)


def moe_sum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # x: [T, K, D] contiguous; out: [T, D] contiguous
    t, k, d = x.shape
    block_d = min(1024, triton.next_power_of_2(d))
    _moe_sum_kernel[(t, triton.cdiv(d, block_d))](x, out, d, TOP_K=k, K_P2=triton.next_power_of_2(k), BLOCK_D=block_d)
    return out


def fused_moe(
    hidden: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    config: MoEConfig | None = None,
) -> torch.Tensor:  # [T, D]
    t, d = hidden.shape
    e, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if t == 0:
        return hidden.new_empty(0, d)
    cfg = config or default_config(t, e, top_k)
    sorted_ids, expert_ids, num_post = moe_align(topk_ids, e, cfg.block_m)
    act = torch.empty(t * top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [T*K, I]
    moe_gemm(
        hidden, w13, act, sorted_ids, expert_ids, num_post, top_k, cfg.block_m, cfg.up_n, cfg.up_k,
        cfg.group_m, cfg.num_warps, cfg.num_stages, fuse_silu=True,
    )
    y = torch.empty(t * top_k, d, dtype=hidden.dtype, device=hidden.device)  # [T*K, D]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    moe_gemm(
        act, w2, y, sorted_ids, expert_ids, num_post, 1, cfg.block_m, cfg.down_n, cfg.down_k,
        cfg.group_m, cfg.num_warps, cfg.num_stages, weights=weights,
    )
    return moe_sum(y.view(t, top_k, d), torch.empty_like(hidden))
