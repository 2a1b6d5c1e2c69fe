"""Triton RMSNorm(+residual) and SiLU-and-mul vs the eager layers on fresh random inputs.

CPU: TRITON_INTERPRET=1, tiny shapes. Tolerances (||out - ref|| / ||ref||): float32 1e-5; bfloat16
1e-2 (same rounding steps as the eager op, so in practice a few ulps at most; on the GPU the
residual sum is bit-exact)."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.triton_activation import silu_and_mul
from ftransformers.kernels.triton_norm import rms_norm
from ftransformers.layers.activation import silu_and_mul as silu_and_mul_ref
from ftransformers.layers.norm import RMSNorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 2048), (8, 7168), (64, 4096), (3, 5, 1000)] if DEV == "cuda" else [(1, 48), (3, 100), (2, 3, 64)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, weight_fp32: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    d = shape[-1]
    norm = RMSNorm(d, eps=1e-6)
    norm.weight.data = torch.randn(d, generator=gen) * 0.5 + 1.0
    norm = norm.to(DEV, torch.float32 if weight_fp32 else dtype)
    x = (torch.randn(shape, generator=gen) * 3).to(DEV, dtype)
    res = torch.randn(shape, generator=gen).to(DEV, dtype)
    # The eager path itself (RMSNorm._norm), so the check holds once forward dispatches to Triton on CUDA.
    assert rel_err(rms_norm(x, norm.weight, norm.variance_epsilon), norm._norm(x)) <= tol(dtype)
    out, new_res = rms_norm(x, norm.weight, norm.variance_epsilon, res)
    ref_res = x + res
    ref_out = norm._norm(ref_res)
    assert rel_err(out, ref_out) <= tol(dtype)
    if DEV == "cuda":
        assert torch.equal(new_res, ref_res)
    else:  # the interpreter rounds float32 -> bfloat16 toward zero: one ulp apart at most
        assert rel_err(new_res, ref_res) <= tol(dtype)


@pytest.mark.parametrize("shape", [(1, 2 * 768), (33, 2 * 2048), (2, 3, 2 * 300)] if DEV == "cuda" else [(1, 96), (5, 2 * 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 4).to(DEV, dtype)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) <= tol(dtype)


def test_strided_input() -> None:
    x = torch.randn(6, 2 * 64, generator=torch.Generator().manual_seed(1)).to(DEV)[:, :64]
    w = torch.rand(64, generator=torch.Generator().manual_seed(2)).to(DEV)
    norm = RMSNorm(64).to(DEV)
    norm.weight.data.copy_(w)
    assert rel_err(rms_norm(x, w, 1e-6), norm._norm(x)) <= 1e-5
