"""Triton attention backend (`--attention-backend triton`): paged decode / extend attention for
MHA/GQA and absorbed MLA, kernels in `ftransformers/kernels/triton_*_attention.py`; MLA prefill in
MHA form over dense expanded K/V in `ftransformers/kernels/triton_mla_prefill.py`.

Numerically the same function as `torch_native` (softmax in float32, output in the query dtype).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from ftransformers.attention.backend import AttentionBackend, register_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode
from ftransformers.cache.kv_pool import MHAKVPool, MLAKVPool
from ftransformers.kernels.cluster import cluster_supported, max_cluster_size
from ftransformers.kernels.launch import cdiv, next_pow2
from ftransformers.kernels.triton_decode_attention import DecodeRope, can_fuse_rope, decode_attention_fwd
from ftransformers.kernels.triton_extend_attention import extend_attention_fwd
from ftransformers.kernels.triton_mla_attention import (
    FEW_HEADS_LIMIT,
    MLA_DECODE_KERNELS,
    gluon_mla_unsupported,
    mla_decode_fwd,
    mla_decode_kernel,
    mla_extend_fwd,
)
from ftransformers.kernels.triton_mla_prefill import mla_prefill_fwd, mla_prefill_sdpa
from ftransformers.kernels.triton_rope_store import rope_store

MAX_KV_SPLITS = 64
GQA_WAVES = 2  # H100: 2 waves of decode programs beat 4 by up to 9% from batch 32 (attention_h100.json)
GQA_BLOCK_N = 64  # KV tokens a tile of the GQA decode kernel on CUDA
# Up to this batch size the fused-rope GQA decode reads its first K/V tile before the PDL wait
# (kernels/triton_decode_attention.py, PRELOAD_FIRST_TILE). H100, Qwen3-30B-A3B, step ms with against without
# (benchmarks/results/ab_preload_attn_*_h100.*): W4A16 ctx 512 B=1 2.105 / 2.131, B=8 4.851 / 4.847, B=32
# 12.546 / 12.450; ctx 4096 B=1 2.290 / 2.325, B=8 5.743 / 6.004; bf16 ctx 512 B=1 3.215 / 3.253, B=8 10.342 /
# 10.313. At 195 registers a thread (156 without) fewer programs fit an SM, which costs where many are live.
GQA_PRELOAD_MAX_BS = 8
# The GQA decode stage 1's warps and pipeline stages (module constants for benchmarks/ab_decode.py's `set=`). H200,
# bf16 graph replay (benchmarks/results/ab_gqa_warps_*_h200.log): 4 warps and 2 stages fastest or level everywhere
# but Qwen3-30B-A3B B=1 ctx 512, where 8 warps read 2.437 against 2.457 ms; 8 warps cost 140 us at B=8, 53 on Qwen3-8B.
GQA_WARPS = 4
GQA_STAGES = 2
# GQA decode in thread-block clusters (kernels/cluster.py, triton_decode_attention's CLUSTER): up to
# GQA_CLUSTER_MAX_BS rows of at most GQA_CLUSTER_MAX_HEAD_BLOCKS head blocks whose longest sequence is below
# GQA_CLUSTER_BELOW tokens run GQA_CLUSTER splits a (head block, row; at most the GPU's max_cluster_size), merged
# through distributed shared memory instead of by stage 2. 0: off. H200, bf16 B=1, graph replay
# (benchmarks/results/ab_cluster2_*_s47_h200, ab_router_30b_bf16_s47_h200, ab_cluster_8b_bf16_s47_h200):
# Qwen3-30B-A3B (4 KV heads) ctx 512 2.441 -> 2.394 ms with 16 (8: 2.417), ctx 1000 2.451 -> 2.404 (8: 2.431);
# Qwen3-8B (8 KV heads, 128 programs) 4.202 -> 4.228 ms, slower, hence the head-block cap. Not where the next
# kernel reads ahead of its PDL wait (early_trigger: a 4-bit o projection, which stage 2 launches early): Qwen3-30B-A3B
# W4A16 1.631 -> 1.706 ms (ab_final_30b_w4a16_s47_h200). Longer contexts and batch 2+ not measured: they keep the
# split launch (below) and stage 2.
# From 2 rows on, a GQA decode launch fills the SMs once (`gqa_decode_launch`): splits for one program an SM
# (GQA_FILL_WAVES, a power of two as before), at 64-token tiles over 3 pipeline stages without the first-tile
# preload; where the (row, head block) pairs alone outnumber the programs the SMs hold at 64-token tiles
# (GQA_SLOTS an SM: 156 registers in an offline sm_90 compile with Triton 3.6), 32-token tiles (116 registers, 4
# an SM), so that one split a pair runs in one wave. GQA_FILL = 0: the rule before, GQA_WAVES programs an SM at
# 64-token tiles and 2 stages everywhere, so that at batch 8 one program in two waited for a second wave.
# H200, bf16 graph replay in one process each, 3 rounds (benchmarks/results/ab_fill2_*_s51_h200.log; the knobs
# one by one in ab_gqa_launch_*_s51_h200.log), step ms and decode attention's critical path (us a step), before -> now:
#   Qwen3-8B      B=8 5.328 -> 5.252 (627 -> 567), B=16 5.331 -> 5.179 (757 -> 604), B=32 5.700 -> 5.474 (1086 -> 833),
#                 B=64 6.444 -> 6.184 (1694 -> 1447), B=128 8.065 -> 8.064 (2880 -> 2844);
#   Qwen3-30B-A3B B=8 8.089 -> 7.993 (692 -> 610), B=16 11.588 -> 11.535 (826 -> 791), B=32 14.742 -> 14.550
#                 (1046 -> 871), B=64 16.822 -> 16.481 (1480 -> 1132), B=128 18.158 -> 17.863 (2304 -> 1959).
# Splits for the programs the SMs hold in any count (3 at Qwen3-8B B=16) were slower than 2 (ab_fill_*_s51_h200.log);
# 2 or 4 programs an SM slower everywhere; at B=64-128, 3 or 4 stages at 32-token tiles level, 8 warps slower
# (ab_tile32_8b_bf16_s51_h200.log).
GQA_FILL = 1
GQA_FILL_WAVES = 1
GQA_FILL_STAGES = 3
GQA_SLOTS = 3
GQA_SMALL_TILE = 32
GQA_CLUSTER = 16
GQA_CLUSTER_MAX_BS = 1
GQA_CLUSTER_MAX_HEAD_BLOCKS = 4
GQA_CLUSTER_BELOW = 1024
MLA_MAX_KV_SPLITS = 64
# MLA decode on the 64-head kernels with at most this many heads a GPU (DeepSeek-V3 / Kimi-K2 at tensor
# parallel 8): up to 128 splits, so that batch 1 puts a program on nearly every SM (H100, batch 1 x 32K, 8 / 16
# heads: 27.0 / 27.9 -> 23.8 / 24.8 us, the same at 4K and 16K). At 64 heads 128 splits were slower at 4K and
# 16K (15.3 -> 17.5, 22.6 -> 25.2 us: their float32 partials are 4x larger), so larger head counts keep 64.
# benchmarks/results/attention_mla_b1_rule_h100.log. The few-heads kernel (Hopper's default up to 32 heads)
# keeps 64 at every head count: at batch 1 it was faster with 64 splits than with 128 (8 / 16 / 32 heads x
# 32K: 20.2 / 21.6 / 25.5 us against 20.8 / 22.2 / 25.9) and much faster than with 32 or 48 (its copies then
# bound it: 29.0 / 31.3 / 38.1 us at 32). benchmarks/results/attention_mla_few_splits_h100.log
MLA_FEW_HEADS = 16
# Above 16 and up to 64 heads a GPU, up to batch 4, the few-heads kernel runs blocks of half the heads, two
# programs a tile, so twice the SMs share a row's tiles (mla_block_h): 32 heads (DeepSeek-V3 at tensor parallel 4,
# Kimi-K2 at 2) in blocks of 16, 64 heads (DeepSeek-V3 at 2, Kimi-K2 on one GPU: the hybrid deployment) in blocks
# of 32 instead of the 64-head kernel. H100, batch 1 / 4 x 4K / 16K / 32K, us:
#   32 heads, one block of 32: 11.1 / 16.7 / 25.5, 17.0 / 38.5 / 63.8; two of 16: 10.6 / 15.9 / 24.0, 14.8 / 36.8 / 64.4
#   64 heads, 64-head kernel: 15.3 / 23.1 / 33.4, 26.6 / 48.9 / 74.6; two of 32: 13.7 / 19.2 / 28.4, 18.5 / 42.8 / 72.8
# From batch 16 each block's copy of the tiles costs more than it saves (32 heads, batch 16 x 32K 214.5 -> 239.3;
# 64 heads 225.3 -> 264.8). At 128 heads blocks of 32 lost at 32K (38.2 -> 39.8 at batch 1).
# benchmarks/results/attention_mla_few_blocks32_h100.log, attention_mla_wide_blocks_h100.log
MLA_FEW_SPLIT_HEADS_MAX_BS = 4
# On GPUs of at least MLA_FEW_WIDE_SPLITS_GBPS_PER_SM (an H200, not an H100) the half-head blocks pay only at short
# context: from the batch's longest sequence named here (by batch size) one block takes all the heads, the
# few-heads kernel's for 17-32 heads and the 64-head kernel for 33-64 (the latter on 128 splits at batch 1, a
# program an SM). 0: at every context; absent: never. A CUDA graph is captured per side of the bound
# (`decode_context_bounds`). H200, us, half blocks -> one block (benchmarks/results/attention_mla_64h_*s46_h200.log):
#   32 heads, batch 2 at 4K / 8K / 16K / 32K / 128K: 11.8 / 15.1 / 22.4 / 35.5 / 110.9 -> 14.1 / 16.0 / 21.6 /
#     31.0 / 83.1; batch 4 at 4K / 32K / 128K: 16.0 / 61.8 / 215.2 -> 15.3 / 48.1 / 159.3
#   64 heads, batch 1 at 16K / 32K / 64K / 128K: 18.8 / 26.9 / 41.7 / 71.4 -> 21.2 / 27.6 / 38.8 / 60.8;
#     batch 2 at 16K / 32K / 128K: 26.6 / 41.4 / 135.3 -> 28.2 / 39.5 / 106.0;
#     batch 4 at 8K / 16K / 32K / 128K: 27.5 / 42.2 / 71.7 / 262.5 -> 29.5 / 40.9 / 62.2 / 200.9
# At 64 heads the bounds held after the 64-head kernel's scores moved to one warpgroup (gluon_mla_decode.SCORES_ONE_WG,
# session 61; benchmarks/results/attention_64h_bounds_s61_h200.log), one block -> two of 32, us: batch 1 at 32K /
# 64K 27.1 / 37.6 -> 23.9 / 38.9; batch 2 at 16K / 32K 26.7 / 37.3 -> 24.4 / 39.2; batch 3 at 8K / 16K 22.8 /
# 31.5 -> 19.6 / 31.6; batch 4 at 8K / 16K 26.6 / 37.6 -> 25.1 / 39.8. Once the 64-head kernel copied its first tile
# before the PDL wait (gluon_mla_decode.EARLY_TILE, session 62; attention_64h_bounds_s62_h200.log) the batch-1 and
# batch-2 bounds came down: batch 1 at 40K / 48K / 56K 28.0 / 30.7 / 33.5 -> 27.9 / 31.4 / 35.3; batch 2 at 12K /
# 24K 22.0 / 30.6 -> 19.9 / 31.8; batch 3 at 12K 26.9 -> 26.0, batch 4 at 12K 32.2 -> 32.5 (no change there)
MLA_ONE_BLOCK_FROM = {32: {2: 16384, 3: 0, 4: 0}, 64: {1: 49152, 2: 24576, 3: 16384, 4: 16384}}
# At batch 1, 17-32 heads keep two blocks of the few-heads kernel (one block of all of them lost: 38.6 against 35.5
# us at 64K), but from this context the 64-head kernel on 128 splits beats both, on the same GPUs: 34.2-34.3 /
# 54.4-54.7 against 35.5-35.6 / 61.0 us at 64K / 128K (23.6-23.7 against 22.3-22.4 at 32K). With its first tile
# copied before the PDL wait (session 62, attention_32h_bounds_s62_h200.log) it wins from 48K: at 40K / 48K / 56K
# 23.5 / 25.8 / 28.5 against 23.0 / 26.2 / 29.5 us
MLA_64_HEAD_KERNEL_FROM = {32: {1: 49152}}
MLA_FEW_HEADS_MAX_KV_SPLITS = 128
# The few-heads kernel at up to 16 heads a GPU takes 128 splits too (batch 1 is the only batch it changes) where
# the GPU's peak DRAM bandwidth an SM is at least this (GB/s): a program's split then has more bandwidth to use than
# one program pulls. H200 (4.8 TB/s peak, 36 GB/s an SM), batch 1 x 4K / 16K / 32K, us with 64 -> 128 splits:
# 16 heads 8.0 / 12.8 / 19.8 -> 7.6 / 12.9 / 18.0, 8 heads 7.0 / 11.7 / 18.3 -> 6.7 / 11.8 / 16.6
# (benchmarks/results/attention_mla_splits_h200.log). The H100 (3.35 TB/s, 25 GB/s an SM) keeps 64 (above).
MLA_FEW_WIDE_SPLITS_GBPS_PER_SM = 30.0
MLA_BLOCK_H = 64  # heads per MLA decode program on CUDA (wgmma M; the accumulator fills the registers)
MLA_NUM_STAGES = 3  # H100: 3-6% faster than 2 from batch 4 (benchmarks/results/attention_h100.json)
# MLA decode stage 1: "auto" takes a Gluon kernel on Hopper where it applies (kernels/gluon_mla_decode.py;
# on an H100 1.5-1.6x the Triton kernel's speed at 128 heads, 1.1-2.2x at 64 and fewer from batch 4 x 32K;
# up to 32 heads, and 64 up to batch 4, kernels/gluon_mla_few_heads.py, 1.02-1.34x that one's), "triton" /
# "gluon" / "gluon_few" force one (A/B runs; a Gluon one fails where it cannot run, saying why)
MLA_DECODE_KERNEL = os.environ.get("FTRANSFORMERS_MLA_DECODE_KERNEL", "auto")
if MLA_DECODE_KERNEL not in MLA_DECODE_KERNELS:
    raise ValueError(f"FTRANSFORMERS_MLA_DECODE_KERNEL must be one of {', '.join(MLA_DECODE_KERNELS)}, not {MLA_DECODE_KERNEL!r}")
DEFAULT_MAX_BS = 256
SDPA_MAX_SEQS = 8  # not measured: above it, per-sequence launches are assumed to outweigh flash's speed


def num_kv_splits(batch_size: int, head_blocks: int, num_sms: int, waves: int = 4) -> int:
    """Fixed split count for a GQA decode launch: enough (batch x head-block x split) programs for
    about `waves` waves, so batch 1 at long context still fills the GPU. Depends on shapes only; the
    kernel's split length (a multiple of BLOCK_N) makes short sequences use fewer."""
    want = cdiv(waves * num_sms, max(1, batch_size * head_blocks))
    return max(1, min(MAX_KV_SPLITS, next_pow2(want)))


