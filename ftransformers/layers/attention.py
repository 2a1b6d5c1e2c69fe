"""Attention layer: reshapes projections to heads and hands them to the batch's backend."""

from __future__ import annotations

import torch
from torch import nn

from ftransformers.attention.forward_batch import get_forward_batch
from ftransformers.layers.rotary import RotaryEmbedding

QKNorm = tuple[torch.Tensor, torch.Tensor, float, float]  # (q weight [D], k weight [D], eps_q, eps_k)


def fusable_rope(rope: nn.Module, head_dim: int) -> bool:
    """A RotaryEmbedding whose function is exactly neox rotation by its [P, head_dim] cos|sin cache."""
    cls = type(rope)
    return (
        isinstance(rope, RotaryEmbedding)
        and rope.is_neox_style
        and rope.rotary_dim == head_dim
        and cls.forward is RotaryEmbedding.forward
        and cls._rotate is RotaryEmbedding._rotate
        and cls._apply_rotary is RotaryEmbedding._apply_rotary
    )


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

    def forward_with_rope(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, H*D], un-roped
        k: torch.Tensor,  # [T, H_kv*D], un-roped
        v: torch.Tensor,  # [T, H_kv*D_v]
        rope: nn.Module,
        qk_norm: QKNorm | None = None,
        early_trigger: bool = False,  # the caller's next kernel reads ahead of its PDL wait (kernels/pdl.py)
    ) -> torch.Tensor | None:  # [T, H*D_v], or None where the caller must norm, rope and call forward
        """Per-head q/k norm, rotary, K/V store and attention with the first three in one kernel, when
        the batch's backend offers it (triton, CUDA) and the rope is plain neox over its cache."""
        if not q.is_cuda or not fusable_rope(rope, self.head_dim):
            return None
        batch = get_forward_batch()
        fused = getattr(batch.attn_backend, "forward_mha_fused_rope", None)
        if fused is None:
            return None
        if qk_norm is not None and (qk_norm[0].dtype != q.dtype or qk_norm[1].dtype != k.dtype):
            return None
        T = q.shape[0]
        norm_args = () if qk_norm is None else qk_norm
        out = fused(
            q.reshape(T, self.num_heads, self.head_dim),
            k.reshape(T, self.num_kv_heads, self.head_dim),
            v.reshape(T, self.num_kv_heads, self.v_head_dim),
            positions,
            rope.cos_sin_cache,
            self.layer_id,
            self.scaling,
            batch,
            *norm_args,
            early_trigger=early_trigger,
        )
        return out.reshape(T, self.num_heads * self.v_head_dim)
