"""Round-to-nearest quantizers (quant/quantizers.py): each format's error bound on fresh random weights,
and the format conventions (symmetric int4 codes in 0..15 around 8, E8M0 exponents, E4M3 scales)."""

from __future__ import annotations

import pytest
import torch

from ftransformers.kernels.quant_formats import dequantize, unpack_int4
from ftransformers.quant.quantizers import quantize_weight


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.02
    w[..., 3] *= 20  # an outlier column, as real weights have
    return w


@pytest.mark.parametrize("fmt,kw,max_rel", [
    ("int4", {"group_size": 32}, 0.10), ("int4", {"group_size": 128, "symmetric": False}, 0.12),
    ("fp8_block", {}, 0.04), ("mxfp4", {}, 0.20), ("nvfp4", {}, 0.12), ("int8", {}, 0.01),
])  # fmt: skip
def test_rtn_error_is_bounded(fmt: str, kw: dict, max_rel: float) -> None:
    """Gaussian weights: the relative RMS error of each rounding grid (int4 g32: step ~0.28 sigma, RMS
    step/sqrt(12) ~ 0.08; g128 asym: range ~5.8 sigma, RMS ~0.11; E4M3 3 mantissa bits ~ 0.02; E2M1 1 mantissa bit), per expert."""
    w = torch.randn(2, 96, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    qw = quantize_weight(w, fmt, **kw)
    assert qw.num_experts == 2 and (qw.out_features, qw.in_features) == (96, 256)
    back = dequantize(qw)
    assert back.shape == w.shape
    rel = ((back - w).norm() / w.norm()).item()
    assert 0 < rel < max_rel, rel
    alone = dequantize(quantize_weight(w[1], fmt, **kw))  # experts are quantized independently
    torch.testing.assert_close(alone, back[1])


@pytest.mark.parametrize("symmetric", [True, False])
def test_int_rounding_is_to_nearest_grid_point(symmetric: bool) -> None:
    """With an outlier column: every element within half a step of its dequantized value, plus the
    clamped extreme's share of the scale's float16 rounding (8 steps x 2^-11)."""
    w = _weight(64, 128, seed=1)
    qw = quantize_weight(w, "int4", group_size=32, symmetric=symmetric)
    codes = unpack_int4(qw.qweight)
    assert codes.min() >= 0 and codes.max() <= 15 and (qw.zeros is None) == symmetric
    step = qw.scales.float().repeat_interleave(32, dim=-1)
    assert ((dequantize(qw) - w).abs() <= step * (0.5 + 8 * 2**-11)).all()
    q8 = quantize_weight(w, "int8")
    assert ((dequantize(q8) - w).abs() <= q8.scales.unsqueeze(-1) / 2 * (1 + 1e-3)).all()


def test_mxfp4_scale_is_the_groups_exponent_and_nvfp4_global() -> None:
    w = _weight(8, 64, seed=2)
    mx = quantize_weight(w, "mxfp4")
    assert mx.scales.dtype == torch.uint8 and mx.scales.shape == (8, 2)
    amax = w.abs().reshape(8, 2, 32).amax(-1)
    assert torch.equal(mx.scales.int() - 127, (torch.floor(torch.log2(amax)) - 2).int())
    nv = quantize_weight(w, "nvfp4")
    assert nv.scales.dtype == torch.float8_e4m3fn and nv.scales.shape == (8, 4)
    assert nv.global_scale.shape == (8,) and torch.allclose(nv.global_scale, w.abs().max() / (448 * 6))
