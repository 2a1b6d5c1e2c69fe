"""Triton skinny GEMM (decode linears, M <= 16) vs a float32-accumulating PyTorch reference on fresh
random inputs, and the linear layer's dispatch to it.

CPU: TRITON_INTERPRET=1, small shapes. Tolerances (||out - ref|| / ||ref||): float32 1e-5; bfloat16
1e-2 (the reference rounds the same float32 sum once, so in practice the kernel is within an ulp or
two of it; the summation order differs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.triton_gemv import GEMV_MAX_M, gemv, gemv_config, gemv_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): K not a multiple of any BLOCK_K exercises the masked path; N not a multiple of BLOCK_N too.
SHAPES = [(5120, 2048), (2048, 4096), (2112, 7168), (129, 1000)] if DEV == "cuda" else [(37, 96), (20, 512)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, GEMV_MAX_M])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype: torch.dtype, M: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(M * 7 + bias)
    for N, K in SHAPES:
        x = torch.randn(M, K, generator=gen).to(DEV, dtype)
        w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEV, dtype)
        b = torch.randn(N, generator=gen).to(DEV, dtype) if bias else None
        out = gemv(x, w, b)
        assert rel_err(out, gemv_ref(x, w, b)) < tol(dtype), (M, N, K)


def test_gemv_every_tile_path() -> None:
    """Both kernels with small tiles, so several programs and K iterations run even on CPU shapes."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 80, generator=gen)
    w = torch.randn(24, 80, generator=gen)
    for cfg in ({"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1},
                {"BLOCK_M": 2, "BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1},
                {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1}):  # fmt: skip
        m = min(6, cfg["BLOCK_M"])
        xs = x[:m].to(DEV)
        assert rel_err(gemv(xs, w.to(DEV), config=cfg), gemv_ref(xs, w.to(DEV))) < 1e-5, cfg
    assert gemv_config(1, 5120, 2048)["BLOCK_M"] == 1 and gemv_config(9, 5120, 2048)["BLOCK_M"] == 16
    # one row: K up to GEMV_WHOLE_ROW_K in one step, longer rows GEMV_BLOCK_K at a time; 2-4 rows 1024 / rows
    ks = [gemv_config(m, 2048, k)["BLOCK_K"] for m, k in ((1, 4096), (1, 3000), (1, 7168), (1, 16384), (2, 4096))]
    assert ks == [4096, 4096, 2048, 2048, 512]


def test_strided_rows() -> None:
    """x may be a row slice of a wider buffer (unit stride along K only)."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(3, 200, generator=gen).to(DEV)
    x = buf[:, 50:146]  # [3, 96], row stride 200
    w = torch.randn(37, 96, generator=gen).to(DEV)
    assert rel_err(gemv(x, w), gemv_ref(x, w)) < 1e-5


@pytest.mark.skipif(DEV != "cuda", reason="the linear layers dispatch to the kernel on CUDA only")
def test_linear_layer_dispatches_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import ftransformers.kernels.triton_gemv as mod
    from ftransformers.layers.linear import ReplicatedLinear

    calls: list[tuple[int, ...]] = []
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda x, w, b=None, config=None: calls.append(tuple(x.shape)) or real(x, w, b))
    layer = ReplicatedLinear(2048, 640, bias=True).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=2048**-0.5)
    torch.nn.init.normal_(layer.bias)
    for shape in [(1, 2048), (1, 1, 2048), (3, 2048)]:
        x = torch.randn(*shape, device=DEV, dtype=torch.bfloat16)
        out = layer(x)
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).to(x.dtype)
        assert rel_err(out, ref) < tol(torch.bfloat16) and out.shape == (*shape[:-1], 640)
    assert calls == [(1, 2048), (1, 2048)]  # the 3-row input stays on cuBLAS


def test_out_buffer() -> None:
    """gemv writes into a given row slice of a wider buffer (the CUDA graph's logits) and returns it."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 96, generator=gen).to(DEV)
    w = torch.randn(300, 96, generator=gen).to(DEV)
    buf = torch.full((3, 300), 7.0, device=DEV)
    y = gemv(x, w, out=buf[1:2])
    assert y.data_ptr() == buf[1].data_ptr() and rel_err(buf[1:2], gemv_ref(x, w)) < 1e-5
    assert (buf[0] == 7.0).all() and (buf[2] == 7.0).all()


@pytest.mark.skipif(DEV != "cuda", reason="the LM head dispatches to the kernel on CUDA only")
def test_lm_head_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of logits (batch-1 decode, or a prefill's last token) from the kernel, float32 or into the
    head's buffer; more rows from cuBLAS."""
    import ftransformers.kernels.triton_gemv as mod
    from ftransformers.layers.embedding import ParallelLMHead

    calls: list[tuple[int, ...]] = []
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda x, w, b=None, config=None, out=None: calls.append(tuple(x.shape))
                        or real(x, w, b, out=out))  # fmt: skip
    head = ParallelLMHead(5000, 256).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(head.weight, std=256**-0.5)
    buf = head.logits_buffer(4)
    for rows in (1, 3):
        x = torch.randn(rows, 256, device=DEV, dtype=torch.bfloat16)
        with torch.inference_mode():  # as the engine runs it (out= takes no autograd)
            ref = gemv_ref(x, head.weight).float()
            got = head.compute_logits(x)
            into = head.compute_logits(x, out=buf[:rows])
        assert got.dtype == torch.float32 and rel_err(got, ref) < tol(torch.bfloat16)
        assert into.data_ptr() == buf.data_ptr() and torch.equal(into.float(), got)
    assert calls == [(1, 256), (1, 256)]
