"""One int4 MoE token in ONE persistent launch: every program requests all of its expert bytes (gate-up and
down) at once into shared memory, computes its gate-up rows as they land, meets the others at a grid
barrier, then sums its rows of down over the top-k slots from the copy already waiting in shared memory.

Why (docs/performance.md, sessions 23-33): at one Qwen3-30B-A3B token the two GEMV-form kernels of
kernels/triton_moe_w4_gemv.py move 19.5 MB in ~12 us on the step's critical path against a 6.5 us byte
floor. Their programs hold the bytes in flight in registers, so the gate-up needs two waves of two serial
DRAM round trips each, and the down kernel's bytes start only when the gate-up's last wave has started.
Here the bytes in flight sit in shared memory: one program an SM, cp.async copies for all of its gate-up
units and its down rows issued right after the PDL wait (~150 KB a program), so DRAM streams the whole
layer's expert bytes in one go while the programs compute.

Work (T = 1 token, K <= SLOTS slots, experts e_k = ids[k]):
- gate-up unit u < K * I / UR: slot k = u // (I / UR), rows n0 = (u % (I / UR)) * UR; its UR gate rows and UR
  up rows of expert e_k ([2, UR, D / 8] words); program p takes units p, p + P, ... (at most UNITS).
  Warp w computes gate row n0 + w and up row n0 + w and stores act[k, n0 + w] = silu(gate) * up in x's dtype.
- grid barrier (every program resident: P <= SMs, one program an SM by its shared memory).
- down: program p forms out rows p * DR .. p * DR + DR - 1: words [DR, SLOTS, I / 8] of the K experts, warp w
  = slot w, summed over slots with the routing weights; act is read through L2 (.cg) after the barrier.

Layouts: a gate-up half tile is [UR rows, NG groups, WG words] (WG = G / 8 words a quantization group), a
thread holding 4 adjacent words of one row (a lane reads 16 bytes, a warp 512 contiguous bytes of shared
memory); x's 8 planes [NG, WG] are loaded once for all units. Each thread reads back only the words its own
cp.async calls copied, so wait_group orders them. The nibble arithmetic is triton_moe_w4_gemv's: a nibble
masked in place is read as a float32 subnormal against x * 2^(100 - 4e), one LOP3 and one FMA a weight.

Needs: int4 experts with 16-bit scales (zeros uint8 or none), G in {32, 64, 128}, D / 8 a power of two in
[128, 1024], I a multiple of UR and of G with I / 8 <= IWP = 128 words, top-k <= SLOTS, at most UNITS gate-up
units and one down tile a program (`takes`). Qwen3-30B-A3B's experts (D 2048, I 768, top-8) are the shape
it is for. CUDA only (Gluon, compute capability 9.x); the CPU and other shapes keep the two-kernel path.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ftransformers.kernels.gluon_mla_decode import _cp_async, _cta_barrier, pdl_enter
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.tickets import ticket_counters

# fused_moe_w4 takes one int4 token here where `takes` allows; `set=gluon_moe_w4_fused.ENABLED=0` in
# benchmarks/ab_decode.py restores the two-kernel token path for an A/B.
ENABLED = True
WARPS = 8
UR = 8  # gate (and up) rows a unit: one a warp
DR = 16  # down rows a program
SLOTS = 8  # the down tile's slot axis: one a warp
UNITS = 8  # gate-up units a program holds at once (the scale tile's leading axis)
IWP = 128  # the down tile's words a row and slot (I / 8 padded)
SMEM_LIMIT = 227 * 1024
DIAG = 0  # timing experiments only (benchmarks/ablate_moe_w4_fused.py), wrong results: 1 no compute, 2 no grid barrier, 3 no copies
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_TWO_49: gl.constexpr = gl.constexpr(2.0**49)
_TWO_M49: gl.constexpr = gl.constexpr(2.0**-49)
_TWO_100: gl.constexpr = gl.constexpr(2.0**100)
_TWO_96: gl.constexpr = gl.constexpr(2.0**96)
_TWO_92: gl.constexpr = gl.constexpr(2.0**92)
_TWO_88: gl.constexpr = gl.constexpr(2.0**88)
_TWO_84: gl.constexpr = gl.constexpr(2.0**84)


# the same, as constexprs for the kernels
_W: gl.constexpr = gl.constexpr(WARPS)
_UR: gl.constexpr = gl.constexpr(UR)
_DR: gl.constexpr = gl.constexpr(DR)
_SL: gl.constexpr = gl.constexpr(SLOTS)
_IWP: gl.constexpr = gl.constexpr(IWP)


@gluon.jit
def _planes(ptrs, mask, CG: gl.constexpr):
    # x at ptrs + j (an element's 8 activations, its word's nibbles j) -> the 8 planes x_j * 2^(100 - 4e_j)
    # (e_j = j for j < 5, j - 3 after: nibbles 5..7 are read from q >> 12) and sum_j x_j 2^-49, float32
    if CG:
        x0 = gl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x1 = gl.load(ptrs + 1, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x2 = gl.load(ptrs + 2, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x3 = gl.load(ptrs + 3, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x4 = gl.load(ptrs + 4, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x5 = gl.load(ptrs + 5, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x6 = gl.load(ptrs + 6, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
        x7 = gl.load(ptrs + 7, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
    else:
        x0 = gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
        x1 = gl.load(ptrs + 1, mask=mask, other=0.0).to(gl.float32)
        x2 = gl.load(ptrs + 2, mask=mask, other=0.0).to(gl.float32)
        x3 = gl.load(ptrs + 3, mask=mask, other=0.0).to(gl.float32)
        x4 = gl.load(ptrs + 4, mask=mask, other=0.0).to(gl.float32)
        x5 = gl.load(ptrs + 5, mask=mask, other=0.0).to(gl.float32)
        x6 = gl.load(ptrs + 6, mask=mask, other=0.0).to(gl.float32)
        x7 = gl.load(ptrs + 7, mask=mask, other=0.0).to(gl.float32)
    xsum = (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))) * _TWO_M49
    xm = (x0 * _TWO_100, x1 * _TWO_96, x2 * _TWO_92, x3 * _TWO_88, x4 * _TWO_84, x5 * _TWO_92, x6 * _TWO_88,
          x7 * _TWO_84)  # fmt: skip
    return xm, xsum


@gluon.jit
def _nibble_dot(q, xm):
    # sum_j code_j(q) x_j 2^-49 for int32 words q (xm broadcast against q)
    h = q >> 12
    t = (q & 0xF).to(gl.float32, bitcast=True) * xm[0]
    t += (q & 0xF0).to(gl.float32, bitcast=True) * xm[1]
    t += (q & 0xF00).to(gl.float32, bitcast=True) * xm[2]
    t += (q & 0xF000).to(gl.float32, bitcast=True) * xm[3]
    t += (q & 0xF0000).to(gl.float32, bitcast=True) * xm[4]
    t += (h & 0xF00).to(gl.float32, bitcast=True) * xm[5]
    t += (h & 0xF000).to(gl.float32, bitcast=True) * xm[6]
    t += (h & 0xF0000).to(gl.float32, bitcast=True) * xm[7]
    return t


@gluon.jit
def _half_rows(words, s, z, xm, xsum, L3: gl.constexpr, S2: gl.constexpr):
    # one half (gate or up) of a unit: words [UR, NG, WG] int32, scales / zeros [UR, NG] in shared memory ->
    # the rows' dot products with x [UR], float32
    sc = gl.expand_dims(s.load(S2).to(gl.float32), 2)  # [UR, NG, 1]
    zc = gl.expand_dims(z.load(S2).to(gl.float32), 2)
    v = sc * (_nibble_dot(words.load(L3), xm) - zc * xsum)
    return gl.sum(gl.sum(v, axis=2), axis=1) * _TWO_49


@gluon.jit
def _grid_barrier(cnt_ptr, programs):
    # every program arrives before any leaves (all resident); stores before it are visible after it through L2
    _cta_barrier()
    gl.atomic_add(cnt_ptr, 1, sem="release")
    seen = gl.atomic_add(cnt_ptr, 0, sem="acquire")
    while seen < programs:
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire")
    _cta_barrier()


@gluon.jit
def _fused_moe_kernel(
    x_ptr, q13_ptr, s13_ptr, z13_ptr, q2_ptr, s2_ptr, z2_ptr, act_ptr, out_ptr, ids_ptr, tw_ptr, cnt_ptr,
    D, I, IW, n_units, programs, stride_q13, stride_s13, stride_q2, stride_s2,
    TOP_K: gl.constexpr, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, DW: gl.constexpr, UNITS: gl.constexpr,
    RING: gl.constexpr,
    USE_PDL: gl.constexpr = False, DIAG: gl.constexpr = 0,
):  # fmt: skip
    # IW = I / 8; q13 [E, 2I, DW] int32, s13 / z13 [E, 2I, D / G]; q2 [E, D, I / 8], s2 / z2 [E, D, I / G] (all contiguous,
    # stride_* the expert strides); act [_SL, I] scratch in x's dtype; cnt_ptr two zeroed int32 counters
    WG: gl.constexpr = GROUP // 8  # words a group
    TW: gl.constexpr = WG // 4  # lanes along a group's words (4 words a lane)
    TN: gl.constexpr = 32 // TW  # lanes along the groups
    NG: gl.constexpr = DW // WG  # groups a gate-up row
    NGI: gl.constexpr = _IWP // WG  # groups a down row and slot (padded)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, TN, TW], [_W, 1, 1], [2, 1, 0])  # [_UR, NG, WG]
    L4: gl.constexpr = gl.BlockedLayout(
        [_DR, 1, 1, 4], [1, 1, TN, TW], [1, _W, 1, 1], [3, 2, 1, 0]
    )  # [_DR, _SL, NGI, WG]
    LS: gl.constexpr = gl.BlockedLayout([1, NG // 2], [16, 2], [_W, 1], [1, 0])  # [16 _UR (unit, half, row), NG]
    S2: gl.constexpr = gl.SliceLayout(2, L3)  # [_UR, NG]
    X2: gl.constexpr = gl.SliceLayout(0, L3)  # [NG, WG]
    S3: gl.constexpr = gl.SliceLayout(3, L4)  # [_DR, _SL, NGI]
    A3: gl.constexpr = gl.SliceLayout(0, L4)  # [_SL, NGI, WG]
    plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
    pid = gl.program_id(0)
    NB = I // _UR
    pdl_enter(USE_PDL)

    # 1. x's planes, every gate-up unit's scales (and zeros) into registers, loads issued first
    xg = gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(1, X2)), 1)
    xw = gl.expand_dims(gl.arange(0, WG, layout=gl.SliceLayout(0, X2)), 0)
    xm, xsum = _planes(x_ptr + (xg * WG + xw) * 8, xg < NG, False)  # [NG, WG] each
    xm = (gl.expand_dims(xm[0], 0), gl.expand_dims(xm[1], 0), gl.expand_dims(xm[2], 0), gl.expand_dims(xm[3], 0),
          gl.expand_dims(xm[4], 0), gl.expand_dims(xm[5], 0), gl.expand_dims(xm[6], 0), gl.expand_dims(xm[7], 0))  # fmt: skip
    xsum = gl.expand_dims(xsum, 0)
    srow = gl.expand_dims(gl.arange(0, 16 * _UR, layout=gl.SliceLayout(1, LS)), 1)  # [16 _UR, 1]
    ug = gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(0, LS)), 0)  # [1, NG]
    uu = pid + (srow // (2 * _UR)) * programs  # row 2 i _UR + h _UR + r: row r of half h (gate, up) of unit i
    ulive = (srow // (2 * _UR) < UNITS) & (uu < n_units)
    ue = gl.load(ids_ptr + uu // NB, mask=ulive, other=0).to(gl.int64)
    urow = ((srow // _UR) % 2) * I + (uu % NB) * _UR + srow % _UR  # the row of the expert's w13
    smask = ulive & (ug < NG)
    s_all = gl.load(s13_ptr + ue * stride_s13 + urow * NG + ug, mask=smask, other=0.0)
    if HAS_ZEROS:
        z_all = gl.load(z13_ptr + ue * stride_s13 + urow * NG + ug, mask=smask, other=0)
    else:
        z_all = gl.full([16 * _UR, NG], 8, gl.uint8, LS)

    # the down tile's scales and zeros, its rows' routing into registers
    d0 = pid * _DR
    sr = gl.expand_dims(gl.expand_dims(gl.arange(0, _DR, layout=gl.SliceLayout(1, gl.SliceLayout(2, S3))), 1), 2)
    ss = gl.expand_dims(gl.expand_dims(gl.arange(0, _SL, layout=gl.SliceLayout(0, gl.SliceLayout(2, S3))), 0), 2)
    sg = gl.expand_dims(gl.expand_dims(gl.arange(0, NGI, layout=gl.SliceLayout(0, gl.SliceLayout(1, S3))), 0), 1)
    se = gl.load(ids_ptr + ss, mask=ss < TOP_K, other=0).to(gl.int64)  # [1, _SL, 1]
    dmask3 = (d0 + sr < D) & (ss < TOP_K) & (sg < I // GROUP)
    ds_raw = gl.load(s2_ptr + se * stride_s2 + (d0 + sr) * (I // GROUP) + sg, mask=dmask3, other=0.0)
    if HAS_ZEROS:
        dz_raw = gl.load(z2_ptr + se * stride_s2 + (d0 + sr) * (I // GROUP) + sg, mask=dmask3, other=0)
    else:
        dz_raw = gl.full([_DR, _SL, NGI], 8, gl.uint8, S3)
    tw = gl.load(tw_ptr + ss, mask=ss < TOP_K, other=0.0)  # [1, _SL, 1] float32

    # 2. every unit's words, then the down tile's, as cp.async groups (one a unit, the last with the down tile)
    r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, _UR, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))), 1), 2)
    g3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))), 0), 2)
    w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, WG, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    ring = gl.allocate_shared_memory(
        gl.int32, [RING, _UR, NG, WG], plain3
    )  # RING = 2 UNITS rounded up to a power of two
    for i in gl.static_range(UNITS):
        u = pid + i * programs
        uc = gl.minimum(u, n_units - 1)
        e = gl.load(ids_ptr + uc // NB).to(gl.int64)
        base = q13_ptr + e * stride_q13 + ((uc % NB) * _UR + r3) * DW + g3 * WG + w3  # [_UR, NG, WG]
        live = (r3 * 0 + u) < n_units
        if DIAG != 3:
            _cp_async(ring.index(2 * i), base, mask=live)
            _cp_async(ring.index(2 * i + 1), base + I * DW, mask=live)
        if i < UNITS - 1:
            async_copy.commit_group()
    rr = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, _DR, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4)))), 1), 2), 3)  # fmt: skip
    rs = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, _SL, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4)))), 0), 2), 3)  # fmt: skip
    rg = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, NGI, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4)))), 0), 1), 3)  # fmt: skip
    rw = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, WG, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4)))), 0), 1), 2)  # fmt: skip
    re = gl.load(ids_ptr + rs, mask=rs < TOP_K, other=0).to(gl.int64)  # [1, _SL, 1, 1]
    col = rg * WG + rw  # [1, 1, NGI, WG] word of I
    dmask4 = (d0 + rr < D) & (rs < TOP_K) & (col < IW)
    dsm = gl.allocate_shared_memory(gl.int32, [_DR, _SL, NGI, WG], plain4)
    if DIAG != 3:
        _cp_async(dsm, q2_ptr + re * stride_q2 + (d0 + rr) * IW + col, mask=dmask4)
    async_copy.commit_group()

    # 3. the scales into shared memory (each unit's read back in the compute layout)
    s_sm = gl.allocate_shared_memory(s13_ptr.dtype.element_ty, [16 * _UR, NG], plain2, s_all)
    z_sm = gl.allocate_shared_memory(gl.uint8, [16 * _UR, NG], plain2, z_all)
    _cta_barrier()

    # 4. gate-up units as their copies land
    rows = gl.arange(0, _UR, layout=gl.SliceLayout(1, S2))
    for i in gl.static_range(UNITS):
        async_copy.wait_group(UNITS - 1 - i)  # this thread's copies of unit i (it reads only those) landed
        u = pid + i * programs
        if (u < n_units) & (DIAG != 1):
            gate = _half_rows(
                ring.index(2 * i), s_sm.slice(2 * i * _UR, _UR), z_sm.slice(2 * i * _UR, _UR), xm, xsum, L3, S2
            )
            up = _half_rows(
                ring.index(2 * i + 1),
                s_sm.slice((2 * i + 1) * _UR, _UR),
                z_sm.slice((2 * i + 1) * _UR, _UR),
                xm,
                xsum,
                L3,
                S2,
            )
            act = gate / (1.0 + gl.exp(-gate)) * up
            gl.store(act_ptr + (u // NB) * I + (u % NB) * _UR + rows, act.to(act_ptr.dtype.element_ty))

    # 5. all of act written; the down tile from shared memory
    if DIAG != 2:
        _grid_barrier(cnt_ptr, programs)
    if (d0 < D) & (DIAG != 1):
        a_s = gl.expand_dims(gl.expand_dims(gl.arange(0, _SL, layout=gl.SliceLayout(1, gl.SliceLayout(2, A3))), 1), 2)
        a_g = gl.expand_dims(gl.expand_dims(gl.arange(0, NGI, layout=gl.SliceLayout(0, gl.SliceLayout(2, A3))), 0), 2)
        a_w = gl.expand_dims(gl.expand_dims(gl.arange(0, WG, layout=gl.SliceLayout(0, gl.SliceLayout(1, A3))), 0), 1)
        a_col = a_g * WG + a_w  # [1, NGI, WG] word of I
        am, asum = _planes(act_ptr + a_s * I + a_col * 8, (a_s < TOP_K) & (a_col < IW), True)  # [_SL, NGI, WG]
        am = (gl.expand_dims(am[0], 0), gl.expand_dims(am[1], 0), gl.expand_dims(am[2], 0), gl.expand_dims(am[3], 0),
              gl.expand_dims(am[4], 0), gl.expand_dims(am[5], 0), gl.expand_dims(am[6], 0), gl.expand_dims(am[7], 0))  # fmt: skip
        asum = gl.expand_dims(asum, 0)
        async_copy.wait_group(0)
        _cta_barrier()
        qd = dsm.load(L4)
        dsc = ds_raw.to(gl.float32) * tw  # [_DR, _SL, NGI]: 0 past I's groups and top-k
        v = gl.expand_dims(dsc, 3) * (_nibble_dot(qd, am) - gl.expand_dims(dz_raw.to(gl.float32), 3) * asum)
        out = gl.sum(gl.sum(gl.sum(v, axis=3), axis=2), axis=1) * _TWO_49  # [_DR]
        orow = d0 + gl.arange(0, _DR, layout=gl.SliceLayout(1, gl.SliceLayout(2, S3)))
        gl.store(out_ptr + orow, out.to(out_ptr.dtype.element_ty), mask=orow < D)
    # the last program out puts both counters back to 0 (every program is past the barrier by then)
    _cta_barrier()
    if gl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel") == programs - 1:
        gl.store(cnt_ptr, 0)
        gl.store(cnt_ptr + 1, 0)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _max_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT))


def smem_bytes(d: int, group: int, units: int) -> int:
    """Shared memory the kernel allocates: the words of RING half units, the down tile, the scales and zeros of
    16 half units (Triton 3.9's sm_90 compile of the kernel reports exactly this; its reduction scratch reuses
    freed buffers)."""
    ng = d // group
    return triton.next_power_of_2(2 * units) * UR * d // 8 * 4 + DR * SLOTS * IWP * 4 + 16 * UR * ng * 3


def plan(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int) -> tuple[int, int] | None:
    """(programs, units a program) where this kernel can run the call, else None (module docstring's needs)."""
    if not ENABLED or _INTERPRET or hidden.device.type != "cuda" or hidden.shape[0] != 1:
        return None
    if hidden.dtype not in (torch.bfloat16, torch.float16) or w13.fmt != "int4" or w2.fmt != "int4":
        return None
    index = hidden.device.index if hidden.device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != 9:
        return None
    d, inter, g = hidden.shape[1], w2.in_features, w13.group_size
    if g not in (32, 64, 128) or w2.group_size != g or d % g or inter % g or inter % UR or top_k > SLOTS:
        return None
    dw = d // 8
    if dw & (dw - 1) or not 128 <= dw <= 1024 or inter // 8 > IWP:
        return None
    tensors = (w13.qweight, w13.scales, w2.qweight, w2.scales) + tuple(
        z for z in (w13.zeros, w2.zeros) if z is not None
    )
    if any(not t.is_contiguous() for t in tensors):
        return None
    if w13.scales.element_size() != 2 or w2.scales.dtype != w13.scales.dtype:
        return None
    if (w13.zeros is None) != (w2.zeros is None) or (w13.zeros is not None and w13.zeros.dtype != torch.uint8):
        return None
    programs = _num_sms(index)
    units = triton.cdiv(top_k * inter // UR, programs)
    if units > UNITS or d > DR * programs:
        return None
    if smem_bytes(d, g, units) > _max_smem(index):  # the compiled kernel's, exactly (sm_90)
        return None
    return programs, units


def takes(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int) -> bool:
    """Whether fused_moe_w4 runs this call here (`plan` finds a launch)."""
    return plan(hidden, w13, w2, top_k) is not None


def moe_w4_fused(
    hidden: torch.Tensor,  # [1, D] bf16 / fp16, unit stride along D
    w13: QuantizedWeight,  # int4 [E, 2I, D]
    w2: QuantizedWeight,  # int4 [E, D, I]
    weights: torch.Tensor,  # [K] float32 contiguous
    ids: torch.Tensor,  # [1, K] int
) -> torch.Tensor | None:  # [1, D] hidden.dtype; None: no ticket counters (a capture before their pool)
    """quant_moe_ref's function for one token in one launch, where `plan` finds one."""
    found = plan(hidden, w13, w2, ids.shape[1])
    if found is None:
        raise ValueError("moe_w4_fused: this call is outside the kernel's shapes (see gluon_moe_w4_fused.plan)")
    programs, units = found
    counters = ticket_counters(hidden.device, "moe_w4_fused", 2)
    if counters is None:
        return None
    d, inter, top_k = hidden.shape[1], w2.in_features, ids.shape[1]
    ids = ids.contiguous()
    act = torch.empty(top_k, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(1, d, dtype=hidden.dtype, device=hidden.device)
    z13 = w13.zeros if w13.zeros is not None else w13.scales
    z2 = w2.zeros if w2.zeros is not None else w2.scales
    _fused_moe_kernel[(programs,)](
        hidden, w13.qweight, w13.scales, z13, w2.qweight, w2.scales, z2, act, out, ids, weights, counters,
        d, inter, inter // 8, top_k * inter // UR, programs,
        w13.qweight.stride(0), w13.scales.stride(0), w2.qweight.stride(0), w2.scales.stride(0),
        TOP_K=top_k, GROUP=w13.group_size, HAS_ZEROS=w13.zeros is not None, DW=d // 8, UNITS=units,
        RING=triton.next_power_of_2(2 * units),
        DIAG=DIAG, num_warps=WARPS, **pdl_launch(hidden.device),
    )  # fmt: skip
    return out
