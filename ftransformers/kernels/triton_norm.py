"""RMSNorm with the residual add fused (one pass: read x and residual, write out and x + residual).

Same function as layers/norm.py: statistics in float32, the normalised row cast back to the input
dtype before the weight multiplies, the output in promote(weight, x) dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.pdl import l2_prefetch, pdl_enter, pdl_launch, prefetch_lines


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, D, eps,
    stride_x, stride_res, stride_out, stride_new_res,
    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr, PF_STRIDE: tl.constexpr, PF_LINES: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    if PREFETCH:  # noqa: SIM102 (a compile-time block, as tests/test_pdl.py reads it)
        # the weight, a constant, to L2 ahead of the wait (x and the residual come from L2 anyway)
        if tl.program_id(0) == 0:  # by one program: at B=32 every program hinting it cost ~40 us a step
            l2_prefetch(w_ptr + tl.minimum(tl.arange(0, PF_LINES) * PF_STRIDE, D - 1), PREFETCH)
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps)
    y = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


# Decoder layers let the kernel that reads a norm's output compute it (layers/norm.py fuses_norm); off, every
# norm runs as `rms_norm` (benchmarks/ab_decode.py `set=triton_norm.FUSE_INTO_CONSUMERS=0`). By consumer:
# the one-row linears' GEMVs (layers/linear.py normed_linear) and the MoE routers (layers/moe/topk.py router_norm)
FUSE_INTO_CONSUMERS = False  # measured slower (session 23): see docs/performance.md
FUSE_INTO_LINEAR = True
FUSE_INTO_ROUTER = True


@dataclass(frozen=True)
class FusedNorm:
    """RMSNorm(x + residual) * weight computed inside the kernel that consumes it (decode: a GEMV, the fused
    router), instead of by a launch of its own. The consumer reads x, `residual` and `weight`, and one of its
    programs writes x + residual to `stream`, the residual of the next layer (x itself when residual is None:
    the first layer, whose stream is the embeddings). Make it with `fused_norm`."""

    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None  # [M, K], x's dtype, unit stride along K
    stream: torch.Tensor  # [M, K]: x + residual, written by the consumer (or x)
    normed: torch.Tensor | None = None  # [M, K]: the norm's output, for consumers that pass it on (the router)


def fused_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, normed: bool = False
) -> FusedNorm:
    """x [M, K] with unit stride along K; weight [K]; residual like x or None; `normed`: a buffer for the output."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"fused_norm: x {tuple(x.shape)} {x.dtype} (unit stride along K) and weight "
                         f"{tuple(weight.shape)} {weight.dtype} (x's dtype)")  # fmt: skip
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"fused_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype} with unit stride along K")  # fmt: skip
    stream = torch.empty_like(x) if residual is not None else x
    return FusedNorm(weight, float(eps), residual, stream, torch.empty_like(x) if normed else None)


def fused_norm_ref(x: torch.Tensor, norm: FusedNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm's output, the new stream) in plain PyTorch, as layers/norm.py computes them."""
    r = x if norm.residual is None else (x.float() + norm.residual.float()).to(x.dtype)
    r32 = r.float()
    y = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
    return norm.weight * y, r


@triton.jit
def residual_tile(x, r_ptrs, nr_ptrs, mask, STORE, HAS_RES: tl.constexpr):
    """A tile of RMSNorm's stream inside a consumer kernel, as float32: x, or with HAS_RES x + residual rounded
    to x's dtype as `_rmsnorm_kernel` does, stored at nr_ptrs where STORE (one program of the consumer)."""
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        if STORE:
            tl.store(nr_ptrs, x, mask=mask)
    return x.to(tl.float32)


def rms_norm(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with a residual (norm(x + residual), x + residual)."""
    shape, d = x.shape, x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, d, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        if residual.dtype != x.dtype:
            raise TypeError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
        res2 = residual.reshape(-1, d)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        new_res = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    else:
        res2 = new_res = x2
    block_d = triton.next_power_of_2(d)
    if rows > 0:
        _rmsnorm_kernel[(rows,)](
            x2, res2, weight, out, new_res, d, eps,
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
            HAS_RES=residual is not None, BLOCK_D=block_d, num_warps=min(16, max(1, block_d // 512)),
            **prefetch_lines(d, weight.element_size()), **pdl_launch(x2.device, prefetch="norm"),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), new_res.view(shape)
