"""One token's int4 MoE in one launch, on mma.sync in Gluon: out = sum_k w_k * down_k(silu(gate_k x) * up_k x).

At one token the pair path (kernels/gluon_moe_w4_mma.py, kernels/triton_fused_moe_w4.py) is two dependent
kernels of short waves: on Qwen3-30B-A3B's experts (D 2048, I 768, top-8) its gate-up and down cost 9.7 and
6.7 us of a W4A16 decode step's critical path (benchmarks/results/timeline_w4a16_h100.log) for 4.2 and 2.1 us
of bytes. Here the work is cut the other way: program (slot k, chunk j of IC rows of I) computes its IC act
values (gate and up rows j IC.., the pair path's gate-up tiles) and at once their share of the down
product, w2[e_k][:, j IC:(j + 1) IC] @ act, a float32 partial over all of D. Nothing waits for another
program until the partials are summed, so the down weights stream with the gate-up ones (their lines are
requested into L2 as the program starts) and there is one launch, one PDL wait and one ids load.

The partials [P, D] are summed after a grid barrier (kernels/tickets.py's protocol: all P programs
resident, which `takes` checks against the SM count, one program an SM): program p adds rows
[p SLICE, (p + 1) SLICE) over the P partials in a fixed order (deterministic) and rounds once.

Both products reuse kernels/gluon_moe_w4_mma.py's chunk (one LOP3 per two weights into the A registers,
the eight-span B columns, scales and zeros once per chunk and span):
  gate-up: BLOCKS = IC / 16 row blocks of 16 gate + 16 up rows, W warps each over D / W of K in chunks
    of KC, the next (block, chunk)'s words requested before a chunk's mma; act rounded to x's dtype (as
    the pair path) and kept in a [P, IC] scratch row the program reads back in B's layout.
  down: one chunk of K = IC (spans of IC / 8), rows in steps of W x ROWS_D, each warp ROWS_D rows.

Measured slower, so fused_moe_w4 does not take it (`set_enabled`, off): H100, Qwen3-30B-A3B experts at one
token, int4 g128 (benchmarks/results/moe_w4_token_sweep_h100.{json,log}), best of 16 configs 18.9-20.2 us
against the pair path's 17.1-18.0; in the W4A16 decode step (ab_decode, moe_w4_token_ab_h100.*) 22.0 us
of critical path a layer against the pair's 16.1, step 2.441 against 2.133 ms. Its chain of dependent
round trips (4 gate-up blocks, 8 down steps from L2, the barrier's atomics, the final sum) is longer
than the pair path's two kernels; holding every weight in flight at once needs more than the register file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ftransformers.kernels.gluon_mla_decode import pdl_enter
from ftransformers.kernels.gluon_moe_w4_mma import MAGIC, _chunk, _offsets, chunk_k, layouts, mma_capable
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.tickets import ticket_counters

# gl.thread_barrier (Triton 3.6) is gl.barrier from Triton 3.7 on
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _l2_prefetch(ptrs):
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _token_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, q2_ptr, s2_ptr, z2_ptr, out_ptr, ids_ptr, tw_ptr, act_ptr, part_ptr, bar_ptr,
    magic, offset, N,
    stride_qe, stride_qn, stride_se, stride_sn, stride_q2e, stride_q2n, stride_s2e, stride_s2n,
    D: gl.constexpr, HAS_ZERO: gl.constexpr, GROUP: gl.constexpr, GROUP2: gl.constexpr, KC: gl.constexpr,
    CHUNKS: gl.constexpr, IC: gl.constexpr, W: gl.constexpr, ROWS_D: gl.constexpr, STEPS_D: gl.constexpr, P: gl.constexpr,
    SLICE: gl.constexpr, PP: gl.constexpr,
    mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, w_l: gl.constexpr, x_l: gl.constexpr,
    xc_l: gl.constexpr, w_ld: gl.constexpr, x_ld: gl.constexpr, xc_ld: gl.constexpr, pf_l: gl.constexpr,
    fin_l: gl.constexpr, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # program pid = slot * (N / IC) + j: slot's expert e, act rows [j IC, (j + 1) IC); D = W ROWS_D STEPS_D
    pdl_enter(USE_PDL)
    RW: gl.constexpr = KC // 32
    KS: gl.constexpr = CHUNKS * KC
    GC: gl.constexpr = KC // 8
    BLOCKS: gl.constexpr = IC // 16
    RWD: gl.constexpr = IC // 32
    GCD: gl.constexpr = IC // 8
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid = gl.program_id(0)
    nch = N // IC
    slot = pid // nch
    j = pid % nch
    expert = gl.load(ids_ptr + slot).to(gl.int64)

    # the down block's lines (w2[e][d, j IC .. (j + 1) IC): IC / 2 <= 128 bytes a row) into L2 now
    pf_rows = gl.arange(0, D, layout=pf_l)
    _l2_prefetch(q2_ptr + expert * stride_q2e + pf_rows.to(gl.int64) * stride_q2n + j * (IC // 8))

    # gate-up: block b is gate rows j IC + 16 b .. + 16 and the matching up rows (N + ..), act [16] each
    ww, wrow, word, xel, xwarp, cel, cw, mw, mrow, mspan = _offsets(w_l, x_l, xc_l, mma, W, 32, RW)
    q_rows = j * IC + wrow % 16 + (wrow // 16) * N
    q_ptrs = q_ptr + expert * stride_qe + q_rows.to(gl.int64) * stride_qn + ww * (KS // 8) + word
    x_ptrs = x_ptr + xwarp * KS + xel
    xc_ptrs = x_ptr + cw * KS + cel
    s_rows = expert * stride_se + (j * IC + mrow % 16 + (mrow // 16) * N).to(gl.int64) * stride_sn
    span_k = mw * KS + mspan * GC
    act_row = act_ptr + pid * IC
    STEPS: gl.constexpr = BLOCKS * CHUNKS
    q = gl.load(q_ptrs)
    x = gl.load(x_ptrs)
    for b in range(BLOCKS):
        tot = gl.zeros([W, 32, 8], gl.float32, mma)
        for c in range(CHUNKS):
            q_c, x_c = q, x
            sn = gl.minimum(b * CHUNKS + c + 1, STEPS - 1)  # the next (block, chunk), requested now
            q = gl.load(q_ptrs + (sn // CHUNKS) * 16 * stride_qn + (sn % CHUNKS) * (KC // 8))
            if CHUNKS > 1:
                x = gl.load(x_ptrs + (sn % CHUNKS) * KC)
            g = (span_k + c * KC) // GROUP
            rows_b = s_rows + b * 16 * stride_sn
            tot = _chunk(q_c, x_c, xc_ptrs + c * KC, s_ptr + rows_b + g, z_ptr + rows_b + g, magic, offset, tot,
                         HAS_ZERO, DT, W, 32, RW, mma, a_l, b_l)  # fmt: skip
        y = gl.sum(gl.sum(tot, axis=2), axis=0)  # [32]: gate rows, then up rows
        gate, up = gl.split(gl.permute(gl.reshape(y, [2, 16]), (1, 0)))
        act = (gate / (1.0 + gl.exp(-gate)) * up).to(DT)
        gl.store(act_row + b * 16 + gl.arange(0, 16, layout=act.type.layout), act)
    _cta_barrier()  # the act row is complete for every warp

    # down: partial[d] = tw[slot] * w2[e][d, j IC ..] @ act, rows d = st W ROWS_D + w ROWS_D + row
    dww, dwrow, dword, dxel, dxwarp, dcel, dcw, dmw, dmrow, dmspan = _offsets(w_ld, x_ld, xc_ld, mma, W, ROWS_D, RWD)
    q2_ptrs = q2_ptr + expert * stride_q2e + (dww * ROWS_D + dwrow).to(gl.int64) * stride_q2n + j * (IC // 8) + dword
    xd = gl.load(act_row + dxwarp * 0 + dxel)
    xdc_ptrs = act_row + dcw * 0 + dcel
    s2_rows = expert * stride_s2e + (dmw * ROWS_D + dmrow).to(gl.int64) * stride_s2n + (j * IC + dmspan * GCD) // GROUP2
    tw = gl.load(tw_ptr + slot)
    prow = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma))), 1) * ROWS_D
    prow = prow + gl.expand_dims(gl.arange(0, ROWS_D, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma))), 0)
    part_row = part_ptr + pid * D + prow  # [W, ROWS_D]
    qd = gl.load(q2_ptrs)
    for st in range(STEPS_D):
        qd_c = qd
        if STEPS_D > 1:
            qd = gl.load(q2_ptrs + gl.minimum(st + 1, STEPS_D - 1) * (W * ROWS_D) * stride_q2n)
        rows_st = s2_rows + st * (W * ROWS_D) * stride_s2n
        tot = _chunk(qd_c, xd, xdc_ptrs, s2_ptr + rows_st, z2_ptr + rows_st, magic, offset,
                     gl.zeros([W, ROWS_D, 8], gl.float32, mma), HAS_ZERO, DT, W, ROWS_D, RWD, mma, a_l, b_l)  # fmt: skip
        gl.store(part_row + st * (W * ROWS_D), gl.sum(tot, axis=2) * tw)

    # grid barrier (all P programs resident): arrivals on bar[0], then exit tickets on bar[1]
    _cta_barrier()
    gl.atomic_add(bar_ptr, 1, sem="release")
    seen = gl.atomic_add(bar_ptr, 0, sem="acquire")
    while seen < P:
        seen = gl.atomic_add(bar_ptr, 0, sem="acquire")
    _cta_barrier()

    # out rows [pid SLICE, (pid + 1) SLICE): the P partials added in program order, rounded once
    fp = gl.expand_dims(gl.arange(0, PP, layout=gl.SliceLayout(1, fin_l)), 1)
    fr = gl.expand_dims(gl.arange(0, SLICE, layout=gl.SliceLayout(0, fin_l)), 0)
    d0 = pid * SLICE
    fmask = (fp < P) & (d0 + fr < D)
    v = gl.load(part_ptr + fp * D + d0 + fr, mask=fmask, other=0.0, cache_modifier=".cg")
    o = gl.sum(v, axis=0)
    orow = gl.arange(0, SLICE, layout=o.type.layout)
    gl.store(out_ptr + d0 + orow, o.to(out_ptr.dtype.element_ty), mask=d0 + orow < D)

    _cta_barrier()
    if gl.atomic_add(bar_ptr + 1, 1, sem="acq_rel") == P - 1:  # the last one out resets both counters
        gl.store(bar_ptr, 0)
        gl.store(bar_ptr + 1, 0)


@dataclass(frozen=True)
class TokenConfig:
    """IC act rows a program (a power of two >= 64: the down chunk's spans of IC / 8 are split over lane pairs), W warps (gate-up: each over D / W of K in
    chunks of at most KC; down: ROWS_D rows each a step)."""

    ic: int = 64
    warps: int = 8
    kc: int = 256
    rows_d: int = 32


SWEEP = [TokenConfig(ic, w, kc, rd) for ic in (64, 128) for w in (8, 16) for kc in (128, 256) for rd in (16, 32)]


# Off: slower than the pair path it would replace (module docstring, measured)
_enabled = False


def set_enabled(enabled: bool) -> None:
    """Let fused_moe_w4 take this kernel (`takes`) or not, for launches from now on (A/B measurements)."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


