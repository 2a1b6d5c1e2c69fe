"""Program-to-tile mapping shared by the Triton GEMMs (dense and grouped MoE)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` over a num_pid_m x num_pid_n grid of output tiles, walked in bands
    of GROUP_M row tiles: consecutive programs take the rows of a band for one column tile, so each
    weight column tile is reused from L2 by GROUP_M row tiles (the last band may be shorter)."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def aligned_tile(max_padded, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program in an MoE aligned-path GEMM: grouped_tile over the max_padded /
    BLOCK_M row blocks of the sorted pairs (kernels/triton_fused_moe.py) and the N / BLOCK_N column
    tiles. Blocks from num_post on are unused: the caller returns for them before loading anything."""
    return grouped_tile(tl.program_id(0), max_padded // BLOCK_M, tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def aligned_rows(sorted_ptr, expert_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Row block pid_m of the sorted pairs: pair ids [BLOCK_M] int64 (num_pairs on padding rows), which
    rows are real pairs, and the block's expert (int64)."""
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pair, pair < num_pairs, tl.load(expert_ids_ptr + pid_m).to(tl.int64)
