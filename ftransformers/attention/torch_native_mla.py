"""Plain-PyTorch MLA attention over the paged latent pool (the reference every faster MLA backend
must match).

Absorbed form: each cached token holds one row [c_kv (L) | k_pe (R)]. With the query already pushed
through W_UK (q_nope: [T, H, L]) the score of head h against token s is
    (q_nope[h] . c_kv[s] + q_rope[h] . k_pe[s]) * scaling,
so the latent row is a key shared by all heads (MQA with head dim L+R) and c_kv is the value
(head dim L). The caller maps the [T, H, L] output back through W_UV.
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
) -> torch.Tensor:  # [T, H, L]
    pool = batch.kv_pool
    if not isinstance(pool, MLAKVPool):
        raise TypeError(f"forward_mla needs an MLAKVPool, got {type(pool).__name__}")
    kv_lora_rank = q_nope.shape[-1]
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