def gqa_decode_launch(batch_size: int, head_blocks: int, num_sms: int) -> tuple[int, int, int]:
    """(splits, KV tokens a tile, pipeline stages) of a GQA decode launch without clusters (see GQA_FILL)."""
    if batch_size <= 1 or not GQA_FILL:
        return num_kv_splits(batch_size, head_blocks, num_sms, GQA_WAVES), GQA_BLOCK_N, GQA_STAGES
    splits = num_kv_splits(batch_size, head_blocks, num_sms, GQA_FILL_WAVES)
    if batch_size <= GQA_PRELOAD_MAX_BS:  # the first tile read before the PDL wait: 2 stages
        return splits, GQA_BLOCK_N, GQA_STAGES
    if batch_size * head_blocks <= GQA_SLOTS * num_sms:
        return splits, GQA_BLOCK_N, GQA_FILL_STAGES
    return splits, GQA_SMALL_TILE, GQA_STAGES


def gqa_clusters(batch_size: int, head_blocks: int) -> bool:
    """Whether a GQA decode of this shape runs in clusters below GQA_CLUSTER_BELOW tokens (where supported)."""
    return GQA_CLUSTER > 1 and batch_size <= GQA_CLUSTER_MAX_BS and head_blocks <= GQA_CLUSTER_MAX_HEAD_BLOCKS


