"""MLA attention (absorbed weights) over the paged latent cache, in Triton.

Each cached token is one row [c_kv (L) | k_pe (R)] shared by all H query heads: for the kernels it
is MQA with one "KV head" whose key is the whole row and whose value is c_kv. The launchers hand
strided views of the latent buffer to the generic decode / extend kernels, so nothing is copied:
decode reads each latent row once per block of BLOCK_H heads (H / BLOCK_H head blocks, launched next
to each other so the repeats hit L2); the output stays in latent space [T, H, L].
"""

from __future__ import annotations

import torch

from ftransformers.kernels.triton_decode_attention import decode_attention_fwd
from ftransformers.kernels.triton_extend_attention import extend_attention_fwd


def latent_views(latent_buf: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # latent_buf: [N, L + R] -> c_kv [N, 1, L], k_pe [N, 1, R] (views, row stride L + R)
    return latent_buf[:, None, :kv_lora_rank], latent_buf[:, None, kv_lora_rank:]


def mla_decode_fwd(
    q_nope: torch.Tensor,  # [B, H, L], absorbed through W_UK
    q_rope: torch.Tensor,  # [B, H, R]
    latent_buf: torch.Tensor,  # [N, L + R], new tokens already stored
    out: torch.Tensor,  # [B, H, L]
    req_to_token: torch.Tensor,  # [R_slots, ctx]
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    mid_o: torch.Tensor,  # [>=B, H, >=num_kv_splits, L] float32 scratch
    mid_lse: torch.Tensor,  # [>=B, H, >=num_kv_splits] float32 scratch
    num_kv_splits: int,
    sm_scale: float,
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    c_kv, k_pe = latent_views(latent_buf, q_nope.shape[-1])
    return decode_attention_fwd(
        q_nope, c_kv, c_kv, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        num_kv_splits, sm_scale, q_pe=q_rope, kpe_buf=k_pe,
        block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def mla_extend_fwd(
    q_nope: torch.Tensor,  # [T, H, L]
    q_rope: torch.Tensor,  # [T, H, R]
    latent_new: torch.Tensor,  # [T, L + R], this step's rows (also stored in latent_buf)
    out: torch.Tensor,  # [T, H, L]
    latent_buf: torch.Tensor,  # [N, L + R]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B]
    extend_lens: torch.Tensor,  # [B]
    extend_start: torch.Tensor,  # [B]
    max_extend_len: int,
    sm_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    L = q_nope.shape[-1]
    c_kv, k_pe = latent_views(latent_buf, L)
    c_new, kpe_new = latent_views(latent_new, L)
    return extend_attention_fwd(
        q_nope, c_new, c_new, out, c_kv, c_kv, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        extend_start, max_extend_len, sm_scale, q_pe=q_rope, kpe_new=kpe_new, kpe_buf=k_pe,
        block_m=block_m, block_n=block_n, num_warps=num_warps,
    )  # fmt: skip


def mla_attention_ref(
    q_nope: torch.Tensor,  # [T, H, L]
    q_rope: torch.Tensor,  # [T, H, R]
    latent_buf: torch.Tensor,  # [N, L + R]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    sm_scale: float,
) -> torch.Tensor:  # [T, H, L] float32
    """Plain PyTorch, float32 (decode is the case extend_lens == 1): scores q_nope . c_kv + q_rope . k_pe."""
    L = q_nope.shape[-1]
    out = torch.empty(*q_nope.shape, dtype=torch.float32, device=q_nope.device)
    start = 0
    for b, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        rows = latent_buf[req_to_token[req_pool_indices[b], : pre + ext]].float()  # [S, L + R]
        qn, qr = q_nope[start : start + ext].float(), q_rope[start : start + ext].float()
        s = torch.einsum("thl,sl->hts", qn, rows[:, :L]) + torch.einsum("thr,sr->hts", qr, rows[:, L:])
        mask = torch.arange(pre + ext, device=s.device)[None, :] <= (pre + torch.arange(ext, device=s.device))[:, None]
        p = torch.softmax((s * sm_scale).masked_fill(~mask, float("-inf")), dim=-1)
        out[start : start + ext] = torch.einsum("hts,sl->thl", p, rows[:, :L])
        start += ext
    return out
