"""Microbenchmark of the Triton attention kernels at the issue's shapes (bf16, one GPU).

Decode (paged, split-K): achieved GB/s = KV bytes read / median time, printed beside the
device-to-device copy bandwidth measured in the same run (bytes read + written / time) and the
floor bytes / copy bandwidth. MLA decode at 128 heads does ~240 FLOP per cached byte, about the
H100's matmul-to-bandwidth ratio, so its matmul floor (FLOPs / the bf16 matmul rate of the same run)
is printed too. The previous implementation is timed in the same process:
  gqa "old": the generic kernel as it was launched before (every row through the partials, a second
             launch merging them, split length = even share rounded up to BLOCK_N).
  mla "old": the generic GQA kernel on the latent views (BLOCK_H=32, BLOCK_N=32, old split rule).
Each timed call runs the kernel over enough layer buffers to exceed L2 several times, captured in a
CUDA graph (decode steps run as graphs), and reports the median per layer. Before timing, every
variant is checked on the GPU against the float32 torch reference on fresh random inputs with
varying per-row lengths (a padded row of length 0 must give zeros).

    PYTHONPATH=. python benchmarks/bench_attention.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import copy_bandwidth, matmul_rate

from ftransformers.attention.triton_backend import (
    gqa_decode_launch,
    mla_block_h,
    mla_decode_launch,
    mla_max_kv_splits,
    mla_num_kv_splits,
    num_kv_splits,
    peak_gbps_per_sm,
)
from ftransformers.kernels.triton_decode_attention import (
    decode_attention_fwd,
    decode_attention_ref,
    decode_scratch,
)
from ftransformers.kernels.triton_extend_attention import extend_attention_fwd
from ftransformers.kernels.triton_mla_attention import (
    FEW_HEADS_LIMIT,
    latent_views,
    mla_attention_ref,
    mla_decode_fwd,
    mla_extend_fwd,
)

DEV = torch.device("cuda")
DT = torch.bfloat16
GQA_SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "qwen3-8b": (32, 8, 128)}  # (H, H_kv, D)
MLA_SHAPE = (128, 512, 64)  # DeepSeek-V3: H, kv_lora_rank, rope dim
MLA_SCALE = 192**-0.5  # DeepSeek-V3: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
CHECK_LENS = [1, 0, 64, 4097, 129, 511]  # + random lengths in [1, CHECK_MAX_LEN); row 1 is padding
CHECK_MAX_LEN = 3000
GQA_CASES = [(1, 512), (1, 4096), (32, 512), (32, 4096), (128, 512), (128, 4096), (1, 32768)]
MLA_BATCHES = (1, 4, 16, 64)  # with --mla-contexts (4K, 16K, 32K unless told)
L2_MULT = 200 << 20  # bytes touched per timed call, ~4x the H100's 50 MB L2

# name -> launcher keywords (+ "waves" of the GQA split rule). Earlier sweeps on the H100 (run 1 of
# 2026-11-22, not kept as defaults): GQA min_split_len 128/256 and a split merge fused into stage 1
# (last split to finish merges, atomic tickets) were slower at every shape; MLA BLOCK_N=32 was
# 15-30% slower than 64, and min_split_len 256 slower at batch 1.
GQA_VARIANTS = {
    "old": dict(direct=False, waves=4),  # the backend's launch before 2026-11-22
    "new": dict(waves=4),  # rows of one split written by stage 1; stage 2 skipped at 1 split
    "new_w2": dict(waves=2),  # + half the programs (fewer splits from batch ~32 up): the backend's rule to session 50
    "fill": {},  # the backend's launch since session 51: triton_backend.gqa_decode_launch's splits, tile, stages
}
MLA_VARIANTS = {
    "old": dict(block_h=32, block_n=32, num_warps=4),  # the generic GQA kernel on the latent views
    "n64s3": dict(block_n=64, num_stages=3, kernel="triton"),  # the Triton kernel as the backend launches it
    "n64s2": dict(block_n=64, num_stages=2, kernel="triton"),
    "gluon": dict(kernel="gluon"),  # kernels/gluon_mla_decode.py: no duplicated QK, a load partition (Hopper)
    # kernels/gluon_mla_few_heads.py: tokens as the wgmma M, heads as its N, in the backend's blocks (mla_block_h;
    # skipped above 64 heads)
    "gluon_few": dict(kernel="gluon_few"),
    # the backend's launch at each case's batch size, heads and context on this GPU (kernel, heads a program, split
    # cap: triton_backend.mla_block_h with the context, mla_max_kv_splits), set per case by resolve_auto
    "auto": dict(kernel="auto"),
    # the same with the split count capped at N instead of the backend's mla_max_kv_splits (batch 1: how many
    # programs a row, at most one per SM; not run unless named). 64: the cap before 2026-11-23 (session 14).
    # few_s32 ... few_s128: the same for the few-heads kernel
    "gluon_s64": dict(kernel="gluon", max_splits=64),
    "gluon_s96": dict(kernel="gluon", max_splits=96),
    "gluon_s132": dict(kernel="gluon", max_splits=132),
    "few_s32": dict(kernel="gluon_few", max_splits=32),
    "few_s48": dict(kernel="gluon_few", max_splits=48),
    "few_s64": dict(kernel="gluon_few", max_splits=64),
    "few_s128": dict(kernel="gluon_few", max_splits=128),
    # the few-heads kernel on blocks of 32 / 16 / 8 heads at every batch size (several programs a tile where
    # there are more heads; gluon_few: the backend's rule, mla_block_h; not run unless named)
    "few_b32": dict(kernel="gluon_few", block_h=32),
    "few_b16": dict(kernel="gluon_few", block_h=16),
    "few_b8": dict(kernel="gluon_few", block_h=8),
    # timing-only diagnostics of the Gluon kernel (wrong results; not run unless named): no copies after
    # the first two tiles (its compute path alone), no wgmma (its copies, softmax and barriers alone).
    # The schedules it was chosen from (gluon_pipe, gluon_seq, gluon_ws_seq_p2, ...) are in commit dcbcafd.
    # the 64-head kernel's scores split over both warpgroups by tokens (before SCORES_ONE_WG, session 61; not run
    # unless named)
    "gluon_split": dict(kernel="gluon", gluon_attrs={"SCORES_ONE_WG": 0}),
    # the 64-head kernel's first tile copied after the wait (before session 62 also the queries before the copies)
    "gluon_late": dict(kernel="gluon", gluon_attrs={"EARLY_TILE": 0}),
    "diag_nocopy": dict(kernel="gluon", gluon_attrs={"DIAG": 1}),
    "diag_nomma": dict(kernel="gluon", gluon_attrs={"DIAG": 2, "SCORES_ONE_WG": 0}),  # the split form's DIAG 2
}


def graph_ms(fn, layers: int) -> float:
    return do_bench_cudagraph(fn, rep=60, return_mode="median") / layers


def contiguous_table(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """req_to_token with each sequence's slots contiguous after the previous one's (a fresh server)."""
    r2t = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    start = 1
    for i, n in enumerate(lens):
        r2t[i, :n] = torch.arange(start, start + n)
        start += n
    return r2t.to(DEV), torch.arange(len(lens), device=DEV), start


def random_table(lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """req_to_token with every sequence's slots scattered over the pool (a long-running server)."""
    n = sum(max(x, 1) for x in lens)
    perm = (torch.randperm(n, generator=gen) + 1).tolist()
    r2t = torch.zeros(len(lens) + 1, max(lens) + 1, dtype=torch.int64)
    start = 0
    for i, x in enumerate(lens):
        r2t[i + 1, :x] = torch.tensor(perm[start : start + x], dtype=torch.int64)
        start += x
    return r2t.to(DEV), torch.arange(1, len(lens) + 1, device=DEV), n + 1


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item() if torch.isfinite(out).all() else float("inf")


