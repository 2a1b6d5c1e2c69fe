"""Prefill ("extend") attention over a paged cache in Triton: new query tokens attend to their
sequence's cached prefix (read through req_to_token) and, causally, to the chunk's own new tokens.

Flash-attention style: program (query tile of BLOCK_M new tokens, query head, sequence) keeps an
online softmax over two loops: the prefix slots (no mask) and the new tokens' K/V read contiguously
from the [T, H_kv, D] tensors of this step (causal mask, stopping at the tile's last query).
Optional "PE" part (MLA): the score adds q_pe . k_pe, k_pe read from separate (strided) views.
Extend launches may depend on host values (the grid's max_extend_len); decode never uses this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2


@cached_launch
@triton.jit
def _extend_kernel(
    Q, QPE, K_new, KPE_new, V_new, K_buf, KPE_buf, V_buf, O,
    req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
    sm_scale, group,
    s_q_t, s_q_h, s_qpe_t, s_qpe_h,
    s_kn_t, s_kn_h, s_kpen_t, s_kpen_h, s_vn_t, s_vn_h,
    s_k_n, s_k_h, s_kpe_n, s_kpe_h, s_v_n, s_v_h,
    s_o_t, s_o_h, s_r2t,
    D: tl.constexpr, DPE: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ext_len = tl.load(extend_lens + b).to(tl.int32)
    if pid_m * BLOCK_M >= ext_len:
        return
    kv_head = h // group
    prefix_len = tl.load(prefix_lens + b).to(tl.int32)
    q_start = tl.load(extend_start + b).to(tl.int32)
    req = tl.load(req_pool_indices + b)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within this chunk
    m_mask = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * s_q_t + h * s_q_h + offs_d[None, :],
                mask=m_mask[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_M, BLOCK_D]
    if BLOCK_DPE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(QPE + rows[:, None] * s_qpe_t + h * s_qpe_h + offs_pe[None, :],
                      mask=m_mask[:, None] & (offs_pe[None, :] < DPE), other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # cached prefix: every new token sees all of it
    for start_n in range(0, prefix_len, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < prefix_len
        loc = tl.load(req_to_token + req * s_r2t + pos, mask=n_mask, other=0)
        k = tl.load(K_buf + loc[None, :] * s_k_n + kv_head * s_k_h + offs_d[:, None],
                    mask=n_mask[None, :] & (offs_d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC)
        if BLOCK_DPE > 0:
            kpe = tl.load(KPE_buf + loc[None, :] * s_kpe_n + kv_head * s_kpe_h + offs_pe[:, None],
                          mask=n_mask[None, :] & (offs_pe[:, None] < DPE), other=0.0)
            qk += tl.dot(qpe, kpe.to(qpe.dtype), input_precision=DOT_PREC)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        v = tl.load(V_buf + loc[:, None] * s_v_n + kv_head * s_v_h + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    # the chunk's own tokens, causal: key j is seen by query i when j <= i
    end_n = tl.minimum((pid_m + 1) * BLOCK_M, ext_len)
    for start_n in range(0, end_n, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < ext_len
        krows = (q_start + pos).to(tl.int64)
        k = tl.load(K_new + krows[None, :] * s_kn_t + kv_head * s_kn_h + offs_d[:, None],
                    mask=n_mask[None, :] & (offs_d[:, None] < D), other=0.0)
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC)
        if BLOCK_DPE > 0:
            kpe = tl.load(KPE_new + krows[None, :] * s_kpen_t + kv_head * s_kpen_h + offs_pe[:, None],
                          mask=n_mask[None, :] & (offs_pe[:, None] < DPE), other=0.0)
            qk += tl.dot(qpe, kpe.to(qpe.dtype), input_precision=DOT_PREC)
        causal = n_mask[None, :] & (pos[None, :] <= offs_m[:, None])
        qk = tl.where(causal, qk * qk_scale, float("-inf"))
        v = tl.load(V_new + krows[:, None] * s_vn_t + kv_head * s_vn_h + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * s_o_t + h * s_o_h + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None] & (offs_dv[None, :] < DV))


def _blocks(d_total: int, dtype: torch.dtype, is_cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): wide head dims (MLA's 512+64) need smaller query tiles."""
    if not is_cuda:
        return 16, 16, 4
    if dtype == torch.float32:
        return (32, 32, 4) if d_total <= 128 else (16, 32, 8)
    if d_total <= 128:
        return 128, 64, 8
    if d_total <= 256:
        return 64, 64, 8
    return 32, 64, 8


