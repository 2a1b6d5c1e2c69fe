"""W8A8 INT8: per-output-channel symmetric INT8 weights, dynamic per-token symmetric INT8 activations.

Checkpoint layout (SGLang's `w8a8_int8`, the channel-wise scheme of compressed-tensors W8A8):
    <module>.weight        int8     [out, in]
    <module>.weight_scale  float    [out, 1]    w ≈ weight * weight_scale
and `quantization_config = {"quant_method": "w8a8_int8"}` (optional `ignore` / `modules_to_not_convert`).
Kernel layout "int8": the same weight, scales float32 [out].

Forward: each row of x gets scale s_x = max|x_row| / 127 and x_q = round(x / s_x) in [-127, 127];
y = (x_q @ weight^T) * s_x * weight_scale^T (+ bias): `quant_linear_ref` on CPU, the Triton INT8 GEMM
on CUDA. Round-to-nearest weights: `quant.quantizers.quantize_int8`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.kernels.quant_formats import INT8_MAX, QuantizedWeight
from ftransformers.quant.base import QuantConfig, Scheme, Shard, TensorSpec, register_quant_method
from ftransformers.quant.fp8 import ignore_list


INT8_DUMMY_SCALE = 1e-3 / INT8_MAX


@dataclass(frozen=True)
class Int8ChannelScheme(Scheme):
    name: str = "w8a8_int8"
    fmt: str = "int8"

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        return [
            TensorSpec("weight", torch.int8, (None, k), dummy=("int8",)),
            TensorSpec("weight_scale", torch.float32, (None, 1), dummy=("scale", INT8_DUMMY_SCALE)),
        ]

    def to_kernel(
        self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str
    ) -> QuantizedWeight:
        scale = t["weight_scale"].float().squeeze(-1).contiguous()  # [.., N]
        return QuantizedWeight("int8", t["weight"].contiguous(), scale, n, k, k)


@register_quant_method("w8a8_int8")
def _parse(raw: dict[str, Any]) -> QuantConfig:
    return QuantConfig(
        "w8a8_int8", Int8ChannelScheme(), ignore_list(raw, "w8a8_int8", ("ignore", "modules_to_not_convert"))
    )
