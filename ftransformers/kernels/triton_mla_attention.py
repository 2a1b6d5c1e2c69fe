"""MLA attention (absorbed weights) over the paged latent cache, in Triton.

Each cached token is one row [c_kv (L) | k_pe (R)] shared by all H query heads: MQA with one "KV
head" whose key is the whole row and whose value is c_kv. The output stays in latent space [T, H, L].

Decode (`mla_decode_fwd`, its own kernel): a program takes one (sequence, KV split) and BLOCK_H
heads (64 on a GPU: the wgmma M, and the most whose [BLOCK_H, L] float32 accumulator fits in the
registers of 8 warps), loads each latent tile [BLOCK_N, L + R] ONCE into shared memory and uses it
for both dots: scores q_nope @ c_kv^T + q_pe @ k_pe^T, then acc += p @ c_kv. The H / BLOCK_H programs
of one split are adjacent in launch order, so the second read of a tile hits L2. At 128 heads the
work is ~240 FLOP per cached byte, about the H100's matmul-to-bandwidth ratio: the kernel is
bounded by both (benchmarks/bench_attention.py prints both floors). Triton lays a chained dot's
warps along M, so with 64 heads both warpgroups compute the same scores (the QK product, half the
FLOPs, runs twice, as m64n32 wgmmas); H100: ~37% of copy bandwidth at batch 64 x 32K. Splits follow
`triton_decode_attention`'s rule (even share rounded up to BLOCK_N, at least `min_split_len`); a row
of one split is written by its program, others go through `decode_combine` (stage 2). On Hopper, for
latent 512 + rope 64, `mla_decode_fwd` runs stage 1 as the Gluon kernel of `gluon_mla_decode.py`
instead (same contract, the warpgroups side by side: no duplicated QK; copies from a load partition;
at batch 16-64 x 16K-32K on an H100 ~55% of copy bandwidth at 128 heads, where the matmul floor is
the byte floor, and 82-94% at 64 heads); up to 32 heads a GPU `gluon_mla_few_heads.py` (the tokens as the
wgmma M, the heads as its N, so a block of 8-16 heads is not padded to 64).

Extend hands strided views of the latent buffer to the generic extend kernel, so nothing is copied.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.triton_decode_attention import _split_len, decode_combine
from ftransformers.kernels.triton_extend_attention import extend_attention_fwd


def latent_views(latent_buf: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # latent_buf: [N, L + R] -> c_kv [N, 1, L], k_pe [N, 1, R] (views, row stride L + R)
    return latent_buf[:, None, :kv_lora_rank], latent_buf[:, None, kv_lora_rank:]


@triton.jit
def _load_rows(ptr, rows, s_row, offs, row_mask, N: tl.constexpr, BLOCK: tl.constexpr, ROW_MASK: tl.constexpr):
    # [len(rows), BLOCK] tile of row-major data; masked rows and columns past N read as 0. Unmasked
    # when possible: a mask-free gather stays eligible for the async-copy pipeline.
    p = ptr + rows[:, None] * s_row + offs[None, :]
    if BLOCK == N:
        if ROW_MASK:
            x = tl.load(p, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(p)
    else:
        if ROW_MASK:
            x = tl.load(p, mask=row_mask[:, None] & (offs[None, :] < N), other=0.0)
        else:
            x = tl.load(p, mask=offs[None, :] < N, other=0.0)
    return x


@cached_launch
@triton.jit
def _mla_decode_stage1_kernel(
    Q_NOPE, Q_ROPE, KV, O, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
    sm_scale, num_kv_splits, min_split_len,
    s_qn_b, s_qn_h, s_qr_b, s_qr_h, s_kv, s_r2t, s_o_b, s_o_h, s_mo_b, s_mo_h, s_mo_s, s_ml_b, s_ml_h,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # PDL: the batch metadata (seq_lens, req_pool_indices; written before the step) is read before the wait
    pid_h, split_id, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    req = tl.load(req_pool_indices + b)
    pdl_enter(USE_PDL)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    offs_l = tl.arange(0, BLOCK_L)
    split_len = _split_len(seq_len, num_kv_splits, min_split_len, BLOCK_N)
    start = split_id * split_len
    end = tl.minimum(start + split_len, seq_len)
    o_mask = h_mask[:, None] & (offs_l < L)[None, :]
    if end <= start:
        if split_id == 0:  # seq_len 0 (a padded CUDA-graph row): zeros, not garbage
            tl.store(O + b * s_o_b + heads[:, None] * s_o_h + offs_l[None, :],
                     tl.zeros([BLOCK_H, BLOCK_L], O.dtype.element_ty), mask=o_mask)
        return

    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    ragged_h: tl.constexpr = H % BLOCK_H != 0
    q_nope = _load_rows(Q_NOPE + b * s_qn_b, heads, s_qn_h, offs_l, h_mask, L, BLOCK_L, ragged_h)  # [BLOCK_H, BLOCK_L]
    q_rope = _load_rows(Q_ROPE + b * s_qr_b, heads, s_qr_h, offs_r, h_mask, R, BLOCK_R, ragged_h)  # [BLOCK_H, BLOCK_R]
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    r2t_row = req_to_token + req * s_r2t

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        n_mask = pos < end
        # positions past the split re-read its last token (a real slot: no row masks on the tile loads)
        loc = tl.load(r2t_row + tl.minimum(pos, end - 1))  # [BLOCK_N] KV slots
        c_kv = _load_rows(KV, loc, s_kv, offs_l, n_mask, L, BLOCK_L, False)  # [BLOCK_N, BLOCK_L]
        k_pe = _load_rows(KV + L, loc, s_kv, offs_r, n_mask, R, BLOCK_R, False)  # [BLOCK_N, BLOCK_R]
        qk = tl.dot(q_nope, tl.trans(c_kv), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
        qk = tl.dot(q_rope, tl.trans(k_pe), qk, input_precision=DOT_PREC)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    if tl.cdiv(seq_len, split_len) == 1:  # the row's only split: final output
        tl.store(O + b * s_o_b + heads[:, None] * s_o_h + offs_l[None, :],
                 (acc / l_i[:, None]).to(O.dtype.element_ty), mask=o_mask)
    else:
        tl.store(mid_o + b * s_mo_b + heads[:, None] * s_mo_h + split_id * s_mo_s + offs_l[None, :],
                 acc / l_i[:, None], mask=o_mask)
        # log-sum-exp in base 2 of this split's scores
        tl.store(mid_lse + b * s_ml_b + heads * s_ml_h + split_id, m_i + tl.log2(l_i), mask=h_mask)


MLA_DECODE_KERNELS = ("auto", "gluon", "gluon_few", "triton")
# the few-heads kernel's widest wgmma N (gluon_mla_few_heads.MAX_HEADS); "auto" takes it wherever it applies
# (H100: faster than the 64-head kernel at every batch 1-64 and context 4K-32K measured at 8, 16, 32 heads)
FEW_HEADS_LIMIT = 32


@functools.cache
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def gluon_mla_unsupported(
    q_nope: torch.Tensor, latent_buf: torch.Tensor, few_heads: bool = False, block_h: int | None = None
) -> str | None:
    """Why the Gluon decode kernel (`few_heads`: the one with the heads as the wgmma N, on blocks of at most
    `block_h` heads) cannot run on these tensors, or None when it can."""
    L, H = q_nope.shape[-1], q_nope.shape[1]
    if few_heads and min(H, block_h or H) > FEW_HEADS_LIMIT:
        return f"the few-heads kernel takes at most {FEW_HEADS_LIMIT} heads a program, not {min(H, block_h or H)}"
    if not q_nope.is_cuda or _capability_major(q_nope.device.index) != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if (L, latent_buf.shape[-1] - L) != (512, 64):
        return f"it needs latent 512 + rope 64, not {L} + {latent_buf.shape[-1] - L}"
    if q_nope.dtype not in (torch.bfloat16, torch.float16) or latent_buf.dtype != q_nope.dtype:
        return f"it needs bf16 or fp16 queries and cache of one dtype, not {q_nope.dtype} / {latent_buf.dtype}"
    if latent_buf.data_ptr() % 16 or latent_buf.stride(0) % 16:  # 16-byte cp.async of every row
        return "the latent cache's base or row stride is not 16-element aligned"
    if _gluon_decode(few_heads) is None:
        return "this Triton has no Gluon"
    return None


@functools.cache
def _gluon_decode(few_heads: bool = False) -> Callable[..., torch.Tensor] | None:  # None without Gluon
    """gluon_mla_decode.mla_decode, or gluon_mla_few_heads.mla_decode_few_heads."""
    try:
        if few_heads:
            from ftransformers.kernels.gluon_mla_few_heads import mla_decode_few_heads as fn
        else:
            from ftransformers.kernels.gluon_mla_decode import mla_decode as fn
    except (ImportError, AttributeError):
        return None
    return fn


def mla_decode_kernel(
    q_nope: torch.Tensor, latent_buf: torch.Tensor, kernel: str = "auto", block_h: int | None = None
) -> str:
    """The stage-1 kernel mla_decode_fwd runs for `kernel` on these tensors at `block_h` heads a program:
    "gluon_few", "gluon" or "triton" ("auto": gluon_few where a program's heads fit its N, at most
    FEW_HEADS_LIMIT, else gluon, where it applies). Asking for a Gluon kernel that cannot run here is an error
    that says why."""
    if kernel not in MLA_DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(MLA_DECODE_KERNELS)}, not {kernel!r}")
    if kernel == "triton":
        return kernel
    H = q_nope.shape[1]
    few = kernel == "gluon_few" or (kernel == "auto" and min(H, block_h or H) <= FEW_HEADS_LIMIT)
    why_not = gluon_mla_unsupported(q_nope, latent_buf, few, block_h)
    if why_not is None:
        return "gluon_few" if few else "gluon"
    if kernel != "auto":
        raise ValueError(f"the Gluon MLA decode kernel does not apply here: {why_not} (kernel={kernel!r})")
    return "triton"


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
    block_h: int | None = None,  # None: 64 on CUDA, 16 elsewhere; few-heads kernel: blocks of it below H
    block_n: int | None = None,  # None: 64 on CUDA, 16 elsewhere
    num_warps: int | None = None,  # None: 8 for 64 heads, else 4
    num_stages: int = 3,
    min_split_len: int = 0,  # rounded up to block_n; 0 = block_n
    kernel: str = "auto",  # "gluon" / "gluon_few" (Hopper, see gluon_mla_decode.py / gluon_mla_few_heads.py),
    # "triton", or "auto" (mla_decode_kernel)
) -> torch.Tensor:
    B, H, L = q_nope.shape
    R = q_rope.shape[-1]
    assert latent_buf.shape[-1] == L + R and latent_buf.stride(-1) == 1
    assert q_nope.stride(-1) == 1 and q_rope.stride(-1) == 1 and q_rope.dtype == q_nope.dtype
    assert mid_o.shape[2] >= num_kv_splits and mid_o.shape[0] >= B
    chosen = mla_decode_kernel(q_nope, latent_buf, kernel, block_h)
    if chosen == "gluon_few":
        return _gluon_decode(True)(q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens,
                                   mid_o, mid_lse, num_kv_splits, sm_scale, min_split_len, block_h)  # fmt: skip
    if chosen == "gluon":
        return _gluon_decode(False)(q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens,
                                    mid_o, mid_lse, num_kv_splits, sm_scale, min_split_len)  # fmt: skip
    cuda = q_nope.is_cuda
    block_h = block_h or (64 if cuda else 16)
    block_h = max(16, min(block_h, next_pow2(H)))
    block_n = block_n or (64 if cuda else 16)
    num_warps = num_warps or (8 if block_h >= 64 else 4)
    min_split_len = cdiv(max(min_split_len, 1), block_n) * block_n
    _mla_decode_stage1_kernel[(cdiv(H, block_h), num_kv_splits, B)](
        q_nope, q_rope, latent_buf, out, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale, num_kv_splits, min_split_len,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), latent_buf.stride(0),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        H=H, L=L, R=R, BLOCK_L=max(16, next_pow2(L)), BLOCK_R=max(16, next_pow2(R)),
        BLOCK_H=block_h, BLOCK_N=block_n, DOT_PREC="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(q_nope.device),
    )  # fmt: skip
    if num_kv_splits > 1:
        decode_combine(mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len, block_n)
    return out


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
