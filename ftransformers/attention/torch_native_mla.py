"""Plain-PyTorch MLA attention over the paged latent pool (the reference every faster MLA backend
must match).

Absorbed form: each cached token holds one row [c_kv (L) | k_pe (R)]. With the query already pushed
through W_UK (q_nope: [T, H, L]) the score of head h against token s is
    (q_nope[h] . c_kv[s] + q_rope[h] . k_pe[s]) * scaling,
so the latent row is a key shared by all heads (MQA with head dim L+R) and c_kv is the value
(head dim L). The caller maps the [T, H, L] output back through W_UV.

`forward_mla_mha` is the non-absorbed form for extend steps over K/V the model expanded through
kv_b_proj (see AttentionBackend.mla_extend_rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftransformers.attention.forward_batch import ForwardBatch
from ftransformers.cache.kv_pool import MLAKVPool


def forward_mla(
    q_nope: torch.Tensor,  # [T, H, L], absorbed
    q_rope: torch.Tensor,  # [T, H, R], roped
    latent: torch.Tensor,  # [T, L + R], new tokens
    layer_id: int,
    scaling: float,
    batch: ForwardBatch,
    latent_stored: bool = False,  # the caller stored `latent` at out_cache_loc already
) -> torch.Tensor:  # [T, H, L]
    pool = batch.kv_pool
    if not isinstance(pool, MLAKVPool):
        raise TypeError(f"forward_mla needs an MLAKVPool, got {type(pool).__name__}")
    kv_lora_rank = q_nope.shape[-1]
    if not latent_stored:
        pool.set_latent(layer_id, batch.out_cache_loc, latent)
    buf = pool.get_latent(layer_id)  # [N+1, L+R]

    q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, L+R], same column order as the latent rows
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, kv_lora_rank)
    start = 0
    for i in range(batch.batch_size):
        prefix_len, extend_len, seq_len = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i], batch.seq_lens_cpu[i]
        slots = batch.req_to_token[batch.req_pool_indices[i], :seq_len]  # [S]
        k = buf[slots].to(q.dtype)  # [S, L+R]
        # query j of this chunk sits at position prefix_len + j and sees tokens 0..prefix_len + j
        q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [E, S]
        q_i = q[start : start + extend_len].transpose(0, 1)  # [H, E, L+R]
        k_i = k[None].expand(num_heads, -1, -1)  # [H, S, L+R]
        v_i = k_i[..., :kv_lora_rank]  # [H, S, L]
        o = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, scale=scaling)  # [H, E, L]
        out[start : start + extend_len] = o.transpose(0, 1)
        start += extend_len
    return out


def forward_mla_mha(
    q_nope: torch.Tensor,  # [T, H, N]
    q_rope: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [P + T, H, N + V], prefixes (batch order) then the new rows
    k_rope: torch.Tensor,  # [P + T, R]
    scaling: float,
    batch: ForwardBatch,
) -> torch.Tensor:  # [T, H, V]
    """Non-absorbed (MHA) form: per-head keys [k_nope | k_pe] (head dim N + R), values v (V), one
    SDPA per sequence over its prefix rows and its new rows, causal with the prefix as offset."""
    T, H, N = q_nope.shape
    V = kv.shape[-1] - N
    P = kv.shape[0] - T
    q = torch.cat([q_nope, q_rope.to(q_nope.dtype)], dim=-1)  # [T, H, N+R]
    out = q.new_empty(T, H, V)
    pre_start, start = 0, 0
    for i in range(batch.batch_size):
        prefix_len, extend_len = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i]
        prefix_rows = torch.arange(pre_start, pre_start + prefix_len, device=kv.device)
        rows = torch.cat([prefix_rows, torch.arange(P + start, P + start + extend_len, device=kv.device)])  # [S]
        kv_i, kpe_i = kv.index_select(0, rows).to(q.dtype), k_rope.index_select(0, rows).to(q.dtype)  # [S,H,N+V], [S,R]
        k_i = torch.cat([kv_i[..., :N], kpe_i[:, None, :].expand(-1, H, -1)], dim=-1)  # [S, H, N+R]
        q_pos = torch.arange(prefix_len, prefix_len + extend_len, device=q.device)
        mask = torch.arange(prefix_len + extend_len, device=q.device)[None, :] <= q_pos[:, None]  # [E, S]
        o = F.scaled_dot_product_attention(
            q[start : start + extend_len].transpose(0, 1),  # [H, E, N+R]
            k_i.transpose(0, 1),  # [H, S, N+R]
            kv_i[..., N:].transpose(0, 1),  # [H, S, V]
            attn_mask=mask,
            scale=scaling,
        )  # [H, E, V]
        out[start : start + extend_len] = o.transpose(0, 1)
        pre_start += prefix_len
        start += extend_len
    return out
