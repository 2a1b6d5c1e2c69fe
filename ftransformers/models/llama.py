"""Llama (and Llama-shaped checkpoints such as SmolLM2) on the paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ftransformers.cache.kv_pool import MHAKVSpec
from ftransformers.layers.activation import SiluAndMul
from ftransformers.layers.attention import Attention, QKNorm
from ftransformers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ftransformers.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    norm_then_linear,
)
from ftransformers.layers.norm import RMSNorm
from ftransformers.layers.rotary import get_rope, rope_parameters_of, share_rotary_caches
from ftransformers.layers.weight_utils import LoadTracker, load_with_mapping
from ftransformers.models.registry import register_model

# A decoder layer's input RMSNorm (with its residual add) runs inside the qkv projection's one-row GEMV
# (layers.linear.norm_then_linear) where that takes the call: batch-1 decode, unquantized qkv. False: its own launch
FOLD_INPUT_NORM = True


def head_dim_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, 2I] -> [T, I] -> [T, D]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, qkv_bias: bool | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False)) if qkv_bias is None else qkv_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias)
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim, config.hidden_size, bias=bool(getattr(config, "attention_bias", False))
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = get_rope(
            self.head_dim,
            self.head_dim,
            int(config.max_position_embeddings),
            rope_parameters_of(config),
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, layer_id)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def qk_norm_params(self) -> QKNorm | None:
        """What `qk_norm` does, for the fused kernel: per-head RMSNorm weights and eps, or None."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D] -> q [T, H*Dh], k/v [T, H_kv*Dh]
        return self.forward_projected(positions, self.qkv_proj(hidden))

    def forward_projected(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        # qkv: [T, (H + 2 H_kv) Dh], qkv_proj's output
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        early = self.o_proj.reads_ahead_of_wait(qkv.shape[0])  # then the attention lets o start early
        out = self.attn.forward_with_rope(positions, q, k, v, self.rotary_emb, self.qk_norm_params(), early)
        if out is None:
            q, k = self.qk_norm(q, k)
            q, k = self.rotary_emb(positions, q, k)
            out = self.attn(q, k, v)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: PretrainedConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual carries the un-normed stream; the first layer starts it from the embeddings.
        # the norm lets qkv start early where qkv reads ahead of its wait (MLA attention, in subclasses, has no qkv_proj)
        qkv = getattr(self.self_attn, "qkv_proj", None)
        folded = None
        if residual is not None and qkv is not None and FOLD_INPUT_NORM:  # one row: the norm inside the qkv GEMV
            folded = norm_then_linear(self.input_layernorm, qkv, hidden, residual)
        if folded is not None:
            projected, residual = folded
            hidden = self.self_attn.forward_projected(positions, projected)
        else:
            early = qkv is not None and qkv.reads_ahead_of_wait(hidden.shape[0])
            if residual is None:
                residual, hidden = hidden, self.input_layernorm(hidden, early_trigger=early)
            else:
                hidden, residual = self.input_layernorm(hidden, residual, early_trigger=early)
            hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers)]
        )
        share_rotary_caches(getattr(layer, "self_attn", None) for layer in self.layers)  # one cos|sin cache
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, D]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel
    # (fused param part, checkpoint name part, shard id)
    stacked_params_mapping: list[tuple[str, str, Any]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> final-normed hidden states [T, D]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)  # [S, D] -> float32 [S, V], or into out

    def logits_buffer(self, rows: int) -> torch.Tensor:
        return self.lm_head.logits_buffer(rows)

    @classmethod
    def kv_spec(cls, config: PretrainedConfig) -> MHAKVSpec:
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return MHAKVSpec(config.num_hidden_layers, num_kv_heads, head_dim, head_dim)

    def skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        # Tied checkpoints sometimes still carry the (identical) head.
        return name == "lm_head.weight" and bool(getattr(self.config, "tie_word_embeddings", False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tracker = LoadTracker(self)
        kept = ((n, w) for n, w in weights if not self.skip_weight(n))
        load_with_mapping(tracker, kept, self.stacked_params_mapping)
        tracker.check_complete()
