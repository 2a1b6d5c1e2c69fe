"""SiLU-and-multiply: x [..., 2I] laid out [gate | up] -> silu(gate) * up [..., I].

Rounds like the eager op (silu rounded to the dtype, then the product rounded)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch


@cached_launch
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2I] -> [..., I]
    shape, two_i = x.shape, x.shape[-1]
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(max(inter, 1)))
    if x2.shape[0] > 0 and inter > 0:
        _silu_and_mul_kernel[(x2.shape[0], cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4,
            **pdl_launch(x2.device),
        )
    return out.view(*shape[:-1], inter)
