"""Qwen3-MoE: Qwen3 attention; sparse (softmax top-k) expert MLPs on every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers`, dense MLPs elsewhere."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from ftransformers.layers.linear import ReplicatedLinear
from ftransformers.layers.moe import FusedMoE, router_softmax_topk
from ftransformers.models.llama import LlamaMLP
from ftransformers.models.moe_weights import load_moe_model_weights
from ftransformers.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from ftransformers.models.registry import register_model


def num_experts_of(config: PretrainedConfig) -> int:
    # transformers spells it `num_experts` (4.x and 5.x attribute) or `num_local_experts` (5.x json).
    value = getattr(config, "num_experts", None)
    return int(value if value is not None else getattr(config, "num_local_experts", 0) or 0)


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    return layer_id not in mlp_only and num_experts_of(config) > 0 and (layer_id + 1) % step == 0


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        num_experts = num_experts_of(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False)
        self.gate.skip_quant = True  # read as a plain weight by the fused router
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D] -> [T, D]. The gate is an unbiased linear [E, D]; at decode sizes its GEMV and
        # the softmax top-k run as one kernel.
        topk_weights, topk_ids = router_softmax_topk(hidden, self.gate.weight, self.top_k, self.renormalize)
        return self.experts(hidden, topk_weights, topk_ids)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Qwen3MoeModel(Qwen3Model):
    decoder_layer_cls = Qwen3MoeDecoderLayer


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_moe_model_weights(self, weights, self.stacked_params_mapping)
