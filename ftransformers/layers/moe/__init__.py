"""Mixture-of-experts: routing (top-k selection) and the expert computation behind a backend seam."""

from ftransformers.layers.moe.experts import MOE_BACKENDS, FusedMoE, register_moe_backend
from ftransformers.layers.moe.topk import select_experts_softmax

__all__ = ["FusedMoE", "MOE_BACKENDS", "register_moe_backend", "select_experts_softmax"]
