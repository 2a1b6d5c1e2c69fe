"""FP8 block-quantized weights (DeepSeek-V3/R1 native, Qwen3-FP8, compressed-tensors float-quantized).

DeepSeek checkpoint layout, `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`:
    <module>.weight            float8_e4m3fn [N, K]
    <module>.weight_scale_inv  float32       [ceil(N/128), ceil(K/128)]   w = weight * weight_scale_inv
(a multiplier despite its name). compressed-tensors' "float-quantized" block scheme is the same with
`weight_scale`; its "channel" strategy is the block (1, K). Kernel layout "fp8_block": the same
tensors; activations are quantized per token and per 128 columns at run time (dynamic).

Fused modules: each part's scale rows follow the rows of the parts before it, so a part need not start
on a block boundary (layers/linear.py "blocks" layout); `kernel_method.block_scales` then refines the
blocks to a size every part offset is a multiple of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.quant.base import QuantConfig, QuantError, Scheme, Shard, TensorSpec, register_quant_method
from ftransformers.quant.kernel_method import block_scales

FP8_DUMMY_SCALE = 1e-3 / 448  # dummy fp8 codes span E4M3's range: weights up to ~1e-3, as float dummies


@dataclass(frozen=True)
class Fp8BlockScheme(Scheme):
    name: str = "fp8"
    block_n: int = 128
    block_k: int = 128  # 0: the whole row (per-channel scales)
    scale_suffix: str = "weight_scale_inv"
    fmt: str = "fp8_block"

    def describe(self) -> str:
        return f"{self.name} block ({self.block_n}, {self.block_k or 'K'})"

    def _bk(self, k: int) -> int:
        return self.block_k or k

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        kb = -(-k // self._bk(k))
        return [
            TensorSpec("weight", torch.float8_e4m3fn, (None, k), dummy=("fp8",)),
            TensorSpec(self.scale_suffix, torch.float32, (None, kb), layout="blocks", block_n=self.block_n,
                       dummy=("scale", FP8_DUMMY_SCALE)),
        ]  # fmt: skip

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        scales, bn = block_scales(t[self.scale_suffix].float(), list(shards), self.block_n)
        return QuantizedWeight("fp8_block", t["weight"].contiguous(), scales, n, k, self._bk(k), block_n=bn)


def ignore_list(raw: dict[str, Any], method: str, keys: Sequence[str]) -> tuple[str, ...]:
    """The union of a config's ignore-style lists (`ignore`, `modules_to_not_convert`, ...)."""
    out: list[str] = []
    for key in keys:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise QuantError(f"{method}: quantization_config {key!r} must be a list of module names")
        out.extend(value)
    return tuple(out)


@register_quant_method("fp8")
def _parse(raw: dict[str, Any]) -> QuantConfig:
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantError(f"fp8: quantization_config fmt {fmt!r} is not supported; supported: e4m3")
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise QuantError(f"fp8: quantization_config activation_scheme {scheme!r} is not supported; supported: dynamic")
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantError(f"fp8: quantization_config weight_block_size {block!r} is not supported; expected two "
                         "positive ints such as [128, 128] (per-tensor FP8 is not supported)")  # fmt: skip
    ignore = ignore_list(raw, "fp8", ("ignored_layers", "modules_to_not_convert", "ignore"))
    return QuantConfig("fp8", Fp8BlockScheme(block_n=block[0], block_k=block[1]), ignore)
