"""Triton router top-k (softmax; DeepSeek noaux_tc grouped) vs the torch reference paths.

CPU: TRITON_INTERPRET=1, tiny shapes. Fresh random inputs; the router math is float32, so weights
agree within 1e-6 (abs and rel) and ids agree exactly: same order for softmax top-k (both sorted
descending), same set per row for grouped top-k (torch's sorted=False order is unspecified, so both
are sorted by id before comparing). bfloat16 logits tie often; there ties may pick other ids of the
same score, so that case checks the kernel's ids against the reference probabilities instead."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.triton_router import grouped_topk_sigmoid, softmax_topk
from ftransformers.layers.moe.grouped_topk import grouped_topk, grouped_topk_torch
from ftransformers.layers.moe.topk import select_experts_softmax, select_experts_softmax_torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOKENS = [1, 7, 64]
TOKENS_GROUPED = TOKENS if CUDA else [1, 64]  # the CPU interpreter is slow: fewer cases
TOL = {"atol": 1e-6, "rtol": 1e-6}


def logits_for(t: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=gen) * 2).to(DEV, dtype)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8), (256, 8)])
@pytest.mark.parametrize("renorm", [False, True])
def test_softmax_topk_fp32(t: int, e: int, k: int, renorm: bool) -> None:
    logits = logits_for(t, e, torch.float32, 1000 * t + e + k)
    w, ids = softmax_topk(logits, k, renorm)
    w_ref, ids_ref = select_experts_softmax_torch(logits, k, renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (t, k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **TOL)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("renorm", [False, True])
def test_softmax_topk_bf16_ties(t: int, renorm: bool) -> None:
    e, k = 128, 8
    logits = logits_for(t, e, torch.bfloat16, 7 + t)
    w, ids = softmax_topk(logits, k, renorm, ids_dtype=torch.int32)
    w_ref, _ = select_experts_softmax_torch(logits, k, renorm)
    assert ids.dtype == torch.int32
    torch.testing.assert_close(w, w_ref, **TOL)  # tied experts carry the same weight
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    picked = probs.gather(1, ids.long())
    if renorm:
        picked = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(picked, w, **TOL)
    assert all(len(set(row)) == k for row in ids.tolist())


GROUPED = [  # (E, n_group, topk_group, K)
    (256, 8, 4, 8),  # DeepSeek-V3
    (64, 8, 3, 6),
    (32, 4, 2, 4),
    (48, 4, 4, 5),  # every group kept
    (384, 1, 1, 8),  # Kimi K2
    (16, None, None, 2),
]


@pytest.mark.parametrize("t", TOKENS_GROUPED)
@pytest.mark.parametrize("e,groups,topk_group,k", GROUPED)
@pytest.mark.parametrize(
    "bias,renorm,scale", [(True, True, 2.5), (False, False, 1.0)] + ([(True, False, 1.5)] if CUDA else [])
)
def test_grouped_topk(t: int, e: int, groups, topk_group, k: int, bias: bool, renorm: bool, scale: float) -> None:
    seed = 31 * t + e + k + int(bias)
    logits = logits_for(t, e, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    corr = (torch.randn(e, generator=gen) * 0.5).to(DEV) if bias else None
    args = (logits, k, groups, topk_group, corr, renorm, scale)
    w, ids = grouped_topk_sigmoid(*args)
    w_ref, ids_ref = grouped_topk_torch(*args)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (t, k)
    ids_s, order = ids.sort(dim=-1)
    ids_ref_s, order_ref = ids_ref.sort(dim=-1)
    assert torch.equal(ids_s, ids_ref_s)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), **TOL)
    # the kernel's own order: descending by the biased selection score
    choice = torch.sigmoid(logits) + (corr if bias else 0)
    assert bool((choice.gather(1, ids).diff(dim=-1) <= 0).all())


def test_dispatch_by_device() -> None:
    logits = logits_for(5, 64, torch.float32, 3)
    w, ids = select_experts_softmax(logits, 4, True)
    w_ref, ids_ref = select_experts_softmax_torch(logits, 4, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **TOL)
    corr = torch.linspace(-0.2, 0.2, 64, device=DEV)
    w, ids = grouped_topk(logits, 4, 4, 2, corr, True, 2.5)
    w_ref, ids_ref = grouped_topk_torch(logits, 4, 4, 2, corr, True, 2.5)
    assert torch.equal(ids.sort(-1)[0], ids_ref.sort(-1)[0])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay() -> None:
    t, e = 16, 256
    logits = logits_for(t, e, torch.float32, 11)
    corr = torch.randn(e, device=DEV) * 0.3
    for _ in range(2):  # warm up (compile) outside the capture
        softmax_topk(logits, 8, True)
        grouped_topk_sigmoid(logits, 8, 8, 4, corr, True, 2.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = softmax_topk(logits, 8, True)
        out_g = grouped_topk_sigmoid(logits, 8, 8, 4, corr, True, 2.5)
    logits.copy_(logits_for(t, e, torch.float32, 12))
    graph.replay()
    torch.cuda.synchronize()
    ref_s = select_experts_softmax_torch(logits, 8, True)
    ref_g = grouped_topk_torch(logits, 8, 8, 4, corr, True, 2.5)
    assert torch.equal(out_s[1], ref_s[1])
    torch.testing.assert_close(out_s[0], ref_s[0], **TOL)
    assert torch.equal(out_g[1].sort(-1)[0], ref_g[1].sort(-1)[0])
