"""One int4 MoE token in one persistent launch (kernels/gluon_moe_w4_fused.py) against quant_moe_ref.

GPU (compute capability 9.x): Qwen3-30B-A3B's experts (E 128, D 2048, I 768, top-8) with zeros and without,
bf16 / fp16 activations and scales, groups 32 / 64 / 128; other shapes the kernel takes (D 1024 and 4096 where
shared memory allows, I 512 / 1024, top-k 4 and 6, whose slots past top-k are masked); CUDA-graph replays of
many routings (the grid barrier's counters must be back to zero after every launch); fused_moe_w4's routing
to it. Fresh random words, scales and zeros every case. Tolerance as tests/test_triton_moe_w4.py: ||out - ref|| /
||ref|| <= 1e-2 (same float32 weights; summation order and act's 16-bit rounding differ).
Anywhere: `plan` declines CPU tensors; the kernel's Hopper compile is checked in tests/test_gluon_mma_compile.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_w4 import CUDA, DEV, TOL, make_routing, random_qw, rel_err

from ftransformers.kernels import gluon_moe_w4_fused as fused
from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.quant_formats import quant_moe_ref

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
QWEN = (2048, 768, 128, 8)  # D, I, E, top-k


def experts(d: int, inter: int, e: int, gen: torch.Generator, **qkw):
    return random_qw("int4", e, 2 * inter, d, gen, **qkw), random_qw("int4", e, d, inter, gen, **qkw)


@pytest.mark.skipif(CUDA, reason="the CPU case")
def test_plan_declines_cpu_tensors() -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    w13, w2 = experts(2048, 768, 8, gen)
    assert fused.plan(torch.randn(1, 2048, dtype=torch.bfloat16), w13, w2, 8) is None


@pytest.mark.skipif(not HOPPER, reason="Gluon kernel for compute capability 9.x")
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_qwen3_experts_match_reference(zeros: bool, dtype: torch.dtype, group: int) -> None:
    d, inter, e, k = QWEN
    gen = torch.Generator(DEV).manual_seed(group + 2 * int(zeros))
    w13, w2 = experts(d, inter, e, gen, group=group, zeros=zeros, scale_dtype=dtype)
    hidden = torch.randn(1, d, generator=gen, device=DEV).to(dtype)
    weights, ids = make_routing(1, e, k, gen)
    assert fused.takes(hidden, w13, w2, k)
    out = fused.moe_w4_fused(hidden, w13, w2, weights.reshape(-1).float().contiguous(), ids)
    assert out is not None and out.dtype == dtype
    err = rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids))
    assert err <= TOL, (zeros, dtype, group, err)


@pytest.mark.skipif(not HOPPER, reason="Gluon kernel for compute capability 9.x")
@pytest.mark.parametrize("d,inter,k", [(1024, 768, 8), (2048, 512, 8), (2048, 1024, 8), (2048, 768, 4),
                                       (2048, 768, 6), (1024, 256, 2)])  # fmt: skip
def test_other_shapes_match_reference(d: int, inter: int, k: int) -> None:
    gen = torch.Generator(DEV).manual_seed(d + inter + k)
    w13, w2 = experts(d, inter, 64, gen, group=128, zeros=True)
    hidden = torch.randn(1, d, generator=gen, device=DEV).to(torch.bfloat16)
    weights, ids = make_routing(1, 64, k, gen)
    assert fused.takes(hidden, w13, w2, k), (d, inter, k)
    out = fused.moe_w4_fused(hidden, w13, w2, weights.reshape(-1).float().contiguous(), ids)
    assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL


@pytest.mark.skipif(not HOPPER, reason="Gluon kernel for compute capability 9.x")
def test_plan_declines_what_does_not_fit() -> None:
    gen = torch.Generator(DEV).manual_seed(5)
    hidden = torch.randn(1, 4096, device=DEV).to(torch.bfloat16)
    w13, w2 = experts(4096, 768, 8, gen)  # 2 x 6 units of 16 KB words: past shared memory
    assert not fused.takes(hidden, w13, w2, 8)
    w13, w2 = experts(2048, 768, 8, gen)
    two = torch.randn(2, 2048, device=DEV).to(torch.bfloat16)
    assert not fused.takes(two, w13, w2, 8) and fused.takes(two[:1], w13, w2, 8)
    assert not fused.takes(two[:1], w13, w2, 16)  # top-k past the down tile's slots
    w13b, w2b = experts(2048, 2048, 8, gen)  # I / 8 past the down tile's 128 words
    assert not fused.takes(two[:1], w13b, w2b, 8)


@pytest.mark.skipif(not HOPPER, reason="Gluon kernel for compute capability 9.x")
def test_cuda_graph_replays_many_routings() -> None:
    d, inter, e, k = QWEN
    gen = torch.Generator(DEV).manual_seed(11)
    w13, w2 = experts(d, inter, e, gen, zeros=True)
    hidden = torch.randn(1, d, generator=gen, device=DEV).to(torch.bfloat16)
    weights, ids = make_routing(1, e, k, gen)
    tw = weights.reshape(-1).float().contiguous()
    fused.moe_w4_fused(hidden, w13, w2, tw, ids)  # the ticket counters' pool exists before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.moe_w4_fused(hidden, w13, w2, tw, ids)
    assert out is not None
    for seed in range(6):
        g = torch.Generator(DEV).manual_seed(100 + seed)
        hidden.copy_(torch.randn(1, d, generator=g, device=DEV).to(torch.bfloat16))
        w, i = make_routing(1, e, k, g)
        tw.copy_(w.reshape(-1).float())
        ids.copy_(i)
        graph.replay()
        assert rel_err(out, quant_moe_ref(hidden, w13, w2, w, i)) <= TOL, seed
    torch.cuda.synchronize()
    counters = fused.ticket_counters(hidden.device, "moe_w4_fused", 2)
    assert counters is not None and counters.tolist() == [0, 0]


@pytest.mark.skipif(not HOPPER, reason="Gluon kernel for compute capability 9.x")
def test_fused_moe_w4_takes_one_int4_token_here(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = fused.moe_w4_fused
    monkeypatch.setattr(fused, "moe_w4_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    d, inter, e, k = QWEN
    gen = torch.Generator(DEV).manual_seed(13)
    w13, w2 = experts(d, inter, e, gen, zeros=True)

    def taken(t: int) -> bool:
        hidden = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
        weights, ids = make_routing(t, e, k, gen)
        before = len(calls)
        out = w4.fused_moe_w4(hidden, w13, w2, weights, ids)
        assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL, t
        return len(calls) > before

    assert taken(1) and not taken(2)
    monkeypatch.setattr(fused, "ENABLED", False)
    assert not taken(1)