def takes(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int) -> bool:
    """Whether fused_moe_w4 runs this call here: a supported one-token call, while enabled."""
    return _enabled and supported(hidden, w13, w2, top_k)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(d: int, inter: int, top_k: int, group: int, group2: int, cfg: TokenConfig, sms: int) -> bool:
    """The shape part of `supported`: P = top_k I / IC programs, at most one an SM; a gate-up chunk for D /
    W; D a multiple of W ROWS_D; spans of the down chunk (IC / 8) inside its groups."""
    ic, w = cfg.ic, cfg.warps
    if ic < 64 or ic & (ic - 1) or inter % ic or d % w or d % (w * cfg.rows_d) or d & (d - 1):
        return False
    programs = top_k * (inter // ic)
    return 1 < programs <= sms and chunk_k(d // w, group, cfg.kc) > 0 and group2 % (ic // 8) == 0


def supported(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int,
              cfg: TokenConfig = TokenConfig()) -> bool:  # fmt: skip
    """Whether the kernel takes this call: one token, CUDA compute capability >= 8.0, bf16 / fp16 x, int4
    experts, and the shape (`fits`) on this GPU's SM count."""
    if hidden.shape[0] != 1 or not mma_capable(hidden) or hidden.dtype not in MAGIC:
        return False
    if w13.fmt != "int4" or w2.fmt != "int4":
        return False
    sms = _sm_count(hidden.device.index or 0)
    return fits(w2.out_features, w2.in_features, top_k, w13.group_size, w2.group_size, cfg, sms)


def constexprs(d: int, inter: int, top_k: int, group: int, group2: int, has_zero: bool, cfg: TokenConfig) -> dict:
    """The kernel's compile-time arguments (a supported shape)."""
    w, ic = cfg.warps, cfg.ic
    kc = chunk_k(d // w, group, cfg.kc)
    programs = top_k * (inter // ic)
    slice_ = max(4, triton.next_power_of_2(triton.cdiv(d, programs)))
    up, down = layouts(w, 32, kc), layouts(w, cfg.rows_d, ic)
    tpr = min(32, slice_ // 4)  # final sum [PP, SLICE]: 4 rows a thread along SLICE
    return {
        "D": d, "HAS_ZERO": has_zero, "GROUP": group, "GROUP2": group2, "KC": kc, "CHUNKS": d // w // kc, "IC": ic,
        "W": w, "ROWS_D": cfg.rows_d, "STEPS_D": d // (w * cfg.rows_d), "P": programs, "SLICE": slice_,
        "PP": triton.next_power_of_2(programs),
        **{name: up[name] for name in ("mma", "a_l", "b_l", "w_l", "x_l", "xc_l")},
        "w_ld": down["w_l"], "x_ld": down["x_l"], "xc_ld": down["xc_l"],
        "pf_l": gl.BlockedLayout([1], [32], [w], [0]),
        "fin_l": gl.BlockedLayout([1, slice_ // tpr], [32 // tpr, tpr], [w, 1], [1, 0]),
    }  # fmt: skip


def _zeros(qw: QuantizedWeight) -> torch.Tensor:
    return qw.zeros if qw.zeros is not None else qw.scales


def moe_w4_token(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor,
                 topk_ids: torch.Tensor, cfg: TokenConfig = TokenConfig()) -> torch.Tensor | None:  # fmt: skip
    """fused_moe_w4 for one token (`supported`): [1, D] in hidden's dtype, weights [K] float32, topk_ids
    [1, K]. None where no barrier counters can be had (a CUDA graph capture before the pool exists)."""
    d, inter, top_k = hidden.shape[1], w2.in_features, topk_ids.shape[1]
    assert supported(hidden, w13, w2, top_k, cfg), (tuple(hidden.shape), w13.group_size, w2.group_size, cfg)
    bar = ticket_counters(hidden.device, "moe_w4_token", 2)
    if bar is None:
        return None
    cx = constexprs(d, inter, top_k, w13.group_size, w2.group_size, w13.zeros is not None, cfg)
    programs = cx["P"]
    act = torch.empty(programs, cfg.ic, dtype=hidden.dtype, device=hidden.device)
    part = torch.empty(programs, d, dtype=torch.float32, device=hidden.device)
    out = torch.empty_like(hidden)
    magic, offset = MAGIC[hidden.dtype]
    q, s, q2, s2 = w13.qweight, w13.scales, w2.qweight, w2.scales
    _token_kernel[(programs,)](
        hidden, q, s, _zeros(w13), q2, s2, _zeros(w2), out, topk_ids.reshape(-1), weights, act, part, bar,
        magic, offset, inter,
        q.stride(0), q.stride(1), s.stride(0), s.stride(1), q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
        **cx, num_warps=cfg.warps, **pdl_launch(hidden.device),
    )  # fmt: skip
    return out