# launchers ---------------------------------------------------------------------------------------
def gqa_launch(var: str, B: int, H: int, H_kv: int, sms: int) -> tuple[int, dict]:
    """A variant's splits and its other decode_attention_fwd keywords at this batch ("fill": the backend's rule;
    the kernel's fused rope and first-tile preload are not used here)."""
    group = H // H_kv
    head_blocks = H_kv * triton.cdiv(group, max(16, triton.next_power_of_2(group)))
    kw = {k: v for k, v in GQA_VARIANTS[var].items() if k != "waves"}
    if var == "fill":
        splits, block_n, stages = gqa_decode_launch(B, head_blocks, sms)
        return splits, dict(kw, block_n=block_n, num_stages=stages)
    return num_kv_splits(B, head_blocks, sms, waves=GQA_VARIANTS[var]["waves"]), dict(kw, block_n=64)


def gqa_call(kw: dict, q, k, v, out, r2t, rows, seq_lens, scratch, splits) -> None:
    mid_o, mid_lse = scratch
    decode_attention_fwd(q, k, v, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, q.shape[-1] ** -0.5, **kw)


def mla_splits(var: str, B: int, sms: int, H: int = MLA_SHAPE[0]) -> int:
    if var == "old":
        return num_kv_splits(B, triton.cdiv(H, 32), sms)
    if "splits" in MLA_VARIANTS[var]:
        return MLA_VARIANTS[var]["splits"]
    kernel = MLA_VARIANTS[var].get("kernel", "triton")
    gbps = peak_gbps_per_sm(torch.cuda.get_device_properties(DEV))  # the backend's rule on this GPU
    cap = MLA_VARIANTS[var].get("max_splits", mla_max_kv_splits(H, kernel, gbps))
    return mla_num_kv_splits(B, triton.cdiv(H, mla_block(var, B, H) or 64), sms, cap)


