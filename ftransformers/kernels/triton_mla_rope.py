"""DeepSeek's MLA rotary and latent assembly in one launch: q_pe rotated, and latent = [c_kv | rotated k_pe].

The same function as layers/rotary_yarn.DeepseekRotaryEmbedding followed by `torch.cat([c_kv, k_pe], -1)`,
which in PyTorch is about twenty small launches a layer (cos / sin of position * inv_freq, the strided pair
views, four products, two sums and a concatenation for q and again for k, then the latent's concatenation).
Written to round as that path rounds (cos / sin in float32 times the attention factor, cast to the activation
dtype; each product, then each sum, cast to it, as PyTorch's upcast-operate-round does). It does not match it bit
for bit: on the H200 75-78% of bf16 outputs were identical to the module's and the rest within bf16 rounding
(relative error under 1e-2; float32 under 1e-5); why the rest differ was not established (Triton's cos / sin, or
its handling of the intermediate casts, are the candidates). Triton's CPU interpreter truncates float32 to bf16.

Layouts (rotary dim R, pairs P = R/2): interleaved pair p is (x[2p], x[2p+1]), half-split (NeoX) (x[p], x[p+P]);
both are written half-split, [x1 cos - x2 sin | x2 cos + x1 sin], as the reference does.

Grid (T,): a program per token rotates every head of q_pe ([BLOCK_H, BLOCK_P] tiles over the heads), then k_pe,
and copies c_kv into the latent row. Graph-safe: reads only device tensors, output shapes fixed by T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _rotate(src, cos, sin, offs_p, mask, P: tl.constexpr, INTERLEAVED: tl.constexpr):
    # src + offs_p addresses pair p's first element per row; -> the two output halves in src's dtype
    if INTERLEAVED:
        x1 = tl.load(src + 2 * offs_p, mask=mask, other=0.0)
        x2 = tl.load(src + 2 * offs_p + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(src + offs_p, mask=mask, other=0.0)
        x2 = tl.load(src + P + offs_p, mask=mask, other=0.0)
    dt = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    ac = (a * cos).to(dt).to(tl.float32)
    bs = (b * sin).to(dt).to(tl.float32)
    bc = (b * cos).to(dt).to(tl.float32)
    as_ = (a * sin).to(dt).to(tl.float32)
    return (ac - bs).to(dt), (bc + as_).to(dt)


@triton.jit
def _mla_rope_kernel(
    pos_ptr, inv_freq_ptr, q_ptr, ckv_ptr, kpe_ptr, q_out_ptr, latent_ptr,
    H, L, attention_factor,
    s_qt, s_qh, s_ct, s_kt, s_qot, s_qoh, s_lt,
    P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freqs = pos * tl.load(inv_freq_ptr + offs_p, mask=p_ok, other=0.0)  # [BP] float32, as position * inv_freq
    dt = q_out_ptr.dtype.element_ty
    cos = (tl.cos(freqs) * attention_factor).to(dt).to(tl.float32)
    sin = (tl.sin(freqs) * attention_factor).to(dt).to(tl.float32)
    cos2 = cos[None, :]
    sin2 = sin[None, :]
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < H) & p_ok[None, :]  # [BH, BP]
        src = q_ptr + t * s_qt + offs_h[:, None].to(tl.int64) * s_qh
        lo, hi = _rotate(src, cos2, sin2, offs_p[None, :], mask, P, INTERLEAVED)
        dst = q_out_ptr + t * s_qot + offs_h[:, None].to(tl.int64) * s_qoh + offs_p[None, :]
        tl.store(dst, lo, mask=mask)
        tl.store(dst + P, hi, mask=mask)
    lo, hi = _rotate(kpe_ptr + t * s_kt, cos, sin, offs_p, p_ok, P, INTERLEAVED)
    row = latent_ptr + t * s_lt
    tl.store(row + L + offs_p, lo.to(latent_ptr.dtype.element_ty), mask=p_ok)
    tl.store(row + L + P + offs_p, hi.to(latent_ptr.dtype.element_ty), mask=p_ok)
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        c = tl.load(ckv_ptr + t * s_ct + offs_l, mask=offs_l < L)
        tl.store(row + offs_l, c.to(latent_ptr.dtype.element_ty), mask=offs_l < L)


def mla_rope(
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [R/2] float32
    attention_factor: float,
    q_pe: torch.Tensor,  # [T, H, R], unit stride along R (a view of q)
    c_kv: torch.Tensor,  # [T, L], unit stride along L
    k_pe: torch.Tensor,  # [T, R], unit stride along R (a view of the kv_a projection)
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # q_pe rotated [T, H, R], latent [T, L + R]
    t, h, r = q_pe.shape  # token and head offsets are int64 in the kernel: any T
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
    block_p = triton.next_power_of_2(r // 2)
    _mla_rope_kernel[(t,)](
        positions, inv_freq, q_pe, c_kv, k_pe, q_out, latent, h, lat, float(attention_factor),
        q_pe.stride(0), q_pe.stride(1), c_kv.stride(0), k_pe.stride(0), q_out.stride(0), q_out.stride(1),
        latent.stride(0), P=r // 2, BLOCK_P=block_p, BLOCK_H=min(triton.next_power_of_2(h), max(1, 4096 // block_p)),
        BLOCK_L=min(1024, triton.next_power_of_2(max(lat, 1))), INTERLEAVED=interleaved, num_warps=4,
        **pdl_launch(q_pe.device),
    )  # fmt: skip
    return q_out, latent