def extend_attention_fwd(
    q: torch.Tensor,  # [T, H, D], new tokens of every sequence, concatenated
    k_new: torch.Tensor,  # [T, H_kv, D] (any strides on the first two dims)
    v_new: torch.Tensor,  # [T, H_kv, D_v]
    out: torch.Tensor,  # [T, H, D_v]
    k_buf: torch.Tensor,  # [N, H_kv, D] paged cache
    v_buf: torch.Tensor,  # [N, H_kv, D_v]
    req_to_token: torch.Tensor,  # [R, L]
    req_pool_indices: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B]
    extend_lens: torch.Tensor,  # [B]
    extend_start: torch.Tensor,  # [B], row of each sequence's first new token in q
    max_extend_len: int,
    sm_scale: float,
    q_pe: torch.Tensor | None = None,  # [T, H, D_pe]
    kpe_new: torch.Tensor | None = None,  # [T, H_kv, D_pe]
    kpe_buf: torch.Tensor | None = None,  # [N, H_kv, D_pe]
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    T, H, D = q.shape
    H_kv, DV = k_buf.shape[1], v_buf.shape[-1]
    B = req_pool_indices.shape[0]
    dpe = 0 if q_pe is None else q_pe.shape[-1]
    bm, bn, nw = _blocks(D + dpe, q.dtype, q.is_cuda)
    bm, bn, nw = block_m or bm, block_n or bn, num_warps or nw
    if q_pe is None:
        q_pe, kpe_new, kpe_buf = q, k_new, k_buf  # unused placeholders
    assert kpe_new is not None and kpe_buf is not None
    grid = (cdiv(max_extend_len, bm), H, B)
    _extend_kernel[grid](
        q, q_pe, k_new, kpe_new, v_new, k_buf, kpe_buf, v_buf, out,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
        sm_scale, H // H_kv,
        q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_new.stride(0), k_new.stride(1), kpe_new.stride(0), kpe_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_buf.stride(0), k_buf.stride(1), kpe_buf.stride(0), kpe_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        D=D, DPE=dpe, DV=DV,
        BLOCK_D=max(16, next_pow2(D)), BLOCK_DPE=0 if dpe == 0 else max(16, next_pow2(dpe)),
        BLOCK_DV=max(16, next_pow2(DV)), BLOCK_M=bm, BLOCK_N=bn,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=nw, num_stages=2 if D + dpe > 256 else 3,
    )  # fmt: skip
    return out


def extend_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_buf: torch.Tensor,  # [N, H_kv, D], new tokens already stored
    v_buf: torch.Tensor,  # [N, H_kv, D_v]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    sm_scale: float,
    q_pe: torch.Tensor | None = None,
    kpe_buf: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, H, D_v] float32
    """Plain PyTorch, float32: query i of a chunk (position prefix + i) sees slots 0..prefix + i."""
    T, H, _ = q.shape
    group = H // k_buf.shape[1]
    out = torch.empty(T, H, v_buf.shape[-1], dtype=torch.float32, device=q.device)
    start = 0
    for b, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        locs = req_to_token[req_pool_indices[b], : pre + ext]
        k = k_buf[locs].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_buf[locs].float().repeat_interleave(group, dim=1)
        qs = q[start : start + ext].float()
        s = torch.einsum("thd,shd->hts", qs, k)
        if q_pe is not None and kpe_buf is not None:
            kpe = kpe_buf[locs].float().repeat_interleave(group, dim=1)
            s = s + torch.einsum("thd,shd->hts", q_pe[start : start + ext].float(), kpe)
        mask = torch.arange(pre + ext, device=q.device)[None, :] <= (pre + torch.arange(ext, device=q.device))[:, None]
        s = (s * sm_scale).masked_fill(~mask, float("-inf"))
        out[start : start + ext] = torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v)
        start += ext
    return out