def resolve_auto(B: int, H: int, context: int, q_nope: torch.Tensor, buf: torch.Tensor) -> None:
    """MLA_VARIANTS["auto"] := what TritonAttentionBackend.forward_mla launches for B rows of H heads whose longest
    sequence holds `context` tokens, on this GPU (triton_backend.mla_decode_launch)."""
    props = torch.cuda.get_device_properties(DEV)
    kernel, block_h, splits = mla_decode_launch(q_nope, buf, B, context, props.multi_processor_count,
                                                peak_gbps_per_sm(props))  # fmt: skip
    MLA_VARIANTS["auto"] = {"kernel": kernel, "block_h": block_h, "splits": splits}


def mla_block(var: str, B: int, H: int) -> int | None:
    """Heads a program: the variant's block_h, or for the few-heads kernel the backend's rule (None: the
    launcher's default)."""
    spec = MLA_VARIANTS[var]
    if "block_h" in spec:
        return spec["block_h"]
    return mla_block_h(H, B, "gluon_few") if spec.get("kernel") == "gluon_few" else None


def mla_applies(var: str, H: int) -> bool:
    # the few-heads kernel: on blocks it can take (gluon_few: up to 64 heads, as the backend may run it)
    spec = MLA_VARIANTS[var]
    return spec.get("kernel") != "gluon_few" or min(H, spec.get("block_h", H // 2)) <= FEW_HEADS_LIMIT


def mla_call(var: str, q_nope, q_rope, buf, out, r2t, rows, seq_lens, scratch, splits, min_split_len=0) -> None:
    mid_o, mid_lse = scratch
    scale = MLA_SCALE
    if var == "old":  # the pre-2026-11 mla_decode_fwd: the generic kernel on the latent views
        c_kv, k_pe = latent_views(buf, MLA_SHAPE[1])
        decode_attention_fwd(q_nope, c_kv, c_kv, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale,
                             q_pe=q_rope, kpe_buf=k_pe, direct=False, **MLA_VARIANTS[var])  # fmt: skip
    else:
        kw = dict(MLA_VARIANTS[var])
        for key in ("max_splits", "splits"):  # launch facts, not launcher keywords
            kw.pop(key, None)
        kw["block_h"] = mla_block(var, *q_nope.shape[:2])
        with gluon_defaults(kw.pop("gluon_attrs", {})):
            mla_decode_fwd(q_nope, q_rope, buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale,
                           min_split_len=min_split_len, **kw)  # fmt: skip


@contextlib.contextmanager
def gluon_defaults(attrs: dict) -> Iterator[None]:
    """Module defaults of gluon_mla_decode (DIAG, LOAD_ROWS, ...) set for the calls inside; read at launch, so
    at graph capture too."""
    if not attrs:
        yield
        return
    from ftransformers.kernels import gluon_mla_decode

    saved = {k: getattr(gluon_mla_decode, k) for k in attrs}
    vars(gluon_mla_decode).update(attrs)
    try:
        yield
    finally:
        vars(gluon_mla_decode).update(saved)


# correctness on the GPU -------------------------------------------------------------------------
def check_gqa(sms: int, reps: int) -> dict:
    """Random per-row lengths (1, off-block lengths, one long row, a padded row of 0), scattered slots."""
    H, H_kv, D = GQA_SHAPES["qwen3-30b-a3b"]
    gen = torch.Generator().manual_seed(1)
    worst: dict[str, float] = {}
    for rep in range(reps):
        extra = torch.randint(1, CHECK_MAX_LEN, (10 if rep % 2 else 58,), generator=gen).tolist()
        lens = CHECK_LENS + extra
        r2t, rows, n = random_table(lens, gen)
        B = len(lens)
        k = torch.randn(n, H_kv, D, generator=gen).to(DEV, DT)
        v = torch.randn(n, H_kv, D, generator=gen).to(DEV, DT)
        q = torch.randn(B, H, D, generator=gen).to(DEV, DT)
        seq_lens = torch.tensor(lens, device=DEV)
        live = [i for i, x in enumerate(lens) if x > 0]
        ref = decode_attention_ref(q[live], k, v, r2t, rows[live], seq_lens[live], D**-0.5)
        for var in GQA_VARIANTS:
            own, kw = gqa_launch(var, B, H, H_kv, sms)
            for splits in (own, 64, 1):
                scratch = decode_scratch(B, H, D, splits, DEV)
                out = torch.full_like(q, float("nan"))
                gqa_call(kw, q, k, v, out, r2t, rows, seq_lens, scratch, splits)
                torch.cuda.synchronize()
                e = rel_err(out[live], ref)
                zero = bool((out[1] == 0).all())
                worst[var] = max(worst.get(var, 0.0), e if zero else float("inf"))
    return worst


def check_mla(sms: int, reps: int) -> dict:
    _, L, R = MLA_SHAPE
    gen = torch.Generator().manual_seed(2)
    worst: dict[str, float] = {}
    for rep, H in itertools.product(range(reps), (MLA_SHAPE[0], 16)):
        lens = CHECK_LENS + torch.randint(1, CHECK_MAX_LEN, (3,), generator=gen).tolist()
        r2t, rows, n = random_table(lens, gen)
        B = len(lens)
        buf = torch.randn(n, L + R, generator=gen).to(DEV, DT)
        q_nope = torch.randn(B, H, L, generator=gen).to(DEV, DT)
        q_rope = torch.randn(B, H, R, generator=gen).to(DEV, DT)
        seq_lens = torch.tensor(lens, device=DEV)
        live = [i for i, x in enumerate(lens) if x > 0]
        ref = mla_attention_ref(q_nope[live], q_rope[live], buf, r2t, rows[live], [lens[i] - 1 for i in live],
                                [1] * len(live), MLA_SCALE)  # fmt: skip
        if "auto" in MLA_VARIANTS:
            resolve_auto(B, H, max(lens), q_nope, buf)
        for var in [v for v in MLA_VARIANTS if mla_applies(v, H)]:
            for splits, msl in ((mla_splits(var, B, sms, H), 0), (64, 0), (1, 0), (7, 256)):
                if var == "old" and msl:
                    continue
                scratch = decode_scratch(B, H, L, splits, DEV)
                out = torch.full_like(q_nope, float("nan"))
                mla_call(var, q_nope, q_rope, buf, out, r2t, rows, seq_lens, scratch, splits, msl)
                torch.cuda.synchronize()
                e = rel_err(out[live], ref)
                zero = bool((out[1] == 0).all())
                worst[var] = max(worst.get(var, 0.0), e if zero else float("inf"))
    return worst


# timing -----------------------------------------------------------------------------------------
def bench_gqa(name: str, B: int, ctx: int, sms: int, copy_gbps: float) -> list[dict]:
    H, H_kv, D = GQA_SHAPES[name]
    r2t, rows, n_slots = contiguous_table([ctx] * B)
    kv_bytes = B * ctx * H_kv * 2 * D * 2
    layers = max(1, min(32, math.ceil(L2_MULT / kv_bytes)))
    ks = [torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT) for _ in range(layers)]
    vs = [torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT) for _ in range(layers)]
    q = torch.randn(B, H, D, device=DEV, dtype=DT)
    seq_lens = torch.full((B,), ctx, device=DEV, dtype=torch.int64)
    out = torch.empty_like(q)
    ref = decode_attention_ref(q, ks[0], vs[0], r2t, rows, seq_lens, D**-0.5) if B * ctx <= 64 * 4096 else None
    res = []
    for var in GQA_VARIANTS:
        splits, kw = gqa_launch(var, B, H, H_kv, sms)
        scratch = decode_scratch(B, H, D, splits, DEV)

        def run(kw: dict = kw, splits: int = splits, scratch: tuple = scratch) -> None:
            for k, v in zip(ks, vs):
                gqa_call(kw, q, k, v, out, r2t, rows, seq_lens, scratch, splits)

        out.fill_(float("nan"))
        gqa_call(kw, q, ks[0], vs[0], out, r2t, rows, seq_lens, scratch, splits)
        torch.cuda.synchronize()
        err = rel_err(out, ref) if ref is not None else None
        ms = graph_ms(run, layers)
        res.append(dict(kernel="gqa_decode", model=name, batch=B, context=ctx, splits=splits, variant=var,
                        us=ms * 1e3, bytes=kv_bytes, gbps=kv_bytes / ms / 1e6, pct_copy=kv_bytes / ms / 1e6 / copy_gbps,
                        floor_us=kv_bytes / copy_gbps / 1e3, rel_err=err))  # fmt: skip
    return res


