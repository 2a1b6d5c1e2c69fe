"""Softmax top-k routing (Mixtral / Qwen-MoE style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_softmax_topk(
    hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router: logits = hidden @ gate_weight^T in hidden's dtype (an unbiased nn.Linear), then
    select_experts_softmax. hidden: [T, D]; gate_weight: [E, D] -> ([T, K] float32, [T, K] int64).
    At decode sizes on a GPU both run as one kernel (kernels.triton_router.fused_router_topk)."""
    if hidden.is_cuda:
        from ftransformers.kernels.triton_router import can_fuse_router, fused_router_topk

        if can_fuse_router(hidden, gate_weight):
            return fused_router_topk(
                hidden, gate_weight, top_k, softmax=True, renormalize=renormalize, round_logits=True
            )
    return select_experts_softmax(F.linear(hidden, gate_weight), top_k, renormalize)


def select_experts_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # router_logits: [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64)
    if router_logits.is_cuda and router_logits.shape[-1] <= 1024:
        # one launch instead of ~6 (kernels.triton_router); imported here so CPU needs no triton
        from ftransformers.kernels.triton_router import softmax_topk

        return softmax_topk(router_logits, top_k, renormalize)
    return select_experts_softmax_torch(router_logits, top_k, renormalize)


def select_experts_softmax_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (and CPU) path of select_experts_softmax."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
