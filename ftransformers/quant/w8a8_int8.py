"""W8A8 INT8: per-output-channel symmetric INT8 weights, dynamic per-token symmetric INT8 activations.

Checkpoint layout (SGLang's `w8a8_int8`, the channel-wise scheme of compressed-tensors W8A8):
    <module>.weight        int8     [out, in]
    <module>.weight_scale  float    [out, 1]    w ≈ weight * weight_scale
and `quantization_config = {"quant_method": "w8a8_int8"}` (optional `ignore` / `modules_to_not_convert`).

Forward: each row of x gets scale s_x = max|x_row| / 127 and x_q = round(x / s_x) in [-127, 127];
y = (x_q @ weight^T) * s_x * weight_scale^T (+ bias). The reference path computes x_q @ weight^T in
float32, exact while in_features * 127 * 127 < 2^24 (in <= 1040) and within float32 rounding beyond.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ftransformers.quant.base import LinearQuantMethod, QuantConfig, QuantError, register_quant_method, replace_parameter

if TYPE_CHECKING:
    from ftransformers.layers.linear import LinearBase

QMAX = 127.0


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


class W8A8Int8LinearMethod(LinearQuantMethod):
    name = "w8a8_int8"

    def create_weights(self, layer: LinearBase) -> None:
        n, k = layer.output_size, layer.input_size
        dev = layer.weight.device
        replace_parameter(layer, "weight", torch.empty(n, k, dtype=torch.int8, device=dev), output_dim=0)
        replace_parameter(layer, "weight_scale", torch.empty(n, 1, dtype=torch.float32, device=dev), output_dim=0)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = w8a8_linear_ref(x2, layer.weight, layer.weight_scale, layer.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


@register_quant_method("w8a8_int8")
def _parse(raw: dict[str, Any]) -> QuantConfig:
    ignore = raw.get("ignore") or raw.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(m, str) for m in ignore):
        raise QuantError("w8a8_int8: quantization_config 'ignore' must be a list of module names")
    return QuantConfig("w8a8_int8", W8A8Int8LinearMethod(), tuple(ignore))