def bench_mla(B: int, ctx: int, sms: int, copy_gbps: float, mm_tflops: float, variants: dict[str, int],
              H: int = MLA_SHAPE[0]) -> list[dict]:  # fmt: skip
    """H: heads on this GPU (DeepSeek-V3 has 128: 16 a GPU at tensor parallel 8; Kimi-K2 64, then 8)."""
    _, L, R = MLA_SHAPE
    r2t, rows, n_slots = contiguous_table([ctx] * B)
    kv_bytes = B * ctx * (L + R) * 2
    flops = 2 * B * ctx * H * ((L + R) + L)
    layers = max(1, min(32, math.ceil(L2_MULT / kv_bytes)))
    bufs = [torch.randn(n_slots, L + R, device=DEV, dtype=DT) for _ in range(layers)]
    q_nope = torch.randn(B, H, L, device=DEV, dtype=DT)
    q_rope = torch.randn(B, H, R, device=DEV, dtype=DT)
    seq_lens = torch.full((B,), ctx, device=DEV, dtype=torch.int64)
    chk = min(B, 2)  # reference on the first rows only (float32 on the GPU)
    ref = mla_attention_ref(q_nope[:chk], q_rope[:chk], bufs[0], r2t, rows[:chk], [ctx - 1] * chk, [1] * chk, MLA_SCALE)
    out = torch.empty_like(q_nope)
    res = []
    for name, msl in variants.items():
        var = name.split("@")[0]
        if var == "auto":
            resolve_auto(B, H, ctx, q_nope, bufs[0])
        if not mla_applies(var, H):
            continue
        splits = mla_splits(var, B, sms, H)
        scratch = decode_scratch(B, H, L, splits, DEV)

        def run(var: str = var, splits: int = splits, scratch: tuple = scratch, msl: int = msl) -> None:
            for buf in bufs:
                mla_call(var, q_nope, q_rope, buf, out, r2t, rows, seq_lens, scratch, splits, msl)

        out.fill_(float("nan"))
        mla_call(var, q_nope, q_rope, bufs[0], out, r2t, rows, seq_lens, scratch, splits, msl)
        torch.cuda.synchronize()
        err = rel_err(out[:chk], ref)
        ms = graph_ms(run, layers)
        res.append(dict(kernel="mla_decode", model="deepseek-v3", heads=H, batch=B, context=ctx, splits=splits, variant=name,
                        us=ms * 1e3, bytes=kv_bytes, gbps=kv_bytes / ms / 1e6, pct_copy=kv_bytes / ms / 1e6 / copy_gbps,
                        floor_us=kv_bytes / copy_gbps / 1e3, flops=flops, tflops=flops / ms / 1e9,
                        matmul_floor_us=flops / mm_tflops / 1e6, rel_err=err))  # fmt: skip
    return res


