"""Stacked expert weights and the expert computation, chosen through a small backend registry.

`FusedMoE` owns the weights of all experts in two stacked parameters (vLLM layout):
  w13_weight [E, 2I, D]  rows [gate (w1) | up (w3)] of every expert
  w2_weight  [E, D, I]   down projection
A backend is a function `(hidden, w13, w2, topk_weights, topk_ids) -> out`; fused GPU kernels,
expert-parallel or CPU-hybrid backends arrive as new entries, not branches here.

Quantized experts: a quant method (quant/) replaces the two parameters by the checkpoint's per-expert
tensors stacked the same way (`w13_qweight`, `w2_scales`, ...: [E, ...] with the gate rows before the
up rows, placed by `linear.shard_view`), and after loading sets `w13_qw` / `w2_qw`, the kernel-layout
`QuantizedWeight`s; the forward then goes to the quantized backend of the same name
(`QUANT_MOE_BACKENDS`: torch_native -> `quant_moe_ref`, triton -> fused_moe_w4 / fused_moe_w8).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ftransformers.attention.forward_batch import get_forward_batch
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_moe_ref
from ftransformers.layers.activation import silu_and_mul
from ftransformers.layers.linear import Shard, copy_checked, shard_view
from ftransformers.layers.weight_utils import new_weight

MoEBackendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
QuantMoEBackendFn = Callable[[torch.Tensor, QuantizedWeight, QuantizedWeight, torch.Tensor, torch.Tensor], torch.Tensor]
MOE_BACKENDS: dict[str, MoEBackendFn] = {}
QUANT_MOE_BACKENDS: dict[str, QuantMoEBackendFn] = {"torch_native": quant_moe_ref}
# Modules that register a backend when imported, loaded on first use (the CPU engine needs no triton).
_BACKEND_MODULES = {"triton": "ftransformers.layers.moe.fused_moe_triton"}
_QUANT_BACKEND_MODULES = {"triton": "ftransformers.layers.moe.fused_moe_quant_triton"}


def get_moe_backend(name: str) -> MoEBackendFn:
    if name not in MOE_BACKENDS and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; valid: {', '.join(sorted({*MOE_BACKENDS, *_BACKEND_MODULES}))}")
    return MOE_BACKENDS[name]


def get_quant_moe_backend(name: str) -> QuantMoEBackendFn:
    if name not in QUANT_MOE_BACKENDS and name in _QUANT_BACKEND_MODULES:
        importlib.import_module(_QUANT_BACKEND_MODULES[name])
    if name not in QUANT_MOE_BACKENDS:
        valid = ", ".join(sorted({*QUANT_MOE_BACKENDS, *_QUANT_BACKEND_MODULES}))
        raise ValueError(f"MoE backend {name!r} has no quantized-experts path; valid: {valid}")
    return QUANT_MOE_BACKENDS[name]


def register_quant_moe_backend(name: str) -> Callable[[QuantMoEBackendFn], QuantMoEBackendFn]:
    def wrap(fn: QuantMoEBackendFn) -> QuantMoEBackendFn:
        QUANT_MOE_BACKENDS[name] = fn
        return fn

    return wrap


def register_moe_backend(name: str) -> Callable[[MoEBackendFn], MoEBackendFn]:
    def wrap(fn: MoEBackendFn) -> MoEBackendFn:
        MOE_BACKENDS[name] = fn
        return fn

    return wrap


@register_moe_backend("torch_native")
def moe_forward_native(
    hidden: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, D]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    # Only the experts some token routed to; one host sync for the list is the price of the loop.
    for expert in torch.unique(flat_ids).tolist():
        token_idx, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden.index_select(0, token_idx)  # [n, D]
        y = silu_and_mul(x @ w13[expert].t()) @ w2[expert].t()  # [n, D]
        weight = topk_weights[token_idx, slot].unsqueeze(-1)  # [n, 1]
        out.index_add_(0, token_idx, y.float() * weight)
    return out.to(hidden.dtype)


class FusedMoE(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str | None = None
    ) -> None:
        """backend None: the forward context's `moe_backend` (the runner's --moe-backend) decides."""
        super().__init__()
        if backend is not None:
            get_moe_backend(backend)  # fail at construction on a bad name
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.backend = backend
        self.w13_weight = nn.Parameter(new_weight(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(new_weight(num_experts, hidden_size, intermediate_size))
        experts = range(num_experts)
        self.w13_weight.weight_shards = {(e, s) for e in experts for s in ("w1", "w3")}  # type: ignore[attr-defined]
        self.w2_weight.weight_shards = {(e, "w2") for e in experts}  # type: ignore[attr-defined]
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # Set by a quant method (quant/): it owns the expert tensors; after loading, the kernel layouts.
        self.quant_method: Any = None
        self.w13_qw: QuantizedWeight | None = None  # [E, 2I, D]
        self.w2_qw: QuantizedWeight | None = None  # [E, D, I]

    def expert_shards(self, which: str) -> list[Shard]:
        """Output-feature shards of one expert's slice of the w13 ([gate | up]) or w2 stack."""
        I = self.intermediate_size
        return [(0, I), (I, I)] if which == "w13" else [(0, self.hidden_size)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, shard_id: str) -> None:
        # loaded_weight: one expert's [I, D] (w1 gate / w3 up) or [D, I] (w2 down), HF layout (or the
        # matching tensor of a quantized layout).
        if not 0 <= expert_id < self.num_experts:
            raise KeyError(f"expert {expert_id} out of range (num_experts={self.num_experts})")
        if shard_id not in ("w1", "w3", "w2"):
            raise KeyError(f"unknown expert shard {shard_id!r}; valid: w1, w3, w2")
        shards = self.expert_shards("w2" if shard_id == "w2" else "w13")
        what = f"expert {expert_id} {shard_id}"
        dst = shard_view(param, param.data[expert_id], shards, int(shard_id == "w3"), what)
        copy_checked(param, dst, loaded_weight, what)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D]; topk_weights: [T, K]; topk_ids: [T, K] -> [T, D]
        name = self.backend if self.backend is not None else get_forward_batch().moe_backend
        if self.w13_qw is not None and self.w2_qw is not None:
            return get_quant_moe_backend(name)(hidden, self.w13_qw, self.w2_qw, topk_weights, topk_ids)
        return get_moe_backend(name)(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    @staticmethod
    def make_expert_params_mapping(
        gate: str = "gate_proj", down: str = "down_proj", up: str = "up_proj"
    ) -> list[tuple[str, str, str]]:
        """(param_suffix, checkpoint_name_part, shard_id) for `experts.{e}.gate_proj.` style names."""
        return [("w13_weight", f".{gate}.", "w1"), ("w13_weight", f".{up}.", "w3"), ("w2_weight", f".{down}.", "w2")]
