"""DeepSeek's MLA rotary and latent assembly in one launch: q_pe rotated, and latent = [c_kv | rotated k_pe].

The same function as layers/rotary_yarn.DeepseekRotaryEmbedding followed by `torch.cat([c_kv, k_pe], -1)`,
which in PyTorch is about twenty small launches a layer (cos / sin of position * inv_freq, the strided pair
views, four products, two sums and a concatenation for q and again for k, then the latent's concatenation).
Written to round as that path rounds: cos / sin in float32 times the attention factor, cast to the activation
dtype; each product, then each sum, rounded to it, as PyTorch's upcast-operate-round does. In bf16 the rounding is
integer arithmetic (`_rounded`): with x.to(bf16).to(float32) the first version matched the module in only 75-78%
of its bf16 outputs on the H200 (the rest one bf16 step away), although its cos / sin matched bit for bit
(benchmarks/check_mla_rope_exact.py). Now bit for bit, on the GPU and under Triton's CPU interpreter.

Layouts (rotary dim R, pairs P = R/2): interleaved pair p is (x[2p], x[2p+1]), read as one contiguous row and split;
half-split (NeoX) (x[p], x[p+P]). Both are written half-split, [x1 cos - x2 sin | x2 cos + x1 sin], as the reference
does.

Grid (T, ceil(H / HEADS_PER_PROGRAM) + 1): program (t, j) rotates a block of token t's q_pe heads; the last j of
a token rotates its k_pe and copies c_kv into the latent row. The first version ran one program a token over
every head, 19.6 us a launch at 128 heads on the H200 for 16 KB. Graph-safe: reads only device tensors, output
shapes fixed by T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch

# heads of q_pe a program (a power of two), and warps a program; module constants for benchmarks/ab_decode.py's `set=`
HEADS_PER_PROGRAM = 16
WARPS = 1


@triton.jit
def _pairs(src, offs_h, h_ok, offs_p, p_ok, P: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    # src: a row's first rotary element, offs_h: row offsets [BH] (already times the row stride); -> x1, x2 [BH, BP]
    if INTERLEAVED:  # pair p is (x[2p], x[2p+1]): one contiguous load of 2P, split into its even and odd lanes
        offs_r = tl.arange(0, 2 * BLOCK_P)
        mask = h_ok[:, None] & (offs_r < 2 * P)[None, :]
        x = tl.load(src + offs_h[:, None] + offs_r[None, :], mask=mask, other=0.0)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], BLOCK_P, 2]))
    else:
        mask = h_ok[:, None] & p_ok[None, :]
        x1 = tl.load(src + offs_h[:, None] + offs_p[None, :], mask=mask, other=0.0)
        x2 = tl.load(src + offs_h[:, None] + P + offs_p[None, :], mask=mask, other=0.0)
    return x1, x2


@triton.jit
def _rounded(x, dt: tl.constexpr):
    # float32 x rounded to dt's precision (ties to even), kept in float32. For bf16 by integer ops: on the H200,
    # x.to(bf16).to(float32) between float32 operations did not round (the kernel's products then matched the
    # module's in only 76% of outputs), so the rounding is spelled out where the compiler cannot drop it.
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # finite inputs (an overflow rounds to inf)
        return bits.to(tl.float32, bitcast=True)
    else:  # float32 (a no-op), or float16 (the cast pair; its exactness not checked)
        return x.to(dt).to(tl.float32)


@triton.jit
def _rotate(x1, x2, cos, sin):
    # x1, x2 [BH, BP] in the activation dtype; cos, sin [1, BP] float32 holding dtype values -> the output halves,
    # each product and each sum rounded to the activation dtype as PyTorch's bf16 ops round them
    dt: tl.constexpr = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    ac = _rounded(a * cos, dt)
    bs = _rounded(b * sin, dt)
    bc = _rounded(b * cos, dt)
    as_ = _rounded(a * sin, dt)
    return _rounded(ac - bs, dt).to(dt), _rounded(bc + as_, dt).to(dt)


@cached_launch
@triton.jit
def _mla_rope_kernel(
    pos_ptr, inv_freq_ptr, q_ptr, ckv_ptr, kpe_ptr, q_out_ptr, latent_ptr,
    H, L, attention_factor,
    s_qt, s_qh, s_ct, s_kt, s_qot, s_qoh, s_lt,
    P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_PDL: tl.constexpr = False,
    pool_ptr=None, loc_ptr=None, s_pt=0, STORE: tl.constexpr = False,
):  # fmt: skip
    # grid (T, head blocks + 1): program (t, j) rotates heads [j BH, (j+1) BH) of token t's q_pe; the last j
    # rotates k_pe and writes the latent row, and with STORE that row also at pool row loc[t], rounded to the pool's
    # dtype from the latent's (as MLAKVPool.set_latent stores it)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    inv_freq = tl.load(inv_freq_ptr + offs_p, mask=p_ok, other=0.0)  # a constant buffer: read before the wait
    pdl_enter(USE_PDL)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freqs = pos * inv_freq  # [BP] float32, as position * inv_freq
    dt = q_out_ptr.dtype.element_ty
    cos = _rounded(tl.cos(freqs) * attention_factor, dt)[None, :]
    sin = _rounded(tl.sin(freqs) * attention_factor, dt)[None, :]
    if hb < tl.num_programs(1) - 1:  # (the branches name their values apart: Triton types a name across an if)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        q1, q2 = _pairs(q_ptr + t * s_qt, offs_h.to(tl.int64) * s_qh, h_ok, offs_p, p_ok, P, BLOCK_P, INTERLEAVED)
        q_lo, q_hi = _rotate(q1, q2, cos, sin)
        mask = h_ok[:, None] & p_ok[None, :]
        dst = q_out_ptr + t * s_qot + offs_h[:, None].to(tl.int64) * s_qoh + offs_p[None, :]
        tl.store(dst, q_lo, mask=mask)
        tl.store(dst + P, q_hi, mask=mask)
    else:
        one = tl.arange(0, 1)
        k1, k2 = _pairs(kpe_ptr + t * s_kt, one.to(tl.int64), one < 1, offs_p, p_ok, P, BLOCK_P, INTERLEAVED)
        k_lo, k_hi = _rotate(k1, k2, cos, sin)  # [1, BP]
        row = latent_ptr + t * s_lt
        ldt = latent_ptr.dtype.element_ty
        tl.store(row + L + offs_p[None, :], k_lo.to(ldt), mask=p_ok[None, :])
        tl.store(row + L + P + offs_p[None, :], k_hi.to(ldt), mask=p_ok[None, :])
        if STORE:
            prow = pool_ptr + tl.load(loc_ptr + t).to(tl.int64) * s_pt
            pdt = pool_ptr.dtype.element_ty
            tl.store(prow + L + offs_p[None, :], k_lo.to(ldt).to(pdt), mask=p_ok[None, :])
            tl.store(prow + L + P + offs_p[None, :], k_hi.to(ldt).to(pdt), mask=p_ok[None, :])
        for l0 in range(0, L, BLOCK_L):
            offs_l = l0 + tl.arange(0, BLOCK_L)
            c = tl.load(ckv_ptr + t * s_ct + offs_l, mask=offs_l < L).to(ldt)
            tl.store(row + offs_l, c, mask=offs_l < L)
            if STORE:
                tl.store(prow + offs_l, c.to(pool_ptr.dtype.element_ty), mask=offs_l < L)


def mla_rope(
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [R/2] float32
    attention_factor: float,
    q_pe: torch.Tensor,  # [T, H, R], unit stride along R (a view of q)
    c_kv: torch.Tensor,  # [T, L], unit stride along L
    k_pe: torch.Tensor,  # [T, R], unit stride along R (a view of the kv_a projection)
    interleaved: bool,
    pool: torch.Tensor | None = None,  # [N, L + R], unit stride along its rows: the latent rows also go to pool[loc]
    loc: torch.Tensor | None = None,  # [T] int, the new tokens' pool rows
) -> tuple[torch.Tensor, torch.Tensor]:  # q_pe rotated [T, H, R], latent [T, L + R]
    t, h, r = q_pe.shape  # token and head offsets are int64 in the kernel: any T
    if (pool is None) != (loc is None) or (
        pool is not None and loc is not None
        and (pool.dim() != 2 or pool.shape[1] != c_kv.shape[1] + r or pool.stride(1) != 1 or loc.shape != (t,))
    ):  # fmt: skip
        raise ValueError(f"mla_rope: pool [N, L + R] (unit stride along a row) and loc [T] come together; got pool "
                         f"{None if pool is None else (tuple(pool.shape), pool.stride())}, loc "
                         f"{None if loc is None else tuple(loc.shape)}")  # fmt: skip
    unit = q_pe.stride(2) == 1 and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1
    shapes = r % 2 == 0 and k_pe.shape == (t, r) and c_kv.shape[0] == t and inv_freq.shape == (r // 2,)
    if not (unit and shapes and inv_freq.dtype == torch.float32):
        raise ValueError(f"mla_rope: q_pe [T, H, R] with even R, k_pe [T, R], c_kv [T, L] (unit stride on the last "
                         f"axis), inv_freq [R/2] float32; got q_pe {tuple(q_pe.shape)} {q_pe.stride()}, k_pe "
                         f"{tuple(k_pe.shape)} {k_pe.stride()}, c_kv {tuple(c_kv.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)} {inv_freq.dtype}")  # fmt: skip
    lat = c_kv.shape[1]
    q_out = torch.empty(t, h, r, dtype=q_pe.dtype, device=q_pe.device)
    latent = torch.empty(t, lat + r, dtype=c_kv.dtype, device=c_kv.device)
    if t == 0:
        return q_out, latent
    block_p = next_pow2(r // 2)
    block_h = min(next_pow2(h), HEADS_PER_PROGRAM)
    _mla_rope_kernel[(t, cdiv(h, block_h) + 1)](
        positions, inv_freq, q_pe, c_kv, k_pe, q_out, latent, h, lat, float(attention_factor),
        q_pe.stride(0), q_pe.stride(1), c_kv.stride(0), k_pe.stride(0), q_out.stride(0), q_out.stride(1),
        latent.stride(0), P=r // 2, BLOCK_P=block_p, BLOCK_H=block_h,
        BLOCK_L=min(1024, next_pow2(max(lat, 1))), INTERLEAVED=interleaved, num_warps=WARPS,
        **pdl_launch(q_pe.device),
        **({} if pool is None else {"pool_ptr": pool, "loc_ptr": loc, "s_pt": pool.stride(0), "STORE": True}),
    )  # fmt: skip
    return q_out, latent
