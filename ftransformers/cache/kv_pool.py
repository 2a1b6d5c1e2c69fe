"""Paged, token-granular KV pools: one slot per token per layer, slot 0 reserved as a padding sink.

Two layouts behind one interface:
- MHA/GQA: per layer a K buffer [N+1, H_kv, D_k] and a V buffer [N+1, H_kv, D_v].
- MLA: per layer one latent buffer [N+1, kv_lora_rank + qk_rope_head_dim] (the compressed KV and
  the shared rope key; K and V are both derived from it).
The pool only stores; which slot belongs to which request is the scheduler's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MHAKVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * item


@dataclass(frozen=True)
class MLAKVSpec:
    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * item


KVSpec = MHAKVSpec | MLAKVSpec


class KVPool(ABC):
    size: int  # usable slots; valid slot indices are 1..size

    @abstractmethod
    def clear(self) -> None: ...


class MHAKVPool(KVPool):
    def __init__(self, spec: MHAKVSpec, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.spec, self.size, self.dtype = spec, size, dtype
        self.k_buffers = [
            torch.zeros(size + 1, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        self.v_buffers = [
            torch.zeros(size + 1, spec.num_kv_heads, spec.v_head_dim, dtype=dtype, device=device)
            for _ in range(spec.num_layers)
        ]

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T]; k: [T, H_kv, D_k]; v: [T, H_kv, D_v]
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def clear(self) -> None:
        for buf in (*self.k_buffers, *self.v_buffers):
            buf.zero_()


class MLAKVPool(KVPool):
    def __init__(self, spec: MLAKVSpec, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.spec, self.size, self.dtype = spec, size, dtype
        width = spec.kv_lora_rank + spec.qk_rope_head_dim
        self.latent_buffers = [
            torch.zeros(size + 1, width, dtype=dtype, device=device) for _ in range(spec.num_layers)
        ]

    def get_latent(self, layer_id: int) -> torch.Tensor:
        return self.latent_buffers[layer_id]  # [N+1, kv_lora_rank + qk_rope_head_dim]

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        # loc: [T]; latent: [T, kv_lora_rank + qk_rope_head_dim] (normalized c_kv, then roped k_pe)
        self.latent_buffers[layer_id][loc] = latent.to(self.dtype)

    def clear(self) -> None:
        for buf in self.latent_buffers:
            buf.zero_()


def make_kv_pool(spec: KVSpec, size: int, dtype: torch.dtype, device: torch.device | str) -> KVPool:
    if isinstance(spec, MLAKVSpec):
        return MLAKVPool(spec, size, dtype, device)
    return MHAKVPool(spec, size, dtype, device)
