"""The absorbed MLA's per-head products (kernels/triton_mla_bmm.py) against a float32 PyTorch reference on fresh
random inputs, in the two forms DeepSeek-V3's attention calls them (W_UK on the query, W_UV transposed on the latent
output, both written in [T, H, *] order), and the model's helper around it.

CPU: TRITON_INTERPRET=1, small shapes. Tolerances (||out - ref|| / ||ref||): float32 1e-5; bfloat16 1e-2 (the
reference rounds the same float32 sum once; the summation order differs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ftransformers.kernels import triton_mla_bmm
from ftransformers.kernels.triton_mla_bmm import MAX_M, mla_bmm, mla_bmm_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (H, nope N, latent L, V): L not a power of two exercises the masked K and N tails
SHAPES = [(16, 128, 512, 128), (128, 128, 512, 128), (3, 64, 200, 96)] if DEV == "cuda" else [(3, 16, 80, 24)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", list(range(1, MAX_M + 1)))
@pytest.mark.parametrize("max_block_k", [triton_mla_bmm.MAX_BLOCK_K, 32])  # 32: several K steps, a masked last one
def test_mla_bmm_both_forms_match_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, T: int, max_block_k: int
) -> None:
    monkeypatch.setattr(triton_mla_bmm, "MAX_BLOCK_K", max_block_k)
    monkeypatch.setattr(triton_mla_bmm, "SMALL_WEIGHT_BYTES", 1 << 40)  # the kernel at every row count and shape
    gen = torch.Generator().manual_seed(31 * T + (dtype == torch.float32))
    for H, N, L, V in SHAPES:
        kv_b = (torch.randn(H * (N + V), L, generator=gen) / L**0.5).to(DEV, dtype)  # kv_b_proj.weight
        w = kv_b.view(H, N + V, L)
        w_uk, w_uv = w[:, :N], w[:, N:]  # views, as DeepseekV3Attention.absorbed_weights
        q = torch.randn(T, H, N + 64, generator=gen).to(DEV, dtype)  # [q_nope | q_pe] a head
        q_nope = q[..., :N]
        lat_out = torch.randn(T, H, L, generator=gen).to(DEV, dtype)
        for a, b in ((q_nope.transpose(0, 1), w_uk), (lat_out.transpose(0, 1), w_uv.transpose(1, 2))):
            out = torch.full((T, H, b.shape[2]), float("nan"), dtype=dtype, device=DEV)
            got = mla_bmm(a, b, out=out.transpose(0, 1))
            assert got.data_ptr() == out.data_ptr()
            assert rel_err(out.transpose(0, 1), mla_bmm_ref(a, b)) <= TOL[dtype], (H, N, L, V, T)
            fresh = mla_bmm(a, b)  # its own [H, T, N] output
            assert fresh.is_contiguous() and rel_err(fresh, mla_bmm_ref(a, b)) <= TOL[dtype]


def test_mla_bmm_rule_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row always takes the kernel; 2-MAX_M rows only on weights of at most SMALL_WEIGHT_BYTES; more rows, or
    ENABLED off, go to torch.bmm (bit for bit, strided outputs too)."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(2, MAX_M + 1, 24, generator=gen).to(DEV)
    b = torch.randn(2, 24, 40, generator=gen).to(DEV)
    cuda = DEV == "cuda"
    assert not triton_mla_bmm.takes(a, b)
    assert triton_mla_bmm.takes(a[:, :1], b) == triton_mla_bmm.takes(a[:, :MAX_M], b) == cuda
    monkeypatch.setattr(triton_mla_bmm, "SMALL_WEIGHT_BYTES", b.numel() * b.element_size() - 1)
    assert triton_mla_bmm.takes(a[:, :1], b) == cuda and not triton_mla_bmm.takes(a[:, :2], b)
    assert torch.equal(mla_bmm(a[:, :2], b), torch.bmm(a[:, :2], b))  # the fallback, bit for bit
    assert torch.equal(mla_bmm(a, b), torch.bmm(a, b))
    monkeypatch.setattr(triton_mla_bmm, "ENABLED", False)
    assert not triton_mla_bmm.takes(a[:, :1], b)
    out = torch.empty(3, 2, 40).to(DEV).transpose(0, 1)  # a strided output through torch.bmm
    assert torch.equal(mla_bmm(a[:, :3], b, out=out), torch.bmm(a[:, :3], b))


def test_per_head_product_matches_bmm() -> None:
    """The model's helper: [T, H, K] x [H, K, N] -> [T, H, N], through the kernel on CUDA (contiguous), through
    torch.bmm elsewhere (a transposed view)."""
    from ftransformers.models.deepseek_v3 import per_head_product

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 40, generator=gen).to(DEV)[..., :32]  # strided, as q_nope
    w = torch.randn(3, 32, 48, generator=gen).to(DEV)
    out = per_head_product(x, w)
    assert out.shape == (2, 3, 48)
    assert rel_err(out, torch.bmm(x.transpose(0, 1).float(), w.float()).transpose(0, 1)) <= TOL[torch.float32]
    assert out.is_contiguous() == (DEV == "cuda")
