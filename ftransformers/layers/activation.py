"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2I] laid out as [gate | up] -> [..., I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one pass instead of three (kernels.triton_activation)
            from ftransformers.kernels.triton_activation import silu_and_mul as silu_and_mul_triton

            return silu_and_mul_triton(x)
        return silu_and_mul(x)
