"""The `--method` table: how each method rounds a float weight and what it writes (docs/quantization.md).

Every method produces a `QuantizedWeight` (kernel layout, ftransformers/kernels/quant_formats.py) and
an encoder turns it into the tensors of the on-disk format vLLM and SGLang read:

  --method    quant_method         tensors per module <m>
  awq         awq (GEMM)           qweight int32 [K, N/8] (AWQ nibble order), qzeros int32 [K/G, N/8], scales fp16 [K/G, N]
  gptq        gptq (v1)            qweight int32 [K/8, N], qzeros int32 [K/G, N/8] (zero - 1), scales fp16 [K/G, N], g_idx int32 [K]
  rtn-int4    compressed-tensors   weight_packed int32 [N, K/8], weight_scale [N, K/G], weight_shape int64 [2],
              pack-quantized       weight_zero_point int32 [N/8, K/G] when asymmetric
  mxfp4       compressed-tensors   weight_packed uint8 [N, K/2], weight_scale uint8 E8M0 [N, K/32]
  nvfp4       compressed-tensors   weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16],
                                   weight_global_scale float32 [1] (w = e2m1 * weight_scale / weight_global_scale)
  fp8         fp8 (DeepSeek)       weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/128), ceil(K/128)]
  w8a8-int8   w8a8_int8 (SGLang)   weight int8 [N, K], weight_scale float32 [N, 1]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ftransformers.kernels.quant_formats import FP8_MAX, QuantizedWeight, float_to_e2m1, pack_int4, unpack_int4
from ftransformers.quant.base import QuantError
from ftransformers.quant.quantizers import E2M1_MAX, quantize_fp8_block, quantize_int4, quantize_int8, quantize_mxfp4

# AWQ GEMM packing: nibble i of a packed column c holds logical column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class QuantOptions:
    group_size: int = 128  # -1: one group per row (gptq only)
    symmetric: bool = False
    desc_act: bool = False
    scale_dtype: torch.dtype = torch.float16  # compressed-tensors int4 scales; AWQ / GPTQ are always fp16

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class MethodSpec:
    name: str  # --method
    quant_method: str  # quantization_config.quant_method
    fmt: str  # QuantizedWeight.fmt
    config: Callable[[QuantOptions, list[str]], dict[str, Any]]
    encode: Callable[[QuantizedWeight, QuantOptions], dict[str, torch.Tensor]]
    grouped: bool = False  # honours --group-size
    default_symmetric: bool = True
    needs_calibration: bool = False
    k_multiple: int = 1  # in_features must be a multiple of this (beyond the group size)
    n_multiple: int = 1  # out_features must be a multiple of this
    shares_global_scale: bool = False  # nvfp4: one global scale per fused module (q/k/v, gate/up)
    aliases: tuple[str, ...] = field(default=())

    def quantize(self, w: torch.Tensor, opts: QuantOptions, global_amax: torch.Tensor | None = None) -> QuantizedWeight:
        """Round-to-nearest w [N, K] in this method's grid (AWQ and GPTQ start from, or fall back to, it)."""
        if self.fmt == "int4":
            sym = opts.symmetric if self.name != "awq" else False
            scale_dtype = opts.scale_dtype if self.quant_method == "compressed-tensors" else torch.float16
            if self.name == "gptq":
                from ftransformers.entrypoints.quantize.gptq import rtn_gptq

                return rtn_gptq(w, opts.group_for(w.shape[-1]), sym)
            return quantize_int4(w, opts.group_for(w.shape[-1]), sym, scale_dtype)
        if self.fmt == "nvfp4":
            return quantize_nvfp4_shared(w, w.float().abs().amax() if global_amax is None else global_amax)
        if self.fmt == "mxfp4":
            return quantize_mxfp4(w)
        if self.fmt == "fp8_block":
            return quantize_fp8_block(w)
        return quantize_int8(w)


