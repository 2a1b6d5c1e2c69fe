"""MoE backend "triton": the fused Triton kernels (alignment, gate-up with SiLU*up, down with the
routing weight, top-k sum). Shapes depend only on (T, K, E), with no host sync: CUDA-graph safe."""

from __future__ import annotations

import torch

from ftransformers.kernels.triton_fused_moe import fused_moe
from ftransformers.layers.moe.experts import register_moe_backend


@register_moe_backend("triton")
def moe_forward_triton(
    hidden: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, D]
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(f"triton MoE wants one dtype; hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    return fused_moe(hidden, w13, w2, topk_weights, topk_ids)
