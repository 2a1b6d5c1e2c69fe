"""Load-time quantization of a float checkpoint (`--quantization fp8 | w8a8_int8 | int4 | mxfp4 |
nvfp4` on a checkpoint without `quantization_config`), as vLLM offers for fp8.

Each quantized module keeps its float `weight` while the checkpoint streams in; after loading, the
round-to-nearest quantizers of quant/quantizers.py turn it into the kernel layout and the float
tensor is freed (fused modules and stacked experts are quantized as the stacked matrix they are:
fp8 blocks may then span two fused parts, which only changes which values share a scale).
  fp8        fp8_block, 128x128 blocks, dynamic per-token-group activations (DeepSeek's recipe)
  w8a8_int8  int8 per-channel weights, dynamic per-token activations
  int4       int4 symmetric, group 128 (64 / 32 / 16 where in_features needs a smaller group)
  mxfp4      E2M1 with E8M0 scales per 32
  nvfp4      E2M1 with E4M3 scales per 16 and a global scale per tensor (per expert)
`--quantization-ignore` (names or `re:` regexes) keeps modules in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.quant.base import QuantConfig, QuantError, Scheme, Shard, TensorSpec
from ftransformers.quant.quantizers import quantize_weight

# --quantization name -> kernel layout
ONLINE_FORMATS = {"fp8": "fp8_block", "w8a8_int8": "int8", "int4": "int4", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
INT4_GROUPS = (128, 64, 32, 16)


@dataclass(frozen=True)
class OnlineScheme(Scheme):
    name: str = "fp8"
    fmt: str = "fp8_block"

    def describe(self) -> str:
        return f"load-time {self.name}"

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec("weight", dtype, (None, k))]

    def _group(self, k: int) -> int:
        return next((g for g in INT4_GROUPS if k % g == 0), 0)

    def check(self, n: int, k: int, shards: Sequence[Shard], where: str) -> None:
        need = {"int4": 16, "mxfp4": 32, "nvfp4": 16}.get(self.fmt, 1)
        if k % need:
            raise QuantError(f"--quantization {self.name}: {where} has {k} input features, not a multiple of {need}; "
                             "keep it unquantized with --quantization-ignore")  # fmt: skip

    def _quantize(self, w: torch.Tensor) -> QuantizedWeight:
        if self.fmt == "int4":
            return quantize_weight(w, "int4", group_size=self._group(w.shape[-1]), symmetric=True)
        return quantize_weight(w, self.fmt)

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        w = t["weight"]
        if w.dim() == 2:
            return self._quantize(w)
        # Stacked experts one at a time: float32 temporaries of one expert, not of the whole stack.
        parts = [self._quantize(w[e]) for e in range(w.shape[0])]
        stacked = {f: torch.stack([getattr(q, f) for q in parts]) for f in ("qweight", "scales", "zeros", "global_scale")
                   if getattr(parts[0], f) is not None}  # fmt: skip
        return replace(parts[0], **stacked)


def online_quant_config(method: str, ignore: tuple[str, ...]) -> QuantConfig:
    if method not in ONLINE_FORMATS:
        raise QuantError(f"--quantization {method} cannot quantize at load time; load-time: {', '.join(ONLINE_FORMATS)}")
    return QuantConfig(method, OnlineScheme(method, ONLINE_FORMATS[method]), ignore, online=True)
