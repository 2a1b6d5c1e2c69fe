"""Qwen3-MoE: Qwen3 attention; sparse (softmax top-k) expert MLPs on every `decoder_sparse_step`-th
layer not listed in `mlp_only_layers`, dense MLPs elsewhere."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from ftransformers.layers.linear import ReplicatedLinear
from ftransformers.layers.moe import FusedMoE, select_experts_softmax
from ftransformers.layers.weight_utils import LoadTracker, load_with_mapping
from ftransformers.models.llama import LlamaMLP
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
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D]; router_logits: [T, E]
        router_logits = self.gate(hidden)
        topk_weights, topk_ids = select_experts_softmax(router_logits, self.top_k, self.renormalize)
        return self.experts(hidden, topk_weights, topk_ids)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Qwen3MoeModel(Qwen3Model):
    decoder_layer_cls = Qwen3MoeDecoderLayer


def _route_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, str, torch.Tensor, int | None, str | None]]:
    """Yield (checkpoint name, param name, tensor, expert id, shard id); expert id is None for
    non-expert tensors. `...experts.{e}.{gate,up,down}_proj.weight` map onto the stacked
    parameters; fused 3-D `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I] (the
    transformers>=5 in-memory layout) are split per expert."""
    shards = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for name, w in weights:
        if ".experts." not in name:
            yield name, name, w, None, None
            continue
        prefix, rest = name.split(".experts.", 1)
        parts = rest.split(".")
        w13, w2 = f"{prefix}.experts.w13_weight", f"{prefix}.experts.w2_weight"
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in shards and parts[2] == "weight":
            yield name, (w2 if parts[1] == "down_proj" else w13), w, int(parts[0]), shards[parts[1]]
        elif rest == "gate_up_proj" and w.dim() == 3:
            half = w.shape[1] // 2
            for e in range(w.shape[0]):
                yield name, w13, w[e, :half], e, "w1"
                yield name, w13, w[e, half:], e, "w3"
        elif rest == "down_proj" and w.dim() == 3:
            for e in range(w.shape[0]):
                yield name, w2, w[e], e, "w2"
        else:
            yield name, name, w, None, None


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tracker = LoadTracker(self)

        def non_expert() -> Iterator[tuple[str, torch.Tensor]]:
            kept = ((n, t) for n, t in weights if not self.skip_weight(n))
            for name, param_name, w, expert_id, shard_id in _route_expert_weights(kept):
                if expert_id is None:
                    yield name, w
                else:
                    tracker.load(param_name, name, w, expert_id, shard_id)

        load_with_mapping(tracker, non_expert(), self.stacked_params_mapping)
        tracker.check_complete()
