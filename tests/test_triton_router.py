"""Triton router top-k (softmax; DeepSeek noaux_tc grouped) vs the torch reference paths.

CPU: TRITON_INTERPRET=1, tiny shapes. Fresh random inputs; the router math is float32, so weights
agree within 1e-6 (abs and rel) and ids agree exactly: same order for softmax top-k (both sorted
descending), same set per row for grouped top-k (torch's sorted=False order is unspecified, so both
are sorted by id before comparing). bfloat16 logits tie often; there ties may pick other ids of the
same score, so that case checks the kernel's ids against the reference probabilities instead.
The fused router (GEMV + selection in one launch) is checked against F.linear + the torch selection:
float32 GEMV sums in another order, so ids must match and weights agree within 1e-5; bfloat16 logits are
rounded like a bf16 nn.Linear, then compared as in the bf16 top-k case."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

import torch.nn.functional as F

from ftransformers.kernels import triton_router
from ftransformers.kernels.triton_router import fused_router_topk, grouped_topk_sigmoid, softmax_topk
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


FUSED_TOKENS = [1, 7, 16]
FUSED_TOL = {"atol": 1e-5, "rtol": 1e-5}


def router_inputs(t: int, e: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=gen).to(DEV, dtype)
    weight = (torch.randn(e, d, generator=gen) * 2 / d**0.5).to(DEV, dtype)
    return hidden, weight


@pytest.mark.parametrize("t", FUSED_TOKENS)
@pytest.mark.parametrize("e,d,k", [(128, 320, 8), (60, 72, 4)])
@pytest.mark.parametrize("renorm", [False, True])
def test_fused_router_softmax_fp32(t: int, e: int, d: int, k: int, renorm: bool) -> None:
    hidden, weight = router_inputs(t, e, d, torch.float32, 100 * t + e)
    w, ids = fused_router_topk(hidden, weight, k, softmax=True, renormalize=renorm, round_logits=True)
    w_ref, ids_ref = select_experts_softmax_torch(F.linear(hidden, weight), k, renorm)
    assert w.shape == ids.shape == (t, k) and ids.dtype == torch.int64
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, **FUSED_TOL)


@pytest.mark.parametrize("t", FUSED_TOKENS)
def test_fused_router_softmax_bf16(t: int) -> None:
    e, d, k = 128, 256, 8
    hidden, weight = router_inputs(t, e, d, torch.bfloat16, 7 * t)
    w, ids = fused_router_topk(hidden, weight, k, softmax=True, renormalize=True, round_logits=True)
    logits = F.linear(hidden.float(), weight.float()).to(torch.bfloat16)  # what a bf16 nn.Linear returns
    w_ref, _ = select_experts_softmax_torch(logits, k, True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    picked = probs.gather(1, ids)
    torch.testing.assert_close(picked / picked.sum(-1, keepdim=True), w, **FUSED_TOL)
    torch.testing.assert_close(w, w_ref, **FUSED_TOL)  # ties carry equal weights
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("t", FUSED_TOKENS if CUDA else [1, 7])
@pytest.mark.parametrize("e,d,groups,topk_group,k", [(256, 200, 8, 4, 8), (48, 64, 4, 4, 5), (16, 32, None, None, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_router_grouped(t: int, e: int, d: int, groups, topk_group, k: int, dtype: torch.dtype) -> None:
    hidden, weight = router_inputs(t, e, d, dtype, 31 * t + e)
    corr = (torch.randn(e, generator=torch.Generator().manual_seed(e)) * 0.5).to(DEV)
    w, ids = fused_router_topk(
        hidden, weight, k, softmax=False, renormalize=True, num_expert_group=groups, topk_group=topk_group,
        correction_bias=corr, routed_scaling_factor=2.5,
    )  # fmt: skip
    logits = F.linear(hidden.float(), weight.float())  # DeepSeek's router: float32 GEMV
    w_ref, ids_ref = grouped_topk_torch(logits, k, groups, topk_group, corr, True, 2.5)
    ids_s, order = ids.sort(dim=-1)
    ids_ref_s, order_ref = ids_ref.sort(dim=-1)
    assert torch.equal(ids_s, ids_ref_s)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), **FUSED_TOL)


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("groups,topk_group", [(8, 4), (None, None)])
def test_fused_router_sigmoid_without_bias(t: int, groups, topk_group) -> None:
    # Without a correction bias each pick's weight is the score it won with (WEIGHT_IS_BEST)
    e, d, k = 64, 96, 6
    hidden, weight = router_inputs(t, e, d, torch.float32, 13 * t + e)
    w, ids = fused_router_topk(hidden, weight, k, softmax=False, renormalize=True, num_expert_group=groups,
                               topk_group=topk_group, routed_scaling_factor=1.5)  # fmt: skip
    w_ref, ids_ref = grouped_topk_torch(F.linear(hidden, weight), k, groups, topk_group, None, True, 1.5)
    ids_s, order = ids.sort(dim=-1)
    ids_ref_s, order_ref = ids_ref.sort(dim=-1)
    assert torch.equal(ids_s, ids_ref_s)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), **FUSED_TOL)


@pytest.mark.parametrize("softmax", [True, False])
def test_fused_router_weight_from_best_is_bitwise_the_sum(softmax: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pick's weight read off the max it won with equals the one-hot sum of its score bit for bit
    e, d, k = 128, 256, 8
    hidden, weight = router_inputs(3, e, d, torch.bfloat16, 77)
    call = partial(fused_router_topk, hidden, weight, k, softmax=softmax, renormalize=True, round_logits=True,
                   routed_scaling_factor=1.0 if softmax else 2.0)  # fmt: skip
    monkeypatch.setattr(triton_router, "PACKED_SELECT", False)  # the float selection, where WEIGHT_FROM_BEST applies
    w_best, ids_best = call()
    monkeypatch.setattr(triton_router, "WEIGHT_FROM_BEST", False)
    w_sum, ids_sum = call()
    assert torch.equal(ids_best, ids_sum)
    assert torch.equal(w_best, w_sum)


def tied_router_inputs(t: int, e: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # every expert's gate row repeated by a later expert, and a quarter of them negated: exactly tied logits
    # (the lower expert must win), ties among negative logits, and logits of both signs around 0
    hidden, weight = router_inputs(t, e, d, dtype, seed)
    weight[: e // 4] = -weight[: e // 4]
    weight[e // 2 :] = weight[: e // 2]
    return hidden, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("inputs", ["random", "tied", "negative"])
@pytest.mark.parametrize("e,k", [(128, 8), (60, 4)])  # 60: a selection tile padded to 64
def test_fused_router_packed_keys_select_as_the_float_path(
    dtype: torch.dtype, renorm: bool, inputs: str, e: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PACKED_SELECT (one int32 max a pick, over logits) picks the same experts in the same order as the float
    # softmax path, ties to the lowest expert, with weights within float32 rounding of its (and torch's)
    d, t = 256, 5
    tied = inputs == "tied"
    hidden, weight = (tied_router_inputs if tied else router_inputs)(t, e, d, dtype, 41 + renorm)
    if inputs == "negative":  # every logit below 0: the picks are the smallest magnitudes
        hidden, weight = hidden.abs(), -weight.abs()
    call = partial(fused_router_topk, hidden, weight, k, softmax=True, renormalize=renorm, round_logits=True,
                   routed_scaling_factor=1.0)  # fmt: skip
    w_packed, ids_packed = call()
    monkeypatch.setattr(triton_router, "PACKED_SELECT", False)
    w_float, ids_float = call()
    assert torch.equal(ids_packed, ids_float)
    torch.testing.assert_close(w_packed, w_float, **TOL)
    if tied:  # expert i + e / 2 ties with i: picked after it (other experts may tie too), never before or alone
        for row in ids_packed.tolist():
            assert all(i - e // 2 in row[:j] for j, i in enumerate(row) if i >= e // 2), row
    if dtype == torch.bfloat16:  # the interpreter's float16 casts truncate, so only bf16 logits equal torch's here
        logits = F.linear(hidden.float(), weight.float()).to(dtype)
        w_ref, _ = select_experts_softmax_torch(logits, k, renorm)  # (bf16 logits tie; torch's tie order is unspecified)
        torch.testing.assert_close(w_packed, w_ref, **FUSED_TOL)


def test_fused_router_counter_resets() -> None:
    # The last program hands the ticket counter back at 0, so repeated launches agree.
    hidden, weight = router_inputs(3, 64, 96, torch.float32, 5)
    first = fused_router_topk(hidden, weight, 4, softmax=True, renormalize=True)
    for _ in range(3):
        again = fused_router_topk(hidden, weight, 4, softmax=True, renormalize=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert int(triton_router._router_counter(hidden.device).item()) == 0


def test_router_softmax_topk_dispatch() -> None:
    # The layer entry point: the fused kernel at decode sizes on a GPU, F.linear + top-k otherwise.
    from ftransformers.layers.moe.topk import router_softmax_topk

    for t in (2, triton_router.MAX_FUSED_TOKENS // 2 + 1, triton_router.MAX_FUSED_TOKENS + 1):
        hidden, weight = router_inputs(t, 64, 96, torch.float32, t)
        w, ids = router_softmax_topk(hidden, weight, 4, True)
        w_ref, ids_ref = select_experts_softmax_torch(F.linear(hidden, weight), 4, True)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, **FUSED_TOL)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay() -> None:
    t, e = 16, 256
    logits = logits_for(t, e, torch.float32, 11)
    corr = torch.randn(e, device=DEV) * 0.3
    hidden, weight = router_inputs(t, e, 512, torch.bfloat16, 13)
    fused = partial(fused_router_topk, hidden, weight, 8, softmax=False, renormalize=True, num_expert_group=8,
                    topk_group=4, correction_bias=corr, routed_scaling_factor=2.5)  # fmt: skip
    for _ in range(2):  # warm up (compile) outside the capture
        softmax_topk(logits, 8, True)
        grouped_topk_sigmoid(logits, 8, 8, 4, corr, True, 2.5)
        fused()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = softmax_topk(logits, 8, True)
        out_g = grouped_topk_sigmoid(logits, 8, 8, 4, corr, True, 2.5)
        out_f = [fused() for _ in range(3)]  # three launches on one counter
    logits.copy_(logits_for(t, e, torch.float32, 12))
    hidden.copy_(router_inputs(t, e, 512, torch.bfloat16, 14)[0])
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    ref_f = grouped_topk_torch(F.linear(hidden.float(), weight.float()), 8, 8, 4, corr, True, 2.5)
    for w_f, ids_f in out_f:
        assert torch.equal(ids_f.sort(-1)[0], ref_f[1].sort(-1)[0])
        torch.testing.assert_close(w_f.sort(-1)[0], ref_f[0].sort(-1)[0], **FUSED_TOL)
    ref_s = select_experts_softmax_torch(logits, 8, True)
    ref_g = grouped_topk_torch(logits, 8, 8, 4, corr, True, 2.5)
    assert torch.equal(out_s[1], ref_s[1])
    torch.testing.assert_close(out_s[0], ref_s[0], **TOL)
    assert torch.equal(out_g[1].sort(-1)[0], ref_g[1].sort(-1)[0])
