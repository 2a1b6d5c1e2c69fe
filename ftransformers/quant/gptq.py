"""GPTQ (AutoGPTQ / GPTQModel): 4-bit weights, fp16 scales and zeros per group of inputs, optional
act-order.

`quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": G (-1: one group),
"desc_act": bool, "sym": bool, "checkpoint_format": "gptq" | "gptq_v2"}`; per module (K in, N out):
    qweight  int32    [K/8, N]    packed along K: nibble i of row r is input k = 8r + i
    qzeros   int32    [K/G, N/8]  packed along N, low nibble first; format "gptq" (v1) stores
                                  zero - 1 (mod 16), "gptq_v2" the zero itself (sym: zero 8)
    scales   float16  [K/G, N]
    g_idx    int32    [K]         group of input k
    W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
Kernel layout "int4": qweight is the transpose (the same nibble order along K). With act-order
(g_idx not k // G) the inputs are sorted by group into `QuantizedWeight.perm` (dense layers only);
fused parts (q/k/v, gate/up) quantized from the same input share one g_idx, which is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight, pack_int4, unpack_int4
from ftransformers.quant.awq import INT4_DUMMY_SCALE
from ftransformers.quant.base import QuantConfig, QuantError, Scheme, Shard, TensorSpec, register_quant_method
from ftransformers.quant.fp8 import ignore_list
from ftransformers.quant.kernel_method import int4_weight

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GPTQScheme(Scheme):
    group_size: int = 128  # -1: the whole row
    desc_act: bool = False
    v2: bool = False
    name: str = "gptq"
    fmt: str = "int4"

    def describe(self) -> str:
        return f"gptq{'_v2' if self.v2 else ''} group_size {self.group_size}"

    def _g(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        ng = k // self._g(k)
        return [
            TensorSpec("qweight", torch.int32, (k // 8, None), dummy=("bits",)),
            TensorSpec("qzeros", torch.int32, (ng, None), packed_factor=8, dummy=("bits",)),
            TensorSpec("scales", torch.float16, (ng, None), dummy=("scale", INT4_DUMMY_SCALE)),
            TensorSpec("g_idx", torch.int32, (k,), layout="per_shard", allowed=(torch.int32, torch.int64),
                       dummy=("g_idx", self._g(k), self.desc_act)),
        ]  # fmt: skip

    def check(self, n: int, k: int, shards: Sequence[Shard], where: str) -> None:
        if k % 8 or k % self._g(k):
            raise QuantError(f"gptq: {where} has {k} input features, not a multiple of 8 and of group_size {self.group_size}")

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        g = self._g(k)
        qweight = t["qweight"].transpose(-1, -2).contiguous()  # [.., N, K/8]
        zeros = unpack_int4(t["qzeros"])  # [.., K/G, N]
        if not self.v2:
            zeros = (zeros + 1) & 0xF
        zeros, scales = zeros.transpose(-1, -2), t["scales"].transpose(-1, -2)
        g_idx = t["g_idx"].long()  # [.., S, K]
        if not bool((g_idx == g_idx[..., :1, :]).all()):
            raise QuantError(f"gptq: {where}: the fused parts have different g_idx (act orders)")
        g_idx = g_idx[..., 0, :]
        in_order = torch.arange(k, device=g_idx.device) // g
        if bool((g_idx == in_order).all()):
            return int4_weight(qweight, scales, zeros, n, k, g)
        if g_idx.dim() > 1:
            raise QuantError(f"gptq: {where}: act-order (desc_act) experts are not supported; "
                             "only dense layers take a column permutation")  # fmt: skip
        counts = torch.bincount(g_idx.clamp(0, k // g - 1), minlength=k // g)
        if bool((g_idx < 0).any() or (g_idx >= k // g).any() or (counts != g).any()):
            raise QuantError(f"gptq: {where}.g_idx does not give each of the {k // g} groups {g} inputs")
        perm = torch.argsort(g_idx, stable=True)  # stored column j is input perm[j], of group j // G
        qweight = pack_int4(unpack_int4(qweight)[..., perm])
        return int4_weight(qweight, scales, zeros, n, k, g, perm=perm)


@register_quant_method("gptq")
def _parse(raw: dict[str, Any]) -> QuantConfig:
    bits = raw.get("bits", 4)
    if bits != 4:
        raise QuantError(f"gptq: quantization_config bits {bits!r} is not supported; supported: 4")
    group = raw.get("group_size", 128)
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
        raise QuantError(f"gptq: quantization_config group_size {group!r} is not supported; expected -1 or a "
                         "positive multiple of 8")  # fmt: skip
    fmt = str(raw.get("checkpoint_format") or "gptq").lower()
    if fmt not in CHECKPOINT_FORMATS:
        raise QuantError(f"gptq: quantization_config checkpoint_format {fmt!r} is not supported; "
                         f"supported: {', '.join(CHECKPOINT_FORMATS)}")  # fmt: skip
    if raw.get("dynamic"):
        raise QuantError("gptq: quantization_config dynamic (per-module overrides) is not supported")
    if raw.get("lm_head"):
        raise QuantError("gptq: quantization_config lm_head true (a quantized lm_head) is not supported")
    ignore = ignore_list(raw, "gptq", ("modules_to_not_convert", "ignore"))
    return QuantConfig("gptq", GPTQScheme(group_size=group, desc_act=bool(raw.get("desc_act", False)),
                                          v2=fmt == "gptq_v2"), ignore)  # fmt: skip
