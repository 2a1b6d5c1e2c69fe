"""Attention layer: reshapes projections to heads and hands them to the batch's backend."""

from __future__ import annotations

import torch
from torch import nn

from ftransformers.attention.forward_batch import get_forward_batch


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scaling: float,
        layer_id: int,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.v_head_dim = v_head_dim or head_dim
        self.scaling, self.layer_id = scaling, layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H*D]; k: [T, H_kv*D]; v: [T, H_kv*D_v] -> [T, H*D_v]
        T = q.shape[0]
        batch = get_forward_batch()
        out = batch.attn_backend.forward_mha(
            q.reshape(T, self.num_heads, self.head_dim),
            k.reshape(T, self.num_kv_heads, self.head_dim),
            v.reshape(T, self.num_kv_heads, self.v_head_dim),
            self.layer_id,
            self.scaling,
            batch,
        )
        return out.reshape(T, self.num_heads * self.v_head_dim)
