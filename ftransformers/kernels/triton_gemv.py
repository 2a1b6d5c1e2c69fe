"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= GEMV_MAX_M rows, in Triton.

At batch 1 a linear layer only streams its weight; cuBLAS picks tiles made for larger M (and adds a
split-K reduction kernel when N is small), reaching 60-85% of copy bandwidth on an H100 for the
attention projections of Qwen3-30B-A3B and DeepSeek-V3 and 4% for a 128-expert router. Here each
program owns BLOCK_N output features and walks the whole K once, so every weight byte is read
exactly once, with no second kernel:

- M <= 4: broadcast-multiply-reduce on CUDA cores, [BLOCK_M, BLOCK_N, BLOCK_K] products summed over
  K in float32 (tensor cores would waste 3/4 of their rows at M = 1..4).
- 4 < M <= 16 (`DOT`): x padded to 16 rows in registers and tl.dot on tensor cores.

Tiles come from `gemv_config` (measured by benchmarks/bench_gemv.py on an H100): small BLOCK_N so
that N / BLOCK_N programs cover the SMs several times over, long BLOCK_K for wide vector loads.
The linear layers (layers/linear.py) use it for one row only: at M = 1 it beat cuBLAS on every
measured shape (up to 1.7x on the router, 1.3x on o_proj); from M = 2 on, cuBLAS wins on some
shapes, so it keeps them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.triton_norm import add_residual, rms_normed

GEMV_MAX_M = 16
# The M <= 4 rule's knobs (module constants so that benchmarks/ab_decode.py can vary them in a whole step):
# weights up to SMALL elements take 2 output rows a program, up to MEDIUM 4, larger ones 8.
GEMV_SMALL = 32 << 20
GEMV_MEDIUM = 110 << 20
GEMV_BLOCK_K = 2048  # K elements a one-row program loads per step (2-4 rows: 1024 / rows)
# A one-row product with K up to this takes its whole row in one step (the H100 sweeps put 2048 and 4096 level).
# H200, bf16 B=1 steps in one process: 4096 for every K cut Qwen3-30B-A3B 2.506 -> 2.477 ms and Qwen3-8B 4.279 ->
# 4.257, but DeepSeek-V3 (K 7168, 16384) went 1.483 -> 1.506 (benchmarks/results/ab_gemv_bk_*_h200.log); whole rows
# only: Qwen3-8B 4.278 -> 4.194, Qwen3-30B-A3B 2.510 -> 2.476, DeepSeek-V3 1.490 -> 1.483 (ab_gemv_rule_*_h200.log).
GEMV_WHOLE_ROW_K = 4096
GEMV_WARPS = 4
GEMV_STAGES = 4
# gemv_rmsnorm's programs take at least FOLD_MIN_WEIGHT_BYTES of weight rows (more than gemv_config's 2 at K = 2048),
# since each also reads and norms the whole row. H200, bf16 B=1 graph replay with the qkv GEMV folded
# (benchmarks/results/ab_fold_rows_*_s53_h200.log): Qwen3-30B-A3B (K 2048) 4 rows 2.305-2.311 ms, 2 rows 2.321-2.327,
# 8 rows 2.426-2.427, the norm's own launch 2.389; Qwen3-8B (K 4096) 2 rows 4.136-4.148, 4 rows 4.164-4.168, the
# norm's own launch 4.172-4.191. FOLD_BLOCK_N > 0 overrides the rule (for an A/B)
FOLD_MIN_WEIGHT_BYTES = 16 << 10
FOLD_MAX_BLOCK_N = 8  # short rows (K < 1024) stop here
FOLD_BLOCK_N = 0
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@cached_launch
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False, NORM: tl.constexpr = False, res_ptr=None, nw_ptr=None, new_res_ptr=None, eps=0.0,
):  # fmt: skip
    # y[m, n] = sum_k x[m, k] * w[n, k]: program pid owns rows n of [pid*BLOCK_N, (pid+1)*BLOCK_N) and walks K.
    # NORM (one row, K <= BLOCK_K: gemv_rmsnorm): x is RMSNorm(x + res) * nw, by kernels/triton_norm.py's own
    # helpers, computed by every program from the row; program 0 stores x + res at new_res.
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if NORM:  # one step of K: the weight tile's loads first, the row's norm under them
        if EVEN_K:  # masks constant along K: vector loads
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)  # [BN, BK]
            h = tl.load(x_ptr + offs_k)  # [BK]
            r = tl.load(res_ptr + offs_k)
            nw = tl.load(nw_ptr + offs_k)
        else:
            mask_k = offs_k < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            h = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0)
            r = tl.load(res_ptr + offs_k, mask=mask_k, other=0.0)
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
        s = add_residual(h, r)
        tl.store(new_res_ptr + offs_k, s, mask=offs_k < tl.where(pid == 0, K, 0))
        xn = rms_normed(s, nw, eps, K).to(x_ptr.dtype.element_ty)  # the norm kernel's output, rounded as it is
        acc += tl.sum(xn.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)[None, :]
    else:
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            else:
                mask_k = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            if DOT:  # tensor cores, x padded to BLOCK_M >= 16 rows
                if IEEE:  # float32 operands (or the CPU interpreter, whose bf16 dot is wrong): exact products
                    acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
            else:  # CUDA cores: [BM, BN, BK] products summed over K
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_config(M: int, N: int, K: int) -> dict[str, int]:
    """Tile and launch parameters for an [M, K] x [N, K]^T product (M <= GEMV_MAX_M).

    From the H100 sweeps (benchmarks/results/gemv_sweep_h100.json, gemv_bk_h100.json): 2-8 output rows per
    program (more rows for larger weights, so each program streams enough); one row steps 2048 elements of K
    at a time (1.01-1.16x faster than 1024 on each of 13 weights, 1.9% off a Qwen3-8B bf16 step), 2-4 rows
    1024 / rows."""
    if M <= 4:
        block_m = next_pow2(M)
        size = N * K
        block_n = 2 if size <= GEMV_SMALL else 4 if size <= GEMV_MEDIUM else 8
        pow2_k = max(16, next_pow2(K))
        step = (pow2_k if K <= GEMV_WHOLE_ROW_K else GEMV_BLOCK_K) if M == 1 else 1024 // block_m
        block_k = min(step, pow2_k)
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": GEMV_WARPS,
                "num_stages": GEMV_STAGES}  # fmt: skip
    return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}


