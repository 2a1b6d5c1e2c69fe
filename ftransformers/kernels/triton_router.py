"""MoE router top-k in one launch per layer: one program per token, all E experts in one block.

- `softmax_topk`: softmax (float32) -> top-k -> optional renormalisation (Qwen-MoE / Mixtral).
- `grouped_topk_sigmoid`: DeepSeek-V3 `noaux_tc`: sigmoid scores, + correction bias for selection
  only, group score = sum of the two best biased scores per group, keep `topk_group` groups, top-k
  experts among them; weights are the unbiased sigmoid scores, renormalised (`+ 1e-20`) when asked,
  times `routed_scaling_factor`.

Selection is an iterative argmax, K times (the fused router takes a pick's weight from the max it won
with where the selection score is the weight itself). Output order: descending by the selection score (softmax
prob; biased sigmoid score). Ties go to the lowest expert index (and, for groups, the lowest group
index); torch.topk leaves the order of ties unspecified, so on exactly tied scores the ids may differ
from the torch reference, never otherwise. No host sync, outputs sized by shape only: graph-safe.

`fused_router_topk` (decode, T <= MAX_FUSED_TOKENS): the router GEMV (hidden @ gate_weight^T) and the
selection in ONE launch. Programs split the weight over (expert block, D split) and store fp32
partial logits; the last program to finish (a ticket of kernels/tickets.py, which it resets to 0)
sums the partials in split order (deterministic) and runs the selection for all tokens at once on a
[T, G, S] tile. For softmax over 16-bit logits that selection runs on the logits as packed int32 keys, one max a
pick (PACKED_SELECT; same picks and tie rule, weights within float32 rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import l2_prefetch, pdl_enter, pdl_launch, prefetch_lines
from ftransformers.kernels.tickets import last_one_out, ticket_counters

MAX_EXPERTS = 1024
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_FUSED_TOKENS = 16
MAX_FUSED_EXPERTS = 512
_ROUND = {torch.bfloat16: 1, torch.float16: 2}  # logits rounding modes of the fused router
# The fused router takes a pick's weight from the max it won with where that max is the score (softmax, or sigmoid
# without a bias): one reduction a pick fewer. 0 sums the score over the pick's one-hot, as before (an A/B toggle,
# `set=triton_router.WEIGHT_FROM_BEST=0` in benchmarks/ab_decode.py). H100, Qwen3-30B-A3B B=1 in one process
# (benchmarks/results/ab_handoff_30b_w4a16_h100.*, ab_pickweight_30b_bf16_h100.*): the router's critical path
# 209 -> 202 us a step in W4A16 (step 1.786 -> 1.770 ms), 206 -> 197 in bf16 (3.184 -> 3.153 ms)
WEIGHT_FROM_BEST = True
# Softmax routing over 16-bit logits (bf16 / fp16, rounded as nn.Linear returns them): the selection runs on one
# int32 key an expert, (logit in an order-preserving 16-bit code) << 16 | (65535 - expert), so a pick is ONE max
# reduction (the highest logit, the lowest expert on ties) instead of a max and an argmin, and the softmax over all
# experts is skipped: softmax is monotonic, so the picks are the same, and a pick's weight is exp(its logit - the
# first pick's), over their sum (renormalised) or over the sum of all experts' (not). 0 keeps the float path (an
# A/B toggle, `set=triton_router.PACKED_SELECT=0` in benchmarks/ab_decode.py).
PACKED_SELECT = True
# The fused router's launch: about this many phase-1 programs (expert blocks x D splits), a selection tile of at
# least this many token rows (H100: [4, G, S] ran faster than [1, G, S]), and its warps (0: 8 for tiles of
# 4096 elements or more, else 4). Module constants for benchmarks/ab_decode.py's `set=`. H200, Qwen3-30B-A3B
# bf16 B=1, with the packed selection (benchmarks/results/ab_router_shape_30b_bf16_h200.log): 2.460 ms; 32 or
# 16 programs, selection tiles of 1 or 2 rows, 2 or 8 warps all 2.49-2.65.
ROUTER_PROGRAMS = 128
ROUTER_SEL_T = 4
ROUTER_WARPS = 0


@cached_launch
@triton.jit
def _softmax_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
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


@cached_launch
@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, scale,
    G: tl.constexpr, S: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # one row as the fused router's selection on a [1, G, S] tile (_float_topk), the pick's weight summed over
    # its one-hot (the bias, when present, is not in the score)
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g3 = tl.arange(0, BLOCK_G)[None, :, None]
    s3 = tl.arange(0, BLOCK_S)[None, None, :]
    eid = g3 * S + s3  # [1, BG, BS] expert index
    ev = (g3 < G) & (s3 < S)
    x = tl.load(logits_ptr + row * stride_l + eid, mask=ev, other=0.0).to(tl.float32)
    w, ids = _float_topk(x, eid, ev, s3, bias_ptr, G, TOPK_GROUP, K, False, HAS_BIAS, GROUPED, RENORM, False, 1,
                         BLOCK_G, BLOCK_S, BLOCK_K)  # fmt: skip
    w = w * scale
    koffs = tl.arange(0, BLOCK_K)[None, :]
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
        block_e = next_pow2(e)
        _softmax_topk_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0),
            K=top_k, RENORM=bool(renormalize), BLOCK_E=block_e, BLOCK_K=next_pow2(top_k),
            num_warps=4 if block_e >= 256 else 2,
            **pdl_launch(logits.device),
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
        block_g, block_s = next_pow2(groups), next_pow2(e // groups)
        _grouped_topk_kernel[(t,)](
            logits, bias, weights, ids, logits.stride(0), float(routed_scaling_factor),
            G=groups, S=e // groups, TOPK_GROUP=int(topk_group or groups), K=top_k,
            HAS_BIAS=correction_bias is not None, GROUPED=grouped, RENORM=bool(renormalize),
            BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=next_pow2(top_k),
            num_warps=4 if block_g * block_s >= 256 else 2,
            **pdl_launch(logits.device),
        )  # fmt: skip
    return weights, ids


@triton.jit
def _float_topk(logits, eid, ev, s3, bias_ptr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORM: tl.constexpr,
                WEIGHT_IS_BEST: tl.constexpr, SEL_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    # logits [SEL_T, BG, BS] float32 of experts eid (valid where ev) -> (weights, ids) [SEL_T, BK], unscaled:
    # scores (softmax, or sigmoid + bias for the selection), optional group pruning, K iterative argmaxes
    if SOFTMAX:
        lm = tl.where(ev, logits, float("-inf"))
        num = tl.exp(lm - tl.max(tl.max(lm, 2), 1)[:, None, None])
        scores = num / tl.sum(tl.sum(num, 2), 1)[:, None, None]
        choice = tl.where(ev, scores, float("-inf"))
    else:
        scores = tl.sigmoid(logits)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + eid, mask=ev, other=0.0).to(tl.float32)
        choice = tl.where(ev, choice, float("-inf"))
    if GROUPED:
        # group_scores [SEL_T, BG]: sum of the two best biased scores in each group
        top1 = tl.max(choice, 2)
        arg1 = tl.min(tl.where(choice == top1[:, :, None], s3, BLOCK_S), 2)
        top2 = tl.max(tl.where(s3 == arg1[:, :, None], float("-inf"), choice), 2)
        gidx = tl.arange(0, BLOCK_G)[None, :]  # [1, BG]
        gs = tl.where(gidx < G, top1 + top2, float("-inf"))
        keep = tl.zeros([SEL_T, BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.min(tl.where(gs == tl.max(gs, 1)[:, None], gidx, BLOCK_G), 1)  # [SEL_T]
            keep = tl.where(gidx == pick[:, None], 1, keep)
            gs = tl.where(gidx == pick[:, None], float("-inf"), gs)
        choice = tl.where(keep[:, :, None] != 0, choice, float("-inf"))
    koffs = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
    w_out = tl.zeros([SEL_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([SEL_T, BLOCK_K], dtype=tl.int32)
    for kk in tl.static_range(K):
        best = tl.max(tl.max(choice, 2), 1)  # [SEL_T]
        idx = tl.min(tl.min(tl.where(choice == best[:, None, None], eid, BLOCK_G * BLOCK_S), 2), 1)
        hit = (eid == idx[:, None, None]) & ev
        if WEIGHT_IS_BEST:  # choice is the score wherever it is finite: the pick's weight is best itself
            w_pick = best
        else:  # choice is score + bias: the pick's unbiased score, by a sum over its one-hot
            w_pick = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 2), 1)
        w_out = tl.where(koffs == kk, w_pick[:, None], w_out)
        ids = tl.where(koffs == kk, idx[:, None], ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        if SOFTMAX:
            w_out = w_out / tl.sum(w_out, 1)[:, None]
        else:
            w_out = w_out / (tl.sum(w_out, 1)[:, None] + 1e-20)
    return w_out, ids


@triton.jit
def _key_logit(key, ROUND: tl.constexpr):
    # _packed_softmax_topk's int32 key -> its logit, float32
    code = key >> 16  # arithmetic shift: the signed code
    bits = tl.where(code < 0, 0x7FFF - code, code)  # the 16-bit pattern
    if ROUND == 1:
        return (bits << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _packed_softmax_topk(logits, eid, ev, ROUND: tl.constexpr, RENORM: tl.constexpr, K: tl.constexpr,
                         SEL_T: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # logits [SEL_T, BG, BS] float32 holding 16-bit values (ROUND 1: bf16, 2: fp16) of experts eid (valid where
    # ev) -> softmax top-K (weights, ids) [SEL_T, BK], unscaled (PACKED_SELECT)
    if ROUND == 1:
        bits = (logits.to(tl.uint32, bitcast=True) >> 16).to(tl.int32)  # bf16 pattern
    else:
        bits = logits.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    bits = tl.where(bits == 0x8000, 0, bits)  # -0 ranks as +0
    # order-preserving code, signed: positives 0x0000.. (bits), negatives ..-1 (descending magnitude)
    code = tl.where(bits >= 0x8000, 0x7FFF - bits, bits)  # [-32768, 32767]
    key = tl.where(ev, (code << 16) | (0xFFFF - eid), -2147483648)  # distinct for distinct experts
    koffs = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
    picks = tl.zeros([SEL_T, BLOCK_K], dtype=tl.int32)
    first = tl.zeros([SEL_T], dtype=tl.int32)
    for kk in tl.static_range(K):
        best = tl.max(tl.max(key, 2), 1)  # [SEL_T]
        if kk == 0:
            first = best
        picks = tl.where(koffs == kk, best[:, None], picks)
        key = tl.where(key == best[:, None, None], -2147483648, key)
    ids = 0xFFFF - (picks & 0xFFFF)
    top = _key_logit(first, ROUND)[:, None]  # the first pick's logit: the max
    w = tl.where(koffs < K, tl.exp(_key_logit(picks, ROUND) - top), 0.0)
    if RENORM:
        w = w / tl.sum(w, 1)[:, None]
    else:
        z = tl.sum(tl.sum(tl.where(ev, tl.exp(logits - top[:, :, None]), 0.0), 2), 1)  # softmax's denominator
        w = w / z[:, None]
    return w, ids


@cached_launch
@triton.jit
def _fused_router_kernel(
    x_ptr, w_ptr, bias_ptr, part_ptr, counter_ptr, tw_ptr, ids_ptr, T, D, stride_xt, stride_we, scale,
    E: tl.constexpr, G: tl.constexpr, S: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORM: tl.constexpr,
    ROUND: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, SEL_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, D_TILES: tl.constexpr, N_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    PF_STRIDE: tl.constexpr, PF_LINES: tl.constexpr,
    WEIGHT_IS_BEST: tl.constexpr = False, PACKED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):  # fmt: skip
    # PACKED (SOFTMAX, ROUND 1 or 2, not GROUPED): the key selection of PACKED_SELECT.
    # WEIGHT_IS_BEST (softmax, or sigmoid without a bias): a pick's weight is the selection score it won with.
    # Phase 1, every program: part[pid_d, t, e] = x[t, d-range] . w[e, d-range] for one expert block.
    E_BLOCKS: tl.constexpr = (E + BLOCK_E - 1) // BLOCK_E
    if PREFETCH:  # this program's gate rows to L2 ahead of the wait
        pf_e = tl.minimum((tl.program_id(0) % E_BLOCKS) * BLOCK_E + tl.arange(0, BLOCK_E), E - 1)
        pf_d = tl.minimum((tl.program_id(0) // E_BLOCKS) * (D_TILES * BLOCK_D) + tl.arange(0, PF_LINES) * PF_STRIDE, D - 1)
        l2_prefetch(w_ptr + pf_e[:, None].to(tl.int64) * stride_we + pf_d[None, :], PREFETCH)
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    pid_e = pid % E_BLOCKS
    pid_d = pid // E_BLOCKS
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = pid_d * (D_TILES * BLOCK_D) + tl.arange(0, BLOCK_D)
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_d[None, :]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_we + offs_d[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for dt in range(D_TILES):
        d_ok = offs_d < D - dt * BLOCK_D
        x = tl.load(x_ptrs, mask=(offs_t[:, None] < T) & d_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=d_ok[:, None] & (offs_e[None, :] < E), other=0.0)
        if IEEE:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_D
        w_ptrs += BLOCK_D
    tl.store(part_ptr + (pid_d * BLOCK_T + offs_t[:, None]) * E + offs_e[None, :], acc, mask=offs_e[None, :] < E)
    # Phase 2, the last program only
    if last_one_out(counter_ptr, E_BLOCKS * N_SPLIT):
        t3 = tl.arange(0, SEL_T)[:, None, None]
        g3 = tl.arange(0, BLOCK_G)[None, :, None]
        s3 = tl.arange(0, BLOCK_S)[None, None, :]
        eid = g3 * S + s3  # [1, BG, BS] expert index
        ev = (g3 < G) & (s3 < S)  # [1, BG, BS]
        ld = ev & (t3 < T)
        logits = tl.zeros([SEL_T, BLOCK_G, BLOCK_S], dtype=tl.float32)
        for sp in tl.static_range(N_SPLIT):
            logits += tl.load(part_ptr + (sp * BLOCK_T + t3) * E + eid, mask=ld, other=0.0, cache_modifier=".cg")
        if ROUND == 1:  # the logits a bf16 nn.Linear returns: round to nearest even, in bits (exact
            # on the GPU and in the interpreter, whose float casts truncate)
            bits = logits.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            logits = bits.to(tl.float32, bitcast=True)
        elif ROUND == 2:
            logits = logits.to(tl.float16).to(tl.float32)
        if PACKED:
            w_out, ids = _packed_softmax_topk(logits, eid, ev, ROUND, RENORM, K, SEL_T, BLOCK_K)
        else:
            w_out, ids = _float_topk(logits, eid, ev, s3, bias_ptr, G, TOPK_GROUP, K, SOFTMAX, HAS_BIAS, GROUPED, RENORM,
                                     WEIGHT_IS_BEST, SEL_T, BLOCK_G, BLOCK_S, BLOCK_K)  # fmt: skip
        koffs = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        w_out = w_out * scale
        t2 = tl.arange(0, SEL_T)[:, None]
        omask = (t2 < T) & (koffs < K)
        tl.store(tw_ptr + t2 * K + koffs, w_out, mask=omask)
        tl.store(ids_ptr + t2 * K + koffs, ids.to(ids_ptr.dtype.element_ty), mask=omask)


def _router_counter(device: torch.device) -> torch.Tensor | None:
    return ticket_counters(device, "router", 1)


def max_fused_tokens(weight: torch.Tensor) -> int:
    """The one-launch router wins while the GEMV it saves outweighs its serial selection phase (H100,
    bench_router.py): up to T=16 for DeepSeek-V3's 3.7 MB gate, T=8 for Qwen3-30B-A3B's 0.5 MB one."""
    return MAX_FUSED_TOKENS if weight.numel() * weight.element_size() >= 2 << 20 else MAX_FUSED_TOKENS // 2


def can_fuse_router(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fused_router_topk takes this call: small T, on a GPU (or the interpreter in tests)."""
    return (
        hidden.dim() == 2
        and 0 < hidden.shape[0] <= max_fused_tokens(weight)
        and weight.shape[0] <= MAX_FUSED_EXPERTS
        and hidden.shape[1] == weight.shape[1]
        and hidden.device == weight.device
        and (hidden.is_cuda or _INTERPRET)
        and _router_counter(hidden.device) is not None
    )


