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
