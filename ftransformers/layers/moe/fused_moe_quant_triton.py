"""Quantized MoE backend "triton": the fused Triton kernels for stacked quantized experts, by format:
4-bit weight-only (int4 / mxfp4 / nvfp4) -> `fused_moe_w4`, FP8 block / INT8 with quantized
activations -> `fused_moe_w8`. Imported on first use, so the CPU engine needs no triton."""

from __future__ import annotations

import torch

from ftransformers.kernels.quant_formats import FOUR_BIT_FORMATS, QuantizedWeight
from ftransformers.layers.moe.experts import register_quant_moe_backend


@register_quant_moe_backend("triton")
def quant_moe_forward_triton(
    hidden: torch.Tensor,  # [T, D]
    w13: QuantizedWeight,  # [E, 2I, D]
    w2: QuantizedWeight,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, D]
    if w13.fmt != w2.fmt:
        raise TypeError(f"triton MoE wants one weight format; w13 {w13.fmt}, w2 {w2.fmt}")
    if w13.fmt in FOUR_BIT_FORMATS:
        from ftransformers.kernels.triton_fused_moe_w4 import fused_moe_w4

        return fused_moe_w4(hidden, w13, w2, topk_weights, topk_ids)
    from ftransformers.kernels.triton_fused_moe_w8 import fused_moe_w8

    return fused_moe_w8(hidden, w13, w2, topk_weights, topk_ids)
