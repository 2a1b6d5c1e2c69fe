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
        self, x: torch.Tensor, residual: torch.Tensor | None = None, early_trigger: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [..., D]. With a residual: returns (norm(x + residual), x + residual). early_trigger: the next
        # kernel reads ahead of its PDL wait, so the norm's kernel lets it start early (kernels/pdl.py).
        if x.is_cuda:  # one fused pass (kernels.triton_norm); imported here so CPU needs no triton
            from ftransformers.kernels.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual, early_trigger)
        if residual is None:
            return self._norm(x)
        new_residual = x + residual
        return self._norm(new_residual), new_residual
