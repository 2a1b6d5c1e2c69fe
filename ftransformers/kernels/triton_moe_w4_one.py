"""A one-token MoE over 4-bit experts in one launch (decode at batch 1), in Triton.

The pair path (kernels/triton_fused_moe_w4.py) runs a token's experts as two kernels, gate-up then
down; at Qwen3-30B-A3B's shape each is a chain of dependent round trips (the PDL wait, the expert ids,
the weights) more than a bandwidth limit, and the down kernel's programs only become resident once
gate-up's leave, so the token's 19 MB are read in two separate streams (H100: 9.5 + 8.0 us against a
6.6 us floor; benchmarks/results/w4_b1_parts_final_h100.log).

Here one cooperative launch of P programs (all resident, P = SMs x programs_per_sm) does both:
  1. each program loads the 8 expert ids once, then issues the loads of its down tile (rows
     [pid * DOWN_N, +DOWN_N) of every slot's w2, all of I: the down phase has at most one tile per
     program) and keeps them in registers, so the down weights stream in under the gate-up phase;
  2. gate-up: items (slot, UP_N rows of I) are strided over the programs, each over all of D in one
     tile, the next item's words loaded before the current one is reduced (two in flight);
     act[slot] = silu(gate) * up goes to float32 planes as in the pair path (plane j = act[8w + j]);
  3. a grid barrier (kernels/tickets.grid_barrier), then each program reads every slot's act (L2) and
     finishes its down tile: out[rows] = sum_k tw[k] * (act[k] @ w2[e_k, rows]^T).
The down tile must fit the register budget (`one_token_plan`); shapes that do not (DeepSeek-V3's
7168 x 2048 experts) keep the pair path. Decoding and the planes' scaling as in the pair path.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.tickets import exit_ticket, grid_barrier, ticket_counters
from ftransformers.kernels.triton_fused_moe_codes import to_16bit
from ftransformers.kernels.w4_tiles import (
    FMT_ID,
    P63,
    decode_scale,
    group_sums,
    nibble,
    tile_dot,
    weight_args,
    x_words,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_DOWN_KT = 4  # the down tile's K pieces held in registers (DOWN_KT <= this)
DOWN_REGS = 64  # registers a thread may give to its preloaded down words


@dataclass(frozen=True)
class W4OneConfig:
    """One-launch tiles: programs per SM (all must be resident: the register cap follows), warps per
    program, rows of I per gate-up item."""

    programs_per_sm: int = 1
    num_warps: int = 8
    up_n: int = 8


@dataclass(frozen=True)
class OnePlan:
    programs: int
    down_n: int  # rows of D per program in the down phase (a power of two)
    down_bkw: int  # int32 words of I per down piece (a power of two, whole groups)
    down_kt: int  # pieces: down_bkw * down_kt * 8 == I
    maxnreg: int  # 0: the compiler's choice


def one_token_plan(d: int, inter: int, top_k: int, group: int, programs: int, cfg: W4OneConfig) -> OnePlan | None:
    """The down tiling for P = `programs`, or None where the one-launch kernel does not apply: top_k
    not a power of two, I not split into <= MAX_DOWN_KT power-of-two pieces of whole groups, or a down
    tile over DOWN_REGS registers a thread."""
    if top_k & (top_k - 1) or inter % 8 or d % 8 or cfg.up_n & (cfg.up_n - 1):
        return None
    words, wpg = inter // 8, group // 8
    kts = [kt for kt in range(1, MAX_DOWN_KT + 1) if words % kt == 0 and _pow2(words // kt) and words // kt >= wpg]
    if not kts:
        return None
    bkw = words // kts[0]
    down_n = triton.next_power_of_2(triton.cdiv(d, programs))
    threads = 32 * cfg.num_warps
    if top_k * down_n * words > DOWN_REGS * threads:
        return None
    cap = 65536 // (cfg.programs_per_sm * threads) // 8 * 8
    return OnePlan(programs, down_n, bkw, words // bkw, 0 if cap >= 255 else cap)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def one_token_programs(device: torch.device, cfg: W4OneConfig) -> int:
    """P: every program resident at once on CUDA; 1 in Triton's interpreter (programs run one after
    another there, so no barrier can be met)."""
    if device.type != "cuda" or _INTERPRET:
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device()) * cfg.programs_per_sm


@triton.jit
def _down_piece(q2e, s2e, z2e, r3, d_ok, wd, gd, kt, sq2n, ss2n, HAS_ZERO: tl.constexpr, BKW: tl.constexpr,
                NG: tl.constexpr):  # fmt: skip
    # Words [TOP_K, DOWN_N, BKW] and raw scales / zeros [TOP_K, DOWN_N, NG] of down piece kt (q2e, s2e,
    # z2e: each slot's expert base, [TOP_K, 1, 1]).
    q = tl.load(q2e + r3 * sq2n + kt * BKW + wd, mask=d_ok & (wd < BKW), other=0)
    s_off = r3 * ss2n + kt * NG + gd
    sm = d_ok & (gd < NG)
    s = tl.load(s2e + s_off, mask=sm, other=0)
    z = tl.load(z2e + s_off, mask=sm, other=0) if HAS_ZERO else s
    return q, s, z


@triton.jit
def _up_item(q1, s1, z1, g1, item, nb_count, slots, experts, rows_n, w, g, I, n_items, sq1e, sq1n, ss1e,
             ss1n, sg1e, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, UP_N: tl.constexpr, D_WORDS: tl.constexpr,
             UP_BKW: tl.constexpr, UP_NG: tl.constexpr, UP_EVEN: tl.constexpr):  # fmt: skip
    # Gate and up words [UP_N, UP_BKW] and raw scales of gate-up item `item` (slot, row block); masked
    # off (and harmless) past the last item.
    slot = item // nb_count
    expert = tl.sum(tl.where(slots == slot, experts, 0), axis=0)  # no memory round trip
    rows = (item % nb_count) * UP_N + rows_n
    ok = rows < tl.where(item < n_items, I, 0)
    q_rows = q1 + expert * sq1e + rows[:, None].to(tl.int64) * sq1n
    s_rows = expert * ss1e + rows[:, None].to(tl.int64) * ss1n + g[None, :]
    qm = ok[:, None] & (w[None, :] < D_WORDS)  # full-shape masks (Triton's interpreter wants them)
    qg = tl.load(q_rows + w[None, :], mask=qm, other=0)
    qu = tl.load(q_rows + I * sq1n + w[None, :], mask=qm, other=0)
    sm = ok[:, None] & (g[None, :] < D_WORDS // (UP_BKW // UP_NG))
    sg = tl.load(s1 + s_rows, mask=sm, other=0)
    su = tl.load(s1 + s_rows + I * ss1n, mask=sm, other=0)
    zg = tl.load(z1 + s_rows, mask=sm, other=0) if HAS_ZERO else sg
    zu = tl.load(z1 + s_rows + I * ss1n, mask=sm, other=0) if HAS_ZERO else su
    gg = 0.0
    gu = 0.0
    if FMT == 2:
        gg = tl.load(g1 + expert * sg1e + rows, mask=ok, other=0.0)[:, None]
        gu = tl.load(g1 + expert * sg1e + I + rows, mask=ok, other=0.0)[:, None]
    return qg, qu, sg, su, zg, zu, gg, gu, slot, rows, ok


@triton.jit
def _down_load(q2, s2, z2, g2, e3, r3, d_ok, wd, gd, sq2e, sq2n, ss2e, ss2n, sg2e, FMT: tl.constexpr,
               HAS_ZERO: tl.constexpr, DOWN_BKW: tl.constexpr, DOWN_NG: tl.constexpr, DOWN_KT: tl.constexpr):  # fmt: skip
    # The down tile's DOWN_KT pieces (words, raw scales, zeros; unused ones repeat piece 0) and the nvfp4
    # global scales [TOP_K, DOWN_N, 1].
    q2e = q2 + e3 * sq2e
    s2e = s2 + e3 * ss2e
    z2e = z2 + e3 * ss2e
    qd0, sd0, zd0 = _down_piece(q2e, s2e, z2e, r3, d_ok, wd, gd, 0, sq2n, ss2n, HAS_ZERO, DOWN_BKW, DOWN_NG)
    qd1, sd1, zd1 = qd0, sd0, zd0
    qd2, sd2, zd2 = qd0, sd0, zd0
    qd3, sd3, zd3 = qd0, sd0, zd0
    if DOWN_KT > 1:
        qd1, sd1, zd1 = _down_piece(q2e, s2e, z2e, r3, d_ok, wd, gd, 1, sq2n, ss2n, HAS_ZERO, DOWN_BKW, DOWN_NG)
    if DOWN_KT > 2:
        qd2, sd2, zd2 = _down_piece(q2e, s2e, z2e, r3, d_ok, wd, gd, 2, sq2n, ss2n, HAS_ZERO, DOWN_BKW, DOWN_NG)
    if DOWN_KT > 3:
        qd3, sd3, zd3 = _down_piece(q2e, s2e, z2e, r3, d_ok, wd, gd, 3, sq2n, ss2n, HAS_ZERO, DOWN_BKW, DOWN_NG)
    gsd = 0.0
    if FMT == 2:
        gsd = tl.load(g2 + e3 * sg2e + r3, mask=d_ok, other=0.0)  # [TOP_K, DOWN_N, 1]
    return qd0, sd0, zd0, qd1, sd1, zd1, qd2, sd2, zd2, qd3, sd3, zd3, gsd


@triton.jit
def _one_token_w4_kernel(
    x_ptr, q1, s1, z1, g1, q2, s2, z2, g2, magic, act_ptr, out_ptr, ids_ptr, tw_ptr, counter_ptr,
    I, D, programs, sq1e, sq1n, ss1e, ss1n, sg1e, sq2e, sq2n, ss2e, ss2n, sg2e,
    FMT: tl.constexpr, HAS_ZERO: tl.constexpr, X_F16: tl.constexpr, ACT_BF16: tl.constexpr,
    GROUP: tl.constexpr, TOP_K: tl.constexpr, D_WORDS: tl.constexpr, UP_BKW: tl.constexpr, UP_N: tl.constexpr,
    DOWN_N: tl.constexpr, DOWN_BKW: tl.constexpr, DOWN_KT: tl.constexpr,
    USE_PDL: tl.constexpr = False, DIAG: tl.constexpr = 0,
):  # fmt: skip
    # x_ptr: hidden [1, D] as int32 pairs; act_ptr: float32 planes [TOP_K, 8, I/8] (scratch); out_ptr
    # [1, D] in hidden's dtype; counter_ptr: 2 zeroed int32 (barrier arrivals, exit tickets).
    pdl_enter(USE_PDL)
    WPG: tl.constexpr = GROUP // 8
    UP_NG: tl.constexpr = UP_BKW // WPG
    DOWN_NG: tl.constexpr = DOWN_BKW // WPG
    UP_EVEN: tl.constexpr = UP_BKW == D_WORDS
    pid = tl.program_id(0)
    magic = magic.to(tl.uint32, bitcast=True)
    slots = tl.arange(0, TOP_K)
    experts = tl.load(ids_ptr + slots).to(tl.int64)  # [TOP_K]

    # 1. This program's down tile, all of I, issued now and used after the barrier.
    rows_d = pid * DOWN_N + tl.arange(0, DOWN_N)
    d_ok = (rows_d[None, :, None] < D) & (slots[:, None, None] < TOP_K)  # [TOP_K, DOWN_N, 1]
    e3 = experts[:, None, None]
    r3 = rows_d[None, :, None].to(tl.int64)
    wd = tl.arange(0, DOWN_BKW)[None, None, :]
    gd = tl.arange(0, DOWN_NG)[None, None, :]
    down = _down_load(q2, s2, z2, g2, e3, r3, d_ok, wd, gd, sq2e, sq2n, ss2e, ss2n, sg2e, FMT, HAS_ZERO, DOWN_BKW,
                      DOWN_NG, DOWN_KT)  # fmt: skip

    # 2. Gate-up items pid, pid + P, ...; the next item's loads are issued before this one is reduced.
    w = tl.arange(0, UP_BKW)
    g = tl.arange(0, UP_NG)
    rows_n = tl.arange(0, UP_N)
    xs, sx = x_words(x_ptr + w * 4, w < D_WORDS, FMT, X_F16, UP_EVEN)
    sxg = group_sums(sx, FMT, UP_N, UP_NG, WPG)
    nb_count = tl.cdiv(I, UP_N)
    n_items = TOP_K * nb_count
    plane = I // 8
    cur = _up_item(q1, s1, z1, g1, pid, nb_count, slots, experts, rows_n, w, g, I, n_items, sq1e, sq1n, ss1e,
                   ss1n, sg1e, FMT, HAS_ZERO, UP_N, D_WORDS, UP_BKW, UP_NG, UP_EVEN)  # fmt: skip
    for item in range(pid, n_items if DIAG & 1 == 0 else 0, programs):
        nxt = _up_item(q1, s1, z1, g1, item + programs, nb_count, slots, experts, rows_n, w, g, I, n_items, sq1e,
                       sq1n, ss1e, ss1n, sg1e, FMT, HAS_ZERO, UP_N, D_WORDS, UP_BKW, UP_NG, UP_EVEN)  # fmt: skip
        qg, qu, sg, su, zg, zu, gg, gu, slot, rows, ok = cur
        scale, zz = decode_scale(sg, zg, gg, FMT, HAS_ZERO)
        gate = tl.sum(tile_dot(qg.to(tl.uint32, bitcast=True), scale, zz, xs, sxg, magic, FMT, UP_N, UP_NG, WPG), axis=1)
        scale, zz = decode_scale(su, zu, gu, FMT, HAS_ZERO)
        up = tl.sum(tile_dot(qu.to(tl.uint32, bitcast=True), scale, zz, xs, sxg, magic, FMT, UP_N, UP_NG, WPG), axis=1)
        act = gate / (1.0 + tl.exp(-gate)) * up
        act = to_16bit(act, tl.bfloat16 if ACT_BF16 else tl.float16).to(tl.float32)
        if FMT != 0:
            act = act * P63
        tl.store(act_ptr + slot * I + (rows % 8) * plane + rows // 8, act, mask=ok)
        cur = nxt

    # 3. Every slot's act is stored; finish the down tile.
    if DIAG & 2 == 0:
        grid_barrier(counter_ptr, programs, 0)
    if DIAG & 8:  # (the loads above are then dead and dropped)
        down = _down_load(q2, s2, z2, g2, e3, r3, d_ok, wd, gd, sq2e, sq2n, ss2e, ss2n, sg2e, FMT, HAS_ZERO, DOWN_BKW,
                          DOWN_NG, DOWN_KT)  # fmt: skip
    qd0, sd0, zd0, qd1, sd1, zd1, qd2, sd2, zd2, qd3, sd3, zd3, gsd = down
    a_rows = act_ptr + slots[:, None] * I + tl.arange(0, DOWN_BKW)[None, :]  # [TOP_K, DOWN_BKW]
    acc = tl.zeros([TOP_K, DOWN_N], dtype=tl.float32)
    acc += _down_sum(qd0, sd0, zd0, gsd, a_rows, plane, magic, FMT, HAS_ZERO, TOP_K, DOWN_N, DOWN_NG, WPG)
    if DOWN_KT > 1:
        acc += _down_sum(qd1, sd1, zd1, gsd, a_rows + DOWN_BKW, plane, magic, FMT, HAS_ZERO, TOP_K, DOWN_N, DOWN_NG,
                         WPG)  # fmt: skip
    if DOWN_KT > 2:
        acc += _down_sum(qd2, sd2, zd2, gsd, a_rows + 2 * DOWN_BKW, plane, magic, FMT, HAS_ZERO, TOP_K, DOWN_N,
                         DOWN_NG, WPG)  # fmt: skip
    if DOWN_KT > 3:
        acc += _down_sum(qd3, sd3, zd3, gsd, a_rows + 3 * DOWN_BKW, plane, magic, FMT, HAS_ZERO, TOP_K, DOWN_N,
                         DOWN_NG, WPG)  # fmt: skip
    y = tl.sum(acc * tl.load(tw_ptr + slots)[:, None], axis=0)  # [DOWN_N]
    if DIAG & 4:
        y = tl.zeros([DOWN_N], dtype=tl.float32)
    tl.store(out_ptr + rows_d, to_16bit(y, out_ptr.dtype.element_ty), mask=rows_d < D)
    exit_ticket(counter_ptr, programs)


@triton.jit
def _down_sum(q, s, z, gs, a_ptrs, plane, magic, FMT: tl.constexpr, HAS_ZERO: tl.constexpr, TOP_K: tl.constexpr,
              DOWN_N: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr):  # fmt: skip
    # One down piece: words q [TOP_K, DOWN_N, BKW] against act planes a_ptrs [TOP_K, BKW] (read through
    # L2: other programs wrote them) -> [TOP_K, DOWN_N] float32.
    q = q.to(tl.uint32, bitcast=True)
    a = tl.load(a_ptrs, cache_modifier=".cg")
    p = nibble(q, 0, magic, FMT) * a[:, None, :]
    sa = a
    for j in tl.static_range(1, 8):
        a = tl.load(a_ptrs + j * plane, cache_modifier=".cg")
        p += nibble(q, j, magic, FMT) * a[:, None, :]
        sa += a
    pg = tl.sum(tl.reshape(p, [TOP_K, DOWN_N, NG, WPG]), axis=3)  # [TOP_K, DOWN_N, NG]
    scale, zz = decode_scale(s, z, gs, FMT, HAS_ZERO)
    if FMT == 0:
        sag = tl.sum(tl.reshape(sa, [TOP_K, NG, WPG]), axis=2)[:, None, :]  # [TOP_K, 1, NG]
        return tl.sum(scale * (pg - zz * sag), axis=2)
    return tl.sum(scale * pg, axis=2)


def fused_moe_w4_one(
    hidden: torch.Tensor,  # [1, D] bf16 / fp16, unit stride
    w13: QuantizedWeight,  # [E, 2I, D]
    w2: QuantizedWeight,  # [E, D, I]
    weights: torch.Tensor,  # [K] float32 routing weights
    ids: torch.Tensor,  # [1, K] int, contiguous
    cfg: W4OneConfig,
    programs: int | None = None,  # P override (tests); default one_token_programs
    diag: int = 0,  # benchmarks only, wrong results: bits 1 no gate-up, 2 no barrier, 4 no down, 8 down loaded late
) -> torch.Tensor | None:
    """fused_moe_w4 at one token in one launch, or None where it does not apply (the caller takes the
    pair path): a shape outside one_token_plan, or no ticket counters (a CUDA graph capture before the
    pool exists). w13 / w2 already checked by fused_moe_w4."""
    d, inter, top_k = hidden.shape[1], w2.in_features, ids.shape[1]
    dev = hidden.device
    p = programs or one_token_programs(dev, cfg)
    plan = one_token_plan(d, inter, top_k, w13.group_size, p, cfg) if w13.group_size == w2.group_size else None
    if plan is None or hidden.shape[0] != 1:
        return None
    counters = ticket_counters(dev, "moe_w4_one", 2) if p > 1 else ids
    if counters is None:
        return None
    act = torch.empty(top_k, inter, dtype=torch.float32, device=dev)  # planes [K, 8, I/8]
    out = torch.empty_like(hidden)
    x = hidden.view(torch.int32)  # [1, D/2] pairs
    a1, a2 = weight_args(w13), weight_args(w2)
    d_words = d // 8
    extra = {"maxnreg": plan.maxnreg} if plan.maxnreg else {}
    _one_token_w4_kernel[(p,)](
        x, *a1[:4], *a2[:5], act, out, ids, weights, counters, inter, d, p, *a1[5:], *a2[5:],
        FMT=FMT_ID[w13.fmt], HAS_ZERO=w13.zeros is not None, X_F16=hidden.dtype == torch.float16,
        ACT_BF16=hidden.dtype == torch.bfloat16, GROUP=w13.group_size, TOP_K=top_k, D_WORDS=d_words,
        UP_BKW=triton.next_power_of_2(d_words), UP_N=cfg.up_n, DOWN_N=plan.down_n, DOWN_BKW=plan.down_bkw,
        DOWN_KT=plan.down_kt, DIAG=diag, num_warps=cfg.num_warps, num_stages=1, launch_cooperative_grid=p > 1, **extra,
        **pdl_launch(dev),
    )  # fmt: skip
    return out
