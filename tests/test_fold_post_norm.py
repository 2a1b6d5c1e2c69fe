"""The RMSNorm after attention folded into its neighbours at one decode row (models/llama.py FOLD_POST_NORM):
o_proj's `forward_residual` adds the residual and sums the new stream's squares in parts, and the Qwen3-MoE
block's `forward_normed` routes on the normed stream and feeds it to the experts, without the norm's launch.

Checked against the unfolded path (the norm's module, then the block) on fresh random inputs. CPU: the linear
does not fold (it returns its plain output and no sums); the block's folded router runs in Triton's interpreter,
float32, rel 1e-5. CUDA: bfloat16, the stream within the GEMV's tolerance of the norm's own sum and the block's
output within 1e-2 (the bf16 tolerance): the folded norm sums its statistic in another order, which may move a
normed element by one bf16 rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.triton_router import can_fuse_router
from ftransformers.layers.linear import RowParallelLinear
from ftransformers.layers.norm import RMSNorm
from ftransformers.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from tests.model_harness import _tiny_config

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_linear_forward_residual() -> None:
    gen = torch.Generator().manual_seed(3)
    o_proj = RowParallelLinear(256, 96).to(DEV, DTYPE)
    with torch.no_grad():
        o_proj.weight.copy_(torch.randn(96, 256, generator=gen) / 16)
    x = torch.randn(1, 256, generator=gen).to(DEV, DTYPE)
    res = torch.randn(1, 96, generator=gen).to(DEV, DTYPE)
    new_res, ss = o_proj.forward_residual(x, res)
    if not CUDA:  # no one-row GEMV on the CPU: the plain product, the sum left to the norm
        assert ss is None and torch.equal(new_res, o_proj(x))
        return
    ref = (o_proj(x).float() + res.float()).to(DTYPE)
    assert rel_err(new_res, ref) < 1e-2 and ss is not None
    torch.testing.assert_close(ss.sum(), (new_res.float() ** 2).sum(), rtol=1e-5, atol=1e-5)
    _, none = o_proj.forward_residual(torch.randn(2, 256, device=DEV, dtype=DTYPE), res.expand(2, 96))
    assert none is None  # two rows: not folded


def test_moe_block_forward_normed_matches_norm_then_block(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _tiny_config("qwen3_moe", {})
    block = Qwen3MoeSparseMoeBlock(config)
    block.experts.backend = "torch_native"
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(config.hidden_size, generator=gen))
    block, norm = block.to(DEV, DTYPE), norm.to(DEV, DTYPE)
    for seed in range(4):
        stream = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEV, DTYPE)
        ss = (stream.float() ** 2).view(1, 8, -1).sum(-1)  # the parts a GEMV of 8 programs would leave
        assert can_fuse_router(stream, block.gate.weight)  # the folded router runs, not the fallback
        with monkeypatch.context() as m:
            m.setattr(RMSNorm, "forward", lambda *a, **k: pytest.fail("the norm's module ran"))
            out = block.forward_normed(stream, ss, norm)
        ref = block(norm(stream))
        assert rel_err(out, ref) <= (1e-2 if CUDA else 1e-5), (seed, rel_err(out, ref))