def bench_extend(kind: str, T: int) -> list[dict]:
    """One fresh prompt of T tokens (prefix 0), causal. FLOPs: QK^T and PV over the causal half."""
    r2t, rows, n_slots = contiguous_table([T])
    ext = torch.tensor([T], device=DEV)
    zero, start = torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
    res = []
    if kind == "mla":
        H, L, R = MLA_SHAPE
        q_nope, q_rope = torch.randn(T, H, L, device=DEV, dtype=DT), torch.randn(T, H, R, device=DEV, dtype=DT)
        buf = torch.randn(n_slots, L + R, device=DEV, dtype=DT)
        latent = buf[1 : T + 1]
        out = torch.empty_like(q_nope)
        flops = 2 * H * (T * (T + 1) / 2) * ((L + R) + L)
        ms = do_bench(lambda: mla_extend_fwd(q_nope, q_rope, latent, out, buf, r2t, rows, zero, ext, start, T, 192**-0.5),
                      warmup=25, rep=200, return_mode="median")  # fmt: skip
        res.append(dict(kernel="mla_extend", model="deepseek-v3", tokens=T, us=ms * 1e3, tflops=flops / ms / 1e9))
        return res
    H, H_kv, D = GQA_SHAPES[kind]
    q = torch.randn(T, H, D, device=DEV, dtype=DT)
    k_buf, v_buf = torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT), torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT)
    k_new, v_new = k_buf[1 : T + 1], v_buf[1 : T + 1]
    out = torch.empty_like(q)
    flops = 2 * 2 * H * D * (T * (T + 1) / 2)
    ms = do_bench(lambda: extend_attention_fwd(q, k_new, v_new, out, k_buf, v_buf, r2t, rows, zero, ext, start, T, D**-0.5),
                  warmup=25, rep=200, return_mode="median")  # fmt: skip
    res.append(dict(kernel="gqa_extend", model=kind, tokens=T, us=ms * 1e3, tflops=flops / ms / 1e9))
    qs = q.transpose(0, 1)[None]  # [1, H, T, D]
    ks = k_new.transpose(0, 1)[None].repeat_interleave(H // H_kv, 1)
    vs = v_new.transpose(0, 1)[None].repeat_interleave(H // H_kv, 1)
    ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                  warmup=25, rep=200, return_mode="median")  # fmt: skip
    res.append(dict(kernel="sdpa_flash_peer", model=kind, tokens=T, us=ms * 1e3, tflops=flops / ms / 1e9))
    return res


def device_tag(name: str) -> str:
    """The results file's device tag: the GPU's model number ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" ->
    "h100"), else the name folded to lower-case words ("gpu" for an empty one)."""
    model = re.search(r"\b[A-Z]{1,2}\d{2,4}[A-Z]?\b", name)
    return model.group(0).lower() if model else "_".join(re.findall(r"[a-z0-9]+", name.lower())) or "gpu"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--kernels", default="gqa,mla", help="groups: gqa, mla, extend")
    ap.add_argument("--gqa-variants", default=",".join(GQA_VARIANTS))
    ap.add_argument("--mla-variants", default=",".join(k for k in MLA_VARIANTS if not k.startswith(("diag_", "gluon_s", "few_s", "few_b"))),
                    help="NAME[@min_split_len]; @ variants run at B=1 only")  # fmt: skip
    ap.add_argument("--mla-batches", default=",".join(map(str, MLA_BATCHES)), help="batch sizes of the MLA cases")
    ap.add_argument("--mla-contexts", default="4096,16384,32768",
                    help="contexts of the MLA cases (DeepSeek-V3's window is 128K: 65536,131072 are long context too)")
    ap.add_argument("--check-reps", type=int, default=4)
    ap.add_argument("--mla-heads", default="128",
                    help="heads a GPU, comma-separated: 128 (DeepSeek-V3), 64 (Kimi-K2), 16 / 8 (those at TP 8)")  # fmt: skip
    args = ap.parse_args()
    for k in [k for k in GQA_VARIANTS if k not in args.gqa_variants.split(",")]:
        del GQA_VARIANTS[k]
    mla_vars = {v: int(v.split("@")[1]) if "@" in v else 0 for v in args.mla_variants.split(",")}
    for k in [k for k in MLA_VARIANTS if k not in {v.split("@")[0] for v in mla_vars}]:
        del MLA_VARIANTS[k]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    sms = props.multi_processor_count
    copy_gbps, mm_tflops = copy_bandwidth(), matmul_rate()  # benchmarks/ceilings.py
    print(f"device {props.name}, {sms} SMs; copy {copy_gbps:.0f} GB/s; bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    groups = set(args.kernels.split(","))
    t0 = time.time()
    checks = {}
    if "gqa" in groups:
        checks["gqa"] = check_gqa(sms, args.check_reps)
        print(f"check gqa (worst rel err, bf16 tol 1e-2): {checks['gqa']}  [{time.time() - t0:.0f}s]", flush=True)
    if "mla" in groups:
        checks["mla"] = check_mla(sms, max(1, args.check_reps // 2))
        print(f"check mla (worst rel err, bf16 tol 1e-2): {checks['mla']}  [{time.time() - t0:.0f}s]", flush=True)
    results: list[dict] = []
    lines = []
    for B, ctx in GQA_CASES if "gqa" in groups else ():
        r = bench_gqa("qwen3-30b-a3b", B, ctx, sms, copy_gbps)
        results += r
        lines.append(f"gqa B={B:<4d} ctx={ctx:<6d} floor {r[0]['floor_us']:6.1f} us | " + " ".join(
            f"{x['variant']}:{x['us']:7.1f}us {x['pct_copy']:4.0%}" for x in r))  # fmt: skip
        print(lines[-1], flush=True)
    mla_heads = [int(h) for h in args.mla_heads.split(",")]
    mla_batches = {int(b) for b in args.mla_batches.split(",")}
    mla_contexts = [int(c) for c in args.mla_contexts.split(",")]
    cases = [(h, (b, c)) for h in mla_heads for b in sorted(mla_batches) for c in mla_contexts]
    for H, (B, ctx) in cases if "mla" in groups else ():
        variants = {k: v for k, v in mla_vars.items() if "@" not in k or (B == 1 and ctx == 4096)}
        r = bench_mla(B, ctx, sms, copy_gbps, mm_tflops, variants, H)
        results += r
        floors = f"floor {r[0]['floor_us']:6.1f} us (matmul {r[0]['matmul_floor_us']:6.1f})"
        lines.append(f"mla H={H:<3d} B={B:<3d} ctx={ctx:<6d} {floors} | "
                     + " ".join(f"{x['variant']}:{x['us']:7.1f}us {x['pct_copy']:4.0%}" for x in r))  # fmt: skip
        print(lines[-1], flush=True)
    for kind in ("qwen3-8b", "mla") if "extend" in groups else ():
        for T in (1024, 8192):
            for x in bench_extend(kind, T):
                results.append(x)
                print(f"{x['kernel']:16s} {x['model']:12s} T={T:<5d} {x['us']:9.1f} us {x['tflops']:6.1f} TFLOP/s "
                      f"({x['tflops'] / mm_tflops:4.0%} of matmul)", flush=True)  # fmt: skip
    doc = dict(device=props.name, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, triton=triton.__version__,
               copy_gbps=copy_gbps, matmul_tflops=mm_tflops, seconds=time.time() - t0,
               command="PYTHONPATH=. python benchmarks/bench_attention.py " + " ".join(sys.argv[1:]),
               checks=checks, results=results)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"attention_{device_tag(props.name)}.json").write_text(json.dumps(doc, indent=1))
    print("\n".join(["", "summary:"] + lines))


if __name__ == "__main__":
    main()
