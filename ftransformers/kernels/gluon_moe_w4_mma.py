"""The int4 MoE pair path on the tensor cores, in Gluon: mma.sync with the weights decoded straight into
the A operand's registers (no shared memory, no layout conversion).

Same contract as the pair path of kernels/triton_fused_moe_w4.py (gate-up with SiLU*up, then down with
the routing weights summed over the slots), for int4 experts, 16-bit activations and TOP_K a power of
two (`supported` lists the shapes).

Why: at one token the CUDA-core pair kernels spend ~4-5 instructions a weight (shift, mask, FFMA and
the group reductions; docs/performance.md, session 15). Here one LOP3 makes two bf16 operands,
(q >> 4i) & 0x000F000F | 0x43004300 = (128 + nibble i, 128 + nibble i + 4) (fp16: 0x64006400, 1024 +
code), and one m16n8k16 mma takes eight weights a thread. Products (128 + c) x are exact in float32;
the code offset and zero leave through scale * (acc - (128 + zero) * sum(x)) per group (the codes
kernel's identity, kernels/triton_w4a16_codes.py; its float32 cancellation leaves ~1e-5 of the result).

A pair has one token, so the mma's 8 B columns are free: column c holds x only on the c-th eighth of a
chunk of KC = 8 GC K (GC divides the group), zero elsewhere, so C[n, c] is the partial sum over that
span alone and the scales apply after the chunk's whole chain of mmas, 8 spans at a time.

Register layouts, the LOP3 decode and the chunk's sums: kernels/gluon_w4_mma_tiles.py, shared with the dense
product (kernels/gluon_w4a16_mma.py, whose NCOL columns are (row of x, span) pairs); here NCOL = S = 8.

The kernels (pair and grouped gate-up and down) are kernels/gluon_moe_w4_kernels.py's; this module holds their
configs, the rule (`takes`) and the launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftransformers.kernels.gluon_moe_w4_kernels import (
    _down_kernel,
    _gate_up_kernel,
    _grouped_down_kernel,
    _grouped_gate_up_kernel,
)
from ftransformers.kernels.gluon_w4_mma_tiles import MAGIC, layouts, mma_capable
from ftransformers.kernels.launch import maxnreg_option
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.tickets import POOL_SIZE, ticket_counters
from ftransformers.kernels.triton_moe_groups import group_leaders, group_pairs


@dataclass(frozen=True)
class MmaMoEConfig:
    """Per kernel: the largest chunk KC (a power of two >= 128; the largest that divides the warp's K and
    whose span KC / 8 divides the group is taken), chunks requested ahead (1 or 2), A rows a warp (16 or
    32) and, for gate-up, warps a program (each over D / warps of K)."""

    up_kc: int = 512
    up_ahead: int = 1
    up_rows: int = 32
    up_warps: int = 4
    down_kc: int = 256
    down_ahead: int = 1
    down_rows: int = 16
    # the grouped down (`down_grouped`): A rows a warp, warps a program (each over its own rows), chunks ahead
    gdown_rows: int = 32
    gdown_warps: int = 4
    gdown_ahead: int = 1


def default_config(num_tokens: int, hidden_size: int) -> MmaMoEConfig:
    """From the H100 sweep (benchmarks/results/moe_w4_mma_sweep_h100.{json,log}, int4 g128 at 1 and 8
    tokens): gate-up with 8 warps of 256-wide chunks at D <= 4096 (Qwen3-30B-A3B: 10.0 against 10.8 us at
    T=1, 41.8 against 45.8 at T=8; fewer warps where D / 8 < 256), 4 warps of 512 above (DeepSeek-V3: 51 us
    at T=1, 80% of copy; 8 warps 62 us); down with 32 rows a program once that leaves a wave of programs
    (DeepSeek-V3 T=1: 28.9 against 35.5 us; Qwen3 T=8: 23.8 against 32.3), else 16 (Qwen3 T=1: 8.2
    against 9.6)."""
    if hidden_size <= 4096:
        warps = 8
        while warps > 1 and hidden_size // warps < 256:
            warps //= 2
        up = dict(up_warps=warps, up_kc=256)
    else:
        up = dict(up_warps=4, up_kc=512)
    rows = 32 if num_tokens * hidden_size // 32 >= 132 else 16
    return MmaMoEConfig(**up, down_kc=256, down_rows=rows, gdown_rows=GROUPED_DOWN_ROWS, gdown_warps=GROUPED_DOWN_WARPS,
                        gdown_ahead=GROUPED_DOWN_AHEAD)  # fmt: skip


def chunk_k(k: int, group: int, most: int, spans: int = 8) -> int:
    """The largest chunk KC <= most (a power of two >= 128) that divides k, whose span KC / spans divides the
    group; 0 if none."""
    kc = most
    while kc >= 128:
        if k % kc == 0 and group % (kc // spans) == 0:
            return kc
        kc //= 2
    return 0


# fused_moe_w4 runs its int4 calls here (`takes`) from MIN_TOKENS tokens up to NARROW_MAX_PAIRS (T * top_k), and on
# wide models (D > 4096) at every count up to WIDE_MAX_PAIRS pairs, except those the GEMV-form token kernels take
# first (triton_moe_w4_gemv.takes: up to INT4_MAX_TOKENS tokens, D <= 4096). Past them, the aligned path. On the
# H200 with x on its spans (session 63), Qwen3-30B-A3B's experts at 24 tokens took 143.7 us here against the aligned
# path's 167.8, and the W4A16 step at batch 24 9.338 against 10.634 ms; at 32 tokens level (186.4 / 184.4 us; 11.512
# / 11.523 ms) (moe_w4_mma_t32_s63_h200.*, ab_pairs256_30b_w4a16_s63_h200.*). With the grouped gate-up (below;
# session 65, spans 2) 32 tokens took 148.0 / 164.9 us against the aligned path's 189.8 / 183.4 (asymmetric /
# symmetric, moe_w4_mma_grouped_spanfirst_t32_*), and the step at batch 32 9.735 against 11.645 ms
# (ab_grouped16_30b_*), so up to 256 pairs. Past 32 tokens (session 68, H200, AWQ-style g128 asymmetric;
# moe_w4_mma_t48_s68_h200.*, ab_pairs512_{30b,dsv3}_w4a16_s68_h200.*), us here against the aligned path: Qwen3-30B-A3B
# 173.5 / 198.1 / 244.6 against 196.4 / 206.0 / 209.9 at 40 / 48 / 64 tokens, its step at B=40 / 48 / 64 11.349 /
# 12.718 / 15.264 against 12.424 / 12.947 / 13.436 ms, so narrow experts up to 384 pairs; DeepSeek-V3 1531.6 /
# 1774.7 / 2155.9 against 2491.2 / 2754.6 / 3071.2, its step (3 layers) at B=48 / 64 4.741 / 5.703 against 6.727 /
# 7.560 ms, so wide ones up to 512 (64 tokens at top-8; past it not measured). With the grouped down (session 69,
# moe_w4_gdown_shape_s69_h200.*, ab_pairs512_30b_w4a16_s69_h200.*) Qwen3-30B-A3B's asymmetric experts at 48 / 64
# tokens took 166.4 / 198.8 us here against the aligned path's 202.7 / 210.2, the W4A16 step at B=56 / 64 12.065 /
# 12.970 against 13.341 / 13.586 ms, so asymmetric narrow experts up to 512 pairs; symmetric ones stayed at 384 (194.0
# against 193.6 us at 48 tokens, 243.4 against 199.4 at 64). With the compact grid and 2 spans from 40 tokens
# (session 70, moe_w4_symrule_s70_h200.*, moe_w4_compact_s70_h200.*) symmetric ones took 165.5 / 175.1 / 191.0 /
# 207.9 us against the aligned path's 185.6 / 196.0 / 198.7 / 200.4 at 40 / 48 / 56 / 64 tokens: up to 448 pairs.
# In the step (session 71, ab_symrules_30b_s71_h200.*, compressed-tensors int4 symmetric g128) B=56 12.599 against
# 12.950 ms at 384.
MIN_TOKENS = 2
NARROW_MAX_HIDDEN = 4096  # experts up to this D are narrow (Qwen3-30B-A3B), wider ones wide (DeepSeek-V3, Kimi-K2)
NARROW_MAX_PAIRS = 512  # with zero points; without, NARROW_MAX_PAIRS_SYM
NARROW_MAX_PAIRS_SYM = 448
WIDE_MAX_PAIRS = 512
# A lane loads x only on its column's span (masked 16-byte loads; kernels/gluon_w4a16_mma.py's form at one row),
# not the whole of its quarter of the chunk: False loads it all (an A/B toggle for the benches). On the H200,
# Qwen3-30B-A3B's asymmetric int4 MoE at 16 tokens took 100.5 against 115.7 us before (the x loads were 8-byte
# vectors of the whole quarter, and the x sums a second load), and the W4A16 step at batch 8 4.113 against 4.426 ms
# (moe_w4_mma_{spanx,old}_s63_h200.*, ab_{spanx,old}_30b_w4a16_s63_h200.*).
SPAN_MASKED_X = True
# The down kernel's register cap on symmetric weights (ptxas maxnreg; 0: the compiler's choice). Its 8 warps keep
# two programs an SM at 128 registers a thread; symmetric weights take 136 uncapped (Triton 3.9's ptxas), one program
# an SM. Capped, Qwen3-30B-A3B's symmetric MoE at 16 tokens took 100.4 against 111.5 us, DeepSeek-V3's 766 against
# 833; the asymmetric kernel, at 128 already, was level or slower capped (moe_w4_mma_downcap_s63_h200.*).
DOWN_MAXNREG_SYM = 128
# The gate-up kernels' register cap (ptxas maxnreg; 0: the compiler's choice; an A/B knob). Offline (Triton 3.9's
# ptxas, Qwen3-30B-A3B's config) the uncapped gate-up takes 76 registers and issues 6 of its 16 16-byte loads before
# its first mma, the rest between mmas; capped at 128 it takes 108 and issues all 16 first, but two 8-warp programs
# fit an SM instead of three. On the H200 that was slower: Qwen3-30B-A3B's MoE at 16 / 24 tokens 105.6 / 155.5 us
# against 99.4 / 142.9, the W4A16 step at B=16 7.133 against 6.808 ms (moe_w4_mma_upcap_s64_h200.*,
# ab_upcap_30b_w4a16_s64_h200.*).
UP_MAXNREG = 0
# From this many tokens the gate-up runs over groups of pairs of one expert (`gate_up_grouped`: an expert's rows
# decoded once a group, not once a pair, after one more launch that forms the groups), with `grouped_spans` spans a
# chunk (so 8 / spans pairs a group); 0: never. Its warps sum each slot's spans inside a lane quad before adding
# across warps, as the pair kernel does. H200, session 65 (benchmarks/results/*_s65_h200.*), gate-up alone at
# uniform routings, pair form against grouped (spans 2 / 4), us:
# - Qwen3-30B-A3B (moe_w4_mma_grouped_spanfirst_*), asymmetric: 37.3 against 36.4 / 34.8 at 8 tokens, 67.9 against
#   61.6 / 60.4 at 16, 98.1 against 75.3 / 79.4 at 24, 127.3 against 88.5 / 98.6 at 32; symmetric: 67.1 against
#   69.5 / 57.7 at 16, 96.2 against 87.7 / 75.1 at 24, 125.0 against 103.1 / 93.3 at 32;
# - DeepSeek-V3 (moe_w4_mma_grouped_spanfirst_dsv3_*), asymmetric: 255 against 264 / 241 at 8, 499 against
#   438 / 383 at 16, 1007 against 775 / 785 at 32; symmetric: 520 against 413 / 429 at 16, 1031 against 743 / 926
#   at 32;
# - in the W4A16 step (AWQ, asymmetric; ab_grouped_rule_*): Qwen3-30B-A3B, pair form against spans 2 / 4, B=16
#   6.830 against 6.455 / 6.422 ms, B=24 9.360 against 8.291 / 8.484, B=32 11.607 against 9.681 / 10.139, and
#   grouped from 8 tokens level at B=8 (4.047 against 4.080); DeepSeek-V3, 3 layers, spans 2, B=16 2.529 against
#   2.574, B=32 3.909 against 4.250, and from 8 tokens slower at B=8 (1.677 against 1.654, ab_grouped8_dsv3_*).
#   So 16 tokens on both widths (narrow experts from 8 since session 70, below); spans 2 but on narrow symmetric
#   experts, 4 there. Before the span-first sums (session 64) the grouped form lost on narrow experts.
GROUPED_FROM_TOKENS = 16
# Narrow experts (D <= NARROW_MAX_HIDDEN) group from this many tokens, with GROUPED_SPANS_NARROW_FEW spans below
# GROUPED_NARROW_FEW_BELOW tokens (GROUPED_NARROW_FEW_BELOW_SYM without zero points). H200, session 70, Qwen3-30B-A3B's
# MoE alone, us, grouped with 4 spans against pairs (moe_w4_small_grouped_s70_h200.*, moe_w4_rule_s70_h200.*):
# asymmetric 34.4 / 46.1 / 53.5 / 73.9 against 32.3 / 44.2 / 55.0 / 77.8 at 4 / 6 / 8 / 12 tokens (2 spans: 38.1 /
# 48.9 / 55.3 / 77.3); symmetric 34.5 / 43.7 / 51.1-51.3 / 71.2-73.4 against 32.0 / 44.5 / 54.6-55.0 / 77.8-77.9.
# Symmetric W4A16 step at B=8 (session 71, ab_symrules_30b_s71_h200.*): 4.012 against 4.083 ms from 16. Wide experts
# from 8 tokens were slower again with the down over the groups too: DeepSeek-V3 (3 layers) B=8 1.713 against 1.679
# ms (ab_wide8_dsv3_w4a16_s71_h200.*), so they keep 16.
GROUPED_FROM_TOKENS_NARROW = 8
# Where the gate-up runs over groups, the down runs over the same groups too (`down_grouped`); False: the per-token
# down kernel, every pair decoding its expert's rows (an A/B knob). H200, session 69, int4 g128 asymmetric, the whole
# MoE alone, us, grouped against per-token down (moe_w4_gdown_shape_s69_h200.*, moe_w4_gdown_dsv3_s69_h200.*):
# Qwen3-30B-A3B 91.2 / 114.6 / 130.5 / 166.4 / 198.8 against 94.0 / 122.5 / 147.8 / 198.9 / 247.0 at 16 / 24 / 32 /
# 48 / 64 tokens (symmetric 87.3 / 116.4 / 142.7 / 194.0 / 243.4 against 90.5 / 123.1 / 154.5 / 217.2 / 276.3);
# DeepSeek-V3 645.3 / 1192.9 / 1745.7 against 667.2 / 1312.7 / 2145.7 at 16 / 32 / 64. W4A16 steps, replay ms:
# Qwen3-30B-A3B B=16 / 32 / 48 6.402 / 8.791 / 11.178 against 6.482 / 9.666 / 12.765 (ab_runs_30b_w4a16_s69_h200.*),
# DeepSeek-V3 (3 layers) B=16 / 32 / 64 2.447 / 3.585 / 4.898 against 2.474 / 3.754 / 5.625 (ab_gdown_dsv3_*).
# Its program: GROUPED_DOWN_WARPS warps of GROUPED_DOWN_ROWS rows each, chunks requested ahead. 32 rows a warp against
# 16: Qwen3-30B-A3B 93.5 / 132.0 / 199.5 against 98.5 / 142.4 / 218.8 us at 16 / 32 / 64 tokens
# (moe_w4_runs_s69_h200.*); 4 warps against 2 / 8 in the first log above (2: 92.8 / 135.2 / 206.0 us at 16 / 32 / 64;
# 8: 100.5 / 146.9 / 225.2); 2 chunks ahead 168.9 against 140.6 at 32 tokens with 16 rows (185 registers;
# moe_w4_gdown_knobs_s69_h200.*).
GROUPED_DOWN = True
# The grouped kernels over a list of the groups (`group_leaders`, one more launch) where at most COMPACT_MAX_SHARE of
# the pairs can lead a group (`compact_takes`): a program per possible group instead of one per pair, most of which
# leave at once (at 64 tokens on Qwen3-30B-A3B's experts an empty grid of pair programs took 31.0 us of the gate-up's
# 128.4 and 21.1 of the down's 85.0; moe_w4_empty_grid_s69_h200.log). H200, session 70, the whole MoE alone, us,
# compact against pair programs (moe_w4_compact_s70_h200.*; bound / pairs in brackets): Qwen3-30B-A3B asymmetric,
# 2 spans, 130.8 against 130.3 at 32 tokens (0.75), 159.9 against 164.7 at 48 (0.58), 189.1 against 198.6 at 64
# (0.5); symmetric, 4 spans, 196.6 against 194.0 at 48 (0.83); with 2 spans 175.9 against 184.2 at 48 (0.58), 207.9
# against 223.8 at 64 (0.5); DeepSeek-V3 1745.7 against 1743.5 at 64 (0.75). In the W4A16 step (session 71,
# ab_leaders_30b_w4a16_s71_h200.*) a share of 0.75 was slower at B=32 (8.780 against 8.710 ms) and level at 40-64.
# The leaders listed by the grouping launch's last program out instead of group_leaders' launch (session 69's
# 480fddb) measured level there (B=48 / 64 10.868 / 12.410 against 10.863 / 12.402 ms) and was taken out.
GROUPED_COMPACT = True
COMPACT_MAX_SHARE = 0.6
GROUPED_DOWN_ROWS = 32
GROUPED_DOWN_WARPS = 4
GROUPED_DOWN_AHEAD = 1
# Spans a chunk of the grouped kernels (8 / spans pairs a group). One span (8 pairs) was slower at 32-64 tokens
# (session 71, moe_w4_onespan_s71_h200.*, us): Qwen3-30B-A3B asymmetric 186.3 / 205.9 / 218.1 against 128.9 / 160.6 /
# 188.2 at 32 / 48 / 64, DeepSeek-V3 1576 / 1937 / 2203 against 1219 / 1554 / 1835.
GROUPED_SPANS_NARROW = 2
GROUPED_SPANS_NARROW_FEW = 4
GROUPED_SPANS_WIDE = 2
# Narrow symmetric experts group by GROUPED_SPANS_NARROW spans from this many tokens (4 pairs a group, so from 48
# tokens the compact grid takes): Qwen3-30B-A3B's symmetric MoE, us, 2 spans against 4 (moe_w4_compact_s70_h200.*,
# moe_w4_symrule_s70_h200.*): 99.9 against 87.2 at 16 tokens, 142.7 against 141.2 at 32, 165.5 against 168.9 at 40
# (pair programs both), 175.1-175.9 against 193.3-194.0 at 48 and 191.0 against 217.7 at 56 (compact against pair
# programs, the rule above). Asymmetric ones from 16 (session 65's rule).
GROUPED_NARROW_FEW_BELOW = 16
GROUPED_NARROW_FEW_BELOW_SYM = 40


def takes(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int) -> bool:
    """Whether fused_moe_w4 runs this call here (the bounds above; on the H100,
    benchmarks/results/moe_w4_mma_h100.{json,log}: on Qwen3-30B-A3B's small experts the CUDA-core pair path
    was as fast at one token, 17.0-18.0 against 18.2 us; on DeepSeek-V3 this path is faster at every count
    measured, 1 to 32 tokens, 78 against 98-108 us at one, 1660 against 2148 at 32)."""
    t, d = hidden.shape
    wide = d > NARROW_MAX_HIDDEN
    most = WIDE_MAX_PAIRS if wide else NARROW_MAX_PAIRS if w13.zeros is not None else NARROW_MAX_PAIRS_SYM
    if t * top_k > most or not (wide or t >= MIN_TOKENS):
        return False
    return supported(hidden, w13, w2, top_k)


def supported(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int,
              cfg: MmaMoEConfig | None = None) -> bool:  # fmt: skip
    """Whether these kernels take the MoE: CUDA compute capability >= 8.0, bf16 / fp16 x, int4 experts,
    TOP_K a power of two <= 8, a chunk for each kernel's K (D / up_warps, I), I a multiple of up_rows / 2
    and D of down_rows, for cfg (default_config when None)."""
    if not mma_capable(hidden):
        return False
    if hidden.dtype not in MAGIC or w13.fmt != "int4" or w2.fmt != "int4":
        return False
    d, inter = w2.out_features, w2.in_features
    cfg = cfg or default_config(hidden.shape[0], d)
    return (
        top_k in (1, 2, 4, 8)
        and d % cfg.up_warps == 0
        and chunk_k(d // cfg.up_warps, w13.group_size, cfg.up_kc) > 0
        and chunk_k(inter, w2.group_size, cfg.down_kc) > 0
        and inter % (cfg.up_rows // 2) == 0
        and d % cfg.down_rows == 0
    )


def _zeros(qw: QuantizedWeight) -> torch.Tensor:
    return qw.zeros if qw.zeros is not None else qw.scales


def _up_launch(hidden: torch.Tensor, w13: QuantizedWeight, num_pairs: int, cfg: MmaMoEConfig,
               spans: int) -> tuple[torch.Tensor, tuple, dict]:  # fmt: skip
    """What both gate-up launches share, for chunks whose `spans` spans lie in the quantization groups: act
    [num_pairs, I] to fill, the arguments after the pair ids (or groups), and the launch's keywords but PDL's (each
    launch site passes `pdl_launch` itself, which tests/test_pdl.py checks)."""
    d, inter = hidden.shape[1], w13.out_features // 2
    magic, offset = MAGIC[hidden.dtype]
    ks = d // cfg.up_warps
    kc = chunk_k(ks, w13.group_size, cfg.up_kc, spans)
    assert kc, (ks, w13.group_size, spans)
    q, s = w13.qweight, w13.scales
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    tail = (magic, offset, inter, num_pairs, hidden.stride(0), q.stride(0), q.stride(1), s.stride(0), s.stride(1))
    kw = dict(HAS_ZERO=w13.zeros is not None, GROUP=w13.group_size, KC=kc, CHUNKS=ks // kc, AHEAD=cfg.up_ahead,
              ROWS=cfg.up_rows, W=cfg.up_warps, **layouts(cfg.up_warps, cfg.up_rows, kc), MASK_X=SPAN_MASKED_X,
              num_warps=cfg.up_warps, **maxnreg_option(UP_MAXNREG))  # fmt: skip
    return act, tail, kw


def gate_up(hidden: torch.Tensor, w13: QuantizedWeight, ids: torch.Tensor,
            cfg: MmaMoEConfig = MmaMoEConfig()) -> torch.Tensor:  # fmt: skip
    """[T*K, I] act = silu(gate) * up in hidden's dtype (ids [T, K] contiguous)."""
    act, tail, kw = _up_launch(hidden, w13, ids.numel(), cfg, 8)
    _gate_up_kernel[(act.numel() // (cfg.up_rows // 2),)](
        hidden, w13.qweight, w13.scales, _zeros(w13), act, ids, *tail, TOP_K=ids.shape[1], **kw,
        **pdl_launch(hidden.device),
    )
    return act


def grouped_spans(hidden: torch.Tensor, w13: QuantizedWeight) -> int:
    """Spans a chunk for the grouped gate-up at hidden's tokens and D and the weights' symmetry (the knobs read at
    call time, so the benches' A/B settings take)."""
    t, d = hidden.shape
    if d > NARROW_MAX_HIDDEN:
        return GROUPED_SPANS_WIDE
    few = GROUPED_NARROW_FEW_BELOW if w13.zeros is not None else GROUPED_NARROW_FEW_BELOW_SYM
    return GROUPED_SPANS_NARROW_FEW if t < few else GROUPED_SPANS_NARROW


def grouped_takes(hidden: torch.Tensor, w13: QuantizedWeight, cfg: MmaMoEConfig, spans: int | None = None) -> bool:
    """Whether moe_w4_mma runs this call's gate-up over groups: GROUPED_FROM_TOKENS tokens or more
    (GROUPED_FROM_TOKENS_NARROW on narrow experts), and a chunk whose spans (default grouped_spans) lie inside the
    quantization groups."""
    d = hidden.shape[1]
    spans = spans or grouped_spans(hidden, w13)
    chunk = chunk_k(d // cfg.up_warps, w13.group_size, cfg.up_kc, spans)
    least = GROUPED_FROM_TOKENS if d > NARROW_MAX_HIDDEN else GROUPED_FROM_TOKENS_NARROW
    return 0 < least <= hidden.shape[0] and chunk > 0


def group_bound(num_pairs: int, num_experts: int, p: int) -> int:
    """The most groups of up to p pairs of one expert num_pairs pairs on num_experts experts can form: every
    expert's count n_e gives ceil(n_e / p) <= floor(n_e / p) + 1 groups."""
    return min(num_pairs, num_experts + num_pairs // p)


def compact_takes(num_pairs: int, num_experts: int, p: int) -> bool:
    """Whether the grouped kernels run a program per group (from group_leaders' list, one more launch) instead of
    one per pair: GROUPED_COMPACT on, and at most COMPACT_MAX_SHARE of the pairs can lead a group."""
    return bool(GROUPED_COMPACT) and group_bound(num_pairs, num_experts, p) <= COMPACT_MAX_SHARE * num_pairs


def gate_up_grouped(hidden: torch.Tensor, w13: QuantizedWeight, ids: torch.Tensor, cfg: MmaMoEConfig = MmaMoEConfig(),
                    spans: int | None = None, groups: torch.Tensor | None = None,
                    leaders: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """gate_up's act [T*K, I] over groups of up to 8 / spans pairs of one expert (ids [T, K] contiguous; spans
    default grouped_spans; groups of 8 / spans pairs from kernels/triton_moe_groups.py, one more launch where not
    given). With leaders (group_leaders(groups)) a program per group and rows, up to group_bound groups."""
    spans = spans or grouped_spans(hidden, w13)
    act, tail, kw = _up_launch(hidden, w13, ids.numel(), cfg, spans)
    if groups is None:
        groups = group_pairs(ids, 8 // spans)
    n = ids.numel()
    bound = group_bound(n, w13.qweight.shape[0], 8 // spans) if leaders is not None else n
    magic, offset, inter, num_pairs, *strides = tail
    _grouped_gate_up_kernel[(bound * (inter // (cfg.up_rows // 2)),)](
        hidden, w13.qweight, w13.scales, _zeros(w13), act, groups, groups if leaders is None else leaders, magic,
        offset, inter, num_pairs, bound, *strides, TOP_K=ids.shape[1], S=spans, COMPACT=leaders is not None, **kw,
        **pdl_launch(hidden.device),
    )  # fmt: skip
    return act


def down(act: torch.Tensor, hidden: torch.Tensor, w2: QuantizedWeight, weights: torch.Tensor,
         ids: torch.Tensor, cfg: MmaMoEConfig = MmaMoEConfig()) -> torch.Tensor:  # fmt: skip
    """[T, D] in hidden's dtype: sum over the K slots of weights * (act @ w2[e]^T)."""
    t, d = hidden.shape
    top_k, inter = ids.shape[1], w2.in_features
    out = torch.empty(t, d, dtype=hidden.dtype, device=hidden.device)
    magic, offset = MAGIC[hidden.dtype]
    kc = chunk_k(inter, w2.group_size, cfg.down_kc)
    q, s = w2.qweight, w2.scales
    _down_kernel[(t * (d // cfg.down_rows),)](
        act, q, s, _zeros(w2), out, ids, weights, magic, offset, t,
        q.stride(0), q.stride(1), s.stride(0), s.stride(1), out.stride(0),
        HAS_ZERO=w2.zeros is not None, GROUP=w2.group_size, KC=kc, CHUNKS=inter // kc, AHEAD=cfg.down_ahead,
        ROWS=cfg.down_rows, W=top_k, **layouts(top_k, cfg.down_rows, kc), MASK_X=SPAN_MASKED_X, num_warps=top_k,
        **maxnreg_option(0 if w2.zeros is not None else DOWN_MAXNREG_SYM), **pdl_launch(hidden.device),
    )  # fmt: skip
    return out


def grouped_down_takes(hidden: torch.Tensor, w2: QuantizedWeight, cfg: MmaMoEConfig, spans: int) -> bool:
    """Whether `down_grouped` can run the down over the gate-up's groups of 8 / spans pairs: GROUPED_DOWN on, a
    chunk of I whose spans lie in the quantization groups, D a multiple of the program's rows, and a ticket counter
    for each (token, row tile) in the pool."""
    (t, d), inter, tile = hidden.shape, w2.in_features, cfg.gdown_rows * cfg.gdown_warps
    fits = d % tile == 0 and t * (d // tile) <= POOL_SIZE
    return bool(GROUPED_DOWN) and fits and chunk_k(inter, w2.group_size, cfg.down_kc, spans) > 0


def down_grouped(act: torch.Tensor, hidden: torch.Tensor, w2: QuantizedWeight, weights: torch.Tensor, ids: torch.Tensor,
                 groups: torch.Tensor, spans: int, cfg: MmaMoEConfig = MmaMoEConfig(),
                 leaders: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`down`'s out [T, D] over groups of 8 / spans pairs of one expert (groups from group_pairs(ids, 8 / spans), as
    the grouped gate-up's): each group's rows decoded once, the pairs' weighted partials added per token by the last
    of its pairs in (ticket counters); with leaders, a program per group and row tile. Runs `down` instead while a
    CUDA graph is captured before the counters exist."""
    t, d = hidden.shape
    top_k, inter = ids.shape[1], w2.in_features
    tile = cfg.gdown_rows * cfg.gdown_warps
    counters = ticket_counters(hidden.device, "moe_w4_grouped_down", t * (d // tile))
    if counters is None:
        return down(act, hidden, w2, weights, ids, cfg)
    out = torch.empty(t, d, dtype=hidden.dtype, device=hidden.device)
    part = torch.empty(t * top_k, d, dtype=torch.float32, device=hidden.device)
    magic, offset = MAGIC[hidden.dtype]
    kc = chunk_k(inter, w2.group_size, cfg.down_kc, spans)
    q, s = w2.qweight, w2.scales
    bound = group_bound(t * top_k, q.shape[0], 8 // spans) if leaders is not None else t * top_k
    _grouped_down_kernel[(bound * (d // tile),)](
        act, q, s, _zeros(w2), out, part, counters, groups, groups if leaders is None else leaders, weights, magic,
        offset, d, t * top_k, bound, q.stride(0), q.stride(1), s.stride(0), s.stride(1), out.stride(0),
        HAS_ZERO=w2.zeros is not None, GROUP=w2.group_size, TOP_K=top_k, KC=kc, CHUNKS=inter // kc,
        AHEAD=cfg.gdown_ahead, S=spans, ROWS=cfg.gdown_rows, W=cfg.gdown_warps, COMPACT=leaders is not None,
        **layouts(cfg.gdown_warps, cfg.gdown_rows, kc), MASK_X=SPAN_MASKED_X, num_warps=cfg.gdown_warps,
        **pdl_launch(hidden.device),
    )  # fmt: skip
    return out


def moe_w4_mma(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor,
               topk_ids: torch.Tensor, cfg: MmaMoEConfig | None = None) -> torch.Tensor:  # fmt: skip
    """fused_moe_w4's pair path on this module's kernels; weights [T*K] float32, topk_ids [T, K]. The gate-up runs
    over groups of pairs where `grouped_takes`, and the down over the same groups where `grouped_down_takes`."""
    ids = topk_ids.contiguous()
    cfg = cfg or default_config(hidden.shape[0], hidden.shape[1])
    spans = grouped_spans(hidden, w13)
    if not grouped_takes(hidden, w13, cfg, spans):
        return down(gate_up(hidden, w13, ids, cfg), hidden, w2, weights, ids, cfg)
    groups = group_pairs(ids, 8 // spans)
    leaders = group_leaders(groups) if compact_takes(ids.numel(), w13.qweight.shape[0], 8 // spans) else None
    act = gate_up_grouped(hidden, w13, ids, cfg, spans, groups, leaders)
    if grouped_down_takes(hidden, w2, cfg, spans):
        return down_grouped(act, hidden, w2, weights, ids, groups, spans, cfg, leaders)
    return down(act, hidden, w2, weights, ids, cfg)