def quantize_nvfp4_shared(w: torch.Tensor, amax: torch.Tensor) -> QuantizedWeight:
    """NVFP4 of w [N, K] with the global scale set by `amax` (the max over the fused module's parts, so
    q/k/v and gate/up share it, as vLLM requires); equal to `quantizers.quantize_nvfp4` when amax is w's."""
    n, k = w.shape
    wg = w.float().reshape(n, k // 16, 16)
    glob = amax.float().clamp_min(1e-12) / (FP8_MAX * E2M1_MAX)
    scale8 = (wg.abs().amax(dim=-1) / E2M1_MAX / glob).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    eff = scale8.float() * glob  # [N, K//16]
    codes = float_to_e2m1(torch.where(eff.unsqueeze(-1) > 0, wg / eff.clamp_min(1e-30).unsqueeze(-1), 0.0))
    return QuantizedWeight("nvfp4", pack_int4(codes.flatten(-2)), scale8, n, k, 16,
                           global_scale=glob.expand(n).contiguous())  # fmt: skip


def _pack_along_n(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """values [R, N] in 0..15 -> int32 [R, N/8]: nibble i of column c holds value column 8c + order[i]."""
    r, n = values.shape
    v = values.to(torch.int64).reshape(r, n // 8, 8)[:, :, list(order)]
    return pack_int4(v.reshape(r, n))


def _int4_codes(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K], zeros uint8 [N, K/G]) of an int4 weight (zero 8 when symmetric)."""
    codes = unpack_int4(qw.qweight)
    zeros = qw.zeros if qw.zeros is not None else torch.full(qw.scales.shape, 8, dtype=torch.uint8)
    return codes, zeros


def encode_awq(qw: QuantizedWeight, opts: QuantOptions) -> dict[str, torch.Tensor]:
    codes, zeros = _int4_codes(qw)
    return {"qweight": _pack_along_n(codes.t(), AWQ_ORDER), "qzeros": _pack_along_n(zeros.t(), AWQ_ORDER),
            "scales": qw.scales.t().contiguous().to(torch.float16)}  # fmt: skip


def encode_gptq(qw: QuantizedWeight, opts: QuantOptions) -> dict[str, torch.Tensor]:
    """GPTQ v1. With act order the stored columns are `perm` of the input; g_idx maps each input back
    to the group its stored position fell in."""
    codes, zeros = _int4_codes(qw)
    k, g = qw.in_features, qw.group_size
    groups = torch.arange(k) // g
    if qw.perm is not None:
        original = torch.empty_like(codes)
        original[:, qw.perm] = codes
        codes = original
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[qw.perm] = groups
    else:
        g_idx = groups
    if int(zeros.min()) < 1:
        raise QuantError("gptq v1 stores zero - 1: a zero point of 0 cannot be written")
    return {"qweight": pack_int4(codes).t().contiguous(),  # [N, K/8] packed along K -> [K/8, N]
            "qzeros": _pack_along_n((zeros.t().to(torch.int64) - 1) & 0xF),
            "scales": qw.scales.t().contiguous().to(torch.float16), "g_idx": g_idx.to(torch.int32)}  # fmt: skip


def encode_ct_int4(qw: QuantizedWeight, opts: QuantOptions) -> dict[str, torch.Tensor]:
    out = {"weight_packed": qw.qweight.contiguous(), "weight_scale": qw.scales.contiguous(),
           "weight_shape": torch.tensor([qw.out_features, qw.in_features], dtype=torch.int64)}  # fmt: skip
    if qw.zeros is not None:  # signed zero point (+8 = our unsigned zero), packed along N
        zt = qw.zeros.t()  # [K/G, N]
        pad = -zt.shape[1] % 8
        zt = torch.nn.functional.pad(zt.to(torch.int64), (0, pad))
        out["weight_zero_point"] = pack_int4(zt).t().contiguous()  # [ceil(N/8), K/G]
    return out


def encode_fp4(qw: QuantizedWeight, opts: QuantOptions) -> dict[str, torch.Tensor]:
    out = {"weight_packed": qw.qweight.contiguous().view(torch.uint8), "weight_scale": qw.scales.contiguous()}
    if qw.fmt == "nvfp4":
        assert qw.global_scale is not None
        out["weight_global_scale"] = (1.0 / qw.global_scale[:1].float()).contiguous()
    return out


def encode_fp8(qw: QuantizedWeight, opts: QuantOptions) -> dict[str, torch.Tensor]:
    return {"weight": qw.qweight.contiguous(), "weight_scale_inv": qw.scales.float().contiguous()}


def encode_int8(qw: QuantizedWeight, opts: QuantOptions) -> dict[str, torch.Tensor]:
    return {"weight": qw.qweight.contiguous(), "weight_scale": qw.scales.float().reshape(-1, 1).contiguous()}


def _ct_config(fmt: str, weights: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    scheme = {"targets": ["Linear"], "weights": {"dynamic": False, **weights}, "input_activations": None,
              "output_activations": None, "format": fmt}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None}  # fmt: skip


def _awq_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": o.group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ignore or None}  # fmt: skip


def _gptq_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": o.group_size, "desc_act": o.desc_act,
            "sym": o.symmetric, "checkpoint_format": "gptq", "true_sequential": False, "damp_percent": 0.01,
            "static_groups": False, "modules_to_not_convert": ignore or None}  # fmt: skip


def _int4_ct_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "int", "symmetric": o.symmetric, "strategy": "group", "group_size": o.group_size}
    return _ct_config("pack-quantized", weights, ignore)


def _mxfp4_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "scale_dtype": "torch.uint8"}  # fmt: skip
    return _ct_config("mxfp4-pack-quantized", weights, ignore)


def _nvfp4_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
               "scale_dtype": "torch.float8_e4m3fn"}  # fmt: skip
    return _ct_config("nvfp4-pack-quantized", weights, ignore)


def _fp8_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "ignored_layers": ignore, "modules_to_not_convert": ignore}  # fmt: skip


def _w8a8_config(o: QuantOptions, ignore: list[str]) -> dict[str, Any]:
    return {"quant_method": "w8a8_int8", "ignore": ignore}


METHOD_SPECS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        MethodSpec("awq", "awq", "int4", _awq_config, encode_awq, grouped=True, default_symmetric=False,
                   needs_calibration=True, n_multiple=8),
        MethodSpec("gptq", "gptq", "int4", _gptq_config, encode_gptq, grouped=True, default_symmetric=True,
                   needs_calibration=True, k_multiple=8, n_multiple=8),
        MethodSpec("rtn-int4", "compressed-tensors", "int4", _int4_ct_config, encode_ct_int4, grouped=True,
                   default_symmetric=False, k_multiple=8),
        MethodSpec("mxfp4", "compressed-tensors", "mxfp4", _mxfp4_config, encode_fp4, k_multiple=32),
        MethodSpec("nvfp4", "compressed-tensors", "nvfp4", _nvfp4_config, encode_fp4, k_multiple=16,
                   shares_global_scale=True),
        MethodSpec("fp8", "fp8", "fp8_block", _fp8_config, encode_fp8),
        MethodSpec("w8a8-int8", "w8a8_int8", "int8", _w8a8_config, encode_int8),
    )
}  # fmt: skip


def check_shape(spec: MethodSpec, opts: QuantOptions, name: str, shape: tuple[int, ...]) -> None:
    """One-line QuantError when weight `name` [N, K] cannot be written in this method's format."""
    n, k = shape[-2:]
    g = opts.group_for(k) if spec.grouped else 1
    if k % g:
        raise QuantError(f"--group-size {g} does not divide in_features {k} of {name}")
    if k % spec.k_multiple or n % spec.n_multiple:
        raise QuantError(f"{spec.name} needs in_features % {spec.k_multiple} == 0 and out_features % "
                         f"{spec.n_multiple} == 0; {name} is [{n}, {k}]")  # fmt: skip
