"""The new token of a fused-rope decode (triton_decode_attention's stage 1 with ROPE): its k normed and rotated, k and
v stored in the pool, and the online softmax seeded with it (score q . k_new, weight 1, value v_new) instead of
reading it back from the pool.

Two forms (NEW_TILE, triton_decode_attention.NEW_TOKEN_TILE): k and v as [BLOCK_H, D] tiles of identical rows in q's
layout, so that k's norm and its score against each query head reduce within a warp as q's norm does; or as [D]
vectors. Either form runs masked in a program that does not hold the new token (has_new false: no load, no store, the
softmax state unchanged), or behind a branch on has_new (triton_decode_attention.NEW_TOKEN_BRANCH).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ftransformers.kernels.triton_rope_store import norm_rope


@triton.jit
def seed_new_token(
    q, m_i, l_i, acc, has_new, store, KNEW, VNEW, K, V, KW, eps_k, cos, sin, new_slot, kv_head, b, qk_scale,
    s_kn_t, s_kn_h, s_vn_t, s_vn_h, s_k_n, s_k_h, s_v_n, s_v_h,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QK_NORM: tl.constexpr, NEW_TILE: tl.constexpr,
):  # fmt: skip
    # q [BLOCK_H, BLOCK_D] normed and rotated (K's dtype); m_i / l_i [BLOCK_H], acc [BLOCK_H, BLOCK_DV] float32: the
    # softmax state, returned seeded where has_new; cos / sin [BLOCK_D // 2] float32 at the new token's position;
    # store: this program writes k / v at new_slot (head block 0 of the KV head, has_new)
    HALF: tl.constexpr = BLOCK_D // 2
    offs_half = tl.arange(0, HALF)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    if NEW_TILE:
        rows = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        k1, k2 = norm_rope(KNEW + b * s_kn_t + kv_head * s_kn_h + 0 * rows, KW, eps_k, cos[None, :], sin[None, :],
                            offs_half[None, :], (offs_half < tl.where(has_new, HALF, 0))[None, :] & (rows >= 0),
                            HALF, QK_NORM)  # fmt: skip
        k_rows = tl.reshape(tl.permute(tl.join(k1, k2), (0, 2, 1)), [BLOCK_H, BLOCK_D]).to(KNEW.dtype.element_ty)
        k_rows = k_rows.to(K.dtype.element_ty)
        v_rows = tl.load(
            VNEW + b * s_vn_t + kv_head * s_vn_h + offs_dv[None, :] + 0 * rows,
            mask=(offs_dv < tl.where(has_new, DV, 0))[None, :] & (rows >= 0),
            other=0.0,
        )
        v_rows = v_rows.to(V.dtype.element_ty)
        first_row = rows < tl.where(store, 1, 0)  # row 0 where this program stores (no scalar & tensor mask: the
        # interpreter makes that an int array)
        tl.store(K + new_slot * s_k_n + kv_head * s_k_h + offs_d[None, :] + 0 * rows, k_rows,
                 mask=first_row & (offs_d < D)[None, :])  # fmt: skip
        tl.store(V + new_slot * s_v_n + kv_head * s_v_h + offs_dv[None, :] + 0 * rows, v_rows,
                 mask=first_row & dv_mask[None, :])  # fmt: skip
        s_new = tl.sum(q.to(tl.float32) * k_rows.to(tl.float32), 1) * qk_scale  # [BLOCK_H]
        acc = tl.where(has_new, acc + v_rows.to(tl.float32), acc)
    else:
        k1, k2 = norm_rope(KNEW + b * s_kn_t + kv_head * s_kn_h, KW, eps_k, cos, sin, offs_half,
                            offs_half < tl.where(has_new, HALF, 0), HALF, QK_NORM)  # fmt: skip
        k_new = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), [BLOCK_D]).to(KNEW.dtype.element_ty)
        k_new = k_new.to(K.dtype.element_ty)
        v_new = tl.load(
            VNEW + b * s_vn_t + kv_head * s_vn_h + offs_dv, mask=offs_dv < tl.where(has_new, DV, 0), other=0.0
        )  # (a scalar & a vector mask is an int array in Triton's interpreter)
        v_new = v_new.to(V.dtype.element_ty)
        tl.store(K + new_slot * s_k_n + kv_head * s_k_h + offs_d, k_new, mask=offs_d < tl.where(store, D, 0))
        tl.store(V + new_slot * s_v_n + kv_head * s_v_h + offs_dv, v_new, mask=offs_dv < tl.where(store, DV, 0))
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # [BLOCK_H]
        acc = tl.where(has_new, acc + v_new.to(tl.float32)[None, :], acc)
    m_i = tl.where(has_new, s_new, m_i)
    l_i = tl.where(has_new, 1.0, l_i)
    return m_i, l_i, acc
