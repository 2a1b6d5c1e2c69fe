"""MoE router top-k in one launch per layer: one program per token, all E experts in one block.

- `softmax_topk`: softmax (float32) -> top-k -> optional renormalisation (Qwen-MoE / Mixtral).
- `grouped_topk_sigmoid`: DeepSeek-V3 `noaux_tc`: sigmoid scores, + correction bias for selection
  only, group score = sum of the two best biased scores per group, keep `topk_group` groups, top-k
  experts among them; weights are the unbiased sigmoid scores, renormalised (`+ 1e-20`) when asked,
  times `routed_scaling_factor`.

Selection is an iterative argmax, K times. Output order: descending by the selection score (softmax
prob; biased sigmoid score). Ties go to the lowest expert index (and, for groups, the lowest group
index); torch.topk leaves the order of ties unspecified, so on exactly tied scores the ids may differ
from the torch reference, never otherwise. No host sync, outputs sized by shape only: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    num = tl.exp(x - tl.max(x, 0))
    p = num / tl.sum(num, 0)  # [BLOCK_E]; masked lanes are 0
    p = tl.where(valid, p, float("-inf"))
    koffs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        w = tl.where(koffs == i, best, w)
        ids = tl.where(koffs == i, idx, ids)
        p = tl.where(offs == idx, float("-inf"), p)
    if RENORM:
        w = w / tl.sum(w, 0)
    kmask = koffs < K
    tl.store(w_ptr + row * K + koffs, w, mask=kmask)
    tl.store(ids_ptr + row * K + koffs, ids.to(ids_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, scale,
    G: tl.constexpr, S: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]  # [BLOCK_G, 1]
    s = tl.arange(0, BLOCK_S)[None, :]  # [1, BLOCK_S]
    eid = g * S + s  # [BLOCK_G, BLOCK_S] expert index
    valid = (g < G) & (s < S)
    x = tl.load(logits_ptr + row * stride_l + eid, mask=valid, other=0.0).to(tl.float32)
    scores = tl.sigmoid(x)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + eid, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        # group_scores: [BLOCK_G], sum of the two best biased scores in each group
        top1 = tl.max(choice, 1)
        arg1 = tl.min(tl.where(choice == top1[:, None], s, BLOCK_S), 1)
        top2 = tl.max(tl.where(s == arg1[:, None], float("-inf"), choice), 1)
        gs = tl.where(tl.arange(0, BLOCK_G) < G, top1 + top2, float("-inf"))
        gidx = tl.arange(0, BLOCK_G)
        keep = gidx < 0  # [BLOCK_G] all False
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gs, 0)
            pick = tl.min(tl.where(gs == best, gidx, BLOCK_G), 0)
            keep = keep | (gidx == pick)
            gs = tl.where(gidx == pick, float("-inf"), gs)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    koffs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    big = BLOCK_G * BLOCK_S
    for i in tl.static_range(K):
        best = tl.max(tl.max(choice, 1), 0)
        idx = tl.min(tl.min(tl.where(choice == best, eid, big), 1), 0)
        hit = (eid == idx) & valid
        w = tl.where(koffs == i, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), w)
        ids = tl.where(koffs == i, idx, ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    w = w * scale
    kmask = koffs < K
    tl.store(w_ptr + row * K + koffs, w, mask=kmask)
    tl.store(ids_ptr + row * K + koffs, ids.to(ids_ptr.dtype.element_ty), mask=kmask)


def _rows(router_logits: torch.Tensor) -> torch.Tensor:
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    return router_logits


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, ids_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    # router_logits: [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] ids_dtype)
    logits = _rows(router_logits)
    t, e = logits.shape
    assert 0 < top_k <= e <= MAX_EXPERTS, (top_k, e)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=ids_dtype, device=logits.device)
    if t > 0:
        block_e = triton.next_power_of_2(e)
        _softmax_topk_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0),
            K=top_k, RENORM=bool(renormalize), BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=4 if block_e >= 256 else 2,
        )  # fmt: skip
    return weights, ids


def grouped_topk_sigmoid(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None = None,  # [E]
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns topk_weights [T, top_k] float32 and topk_ids [T, top_k] ids_dtype."""
    logits = _rows(router_logits)
    t, e = logits.shape
    grouped = num_expert_group is not None and num_expert_group > 1
    groups = num_expert_group if grouped else 1
    assert e % groups == 0 and 0 < top_k <= e <= MAX_EXPERTS, (e, groups, top_k)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=ids_dtype, device=logits.device)
    if t > 0:
        bias = correction_bias.contiguous() if correction_bias is not None else weights
        block_g, block_s = triton.next_power_of_2(groups), triton.next_power_of_2(e // groups)
        _grouped_topk_kernel[(t,)](
            logits, bias, weights, ids, logits.stride(0), float(routed_scaling_factor),
            G=groups, S=e // groups, TOPK_GROUP=int(topk_group or groups), K=top_k,
            HAS_BIAS=correction_bias is not None, GROUPED=grouped, RENORM=bool(renormalize),
            BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=4 if block_g * block_s >= 256 else 2,
        )  # fmt: skip
    return weights, ids
