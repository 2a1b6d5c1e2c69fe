"""AWQ (AutoAWQ GEMM layout): 4-bit asymmetric weights, one fp16 scale and zero per group of inputs.

`quantization_config = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
"version": "gemm", "modules_to_not_convert": [...] | null}`; per module (K in, N out):
    qweight  int32    [K, N/8]    packed along N in AWQ order: nibble i of packed column c holds
                                  output column 8c + AWQ_ORDER[i]
    qzeros   int32    [K/G, N/8]  the same packing, zeros unsigned 0..15
    scales   float16  [K/G, N]
    W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]
Kernel layout "int4": qweight [N, K/8] (low nibble first along K), scales / zeros [N, K/G].
`modules_to_not_convert` entries match as substrings of module names, as in vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight, pack_int4
from ftransformers.quant.base import QuantConfig, QuantError, Scheme, Shard, TensorSpec, register_quant_method
from ftransformers.quant.kernel_method import int4_weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INT4_DUMMY_SCALE = 1e-3 / 8  # codes -8..7 around their zero: weights up to ~1e-3, as float dummies


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [.., R, C/8] in AWQ order -> uint8 [.., R, C] in logical column order."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [.., R, C/8, 8]: position i holds column AWQ_ORDER[i]
    position_of = [AWQ_ORDER.index(j) for j in range(8)]
    codes = nibbles[..., position_of]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.uint8)


@dataclass(frozen=True)
class AWQScheme(Scheme):
    group_size: int = 128
    name: str = "awq"
    fmt: str = "int4"

    def describe(self) -> str:
        return f"awq group_size {self.group_size}"

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        ng = k // self.group_size
        return [
            TensorSpec("qweight", torch.int32, (k, None), packed_factor=8, dummy=("bits",)),
            TensorSpec("qzeros", torch.int32, (ng, None), packed_factor=8, dummy=("bits",)),
            TensorSpec("scales", torch.float16, (ng, None), dummy=("scale", INT4_DUMMY_SCALE)),
        ]

    def check(self, n: int, k: int, shards: Sequence[Shard], where: str) -> None:
        if k % self.group_size:
            raise QuantError(f"awq: {where} has {k} input features, not a multiple of group_size {self.group_size}")

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        codes = unpack_awq(t["qweight"]).transpose(-1, -2)  # [.., N, K]
        zeros = unpack_awq(t["qzeros"]).transpose(-1, -2)  # [.., N, K/G]
        scales = t["scales"].transpose(-1, -2)
        return int4_weight(pack_int4(codes), scales, zeros, n, k, self.group_size)


@register_quant_method("awq")
def _parse(raw: dict[str, Any]) -> QuantConfig:
    bits = raw.get("bits", raw.get("w_bit", 4))
    if bits != 4:
        raise QuantError(f"awq: quantization_config bits {bits!r} is not supported; supported: 4")
    group = raw.get("group_size", raw.get("q_group_size", 128))
    if not isinstance(group, int) or group <= 0 or group % 8:
        raise QuantError(f"awq: quantization_config group_size {group!r} is not supported; expected a positive multiple of 8")
    if not raw.get("zero_point", True):
        raise QuantError("awq: quantization_config zero_point false is not supported; supported: true")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantError(f"awq: quantization_config version {version!r} is not supported; supported: gemm")
    skip = raw.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise QuantError("awq: quantization_config modules_to_not_convert must be a list of module names")
    ignore = tuple(f"re:.*{re.escape(m)}.*" for m in skip)
    return QuantConfig("awq", AWQScheme(group_size=group), ignore)
