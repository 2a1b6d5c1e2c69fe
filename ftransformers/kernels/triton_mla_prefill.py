"""MLA prefill in the non-absorbed ("MHA") form over dense, ragged K/V expanded through kv_b_proj.

Layout (see AttentionBackend.mla_extend_rows / forward_mla_mha): `kv` [P + T, H, N + V] holds every
sequence's cached prefix rows (sequence b's at prefix_start[b], P rows in all) followed by the T new
rows in query order; `k_rope` [P + T, R] is the roped k_pe of the same rows, one per token, shared by
all heads. Query i of sequence b sees its prefix and its new rows 0..i.

`mla_prefill_fwd` reuses the paged extend kernel unchanged: the prefix is "paged" through an identity
slot table (req_to_token = arange, one row per sequence starting at prefix_start[b], row stride 1),
k_nope / v are strided views of `kv` (no copy), and the shared k_pe goes in as the kernel's PE part
with head stride 0, so the 192-wide key is never materialised per head and the QK dots stay 128 + 64
wide (no padding to 256). `mla_prefill_sdpa` is the torch peer: one flash SDPA call per sequence
(lower-right causal mask for the prefix offset; V padded to the key width, as flash needs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftransformers.kernels.triton_extend_attention import extend_attention_fwd


def mla_prefill_fwd(
    q_nope: torch.Tensor,  # [T, H, N]
    q_rope: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [P + T, H, N + V]
    k_rope: torch.Tensor,  # [P + T, R]
    out: torch.Tensor,  # [T, H, V]
    identity: torch.Tensor,  # [>= max(P, 1)] int64, identity[i] == i
    prefix_start: torch.Tensor,  # [B], first prefix row of each sequence
    prefix_lens: torch.Tensor,  # [B]
    extend_lens: torch.Tensor,  # [B]
    extend_start: torch.Tensor,  # [B], first new row of each sequence (row in q / out)
    max_extend_len: int,
    sm_scale: float,
) -> torch.Tensor:
    T, H, N = q_nope.shape
    P = kv.shape[0] - T
    k_nope, v = kv[..., :N], kv[..., N:]  # strided views [P + T, H, N], [P + T, H, V]
    kpe = k_rope[:, None, :].expand(-1, H, -1)  # [P + T, H, R], head stride 0
    return extend_attention_fwd(
        q_nope, k_nope[P:], v[P:], out, k_nope[:P], v[:P], identity, prefix_start, prefix_lens, extend_lens,
        extend_start, max_extend_len, sm_scale, q_pe=q_rope.to(q_nope.dtype), kpe_new=kpe[P:], kpe_buf=kpe[:P],
    )  # fmt: skip


def mla_prefill_sdpa(
    q_nope: torch.Tensor,  # [T, H, N]
    q_rope: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [P + T, H, N + V]
    k_rope: torch.Tensor,  # [P + T, R]
    out: torch.Tensor,  # [T, H, V]
    prefix_lens: list[int],
    extend_lens: list[int],
    sm_scale: float,
) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    T, H, N = q_nope.shape
    P, V = kv.shape[0] - T, kv.shape[-1] - N
    q = torch.cat([q_nope, q_rope.to(q_nope.dtype)], dim=-1)  # [T, H, N+R]
    D = q.shape[-1]
    pre_start, start = 0, 0
    for pre, ext in zip(prefix_lens, extend_lens):
        kv_i = torch.cat([kv[pre_start : pre_start + pre], kv[P + start : P + start + ext]])  # [S, H, N+V]
        kpe_i = torch.cat([k_rope[pre_start : pre_start + pre], k_rope[P + start : P + start + ext]])  # [S, R]
        S = pre + ext
        k_i = torch.cat([kv_i[..., :N], kpe_i[:, None, :].expand(-1, H, -1)], dim=-1)  # [S, H, N+R]
        v_i = F.pad(kv_i[..., N:], (0, D - V)) if D != V else kv_i[..., N:]  # [S, H, D]
        o = F.scaled_dot_product_attention(
            q[start : start + ext].transpose(0, 1)[None],
            k_i.transpose(0, 1)[None],
            v_i.transpose(0, 1)[None],
            attn_mask=causal_lower_right(ext, S),
            scale=sm_scale,
        )  # [1, H, E, D]
        out[start : start + ext] = o[0, ..., :V].transpose(0, 1)
        pre_start += pre
        start += ext
    return out


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, N]
    q_rope: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [P + T, H, N + V]
    k_rope: torch.Tensor,  # [P + T, R]
    prefix_lens: list[int],
    extend_lens: list[int],
    sm_scale: float,
) -> torch.Tensor:  # [T, H, V] float32
    """Plain PyTorch, float32, one einsum per sequence."""
    T, H, N = q_nope.shape
    P = kv.shape[0] - T
    out = torch.empty(T, H, kv.shape[-1] - N, dtype=torch.float32, device=q_nope.device)
    pre_start, start = 0, 0
    for pre, ext in zip(prefix_lens, extend_lens):
        rows = torch.cat([kv[pre_start : pre_start + pre], kv[P + start : P + start + ext]]).float()  # [S, H, N+V]
        kpe = torch.cat([k_rope[pre_start : pre_start + pre], k_rope[P + start : P + start + ext]]).float()  # [S, R]
        qn, qr = q_nope[start : start + ext].float(), q_rope[start : start + ext].float()
        s = torch.einsum("thn,shn->hts", qn, rows[..., :N]) + torch.einsum("thr,sr->hts", qr, kpe)
        mask = torch.arange(pre + ext, device=s.device)[None, :] <= (pre + torch.arange(ext, device=s.device))[:, None]
        p = torch.softmax((s * sm_scale).masked_fill(~mask, float("-inf")), dim=-1)
        out[start : start + ext] = torch.einsum("hts,shv->thv", p, rows[..., N:])
        pre_start += pre
        start += ext
    return out
