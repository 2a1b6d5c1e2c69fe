"""Attention backend interface and registry (`--attention-backend`).

A backend stores the new tokens' K/V (or MLA latent) into the pool at `out_cache_loc` and attends
every new query token to its sequence's cached tokens (positions 0..its own, causal), reading the
KV slots through `req_to_token`. Backends are picked by name through `ATTENTION_BACKENDS`.

MLA has two forms. `forward_mla` is the absorbed form over the latent pool (decode, and extend
steps where it is cheaper). The non-absorbed ("MHA") form for extend steps is split in two so the
model keeps its own weights: `mla_extend_rows` stores the new latent rows and returns every
sequence's cached prefix rows followed by the new rows; the model expands them through `kv_b_proj`
and `forward_mla_mha` runs ordinary causal attention (key = k_nope | shared k_pe) over that dense,
ragged K/V.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ftransformers.attention.forward_batch import ForwardBatch
from ftransformers.cache.kv_pool import MLAKVPool


class AttentionBackend(ABC):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Called by the runner once per forward, before the model runs: derive whatever index
        tensors the kernels need (e.g. cumulative offsets) so layers do not recompute them."""

    def decode_context_bounds(self, batch_size: int) -> tuple[int, ...]:
        """Longest-sequence lengths (ascending) at which this backend's decode launch at `batch_size` rows changes;
        the CUDA graph runner captures a graph per range between them and replays the one holding the batch's
        longest sequence. Asked after a warm-up decode of that size. Empty: one launch at every context."""
        return ()

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
        latent_stored: bool = False,  # the caller already stored `latent` at out_cache_loc (rope_latent's pool)
    ) -> torch.Tensor:  # [T, H, kv_lora_rank]: attention output in latent space (caller applies W_UV)
        ...

    def mla_extend_rows(
        self,
        latent: torch.Tensor,  # [T, L + R], new tokens (normed c_kv, roped k_pe)
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [P + T, L + R], P = sum(prefix_lens): every prefix (batch order), then the new rows
        """Stores the new latent rows at `out_cache_loc` and gathers each sequence's cached prefix.
        The new rows are returned as stored (in the pool's dtype), so both MLA forms see the same keys."""
        pool = batch.kv_pool
        if not isinstance(pool, MLAKVPool):
            raise TypeError(f"mla_extend_rows needs an MLAKVPool, got {type(pool).__name__}")
        buf = pool.get_latent(layer_id)  # [N+1, L+R]
        new = latent.to(buf.dtype)
        pool.set_latent(layer_id, batch.out_cache_loc, new)
        prefix_locs = self._prefix_locs(batch)  # [P]
        if prefix_locs.numel() == 0:
            return new
        return torch.cat([buf.index_select(0, prefix_locs), new])

    def _prefix_locs(self, batch: ForwardBatch) -> torch.Tensor:  # [P] int64, cached once per forward
        cached = getattr(self, "_prefix_locs_cache", None)
        if cached is not None and cached[0] is batch:
            return cached[1]
        parts = [batch.req_to_token[batch.req_pool_indices[i], :p] for i, p in enumerate(batch.prefix_lens_cpu) if p]
        locs = torch.cat(parts) if parts else batch.out_cache_loc.new_empty(0)
        self._prefix_locs_cache = (batch, locs)
        return locs

    @abstractmethod
    def forward_mla_mha(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_rope: torch.Tensor,  # [T, H, R], roped
        kv: torch.Tensor,  # [P + T, H, N + V]: kv_b_proj of mla_extend_rows' c_kv (k_nope | v per head)
        k_rope: torch.Tensor,  # [P + T, R]: k_pe of the same rows, shared by every head
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, V]
        """EXTEND only: sequence b's keys are its prefix rows (at sum(prefix_lens[:b]) in the first P
        rows) then its new rows (at P + extend_start[b]); its query i sees prefix + new rows 0..i."""
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


def create_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name]()
