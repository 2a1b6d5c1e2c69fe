"""Attention backend interface and registry (`--attention-backend`).

A backend stores the new tokens' K/V (or MLA latent) into the pool at `out_cache_loc` and attends
every new query token to its sequence's cached tokens (positions 0..its own, causal), reading the
KV slots through `req_to_token`. Backends are picked by name through `ATTENTION_BACKENDS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ftransformers.attention.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def forward_mha(
        self,
        q: torch.Tensor,  # [T, H, D_k]
        k: torch.Tensor,  # [T, H_kv, D_k], new tokens only
        v: torch.Tensor,  # [T, H_kv, D_v]
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, D_v]
        ...

    @abstractmethod
    def forward_mla(
        self,
        q_nope: torch.Tensor,  # [T, H, kv_lora_rank], already absorbed through W_UK
        q_rope: torch.Tensor,  # [T, H, qk_rope_head_dim], roped
        latent: torch.Tensor,  # [T, kv_lora_rank + qk_rope_head_dim], new tokens (normed c_kv, roped k_pe)
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, kv_lora_rank]: attention output in latent space (caller applies W_UV)
        ...


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(name: str) -> Callable[[Callable[[], AttentionBackend]], Callable[[], AttentionBackend]]:
    def wrap(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        ATTENTION_BACKENDS[name] = factory
        return factory

    return wrap


def create_attention_backend(name: str) -> AttentionBackend:
    # Importing the module that defines a backend registers it.
    import ftransformers.attention.torch_native  # noqa: F401

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name]()
