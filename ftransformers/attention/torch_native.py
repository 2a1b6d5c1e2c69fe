"""Reference attention backend in plain PyTorch: one SDPA call per sequence over its paged KV.

Correct for any mix of prefill chunks and decodes; not fast. Each sequence's cached K/V is
gathered through `req_to_token[req_pool_idx, :seq_len]` after the new tokens are stored, so a
query at position p attends to KV positions 0..p (prefix_len offsets the causal mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftransformers.attention.backend import AttentionBackend, register_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch
from ftransformers.cache.kv_pool import MHAKVPool

# a one-token row on the CPU takes one_query_attention instead of SDPA (False: SDPA for every row, an A/B knob of
# benchmarks/bench_cpu_decode.py)
CPU_ONE_QUERY = True


def causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    # [extend_len, prefix_len + extend_len] bool: query i (position prefix_len + i) sees keys <= it
    q_pos = torch.arange(extend_len, device=device) + prefix_len
    k_pos = torch.arange(prefix_len + extend_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def one_query_attention(
    q: torch.Tensor,  # [H, D_k]
    k: torch.Tensor,  # [S, H_kv, D_k]
    v: torch.Tensor,  # [S, H_kv, D_v]
    scaling: float,
) -> torch.Tensor:  # [H, D_v] in q's dtype
    """One query row against all S keys (a decode token sees its whole sequence: no mask), in float32, the
    H / H_kv query heads of a group against their shared K/V head without repeating it. On the CPU, SDPA takes
    4-8 ms a call for one query over 2800 keys of 9 heads (torch 2.13, 2 cores), these two products 0.6-0.9."""
    num_kv_heads = k.shape[1]
    qg = q.float().view(num_kv_heads, -1, q.shape[-1])  # [H_kv, G, D_k]
    scores = torch.einsum("hgd,shd->hgs", qg, k.float()) * scaling
    o = torch.einsum("hgs,shd->hgd", scores.softmax(-1), v.float())  # [H_kv, G, D_v]
    return o.reshape(q.shape[0], -1).to(q.dtype)


@register_attention_backend("torch_native")
class TorchNativeAttentionBackend(AttentionBackend):
    def forward_mha(
        self,
        q: torch.Tensor,  # [T, H, D_k]
        k: torch.Tensor,  # [T, H_kv, D_k]
        v: torch.Tensor,  # [T, H_kv, D_v]
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, D_v]
        pool = batch.kv_pool
        assert isinstance(pool, MHAKVPool), "forward_mha needs an MHA KV pool"
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer_id)
        num_heads, num_kv_heads = q.shape[1], k_buf.shape[1]
        group = num_heads // num_kv_heads
        out = q.new_empty(q.shape[0], num_heads, v_buf.shape[-1])
        start = 0
        for i in range(batch.batch_size):
            ext, pre, seq = batch.extend_lens_cpu[i], batch.prefix_lens_cpu[i], batch.seq_lens_cpu[i]
            locs = batch.req_to_token[batch.req_pool_indices[i], :seq]  # [S]
            ks = k_buf.index_select(0, locs).to(q.dtype)  # [S, H_kv, D_k]
            vs = v_buf.index_select(0, locs).to(q.dtype)  # [S, H_kv, D_v]
            if ext == 1 and q.device.type == "cpu" and CPU_ONE_QUERY:
                out[start] = one_query_attention(q[start], ks, vs, scaling)
                start += 1
                continue
            if group > 1:
                ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            qs = q[start : start + ext]  # [E, H, D_k]
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1),  # [H, E, D_k]
                ks.transpose(0, 1),  # [H, S, D_k]
                vs.transpose(0, 1),  # [H, S, D_v]
                attn_mask=causal_mask(pre, ext, q.device),
                scale=scaling,
            )
            out[start : start + ext] = o.transpose(0, 1)
            start += ext
        return out

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
        latent_stored: bool = False,
    ) -> torch.Tensor:
        from ftransformers.attention.torch_native_mla import forward_mla

        return forward_mla(q_nope, q_rope, latent, layer_id, scaling, batch, latent_stored)

    def forward_mla_mha(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_rope: torch.Tensor,  # [T, H, R]
        kv: torch.Tensor,  # [P + T, H, N + V]
        k_rope: torch.Tensor,  # [P + T, R]
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, V]
        from ftransformers.attention.torch_native_mla import forward_mla_mha

        return forward_mla_mha(q_nope, q_rope, kv, k_rope, scaling, batch)
