"""One token's 8-bit MoE ("int8" and "fp8_block" experts) in two kernels that load each program's expert rows
over all of K at once.

The pair path of kernels/triton_fused_moe_w8.py walks K in tiles, and its down kernel walks the top-k slots one
after another (each slot: its expert id, an amax pass over its activation row, then its K tiles), so a program
waits on about thirty dependent memory round trips; fp8 also runs a quantization kernel before each GEMV. Here,
for one token with K <= MAX_K:

- `_token_gate_up_w8_kernel`, grid (I / BLOCK_N, TOP_K): program (row block, slot) loads the gate and up rows of
  expert ids[slot] ([BLOCK_N, 2, BK]) beside the token's row, quantizes the row itself (int8: per token; fp8: per
  K group, each group's value times the weight block's scale), and stores act[slot, n] = silu(gate) * up with gate
  and up rounded to the activation dtype first (quant_moe_ref's order).
- `_token_down_w8_kernel`, grid (D / BLOCK_N,): a program's BLOCK_N rows of every slot's expert
  ([BLOCK_N, SLOTS, BK]), the routing and the weight scales are loaded before the PDL wait: the routing was read
  by the gate-up kernel after its own wait, the rest is constant, and only act comes from the predecessor. It then
  quantizes each slot's act row, rounds each expert's output to the output dtype and adds them times their
  routing weights in float32.

K runs as [NG, GROUP] (fp8: GROUP is the quantization group), masked past K. int8 products are summed exactly in
int32 and scaled once; fp8 products are float32 (code times the group's dequantized x and weight scale).
Graph-safe: no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.triton_fp8_gemm import fp8_scale, quant_fp8
from ftransformers.kernels.triton_int8_gemm import int8_scale, quant_int8
from ftransformers.kernels.triton_w8_row import k_tiles, pow2_dividing, quant_row

# fused_moe_w8 takes one int8 token here (`takes`); `set=triton_moe_w8_token.ENABLED=0` in benchmarks/ab_decode.py
# restores the pair path for an A/B.
ENABLED = True
MAX_K = 4096  # a program holds its rows over all of K; wider experts (DeepSeek-V3's D) keep the pair path


@dataclass(frozen=True)
class TokenW8Config:
    """Rows a program (gate-up: of gate and of up each; down: of every slot) and warps of each kernel."""

    up_n: int = 4
    up_warps: int = 8
    down_n: int = 16
    down_warps: int = 32


# The tiles moe_w8_token runs without a config (module names, so that benchmarks/ab_decode.py's `set=` can change
# them in a whole model). H100, Qwen3-30B-A3B W8A8 at batch 1, critical path of the step's down kernels
# (benchmarks/results/ab_w8tok{,2}_30b_{w8a8,fp8}_h100.*): 16 rows a program on 32 warps 562 us a step (128 programs,
# one wave, every weight read ahead of the wait), 8 on 16 warps 724-728, 4 on 16 warps 1177, 2 on 8 warps 2831,
# against the pair path's 1329-1337. The gate-up kernel is no faster than the pair path's (602-653 against 576 us);
# 4 rows on 8 warps kept. Step: 2.841 against 3.612 ms (ab_w8tok3_30b_w8a8_h100.*). On the H200 (session 61,
# ab_w8tiles_30b_{w8a8,fp8}_s61_h200.*) these tiles still won, and a down kernel over K tiles of a few rows a program,
# reading only its first tile before the wait (d7588dd), lost: W8A8 2.302 -> 2.404-3.320 ms, FP8 2.467 -> 2.655-4.456.
UP_N, UP_WARPS, DOWN_N, DOWN_WARPS = (TokenW8Config.up_n, TokenW8Config.up_warps, TokenW8Config.down_n,
                                      TokenW8Config.down_warps)  # fmt: skip


# fp8: the down kernel on 16 warps (538 us a step against 913 on 32), after the pair path's gate-up kernel, which
# was faster than this module's on fp8 (540 against 649-749 us); FP8_DOWN = 0 leaves one fp8 token to the pair path
FP8_DOWN, FP8_DOWN_WARPS = True, 16


def default_config() -> TokenW8Config:
    return TokenW8Config(UP_N, UP_WARPS, DOWN_N, DOWN_WARPS)


def fp8_down_config() -> TokenW8Config:
    return TokenW8Config(UP_N, UP_WARPS, DOWN_N, FP8_DOWN_WARPS)


@cached_launch
@triton.jit
def _token_gate_up_w8_kernel(
    x_ptr, w_ptr, ws_ptr, act_ptr, ids_ptr, N, K,
    stride_we, stride_wn, stride_se, stride_sn,
    FP8: tl.constexpr, SCALE_N: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # act[slot, n] = silu(g) * u, g / u = x @ w13[e, n] / w13[e, N + n] rounded to act's dtype, e = ids[slot].
    # fp8: BLOCK_N divides SCALE_N and N, so each of the two row sets lies in one scale block.
    pdl_enter(USE_PDL)
    BK: tl.constexpr = NG * GROUP
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.arange(0, 2)  # gate, up
    kk = tl.arange(0, BK)
    rows = n[:, None] + h[None, :] * N  # [BN, 2]
    w = tl.load(
        w_ptr + expert * stride_we + rows[:, :, None].to(tl.int64) * stride_wn + kk[None, None, :],
        mask=(n < N)[:, None, None] & (kk < K)[None, None, :], other=0.0 if FP8 else 0,
    )  # [BN, 2, BK]  # fmt: skip
    x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)  # [BK]
    xq, sx = quant_row(x, FP8, NG, GROUP)
    if FP8:
        g = tl.arange(0, NG)
        blocks = (pid_n * BLOCK_N + h * N) // SCALE_N  # [2]
        ws = tl.load(ws_ptr + expert * stride_se + blocks[:, None] * stride_sn + g[None, :],
                     mask=(g < tl.cdiv(K, GROUP))[None, :], other=0.0)  # [2, NG]  # fmt: skip
        xw = tl.reshape(xq[None, :, :] * ws[:, :, None], [2, BK])
        y = tl.sum(w.to(tl.float32) * xw[None, :, :], axis=2)  # [BN, 2]
    else:
        ws = tl.load(ws_ptr + expert * stride_se + rows * stride_sn, mask=(n < N)[:, None], other=0.0)  # [BN, 2]
        y = tl.sum(w.to(tl.int32) * xq[None, None, :], axis=2).to(tl.float32) * (sx * ws)
    gate, up = tl.split(y.to(act_ptr.dtype.element_ty).to(tl.float32))
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + slot * N + n, act.to(act_ptr.dtype.element_ty), mask=n < N)


@cached_launch
@triton.jit
def _token_down_w8_kernel(
    act_ptr, w_ptr, ws_ptr, out_ptr, ids_ptr, tw_ptr, N, K,
    stride_we, stride_wn, stride_se, stride_sn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr, GROUP: tl.constexpr,
    NG: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # out[n] = sum_s tw[s] * round(act[s] @ w2[ids[s], n]), n < N = D, over K = I; SLOTS = TOP_K padded to a
    # power of two. fp8: BLOCK_N divides SCALE_N. Everything but act is loaded ahead of the PDL wait.
    BK: tl.constexpr = NG * GROUP
    pid = tl.program_id(0)
    s = tl.arange(0, SLOTS)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BK)
    g = tl.arange(0, NG)
    expert = tl.load(ids_ptr + s, mask=s < TOP_K, other=0).to(tl.int64)
    tw = tl.load(tw_ptr + s, mask=s < TOP_K, other=0.0)
    # rows outermost: the slots and K take the warps, so a thread's act values serve all its rows
    w = tl.load(
        w_ptr + expert[None, :, None] * stride_we + n[:, None, None].to(tl.int64) * stride_wn + kk[None, None, :],
        mask=(n < N)[:, None, None] & (s < TOP_K)[None, :, None] & (kk < K)[None, None, :],
        other=0.0 if FP8 else 0,
    )  # [BN, SLOTS, BK]  # fmt: skip
    if FP8:
        ws = tl.load(ws_ptr + expert[:, None] * stride_se + (pid * BLOCK_N // SCALE_N) * stride_sn + g[None, :],
                     mask=(s < TOP_K)[:, None] & (g < tl.cdiv(K, GROUP))[None, :], other=0.0)  # [SLOTS, NG] # fmt: skip
    else:
        ws = tl.load(ws_ptr + expert[None, :] * stride_se + n[:, None] * stride_sn,
                     mask=(n < N)[:, None] & (s < TOP_K)[None, :], other=0.0)  # [BN, SLOTS]  # fmt: skip
    pdl_enter(USE_PDL)
    a = tl.load(act_ptr + s[:, None] * K + kk[None, :], mask=(s < TOP_K)[:, None] & (kk < K)[None, :],
                other=0.0).to(tl.float32)  # [SLOTS, BK]  # fmt: skip
    if FP8:
        a3 = tl.reshape(a, [SLOTS, NG, GROUP])
        sx = fp8_scale(tl.max(tl.abs(a3), axis=2))  # [SLOTS, NG]
        xd = quant_fp8(a3, sx[:, :, None]).to(tl.float32) * (sx * ws)[:, :, None]
        y = tl.sum(w.to(tl.float32) * tl.reshape(xd, [SLOTS, BK])[None, :, :], axis=2)  # [BN, SLOTS]
    else:
        sx = int8_scale(tl.max(tl.abs(a), axis=1))  # [SLOTS]
        q = quant_int8(a, sx[:, None]).to(tl.int32)
        y = tl.sum(w.to(tl.int32) * q[None, :, :], axis=2).to(tl.float32) * (sx[None, :] * ws)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * tw[None, :]
    out = tl.sum(tl.where((s < TOP_K)[None, :], y, 0.0), axis=1)  # [BN]
    tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=n < N)


def takes(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight) -> bool:
    """Whether fused_moe_w8 runs this call here, both kernels: one token, int8 experts, D and I at most MAX_K. On fp8
    experts (H100, Qwen3-30B-A3B, ab_w8tok{2,3}_30b_fp8_h100.*) this gate-up kernel lost to the pair path's (649-749
    against 540 us a step) while the down kernel won on 16 warps (538 against 666; 913 on 32), so one fp8 token
    takes only the down kernel (`takes_down`). moe_w8_token still runs fp8 whole when called directly (tests)."""
    return (
        ENABLED
        and hidden.shape[0] == 1
        and w13.fmt == w2.fmt == "int8"
        and max(w13.in_features, w2.in_features) <= MAX_K
        and hidden.dtype in (torch.bfloat16, torch.float16)
    )


def takes_down(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight) -> bool:
    """Whether fused_moe_w8 runs one fp8 token's down projection here (`token_down`, after the pair path's
    gate-up kernel): one token, fp8_block experts, I at most MAX_K."""
    return (
        FP8_DOWN
        and hidden.shape[0] == 1
        and w13.fmt == w2.fmt == "fp8_block"
        and w2.in_features <= MAX_K
        and hidden.dtype in (torch.bfloat16, torch.float16)
    )


def _scales(qw: QuantizedWeight) -> tuple[torch.Tensor, int, int]:
    # (scales, expert stride, row (int8) or row-block (fp8) stride); fp8's K blocks are contiguous
    s = qw.scales
    if qw.fmt == "fp8_block":
        assert s.stride(-1) == 1, "fp8_block scales must be contiguous along K blocks"
    return s, s.stride(0), s.stride(1)


def token_gate_up(hidden: torch.Tensor, w13: QuantizedWeight, ids: torch.Tensor, cfg: TokenW8Config) -> torch.Tensor:
    """The first kernel: act [K, I] in hidden's dtype."""
    d, top_k = hidden.shape[1], ids.numel()
    inter = w13.out_features // 2
    fp8 = w13.fmt == "fp8_block"
    assert w13.qweight.stride(-1) == 1 and hidden.stride(-1) == 1
    act = torch.empty(top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [K, I]
    bn = pow2_dividing(cfg.up_n, w13.block_n, inter) if fp8 else cfg.up_n
    group, ng = k_tiles(w13)
    s13, se, sn = _scales(w13)
    _token_gate_up_w8_kernel[(cdiv(inter, bn), top_k)](
        hidden, w13.qweight, s13, act, ids, inter, d,
        w13.qweight.stride(0), w13.qweight.stride(1), se, sn,
        FP8=fp8, SCALE_N=w13.block_n, GROUP=group, NG=ng, BLOCK_N=bn, num_warps=cfg.up_warps,
        **pdl_launch(hidden.device),
    )  # fmt: skip
    return act


def token_down(act: torch.Tensor, w2: QuantizedWeight, weights: torch.Tensor, ids: torch.Tensor,
               cfg: TokenW8Config) -> torch.Tensor:  # fmt: skip
    """The second kernel: [1, D] in act's dtype. It reads ids, weights and w2 before its PDL wait, so the kernel
    launched just before it must have read ids after its own wait (either gate-up kernel of one token does)."""
    top_k, inter = act.shape
    d = w2.out_features
    fp8 = w2.fmt == "fp8_block"
    assert w2.qweight.stride(-1) == 1 and act.is_contiguous() and weights.is_contiguous()
    out = torch.empty(1, d, dtype=act.dtype, device=act.device)
    bn = pow2_dividing(cfg.down_n, w2.block_n) if fp8 else cfg.down_n
    group, ng = k_tiles(w2)
    s2, se, sn = _scales(w2)
    _token_down_w8_kernel[(cdiv(d, bn),)](
        act, w2.qweight, s2, out, ids, weights, d, inter,
        w2.qweight.stride(0), w2.qweight.stride(1), se, sn,
        TOP_K=top_k, SLOTS=next_pow2(top_k), FP8=fp8, SCALE_N=w2.block_n, GROUP=group, NG=ng,
        BLOCK_N=bn, num_warps=cfg.down_warps, **pdl_launch(act.device),
    )  # fmt: skip
    return out


def moe_w8_token(
    hidden: torch.Tensor,  # [1, D] bf16 / fp16, unit stride
    w13: QuantizedWeight,  # [E, 2I, D]: rows [gate | up]
    w2: QuantizedWeight,  # [E, D, I]
    weights: torch.Tensor,  # [K] float32 contiguous
    ids: torch.Tensor,  # [1, K] int
    cfg: TokenW8Config | None = None,
) -> torch.Tensor:  # [1, D] hidden.dtype
    """quant_moe_ref's function for one token, in the two kernels above (check `takes` first)."""
    cfg = cfg or default_config()
    return token_down(token_gate_up(hidden, w13, ids, cfg), w2, weights, ids, cfg)