def mla_num_kv_splits(batch_size: int, head_blocks: int, num_sms: int, max_splits: int = MLA_MAX_KV_SPLITS) -> int:
    """Split count for the MLA decode kernel (one 8-warp program per SM, compute- and
    bandwidth-bound): one wave of (batch x head-block x split) programs, rounded down so that a
    second, mostly idle wave is not started; 1 from batch >= num_sms / head_blocks. Above
    MLA_MAX_KV_SPLITS (64) a power of two: stage 2's split block is the next one up (66 splits of 32K ran ~1 us slower than 64 at
    128 heads, for the same 64 non-empty splits)."""
    n = max(1, min(max_splits, num_sms // max(1, batch_size * head_blocks)))
    return n if n <= MLA_MAX_KV_SPLITS else 1 << (n.bit_length() - 1)


def mla_one_block_from(num_heads: int, batch_size: int, gbps_per_sm: float = 0.0) -> int | None:
    """The longest-sequence length from which 17-64 heads a GPU run as one block at batch 1-4 (MLA_ONE_BLOCK_FROM)
    on a GPU of this peak DRAM bandwidth an SM; None where they run as two blocks at every context."""
    if gbps_per_sm < MLA_FEW_WIDE_SPLITS_GBPS_PER_SM or not MLA_FEW_HEADS < num_heads <= 2 * FEW_HEADS_LIMIT:
        return None
    return MLA_ONE_BLOCK_FROM[FEW_HEADS_LIMIT if num_heads <= FEW_HEADS_LIMIT else 2 * FEW_HEADS_LIMIT].get(batch_size)


def mla_block_h(
    num_heads: int, batch_size: int, kernel: str = "auto", gbps_per_sm: float = 0.0, context: int = 0
) -> int:
    """At most this many heads a program of the few-heads MLA kernel at this batch size (see
    MLA_FEW_SPLIT_HEADS_MAX_BS): half of 17-64 heads up to that batch, else all; mla_decode_kernel("auto")
    takes that kernel where a program's heads fit it, the 64-head one (MLA_BLOCK_H a program) otherwise.
    With "auto", on a GPU of `gbps_per_sm` a batch whose longest sequence holds `context` tokens may take one
    block instead (mla_one_block_from). With the few-heads kernel forced (`kernel` "gluon_few"), blocks it can
    take."""
    if MLA_FEW_HEADS < num_heads <= 2 * FEW_HEADS_LIMIT and batch_size <= MLA_FEW_SPLIT_HEADS_MAX_BS:
        one_from = mla_one_block_from(num_heads, batch_size, gbps_per_sm) if kernel == "auto" else None
        if one_from is None or context < one_from:
            return next_pow2(num_heads) // 2
    return FEW_HEADS_LIMIT if kernel == "gluon_few" else MLA_BLOCK_H


def mla_64_head_kernel_from(num_heads: int, batch_size: int, gbps_per_sm: float = 0.0) -> int | None:
    """The longest-sequence length from which 17-32 heads a GPU take the 64-head kernel at this batch size
    (MLA_64_HEAD_KERNEL_FROM) on a GPU of this peak DRAM bandwidth an SM; None where they never do."""
    if gbps_per_sm < MLA_FEW_WIDE_SPLITS_GBPS_PER_SM or not MLA_FEW_HEADS < num_heads <= FEW_HEADS_LIMIT:
        return None
    return MLA_64_HEAD_KERNEL_FROM[FEW_HEADS_LIMIT].get(batch_size)


def mla_context_bounds(
    num_heads: int, batch_size: int, kernel: str = "auto", gbps_per_sm: float = 0.0
) -> tuple[int, ...]:
    """Longest-sequence lengths at which mla_decode_launch's answer changes at this batch size (ascending; empty:
    one launch at every context)."""
    if kernel != "auto":
        return ()
    bounds = (mla_one_block_from(num_heads, batch_size, gbps_per_sm),
              mla_64_head_kernel_from(num_heads, batch_size, gbps_per_sm))  # fmt: skip
    return tuple(sorted({c for c in bounds if c}))


def mla_decode_launch(
    q_nope: torch.Tensor,  # [B, H, L]
    latent_buf: torch.Tensor,  # [N, L + R]
    batch_size: int,
    context: int,
    num_sms: int,
    gbps_per_sm: float = 0.0,
    kernel: str = "auto",
) -> tuple[str, int, int]:
    """(stage-1 kernel, heads a program, KV splits) of the MLA decode of `batch_size` rows whose longest sequence
    holds `context` tokens, for `kernel` (MLA_DECODE_KERNEL's choices): the backend's launch rules above, on a GPU of
    `num_sms` SMs and `gbps_per_sm` peak DRAM bandwidth an SM (peak_gbps_per_sm)."""
    H = q_nope.shape[1]
    want = mla_block_h(H, batch_size, kernel, gbps_per_sm, context)
    wide_from = mla_64_head_kernel_from(H, batch_size, gbps_per_sm) if kernel == "auto" else None
    if wide_from is not None and context >= wide_from and gluon_mla_unsupported(q_nope, latent_buf) is None:
        kernel = "gluon"
    kernel = mla_decode_kernel(q_nope, latent_buf, kernel, want)
    block_h = want if kernel == "gluon_few" else MLA_BLOCK_H if q_nope.is_cuda else 16
    splits = mla_num_kv_splits(batch_size, cdiv(H, block_h), num_sms, mla_max_kv_splits(H, kernel, gbps_per_sm))
    return kernel, block_h, splits


def mla_max_kv_splits(num_heads: int, kernel: str = "triton", gbps_per_sm: float = 0.0) -> int:
    """mla_num_kv_splits's cap for this many heads a GPU on this stage-1 kernel (mla_decode_kernel's name;
    see MLA_FEW_HEADS), on a GPU of this peak DRAM bandwidth an SM (peak_gbps_per_sm; 0: unknown, the
    few-heads kernel keeps 64; see MLA_FEW_WIDE_SPLITS_GBPS_PER_SM)."""
    if num_heads > MLA_FEW_HEADS:
        wide = kernel == "gluon" and num_heads <= 2 * FEW_HEADS_LIMIT and gbps_per_sm >= MLA_FEW_WIDE_SPLITS_GBPS_PER_SM
        return MLA_FEW_HEADS_MAX_KV_SPLITS if wide else MLA_MAX_KV_SPLITS  # 33-64 heads on the 64-head kernel: 128
    if kernel == "gluon_few" and gbps_per_sm < MLA_FEW_WIDE_SPLITS_GBPS_PER_SM:
        return MLA_MAX_KV_SPLITS
    return MLA_FEW_HEADS_MAX_KV_SPLITS


def peak_gbps_per_sm(props: Any) -> float:
    """Peak DRAM bandwidth an SM, GB/s, from CUDA device properties (double data rate x bus width); 0 where
    torch does not report the memory clock or bus."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 / max(1, props.multi_processor_count)


@register_attention_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention.

    EXTEND: `init_forward_metadata` derives each sequence's first row in the flattened new tokens
    (`extend_start`, on the device) and the grid size `max_extend_len` from `extend_lens_cpu`.
    If a forward arrives without it (test harnesses), it is derived on first use.

    DECODE obeys the CUDA-graph rule: the kernels read only the ForwardBatch's fixed-shape device
    tensors (req_to_token, req_pool_indices, seq_lens, out_cache_loc); the split count is a function
    of the batch size and head counts (tensor shapes), and the split-K scratch (float32 partial
    outputs and log-sum-exps) is one flat buffer per (num_heads, v_head_dim), sized for every batch
    size up to `max_bs` the first time a decode with those heads runs, and never freed.
    Graph runner protocol: call `init_cuda_graph_state(max_bs, max_context_len)` once, run one
    eager decode forward (the warm-up that also compiles the kernels), then capture; a decode inside
    a capture that would need a larger scratch raises instead of allocating. The split lengths are
    computed in-kernel from seq_lens, so `max_context_len` does not size anything.
    """

    # decode: per-head q/k norm, rope and the K/V store inside the attention's first stage (one launch a
    # layer less than kernels/triton_rope_store.py + stage 1); False keeps the separate launch (A/B benches)
    fuse_decode_rope = True

    def __init__(self) -> None:
        self.max_bs = DEFAULT_MAX_BS
        self._scratch: dict[tuple[int, int, str], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # replaced scratch, kept alive for captured graphs
        self._meta_batch: ForwardBatch | None = None
        self._extend_start: torch.Tensor | None = None
        self._max_extend_len = 0
        self._gpu_facts: tuple[int, float] | None = None  # (SMs, peak_gbps_per_sm), read once
        self._mla_heads: set[int] = set()  # heads a GPU of the MLA decodes run so far (decode_context_bounds)
        self._gqa_clustered = 0  # head blocks of the GQA decodes that may run in clusters (decode_context_bounds)
        self._prefix_start: torch.Tensor | None = None
        self._identity: torch.Tensor | None = None  # arange, grown on demand (MLA prefill's slot table)
        # MHA-form MLA prefill: "sdpa" (torch flash, one call per sequence), "triton" (the extend kernel
        # over dense K/V, one launch) or "auto": sdpa on CUDA for up to SDPA_MAX_SEQS sequences (H100,
        # 8K tokens: 6.8 ms a layer against 14.2; benchmarks/results/mla_prefill_h100.json), else triton.
        self.mla_prefill_kernel = "auto"

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self.max_bs = max_bs
        self._retired.extend(self._scratch.values())  # re-sized by the next (eager) decode
        self._scratch.clear()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._meta_batch = batch
        if batch.mode == ForwardMode.EXTEND:
            ext = batch.extend_lens
            self._extend_start = torch.cumsum(ext, 0) - ext  # [B]
            self._max_extend_len = max(batch.extend_lens_cpu)
            pre = batch.prefix_lens
            self._prefix_start = torch.cumsum(pre, 0) - pre  # [B]

    # helpers -------------------------------------------------------------------------------
    def _extend_meta(self, batch: ForwardBatch) -> tuple[torch.Tensor, int]:
        if self._meta_batch is not batch or self._extend_start is None:
            self.init_forward_metadata(batch)
        assert self._extend_start is not None
        return self._extend_start, self._max_extend_len

    def _gpu(self, device: torch.device) -> tuple[int, float]:
        """SMs and peak DRAM bandwidth an SM (GB/s) of `device`; a CPU counts as 2 SMs of unknown bandwidth."""
        if self._gpu_facts is None:
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device)
                self._gpu_facts = (props.multi_processor_count, peak_gbps_per_sm(props))
            else:
                self._gpu_facts = (2, 0.0)
        return self._gpu_facts

    def _decode_scratch(
        self, B: int, H: int, DV: int, splits: int, size_rule: Callable[[int], int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # size_rule: batch size -> the most splits a launch at that size takes (num_kv_splits / mla_num_kv_splits
        # with its head blocks, at every context), so that one buffer serves every launch a graph may capture
        per_row = H * (DV + 1)  # floats per (sequence, split): outputs + lse
        key = (H, DV, str(device))
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < B * splits * per_row:
            self._check_not_capturing(device)
            rows = max(b * size_rule(b) for b in range(1, max(self.max_bs, B) + 1))
            rows = max(rows, B * splits)
            if buf is not None:
                self._retired.append(buf)
            buf = torch.empty(rows * per_row, dtype=torch.float32, device=device)
            self._scratch[key] = buf
        n = B * splits * H
        mid_o = buf[: n * DV].view(B, H, splits, DV)
        mid_lse = buf[n * DV : n * (DV + 1)].view(B, H, splits)
        return mid_o, mid_lse

    def decode_context_bounds(self, batch_size: int) -> tuple[int, ...]:
        """Longest-sequence lengths at which a decode launch of `batch_size` rows changes (ascending): the graph
        runner captures one graph per side of each. Known after a decode of the model ran (its heads)."""
        if self._gpu_facts is None:
            return ()
        gbps = self._gpu_facts[1]
        bounds = {c for H in self._mla_heads for c in mla_context_bounds(H, batch_size, MLA_DECODE_KERNEL, gbps)}
        if self._gqa_clustered and gqa_clusters(batch_size, self._gqa_clustered):
            bounds.add(GQA_CLUSTER_BELOW)
        return tuple(sorted(bounds))

    @staticmethod
    def _decode_context(batch: ForwardBatch) -> int:
        """The context a decode's launch is chosen for: the graph's class (ForwardBatch.decode_context), else the
        batch's longest sequence."""
        if batch.decode_context is not None:
            return batch.decode_context
        return max(batch.seq_lens_cpu, default=0)

    @staticmethod
    def _check_not_capturing(device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("triton attention: decode scratch must be allocated before graph capture "
                               "(run one eager decode after init_cuda_graph_state)")  # fmt: skip

    # AttentionBackend --------------------------------------------------------------------------
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
        return self._attend_mha(q, k, v, layer_id, scaling, batch)

    def forward_mha_fused_rope(
        self,
        q: torch.Tensor,  # [T, H, D], un-roped (last dim contiguous; a view into qkv is fine)
        k: torch.Tensor,  # [T, H_kv, D], un-roped
        v: torch.Tensor,  # [T, H_kv, D_v]
        positions: torch.Tensor,  # [T]
        cos_sin_cache: torch.Tensor,  # [P, D] float32 cos | sin (neox, rotary_dim == D)
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
        q_norm_weight: torch.Tensor | None = None,  # [D] per-head RMSNorm (Qwen3), with k's
        k_norm_weight: torch.Tensor | None = None,
        eps_q: float = 1e-6,
        eps_k: float = 1e-6,
        early_trigger: bool = False,
    ) -> torch.Tensor:  # [T, H, D_v]
        """forward_mha after (optional per-head q/k RMSNorm and) neox rotary. Decode (with
        `fuse_decode_rope`, power-of-two head dims): inside the attention kernel's first stage
        (triton_decode_attention.DecodeRope); otherwise one launch of kernels/triton_rope_store.py first.
        early_trigger: the kernel after the attention reads ahead of its PDL wait (the fused decode's stage 2
        then triggers it early; kernels/pdl.py)."""
        pool = batch.kv_pool
        assert isinstance(pool, MHAKVPool), "forward_mha_fused_rope needs an MHA KV pool"
        k_buf, v_buf = pool.get_kv(layer_id)
        fuse = self.fuse_decode_rope and can_fuse_rope(q.shape[-1], v_buf.shape[-1], cos_sin_cache)
        if batch.mode == ForwardMode.DECODE and fuse:
            loc = batch.out_cache_loc
            rope = DecodeRope(k, v, positions, cos_sin_cache, loc, q_norm_weight, k_norm_weight, eps_q, eps_k)
            return self._attend_mha(q, k, v, layer_id, scaling, batch, rope, early_trigger)
        q, k_rot = rope_store(
            q, k, v, positions, cos_sin_cache, k_buf, v_buf, batch.out_cache_loc, q_norm_weight, k_norm_weight,
            eps_q, eps_k, write_k=batch.mode != ForwardMode.DECODE,
        )  # fmt: skip
        return self._attend_mha(q, k if k_rot is None else k_rot, v, layer_id, scaling, batch)

    def _attend_mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float, batch: ForwardBatch,
        rope: DecodeRope | None = None, early_trigger: bool = False,
    ) -> torch.Tensor:  # K/V already stored (by stage 1 itself with `rope`); k/v (new tokens) read by extend only
        k_buf, v_buf = batch.kv_pool.get_kv(layer_id)  # type: ignore[union-attr]
        T, H, _ = q.shape
        out = q.new_empty(T, H, v_buf.shape[-1])
        if batch.mode == ForwardMode.DECODE:
            H_kv = k_buf.shape[1]
            head_blocks = H_kv * cdiv(H // H_kv, max(16, next_pow2(H // H_kv)))
            sms, _ = self._gpu(q.device)

            def rule(b: int) -> int:
                return gqa_decode_launch(b, head_blocks, sms)[0]

            splits, block_n, stages = gqa_decode_launch(T, head_blocks, sms)
            cluster = 1
            if cluster_supported(q.device) and not early_trigger:  # (see GQA_CLUSTER)
                self._gqa_clustered = head_blocks
                if gqa_clusters(T, head_blocks) and self._decode_context(batch) < GQA_CLUSTER_BELOW:
                    cluster = splits = min(GQA_CLUSTER, max_cluster_size(q.device))
            mid_o, mid_lse = self._decode_scratch(T, H, v_buf.shape[-1], splits, rule, q.device)
            return decode_attention_fwd(
                q, k_buf, v_buf, out, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                mid_o, mid_lse, splits, scaling, block_n=block_n if q.is_cuda else 16, num_warps=GQA_WARPS,
                num_stages=stages, rope=rope, preload=None if T <= GQA_PRELOAD_MAX_BS else False,
                early_trigger=early_trigger, cluster=cluster,
            )  # fmt: skip
        extend_start, max_extend_len = self._extend_meta(batch)
        return extend_attention_fwd(
            q, k.to(k_buf.dtype), v.to(v_buf.dtype), out, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices,
            batch.prefix_lens, batch.extend_lens, extend_start, max_extend_len, scaling,
        )  # fmt: skip

    def forward_mla(
        self,
        q_nope: torch.Tensor,  # [T, H, L], absorbed
        q_rope: torch.Tensor,  # [T, H, R], roped
        latent: torch.Tensor,  # [T, L + R], new tokens
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
        latent_stored: bool = False,  # the caller stored `latent` at out_cache_loc already (rope_latent's pool)
    ) -> torch.Tensor:  # [T, H, L]
        pool = batch.kv_pool
        if not isinstance(pool, MLAKVPool):
            raise TypeError(f"forward_mla needs an MLAKVPool, got {type(pool).__name__}")
        if not latent_stored:
            pool.set_latent(layer_id, batch.out_cache_loc, latent)
        buf = pool.get_latent(layer_id)  # [N+1, L+R]
        T, H, L = q_nope.shape
        q_rope = q_rope.to(q_nope.dtype)
        out = q_nope.new_empty(T, H, L)
        if batch.mode == ForwardMode.DECODE:
            sms, gbps_per_sm = self._gpu(q_nope.device)
            self._mla_heads.add(H)

            def launch(b: int, context: int) -> tuple[str, int, int]:  # stage-1 kernel, heads a program, splits
                return mla_decode_launch(q_nope, buf, b, context, sms, gbps_per_sm, MLA_DECODE_KERNEL)

            def most_splits(b: int) -> int:  # over the launches of every context at batch b
                bounds = mla_context_bounds(H, b, MLA_DECODE_KERNEL, gbps_per_sm)
                return max(launch(b, c)[2] for c in (0, *bounds))

            kernel, block_h, splits = launch(T, self._decode_context(batch))
            mid_o, mid_lse = self._decode_scratch(T, H, L, splits, most_splits, q_nope.device)
            return mla_decode_fwd(
                q_nope, q_rope, buf, out, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                mid_o, mid_lse, splits, scaling, block_h=block_h, num_stages=MLA_NUM_STAGES, kernel=kernel,
            )  # fmt: skip
        extend_start, max_extend_len = self._extend_meta(batch)
        return mla_extend_fwd(
            q_nope, q_rope, latent.to(buf.dtype), out, buf, batch.req_to_token, batch.req_pool_indices,
            batch.prefix_lens, batch.extend_lens, extend_start, max_extend_len, scaling,
        )  # fmt: skip

    def forward_mla_mha(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_rope: torch.Tensor,  # [T, H, R]
        kv: torch.Tensor,  # [P + T, H, N + V]
        k_rope: torch.Tensor,  # [P + T, R]
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, H, V]
        T, H, N = q_nope.shape
        out = q_nope.new_empty(T, H, kv.shape[-1] - N)
        kv, k_rope = kv.to(q_nope.dtype), k_rope.to(q_nope.dtype)
        kernel = self.mla_prefill_kernel
        if kernel == "auto":
            kernel = "sdpa" if q_nope.is_cuda and batch.batch_size <= SDPA_MAX_SEQS else "triton"
        if kernel == "sdpa":
            pre, ext = batch.prefix_lens_cpu, batch.extend_lens_cpu
            return mla_prefill_sdpa(q_nope, q_rope, kv, k_rope, out, pre, ext, scaling)
        extend_start, max_extend_len = self._extend_meta(batch)
        assert self._prefix_start is not None
        P = kv.shape[0] - T
        if self._identity is None or self._identity.numel() < max(P, 1) or self._identity.device != kv.device:
            self._identity = torch.arange(max(P, 1, 2 * (0 if self._identity is None else self._identity.numel())),
                                          dtype=torch.int64, device=kv.device)  # fmt: skip
        return mla_prefill_fwd(
            q_nope, q_rope, kv, k_rope, out, self._identity, self._prefix_start, batch.prefix_lens,
            batch.extend_lens, extend_start, max_extend_len, scaling,
        )  # fmt: skip
