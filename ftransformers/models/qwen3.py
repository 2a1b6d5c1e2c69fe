"""Qwen3 (dense): Llama with per-head RMSNorm on q and k before rope."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ftransformers.layers.attention import QKNorm
from ftransformers.layers.norm import RMSNorm
from ftransformers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from ftransformers.models.registry import register_model


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H*Dh] -> per-head norm over Dh -> [T, H*Dh]; same for k with H_kv heads
        T = q.shape[0]
        q = self.q_norm(q.reshape(T, -1, self.head_dim)).reshape(T, -1)
        k = self.k_norm(k.reshape(T, -1, self.head_dim)).reshape(T, -1)
        return q, k

    def qk_norm_params(self) -> QKNorm:
        qn, kn = self.q_norm, self.k_norm
        return qn.weight, kn.weight, qn.variance_epsilon, kn.variance_epsilon


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
