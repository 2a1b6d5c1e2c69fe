"""Per-head q/k RMSNorm (optional) + neox rotary + K/V store into the paged pool, one launch.

Same function as, in order: `layers/norm.RMSNorm` over each head (statistics in float32, the
normalised row cast back to the input dtype before the weight multiplies), `layers/rotary.
RotaryEmbedding` (neox style, rotary_dim == head_dim, the float32 [P, D] cos|sin cache, rotated in
float32 and cast back), then `MHAKVPool.set_kv` (k and v cast to the pool dtype at out_cache_loc).

Grid (T, H + H_kv): a program per (token, head); the k-head programs also copy that head of v.
Graph-safe: reads only device tensors, no host sync, output shapes fixed by T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def norm_rope(src, w_ptr, eps, cos, sin, offs, mask, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    # one head per row of src + offs (offs [BLOCK_HALF], or [1, BLOCK_HALF] under [R, 1] row pointers):
    # -> the rotated halves in float32, shaped like src + offs
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    if HAS_NORM:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        sq = tl.sum(a * a, axis=-1, keep_dims=True) + tl.sum(b * b, axis=-1, keep_dims=True)
        rstd = tl.rsqrt(sq / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = ((a * rstd).to(src.dtype.element_ty).to(tl.float32) * w1).to(src.dtype.element_ty)
        x2 = ((b * rstd).to(src.dtype.element_ty).to(tl.float32) * w2).to(src.dtype.element_ty)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@cached_launch
@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, loc_ptr,
    q_out_ptr, k_out_ptr, k_buf_ptr, v_buf_ptr,
    H, eps_q, eps_k,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_cs,
    s_qot, s_qoh, s_kot, s_koh, s_kbt, s_kbh, s_vbt, s_vbh,
    HALF: tl.constexpr, DV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_NORM: tl.constexpr, WRITE_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # PDL: positions and out_cache_loc (the batch's metadata, written before the step by host copies)
    # and the cos|sin cache (constant) are read before the wait; q, k, v after it
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * s_cs + offs, mask=mask, other=0.0)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=mask, other=0.0)
    pdl_enter(USE_PDL)
    if h < H:
        r1, r2 = norm_rope(q_ptr + t * s_qt + h * s_qh, qw_ptr, eps_q, cos, sin, offs, mask, HALF, HAS_NORM)
        dst = q_out_ptr + t * s_qot + h * s_qoh
        tl.store(dst + offs, r1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + offs, r2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        hk = (h - H).to(tl.int64)
        r1, r2 = norm_rope(k_ptr + t * s_kt + hk * s_kh, kw_ptr, eps_k, cos, sin, offs, mask, HALF, HAS_NORM)
        k1 = r1.to(k_ptr.dtype.element_ty)
        k2 = r2.to(k_ptr.dtype.element_ty)
        if WRITE_K:
            kd = k_out_ptr + t * s_kot + hk * s_koh
            tl.store(kd + offs, k1, mask=mask)
            tl.store(kd + HALF + offs, k2, mask=mask)
        kb = k_buf_ptr + loc * s_kbt + hk * s_kbh
        tl.store(kb + offs, k1.to(k_buf_ptr.dtype.element_ty), mask=mask)
        tl.store(kb + HALF + offs, k2.to(k_buf_ptr.dtype.element_ty), mask=mask)
        offs_v = tl.arange(0, BLOCK_DV)
        mask_v = offs_v < DV
        vv = tl.load(v_ptr + t * s_vt + hk * s_vh + offs_v, mask=mask_v, other=0.0)
        tl.store(v_buf_ptr + loc * s_vbt + hk * s_vbh + offs_v, vv.to(v_buf_ptr.dtype.element_ty), mask=mask_v)


def rope_store(
    q: torch.Tensor,  # [T, H, D], last dim contiguous (may be a view into the qkv projection)
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D_v]
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [P, D] float32: cos | sin
    k_buf: torch.Tensor,  # [N+1, H_kv, D]
    v_buf: torch.Tensor,  # [N+1, H_kv, D_v]
    out_cache_loc: torch.Tensor,  # [T] int
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps_q: float = 1e-6,
    eps_k: float = 1e-6,
    write_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (roped q [T, H, D], roped k [T, H_kv, D] if write_k else None); k/v land in the pool."""
    T, H, D = q.shape
    H_kv, D_v = k.shape[1], v.shape[-1]
    if D % 2 or cos_sin_cache.shape[-1] != D or k.shape[-1] != D:
        raise ValueError(f"rope_store needs rotary_dim == head_dim (even); got D={D}, cache {tuple(cos_sin_cache.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_store: give both q and k norm weights or neither")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos_sin_cache, k_buf, v_buf)):
        raise ValueError("rope_store: last dims must be contiguous")
    q_out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, H_kv, D, dtype=k.dtype, device=k.device) if write_k else None
    if T == 0:
        return q_out, k_out
    has_norm = q_norm_weight is not None
    qw = q_norm_weight if has_norm else cos_sin_cache
    kw = k_norm_weight if has_norm else cos_sin_cache
    ko = k_out if k_out is not None else q_out
    half = D // 2
    _rope_store_kernel[(T, H + H_kv)](
        q, k, v, positions, cos_sin_cache, qw, kw, out_cache_loc, q_out, ko, k_buf, v_buf,
        H, float(eps_q), float(eps_k),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), ko.stride(0), ko.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        HALF=half, DV=D_v, BLOCK_HALF=next_pow2(half), BLOCK_DV=next_pow2(D_v),
        HAS_NORM=has_norm, WRITE_K=write_k, num_warps=1,
        **pdl_launch(q.device),
    )  # fmt: skip
    return q_out, k_out


def rope_store_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_buf: torch.Tensor, v_buf: torch.Tensor, out_cache_loc: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    eps_q: float = 1e-6, eps_k: float = 1e-6, write_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Plain PyTorch: the same steps as the eager layers (norm, rope, index assignment)."""

    def norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        if w is None:
            return x
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q_out = rope(norm(q, q_norm_weight, eps_q))
    k_rot = rope(norm(k, k_norm_weight, eps_k))
    k_buf[out_cache_loc] = k_rot.to(k_buf.dtype)
    v_buf[out_cache_loc] = v.to(v_buf.dtype)
    return q_out, (k_rot if write_k else None)