def gemv(
    x: torch.Tensor,  # [M, K], unit stride along K
    weight: torch.Tensor,  # [N, K], unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,  # [M, N] x.dtype, unit stride along N: written and returned
) -> torch.Tensor:  # [M, N], x.dtype
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, weight.shape)
    assert 1 <= M <= GEMV_MAX_M, M
    cfg = dict(config or gemv_config(M, N, K))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (M, N) and y.dtype == x.dtype and y.stride(1) == 1, (y.shape, y.dtype)
    _launch(x, weight, bias, y, cfg)
    return y


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, cfg: dict[str, int], **norm: object
) -> None:
    # _gemv_kernel on cfg's tiles, a program per BLOCK_N rows of the weight; norm: the NORM form's arguments
    M, K = x.shape
    N = weight.shape[0]
    _gemv_kernel[(cdiv(N, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % cfg["BLOCK_K"] == 0, DOT=cfg["BLOCK_M"] > 4,
        IEEE=x.dtype == torch.float32 or _INTERPRET, **cfg, **pdl_launch(x.device), **norm,
    )  # fmt: skip


def gemv_rmsnorm(
    x: torch.Tensor,  # [1, K]: the new stream (a layer's output), unit stride
    residual: torch.Tensor,  # [1, K]
    norm_weight: torch.Tensor,  # [K], x.dtype
    eps: float,
    weight: torch.Tensor,  # [N, K], unit stride along K
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [1, N], x + residual [1, K])
    """One row's RMSNorm with its residual add (kernels/triton_norm.py's rms_norm) and the product after it in one
    launch: every program norms the row itself (4-8 KB of it from L2) under its first weight loads, so the norm's own
    launch and its output's round trip leave the critical path. K up to GEMV_WHOLE_ROW_K (one step of K)."""
    k, n = x.shape[1], weight.shape[0]
    assert can_fold_norm(x, residual, norm_weight, weight), (x.shape, residual.shape, norm_weight.shape, weight.shape)
    cfg = gemv_config(1, n, k)
    rows = next_pow2(cdiv(FOLD_MIN_WEIGHT_BYTES, k * weight.element_size()))
    cfg["BLOCK_N"] = FOLD_BLOCK_N or min(FOLD_MAX_BLOCK_N, max(cfg["BLOCK_N"], rows))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(x)
    _launch(x, weight, bias, y, cfg, NORM=True, res_ptr=residual, nw_ptr=norm_weight, new_res_ptr=new_res,
            eps=float(eps))  # fmt: skip
    return y, new_res


def can_fold_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_rmsnorm takes this call: one contiguous row of K <= GEMV_WHOLE_ROW_K, all in one dtype."""
    k = x.shape[-1]
    return (
        x.dim() == 2 and x.shape[0] == 1 and residual.shape == x.shape and norm_weight.shape == (k,)
        and weight.dim() == 2 and weight.shape[1] == k and k <= GEMV_WHOLE_ROW_K
        and x.dtype == residual.dtype == norm_weight.dtype == weight.dtype
        and x.is_contiguous() and residual.is_contiguous() and norm_weight.is_contiguous() and weight.stride(1) == 1
    )  # fmt: skip


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch reference: float32 accumulation, rounded to x.dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
