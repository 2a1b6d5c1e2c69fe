"""RMSNorm with SGLang's fused residual-add form."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the activation dtype; the weight multiplies after the cast
        # back, as Hugging Face's Llama/Qwen RMSNorm does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [..., D]. With a residual: returns (norm(x + residual), x + residual).
        if x.is_cuda:  # one fused pass (kernels.triton_norm); imported here so CPU needs no triton
            from ftransformers.kernels.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is None:
            return self._norm(x)
        new_residual = x + residual
        return self._norm(new_residual), new_residual


def norm_input(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for a decoder layer's stream; residual None: x is the stream (the
    first layer starts it from the embeddings), returned as it is."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)  # type: ignore[return-value]


def fuses_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, consumer: str) -> bool:
    """Whether the RMSNorm of x [T, D] (+ residual) may run inside the kernel that consumes it
    (kernels/triton_norm.FusedNorm): on CUDA, contiguous rows, the norm weight in x's dtype, and
    `triton_norm.FUSE_INTO_CONSUMERS` and the consumer's own switch on (consumer "linear" or "router"). The
    consumer decides the rest (layers/linear.py normed_linear, layers/moe/topk.py router_norm)."""
    if not x.is_cuda or x.dim() != 2 or not x.is_contiguous() or norm.weight.dtype != x.dtype:
        return False
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype):
        return False
    from ftransformers.kernels import triton_norm  # here: CPU needs no triton

    own = triton_norm.FUSE_INTO_LINEAR if consumer == "linear" else triton_norm.FUSE_INTO_ROUTER
    return bool(triton_norm.FUSE_INTO_CONSUMERS and own)