def fused_router_topk(
    hidden: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [E, D] the router (gate) weight
    top_k: int,
    *,
    softmax: bool,
    renormalize: bool,
    round_logits: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,  # [E], sigmoid scoring only
    routed_scaling_factor: float = 1.0,
    ids_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits = hidden @ weight^T (float32 accumulation; `round_logits` rounds them to hidden's dtype as
    nn.Linear would), then softmax_topk (softmax=True) or grouped_topk_sigmoid semantics.
    Returns topk_weights [T, top_k] float32 and topk_ids [T, top_k] ids_dtype. Caller checks can_fuse_router."""
    t, d = hidden.shape
    e = weight.shape[0]
    grouped = not softmax and num_expert_group is not None and num_expert_group > 1
    groups = num_expert_group if grouped else 1
    assert e % groups == 0 and 0 < top_k <= e and 0 < t <= MAX_FUSED_TOKENS, (e, groups, top_k, t)
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    counter = _router_counter(hidden.device)
    assert counter is not None, "check can_fuse_router first"
    block_e, block_d = 32, 128
    e_blocks, d_tiles = cdiv(e, block_e), cdiv(d, block_d)
    n_split = min(d_tiles, max(1, ROUTER_PROGRAMS // e_blocks))  # ~ROUTER_PROGRAMS programs of one or more D tiles
    tiles_per_split = cdiv(d_tiles, n_split)
    n_split = cdiv(d_tiles, tiles_per_split)
    block_t = 16  # tl.dot needs M >= 16
    part = torch.empty(n_split, block_t, e, dtype=torch.float32, device=hidden.device)
    out_w = torch.empty(t, top_k, dtype=torch.float32, device=hidden.device)
    out_ids = torch.empty(t, top_k, dtype=ids_dtype, device=hidden.device)
    bias = correction_bias.contiguous() if correction_bias is not None else out_w
    block_g, block_s = next_pow2(groups), next_pow2(e // groups)
    ieee = _INTERPRET or hidden.dtype != weight.dtype or hidden.dtype == torch.float32
    sel_t = max(ROUTER_SEL_T, next_pow2(t))
    has_bias = correction_bias is not None and not softmax
    rounding = _ROUND.get(hidden.dtype, 0) if round_logits else 0
    _fused_router_kernel[(e_blocks * n_split,)](
        hidden, weight, bias, part, counter, out_w, out_ids, t, d, hidden.stride(0), weight.stride(0),
        float(routed_scaling_factor),
        E=e, G=groups, S=e // groups, TOPK_GROUP=int(topk_group or groups) if grouped else 1, K=top_k,
        SOFTMAX=softmax, HAS_BIAS=has_bias, GROUPED=grouped, WEIGHT_IS_BEST=WEIGHT_FROM_BEST and not has_bias,
        PACKED=PACKED_SELECT and softmax and rounding in (1, 2),
        RENORM=bool(renormalize), ROUND=rounding, IEEE=ieee,
        BLOCK_T=block_t, SEL_T=sel_t, BLOCK_E=block_e, BLOCK_D=block_d, D_TILES=tiles_per_split,
        N_SPLIT=n_split, BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=next_pow2(top_k),
        num_warps=ROUTER_WARPS or (8 if sel_t * block_g * block_s >= 4096 else 4),
        **prefetch_lines(tiles_per_split * block_d, weight.element_size()), **pdl_launch(hidden.device, prefetch="router"),
    )  # fmt: skip
    return out_w, out_ids
