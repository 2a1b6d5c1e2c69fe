"""The split-K dense GEMM for decode batches of 32-256 rows (kernels/triton_splitk_gemm.py) against a
float32-accumulating PyTorch reference, on fresh random inputs.

CPU: TRITON_INTERPRET=1, small tiles and shapes. Tolerances (||out - ref|| / ||ref||): bfloat16 and float16 1e-2
(one rounding of a float32 sum; the kernel sums in another order). Split runs must also be bit for bit equal on a
second call (the partials are added in split order) and leave their ticket counters at zero."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.tickets import ticket_counters
from ftransformers.kernels.triton_splitk_gemm import SplitKConfig, fits, splitk_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().T
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert out.shape == want.shape and out.dtype == want.dtype and not out.isnan().any()
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


CONFIGS = [
    SplitKConfig(block_m=16, block_n=16, block_k=16, split=1, warps=1, stages=1),
    SplitKConfig(block_m=16, block_n=32, block_k=16, split=2, warps=1, stages=1),
    SplitKConfig(block_m=32, block_n=16, block_k=16, split=4, warps=1, stages=1, swap=True),
    SplitKConfig(block_m=16, block_n=16, block_k=32, split=3, warps=1, stages=1, swap=True),
    SplitKConfig(block_m=16, block_n=16, block_k=16, split=2, warps=1, stages=1, tma=True),
    SplitKConfig(block_m=32, block_n=16, block_k=16, split=1, warps=1, stages=1, swap=True, tma=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_splitk_gemm_matches_reference(cfg: SplitKConfig, dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(cfg.split * 31 + cfg.block_m + bias)
    # M and N past a tile edge (masked rows and columns); K in steps a split, or 7 steps (the last share shorter)
    for m, n, k in ((37, 40, 96 * cfg.split), (16, 48, 64 * cfg.split), (20, 16, 7 * cfg.block_k)):
        assert fits(m, n, k, cfg)
        x = torch.randn(m, k, generator=gen).to(DEV, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
        b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
        out = splitk_gemm(x, w, b, cfg)
        assert rel_err(out, ref(x, w, b)) < 1e-2, (m, n, k)
        if cfg.split > 1:
            assert torch.equal(splitk_gemm(x, w, b, cfg), out)  # partials summed in split order
            counters = ticket_counters(x.device, "splitk_gemm", 64)
            assert counters is not None and int(counters.abs().sum()) == 0  # every ticket put back


def test_fits_needs_whole_k_steps_and_a_share_for_every_split() -> None:
    cfg = SplitKConfig(block_k=64, split=4)
    assert fits(128, 4096, 4096, cfg) and fits(128, 4096, 4096 + 64, cfg) and not fits(0, 4096, 4096, cfg)
    assert not fits(128, 4096, 4096 + 32, cfg)  # not a whole number of steps
    assert fits(1, 16, 5 * 64, SplitKConfig(block_k=64, split=3)) and not fits(1, 16, 5 * 64, SplitKConfig(block_k=64, split=4))
