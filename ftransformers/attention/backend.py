"""Attention backend interface and registry (`--attention-backend`).

A backend stores the new tokens' K/V (or MLA latent) into the pool at `out_cache_loc` and attends
every new query token to its sequence's cached tokens (positions 0..its own, causal), reading the
KV slots through `req_to_token`. Backends are picked by name through `ATTENTION_BACKENDS`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ftransformers.attention.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Called by the runner once per forward, before the model runs: derive whatever index
        tensors the kernels need (e.g. cumulative offsets) so layers do not recompute them."""
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
# Modules that register a backend when imported; imported on first use so that, e.g., the CPU
# engine never needs triton.
_BACKEND_MODULES = {
    "torch_native": "ftransformers.attention.torch_native",
    "triton": "ftransformers.attention.triton_backend",
}


def register_attention_backend(name: str) -> Callable[[Callable[[], AttentionBackend]], Callable[[], AttentionBackend]]:
    def wrap(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        ATTENTION_BACKENDS[name] = factory
        return factory

    return wrap


def resolve_attention_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch_native"
    return name


def create_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name]()
