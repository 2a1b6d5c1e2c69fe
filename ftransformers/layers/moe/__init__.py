"""Mixture-of-experts: routing (top-k selection) and the expert computation behind a backend seam."""

from ftransformers.layers.moe.experts import MOE_BACKENDS, FusedMoE, register_moe_backend
from ftransformers.layers.moe.topk import router_softmax_topk, select_experts_softmax

__all__ = ["MOE_BACKENDS", "FusedMoE", "register_moe_backend", "router_softmax_topk", "select_experts_softmax"]
