"""Round-to-nearest quantizers: a float weight [..., N, K] -> a `QuantizedWeight` in kernel layout.

They are the building blocks of `ftransformers quantize` (RTN directly; AWQ and GPTQ choose scales or
update weights, then round with the int4 rules here) and of quantizing a float checkpoint at load time.
Conventions follow the formats' reference tools:
  int4 symmetric   scale = amax / 7.5 per group, code = clamp(round(w / scale), -8, 7) + 8 (zero point 8),
                   as compressed-tensors and GPTQ (sym) do
  int4 asymmetric  scale = (max - min) / 15, zero = clamp(round(-min / scale), 0, 15),
                   code = clamp(round(w / scale) + zero, 0, 15), as AutoAWQ does
  fp8_block        scale = amax / 448 per 128x128 block (DeepSeek-V3's `weight_scale_inv`)
  mxfp4            shared exponent 2^(floor(log2 amax) - 2) per 32 values (OCP MX v1.0), E2M1 codes
  nvfp4            global = amax(tensor) / (448 * 6); per 16 values an E4M3 scale amax / 6 / global
  int8             scale = amax / 127 per output row
"""

from __future__ import annotations

import torch

from ftransformers.kernels.quant_formats import (
    FP8_MAX,
    INT8_MAX,
    QuantizedWeight,
    float_to_e2m1,
    pack_int4,
    round_to_e4m3,
)

E2M1_MAX = 6.0


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [..., N, K] float32 -> [..., N, K//group, group]."""
    k = w.shape[-1]
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    return w.float().reshape(*w.shape[:-1], k // group, group)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:  # fmt: skip
    n, k = w.shape[-2:]
    wg = _groups(w, group_size)
    if symmetric:
        scale = (wg.abs().amax(dim=-1) / 7.5).clamp_min(1e-10)  # [..., N, K//G]
        scale = scale.to(scale_dtype).float()  # round with the scale the checkpoint will hold
        codes = (torch.round(wg / scale.unsqueeze(-1)).clamp(-8, 7) + 8).to(torch.uint8)
        zeros = None
    else:
        lo, hi = wg.amin(dim=-1).clamp(max=0), wg.amax(dim=-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-10).to(scale_dtype).float()
        zeros = torch.round(-lo / scale).clamp(0, 15)
        codes = (torch.round(wg / scale.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        zeros = zeros.to(torch.uint8)
    return QuantizedWeight("int4", pack_int4(codes.flatten(-2)), scale.to(scale_dtype), n, k, group_size,
                           zeros=zeros)  # fmt: skip


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> QuantizedWeight:
    n, k = w.shape[-2:]
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = wp.reshape(*w.shape[:-2], nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(1e-12)  # [..., nb, kb]
    q = round_to_e4m3((blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    q = q.reshape(*w.shape[:-2], nb * bn, kb * bk)[..., :n, :k].contiguous()
    return QuantizedWeight("fp8_block", q, scale, n, k, bk, block_n=bn)


def quantize_mxfp4(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape[-2:]
    wg = _groups(w, 32)
    amax = wg.abs().amax(dim=-1).clamp_min(2.0**-127)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # E2M1's largest exponent is 2
    codes = float_to_e2m1(wg / torch.exp2(exp).unsqueeze(-1))
    return QuantizedWeight("mxfp4", pack_int4(codes.flatten(-2)), (exp + 127).to(torch.uint8), n, k, 32)


def quantize_nvfp4(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape[-2:]
    wg = _groups(w, 16)
    lead = w.shape[:-2]
    # One global scale per tensor (per expert for stacked experts), stored per output row.
    amax_t = w.float().abs().reshape(*lead, -1).amax(dim=-1).clamp_min(1e-12)  # [...]
    glob = amax_t / (FP8_MAX * E2M1_MAX)
    scale = (wg.abs().amax(dim=-1) / E2M1_MAX / glob[..., None, None]).clamp(max=FP8_MAX)
    scale8 = round_to_e4m3(scale).to(torch.float8_e4m3fn)  # the same on every device
    eff = scale8.float() * glob[..., None, None]  # [..., N, K//16]
    codes = float_to_e2m1(torch.where(eff.unsqueeze(-1) > 0, wg / eff.clamp_min(1e-30).unsqueeze(-1), 0.0))
    global_scale = glob[..., None].expand(*lead, n).contiguous().float()
    return QuantizedWeight("nvfp4", pack_int4(codes.flatten(-2)), scale8, n, k, 16, global_scale=global_scale)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape[-2:]
    scale = (w.float().abs().amax(dim=-1) / INT8_MAX).clamp_min(1e-10)  # [..., N]
    q = torch.round(w.float() / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight("int8", q, scale, n, k, k)


def quantize_weight(w: torch.Tensor, fmt: str, group_size: int = 128, symmetric: bool = True) -> QuantizedWeight:
    """Round-to-nearest `w` [..., N, K] into kernel format `fmt`."""
    if fmt == "int4":
        return quantize_int4(w, group_size, symmetric)
    if fmt == "fp8_block":
        return quantize_fp8_block(w)
    if fmt == "mxfp4":
        return quantize_mxfp4(w)
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    if fmt == "int8":
        return quantize_int8(w)
    raise ValueError(f"unknown weight format {fmt!r}")
