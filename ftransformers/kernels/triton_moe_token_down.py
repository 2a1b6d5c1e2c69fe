"""A decode token's MoE down projection over 16-bit experts, its first K tile read before the PDL wait.

The 16-bit twin of triton_moe_w4_gemv's `_token_down_kernel`, for the pair path of kernels/triton_fused_moe.py:

    out[t, n] = sum_k act[t K + k] @ w2[ids[t, k], n]^T,  n < N = D, contracted over K = I

with act [T * K, I] already carrying the routing weight (`pair_gate_up`). Grid (D / BLOCK_N, T): a program holds
BLOCK_N rows of every slot's expert as one [BLOCK_N, SLOTS_P2, BLOCK_K] tile a K step, so it sums all top-k slots
of its rows in one float32 accumulator; no partials, no tickets (`pair_down_sum` splits the slots over programs
and adds their partials through a ticket, two more dependent round trips at the end).

PRELOAD: the routing and the experts' first K tile are loaded before the PDL wait. The weights are constant, and
the routing was read by the kernel launched just before this one (`pair_gate_up`, after its own wait returned,
so the router that wrote it had completed before this grid could start); only act comes from that predecessor.
With BLOCK_K >= I the whole of a program's weight is in registers before the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch

# The pair path of fused_moe runs its down projection here (`set=triton_moe_token_down.ENABLED=0` in
# benchmarks/ab_decode.py restores pair_down_sum for an A/B).
ENABLED = True
# Up to this many tokens (each program reads its token's experts; tokens sharing an expert re-read it from L2).
MAX_TOKENS = 2
MAX_TOP_K = 16
# Default tiles (module names so that ab_decode's `set=` can sweep them in a whole model).
BLOCK_N, BLOCK_K, WARPS, PRELOAD = 2, 256, 8, True


@dataclass(frozen=True)
class TokenDownConfig:
    block_n: int = BLOCK_N  # rows of D a program
    block_k: int = BLOCK_K  # K step over I (capped at the next power of two of I)
    warps: int = WARPS
    preload: bool = PRELOAD  # routing and first K tile before the PDL wait


def default_config() -> TokenDownConfig:
    """The module's tiles (which `set=` may have changed)."""
    return TokenDownConfig(BLOCK_N, BLOCK_K, WARPS, PRELOAD)


def takes(num_tokens: int, top_k: int) -> bool:
    return ENABLED and 1 <= num_tokens <= MAX_TOKENS and 1 <= top_k <= MAX_TOP_K


@cached_launch
@triton.jit
def _moe_token_down_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    TOP_K: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, PRELOAD: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # Tiles are [BLOCK_N, SLOTS_P2, BLOCK_K]: rows of D, top-k slots (padded to a power of two, masked), K.
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SLOTS_P2)
    n3 = offs_n[:, None, None]  # [BN, 1, 1]
    s3 = slots[None, :, None]  # [1, S, 1]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]  # [1, 1, BK]
    row_ok = (n3 < N) & (s3 < TOP_K)  # [BN, S, 1]
    a_ptrs = act_ptr + (tok * TOP_K + s3).to(tl.int64) * stride_am + k3  # [1, S, BK]
    if PRELOAD:
        expert = tl.load(ids_ptr + tok * TOP_K + slots, mask=slots < TOP_K, other=0).to(tl.int64)  # [S]
        w_ptrs = w_ptr + expert[None, :, None] * stride_we + n3.to(tl.int64) * stride_wn + k3 * stride_wk
        w0 = tl.load(w_ptrs, mask=row_ok & (k3 < K), other=0.0)
    pdl_enter(USE_PDL)
    if not PRELOAD:
        expert = tl.load(ids_ptr + tok * TOP_K + slots, mask=slots < TOP_K, other=0).to(tl.int64)  # [S]
        w_ptrs = w_ptr + expert[None, :, None] * stride_we + n3.to(tl.int64) * stride_wn + k3 * stride_wk
        w0 = tl.load(w_ptrs, mask=row_ok & (k3 < K), other=0.0)
    a = tl.load(a_ptrs, mask=(s3 < TOP_K) & (k3 < K), other=0.0)
    acc = w0.to(tl.float32) * a.to(tl.float32)  # [BN, S, BK]
    for kt in range(1, K_TILES):
        k0 = kt * BLOCK_K
        w = tl.load(w_ptrs + k0 * stride_wk, mask=row_ok & (k3 < K - k0), other=0.0)
        a = tl.load(a_ptrs + k0, mask=(s3 < TOP_K) & (k3 < K - k0), other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    tl.store(out_ptr + tok.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def moe_token_down(
    act: torch.Tensor,  # [T*K, I], unit stride along I, routing weight applied
    w2: torch.Tensor,  # [E, D, I]
    ids: torch.Tensor,  # [T, K] contiguous
    out: torch.Tensor,  # [T, D], unit stride along D
    cfg: TokenDownConfig | None = None,
) -> torch.Tensor:
    """out = the pair path's down projection and top-k sum. With cfg.preload, ids must not be written by the kernel
    launched just before this one (fused_moe's pair_gate_up reads them after its own wait, so they qualify)."""
    cfg = cfg or default_config()
    t, top_k = ids.shape
    d, inter = w2.shape[1], w2.shape[2]
    if not (1 <= top_k <= MAX_TOP_K and act.shape == (t * top_k, inter) and act.stride(1) == 1 and out.stride(1) == 1):
        raise ValueError(f"moe_token_down: act [T*K, I] = [{t * top_k}, {inter}] unit-stride and top-k <= {MAX_TOP_K} "
                         f"expected, got act {tuple(act.shape)} stride {act.stride()}, top-k {top_k}")  # fmt: skip
    block_k = min(cfg.block_k, next_pow2(inter))
    _moe_token_down_kernel[(cdiv(d, cfg.block_n), t)](
        act, w2, out, ids, d, inter, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        TOP_K=top_k, SLOTS_P2=next_pow2(top_k), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        K_TILES=cdiv(inter, block_k), PRELOAD=cfg.preload, num_warps=cfg.warps, **pdl_launch(act.device),
    )  # fmt: skip
    return out
