"""What one forward pass computes, and the forward context that hands it to attention and MoE layers.

The runtime (L4) builds a `ForwardBatch` from a scheduler `StepBatch` and runs the model inside
`with forward_context(batch):`; layers read it with `get_forward_batch()`. It is the one sanctioned
global: everything else reaches a layer as a constructor or call argument.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ftransformers.attention.backend import AttentionBackend
    from ftransformers.cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # some sequence computes more than one new token (prefill chunks, maybe with decodes)
    DECODE = enum.auto()  # every sequence computes exactly one new token


@dataclass
class ForwardBatch:
    mode: ForwardMode
    # T = total new tokens over the batch, B = sequences; sequences appear in the same order everywhere.
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token's K/V is written to
    req_pool_indices: torch.Tensor  # [B] int64, row of req_to_token per sequence
    seq_lens: torch.Tensor  # [B] int64, tokens in the KV cache after this step (prefix + new)
    prefix_lens: torch.Tensor  # [B] int64, tokens already cached before this step
    extend_lens: torch.Tensor  # [B] int64, new tokens per sequence (1 for a decode)
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    logits_indices: torch.Tensor  # [S] int64, rows of the [T, D] hidden states to compute logits for
    req_to_token: torch.Tensor  # [R, L] int64, row r: KV slot of every position of request slot r
    kv_pool: KVPool
    attn_backend: AttentionBackend
    moe_backend: str = "torch_native"  # name in layers.moe's registry, resolved by the runner
    # DECODE: the longest-sequence length its attention launch is chosen for (AttentionBackend.decode_context_bounds).
    # None: the backend reads max(seq_lens_cpu); a CUDA graph, whose seq_lens_cpu are placeholders, sets the lower
    # end of the context range it is captured for
    decode_context: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


_current: ForwardBatch | None = None


@contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[ForwardBatch]:
    global _current
    previous, _current = _current, batch
    try:
        yield batch
    finally:
        _current = previous


def get_forward_batch() -> ForwardBatch:
    if _current is None:
        raise RuntimeError("attention ran outside `with forward_context(batch):`")
    return _current
