"""W8A8 INT8: per-output-channel symmetric INT8 weights, dynamic per-token symmetric INT8 activations.

Checkpoint layout (SGLang's `w8a8_int8`, the channel-wise scheme of compressed-tensors W8A8):
    <module>.weight        int8     [out, in]
    <module>.weight_scale  float    [out, 1]    w ≈ weight * weight_scale
and `quantization_config = {"quant_method": "w8a8_int8"}` (optional `ignore` / `modules_to_not_convert`).
Kernel layout "int8": the same weight, scales float32 [out].

Forward: each row of x gets scale s_x = max|x_row| / 127 and x_q = round(x / s_x) in [-127, 127];
y = (x_q @ weight^T) * s_x * weight_scale^T (+ bias): `quant_linear_ref` on CPU, the Triton INT8 GEMM
on CUDA. `w8a8_linear_ref` below is the same function on plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.quant.base import QuantConfig, Scheme, Shard, TensorSpec, register_quant_method
from ftransformers.quant.fp8 import ignore_list

QMAX = 127.0
INT8_DUMMY_SCALE = 1e-3 / QMAX


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric INT8 per output row: weight [N, K] -> (int8 [N, K], float32 scale [N, 1])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / QMAX).clamp_min(1e-10)
    return torch.round(w / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M, 1]), symmetric per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / QMAX).clamp_min(1e-10)
    return torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def w8a8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-PyTorch W8A8 linear: x [M, K] float, weight int8 [N, K], weight_scale [N, 1] -> [M, N] x.dtype."""
    xq, sx = quantize_per_token(x)
    acc = xq.float() @ weight.float().t()  # [M, N], integer-valued
    y = acc * sx * weight_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@dataclass(frozen=True)
class Int8ChannelScheme(Scheme):
    name: str = "w8a8_int8"
    fmt: str = "int8"

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        return [
            TensorSpec("weight", torch.int8, (None, k), dummy=("int8",)),
            TensorSpec("weight_scale", torch.float32, (None, 1), dummy=("scale", INT8_DUMMY_SCALE)),
        ]

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        scale = t["weight_scale"].float().squeeze(-1).contiguous()  # [.., N]
        return QuantizedWeight("int8", t["weight"].contiguous(), scale, n, k, k)


@register_quant_method("w8a8_int8")
def _parse(raw: dict[str, Any]) -> QuantConfig:
    return QuantConfig("w8a8_int8", Int8ChannelScheme(), ignore_list(raw, "w8a8_int8", ("ignore", "modules_to_not_convert")))
