"""RMSNorm with the residual add fused (one pass: read x and residual, write out and x + residual).

Same function as layers/norm.py: statistics in float32, the normalised row cast back to the input
dtype before the weight multiplies, the output in promote(weight, x) dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, next_pow2
from ftransformers.kernels.pdl import early_trigger_on, l2_prefetch, pdl_enter, pdl_launch, pdl_trigger, prefetch_lines

# The norm triggers the next kernel's launch before its PDL wait (pdl.py, "Early trigger"; the kernels after a
# norm, a projection, the fused router or the LM head, read only constants ahead of their waits): 0 never, 1 on
# the calls whose next kernel reads ahead of its wait (rms_norm's early_trigger: the decoder layer's input norm
# before a 4-bit qkv GEMV), 2 always.
EARLY_TRIGGER = 1
# Warps a row's program (a module constant for benchmarks' `set=`): 0 = one per 512 elements, 1-16. H200, Qwen3-30B-A3B
# bf16 B=1 ctx 4096 (benchmarks/results/ab_warps_30b_b1_ctx4096_s55_h200.log): the rule's 4 at 2.497 ms, 2 level
# (2.497), 1 slower (2.517; the norms' critical path 58 -> 83 us a step)
NORM_WARPS = 0


@triton.jit
def add_residual(x, r):
    # x + r in float32, rounded to x's dtype: the new residual stream
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def rms_normed(x, w, eps, D):
    # a row x [BLOCK_D] (zeros past D) -> weight * normed row, float32: the statistics in float32, the normed row
    # rounded to x's dtype before the weight multiplies (layers/norm.py, Hugging Face's Llama / Qwen RMSNorm)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps)
    return (x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)


@cached_launch
@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, D, eps,
    stride_x, stride_res, stride_out, stride_new_res,
    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr, PF_STRIDE: tl.constexpr, PF_LINES: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, EARLY_TRIGGER: tl.constexpr = False,
):
    pdl_trigger(EARLY_TRIGGER)
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
        x = add_residual(x, r)
        tl.store(new_res_ptr + row * stride_new_res + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, rms_normed(x, w, eps, D).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D]
    early_trigger: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with a residual (norm(x + residual), x + residual). early_trigger: the caller's next kernel
    may start before this one's predecessor completes (EARLY_TRIGGER above)."""
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
    block_d = next_pow2(d)
    if rows > 0:
        _rmsnorm_kernel[(rows,)](
            x2, res2, weight, out, new_res, d, eps,
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
            HAS_RES=residual is not None, BLOCK_D=block_d, num_warps=NORM_WARPS or min(16, max(1, block_d // 512)),
            **prefetch_lines(d, weight.element_size()),
            **pdl_launch(x2.device, prefetch="norm", early=early_trigger_on(EARLY_TRIGGER, early_trigger)),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), new_res.view(shape)
