"""FP4 (E2M1) weights in compressed-tensors' layouts: "nvfp4-pack-quantized" and "mxfp4-pack-quantized".

Per module (K in, N out), two codes per byte, low nibble first along K:
    nvfp4  weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale
           float32 [1]:  w = e2m1 * weight_scale / weight_global_scale  (compressed-tensors divides)
    mxfp4  weight_packed uint8 [N, K/2], weight_scale uint8 [N, K/32] (E8M0):  w = e2m1 * 2^(s - 127)
Kernel layouts "nvfp4" / "mxfp4": qweight is the little-endian int32 view of the bytes; nvfp4's
`global_scale` [N] holds 1 / weight_global_scale of each row's part, so fused q/k/v or gate/up parts
may keep their own global scales. NVFP4 W4A4 checkpoints run weight-only here (their
`input_global_scale` is read and unused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.quant.base import QuantError, Scheme, Shard, TensorSpec
from ftransformers.quant.kernel_method import rows_of_shards

MX_DUMMY_EXP = 127 - 13  # 2^-13 * |e2m1| <= 6: weights up to ~1e-3, as float dummies
NV_DUMMY_GLOBAL = 1.2e6  # E4M3 scales in [64, 192] * |e2m1| <= 6 / global: weights up to ~1e-3


@dataclass(frozen=True)
class Fp4Scheme(Scheme):
    fmt: str = "nvfp4"  # or "mxfp4"
    name: str = "compressed-tensors nvfp4-pack-quantized"

    @property
    def group(self) -> int:
        return 16 if self.fmt == "nvfp4" else 32

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        packed = TensorSpec("weight_packed", torch.uint8, (None, k // 2), dummy=("bits",))
        if self.fmt == "mxfp4":
            return [packed, TensorSpec("weight_scale", torch.uint8, (None, k // 32), dummy=("e8m0", MX_DUMMY_EXP))]
        return [
            packed,
            TensorSpec("weight_scale", torch.float8_e4m3fn, (None, k // 16), dummy=("scale", 128.0)),
            TensorSpec("weight_global_scale", torch.float32, (1,), layout="per_shard",
                       dummy=("scale", NV_DUMMY_GLOBAL)),
            TensorSpec("input_global_scale", torch.float32, (1,), layout="per_shard", optional=True,
                       dummy=("scale", 1.0)),
        ]  # fmt: skip

    def check(self, n: int, k: int, shards: Sequence[Shard], where: str) -> None:
        if k % self.group or k % 8:
            raise QuantError(f"{self.name}: {where} has {k} input features, not a multiple of {max(self.group, 8)}")

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        qweight = t["weight_packed"].contiguous().view(torch.int32)  # [.., N, K/8]
        scales = t["weight_scale"].contiguous()
        if self.fmt == "mxfp4":
            return QuantizedWeight("mxfp4", qweight, scales, n, k, 32)
        glob = t["weight_global_scale"].float().squeeze(-1)  # [.., S]
        if not bool((glob > 0).all() and torch.isfinite(glob).all()):
            raise QuantError(f"{self.name}: {where}.weight_global_scale must be positive and finite")
        global_scale = rows_of_shards(1.0 / glob, list(shards)).contiguous()  # [.., N]
        return QuantizedWeight("nvfp4", qweight, scales, n, k, 16, global_scale=global_scale)
