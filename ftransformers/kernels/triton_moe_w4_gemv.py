"""A few tokens' 4-bit MoE as two GEMV-form kernels (the layout of triton_w4a16's `_w4a16_gemv_kernel`).

The pair path of kernels/triton_fused_moe_w4.py spreads a quantization group over four lanes, decodes each
nibble with a shift and a mask, and moves x from its load layout to the weights' through shared memory
(16 barriers a K tile). Here, as in the dense one-row GEMV, tensors are [word, row, nibble]: lanes and
warps run along the words of a K tile only, each thread holds all rows of its word column, so the 16-byte
vector of x for a word, the word itself and its rows' scales meet in one register layout; a nibble is
masked in place and read as a float32 subnormal (code * 16^e * 2^-149) against x * 2^(100 - 4e), one LOP3
and one FMA a weight; rows are summed over the words once, at the end.

- `_token_gate_up_kernel`, grid (I / BLOCK_N, T * TOP_K): program (row block, pair) forms its rows of gate and
  up for expert ids[pair] on token pair // TOP_K and stores act[pair, n] = silu(gate) * up rounded to hidden's
  dtype ([T * TOP_K, I]).
- `_token_down_kernel`, grid (D / BLOCK_N, T): the word axis runs over (slot, word of I) pairs, SLOTS slots
  a tile (a power of two dividing top-k), so one program sums all TOP_K slots of its D rows: each lane's
  slot is fixed, its partial is scaled by that slot's routing weight, and the lanes are summed at the end
  (no partials, no tickets).

FP4 experts (mxfp4, nvfp4; FMT 1 / 2) run the same kernels: nibble j shifted to bits 31..28, arithmetic-shifted
right by 6 and masked is the float32 e2m1 * 2^-126 (as in triton_w4a16's GEMV: three integer ops and one FMA a
weight), against x * 2^77, so that the products carry int4's 2^-49; the group scale is decoded from its E8M0 /
E4M3 byte (times the row's global scale for nvfp4), and there is no zero term.

int4 with 16-bit or float32 scales, zeros present or not (symmetric: 8), bf16 / fp16 x. Up to MAX_TOKENS tokens, each
its own pairs (the kernels read each pair's expert rows, no sharing between tokens that pick the same expert):
`takes` sends int4 up to INT4_MAX_TOKENS here (more runs gluon_moe_w4_mma), and FP4 up to FP4_MAX_TOKENS
(FP4_WIDE_MAX_TOKENS at DeepSeek-V3 width).
Invariants (as the dense GEMV): |x| < 2^28, int4 scales < 2^100, FP4 scales < 2^64. Graph-safe: no host syncs.

Measured and dropped (session 34, commit e19ec29, docs/performance.md): both kernels as one persistent launch, one
8-warp program an SM copying all of its expert bytes into shared memory at once, with a grid barrier before the
down rows. Correct, but it took 25-27 us against these kernels' 13.4 at one Qwen3-30B-A3B token, and 20 us with no
copies at all. Two warps a scheduler could not hide the nibble arithmetic's latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.quant_formats import FOUR_BIT_FORMATS, QuantizedWeight
from ftransformers.kernels.triton_fused_moe_codes import to_16bit
from ftransformers.kernels.triton_w4a16 import _FMT_ID, _TWO_49, _TWO_M49, _e2m1_top, _scale_f32, gemv_words
from ftransformers.kernels.w4_tiles import masked_load

# fused_moe_w4 takes a few int4 tokens' MoE here (where the CUDA-core pair path or the mma path took it before);
# `set=triton_moe_w4_gemv.ENABLED=0` in benchmarks/ab_decode.py restores the pair path for an A/B.
ENABLED = True
# FP4 experts (mxfp4, nvfp4) take it too (`set=triton_moe_w4_gemv.FP4=0` sends them to the pair path, for an A/B)
FP4 = True
MAX_HIDDEN = 4096  # wider int4 experts (DeepSeek-V3) go to the mma path at any count (gluon_moe_w4_mma.takes)
MAX_TOKENS = 64  # moe_w4_token's bound: every pair reads its expert's rows, so many tokens belong to the aligned path
# int4 experts come here up to this many tokens (fused_moe_w4 asks `takes` before the mma path's), then go to
# gluon_moe_w4_mma. On the H100 (Qwen3-30B-A3B AWQ experts, alone) these kernels took 22.8-23.2 us at two tokens
# against the mma path's 25.2-25.6, and 41.1 against 39.3 at four (benchmarks/results/w4_tokens_paths{,2}_qwen_h100.log);
# the W4A16 step at batch 2 went from 2.579 to 2.494 ms, the MoE's critical path from 1152 to 1066 us, batch 1
# unchanged (ab_int4two2_30b_w4a16_h100.*). Since the mma path loads x on its spans only (session 63, H200), it
# takes two tokens: 20.8 against 21.8 us alone, asymmetric (w4_tokens_spanx_s63_h200.*), and the W4A16 step at
# batch 2 went from 2.191 to 2.135 ms (ab_spanx_30b_w4a16_s63_h200.*); one token stays here (12.3 against 14.7 us).
INT4_MAX_TOKENS = 1
# FP4 experts, which have no mma path, come here up to FP4_MAX_TOKENS tokens (FP4_WIDE_MAX_TOKENS where D >
# MAX_HIDDEN) and D <= FP4_MAX_HIDDEN. On the H100 (w4_tokens_paths{,2}_{qwen,dsv3}_h100.log) these kernels beat
# the pair path at 1-64 tokens, mxfp4 and nvfp4. Against the aligned path (fused_moe_w4's choice from 17 tokens):
# on Qwen3-30B-A3B's experts faster at 24 and 32 tokens (mxfp4 302 against 350 us at 32, nvfp4 340 against 344)
# and slower from 48 (mxfp4 450 against 379); on DeepSeek-V3's faster up to 64 (mxfp4 4947 against 5806 us at 64,
# 2480 against 4281 at 32). The Qwen3-30B-A3B step went from 12.382 to 10.790 ms at batch 16 and 20.055 to
# 18.317 at 32 for MXFP4 (NVFP4 13.439 -> 11.505, 20.455 -> 20.144; ab_fp4many_30b_{mxfp4,nvfp4}_h100.log)
FP4_MAX_TOKENS = 32
FP4_WIDE_MAX_TOKENS = 64
FP4_MAX_HIDDEN = 7168

_TWO_100: tl.constexpr = tl.constexpr(2.0**100)
_TWO_96: tl.constexpr = tl.constexpr(2.0**96)
_TWO_92: tl.constexpr = tl.constexpr(2.0**92)
_TWO_88: tl.constexpr = tl.constexpr(2.0**88)
_TWO_84: tl.constexpr = tl.constexpr(2.0**84)
_TWO_77: tl.constexpr = tl.constexpr(2.0**77)


@dataclass(frozen=True)
class TokenGemvConfig:
    """Rows a program and K tile (elements) of each kernel; down_slots slots share a down tile's word axis;
    *_words: int4 words a lane loads at once for each row (1, or 2 as one 8-byte load where the layout allows,
    see triton_w4a16.gemv_words)."""

    up_n: int = 4
    up_k: int = 1024
    up_warps: int = 2
    down_n: int = 8
    down_k: int = 256
    down_slots: int = 8
    down_warps: int = 8
    up_words: int = 2
    down_words: int = 1


# The tiles moe_w4_token runs without a config (module names so that benchmarks/ab_decode.py's `set=` can
# change them in a whole model): TokenGemvConfig's defaults, for experts with and without zero points. From the
# H100 runs on Qwen3-30B-A3B's experts (benchmarks/results/ab_words{2,3}_30b_w4a16_h100.*, w4_b1_words_h100.*):
# gate-up on two words a lane, 4 rows, 1024-wide K tiles over 2 warps (80 registers, 12 programs an SM) took
# 367.6 us a step on the critical path against 445.6 for one word, 8 rows, 512 over 2 warps (168 registers, 6);
# alone 14.7 / 14.9 us (asym / sym) against 16.1 / 15.9. The down kernel read slower on two words at every tile
# tried (17.0-22.9 us alone against 16.1), so it keeps one; with its first K tile read before the PDL wait
# (DOWN_PRELOAD), 8 rows a program (117 registers, 256 programs in one wave) step 1.840 / 1.842 ms against
# 1.853 / 1.874 at 4 rows (ab_dpre{,2}_30b_w4a16_h100.*).
# On the H200 these tiles held (session 71, the W4A16 step at B=1, replay ms, ab_gemv_tiles_30b_w4a16_s71_h200.*):
# 1.567 against 1.614 / 1.603 with gate-up rows 8 / 2, 1.644 on 1 warp of 512-wide tiles, 1.581 with down rows 4,
# 1.600 with the down on 4 warps of two words a lane.
UP_N, UP_K, UP_WARPS, UP_WORDS = (
    TokenGemvConfig.up_n,
    TokenGemvConfig.up_k,
    TokenGemvConfig.up_warps,
    TokenGemvConfig.up_words,
)
DOWN_N, DOWN_K, DOWN_SLOTS, DOWN_WARPS = (TokenGemvConfig.down_n, TokenGemvConfig.down_k, TokenGemvConfig.down_slots,
                                          TokenGemvConfig.down_warps)  # fmt: skip
DOWN_WORDS = TokenGemvConfig.down_words
# moe_w4_token's down kernel reads the routing and its first K tile before the PDL wait (token_down's preload)
DOWN_PRELOAD = True


def default_config() -> TokenGemvConfig:
    """The tiles moe_w4_token runs without a config (the module's names, which `set=` may have changed)."""
    return TokenGemvConfig(UP_N, UP_K, UP_WARPS, DOWN_N, DOWN_K, DOWN_SLOTS, DOWN_WARPS, UP_WORDS, DOWN_WORDS)


@triton.jit
def _x_planes(x, FMT: tl.constexpr):
    # x [BW, 8] float32 (8 in-thread) -> (x_0..x_7 [BW, 1], each times 2^(100 - 4e_j), sum_j x_j * 2^-49):
    # nibble j is bits 4e_j.. of q (e_j = j, j < 5) or of q >> 12 (e_j = j - 3, j >= 5). FP4: each times 2^77
    # (against e2m1 * 2^-126), and a zero sum (no zero point).
    bw: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, [bw, 4, 2]))  # j = 0 2 4 6 / 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, [bw, 2, 2]))
    o15, o37 = tl.split(tl.reshape(odd, [bw, 2, 2]))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    if FMT == 0:
        xsum = ((((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))) * _TWO_M49)[:, None]
        xm = ((x0 * _TWO_100)[:, None], (x1 * _TWO_96)[:, None], (x2 * _TWO_92)[:, None], (x3 * _TWO_88)[:, None],
              (x4 * _TWO_84)[:, None], (x5 * _TWO_92)[:, None], (x6 * _TWO_88)[:, None],
              (x7 * _TWO_84)[:, None])  # fmt: skip
    else:
        xsum = tl.zeros_like(x0)[:, None]
        xm = ((x0 * _TWO_77)[:, None], (x1 * _TWO_77)[:, None], (x2 * _TWO_77)[:, None], (x3 * _TWO_77)[:, None],
              (x4 * _TWO_77)[:, None], (x5 * _TWO_77)[:, None], (x6 * _TWO_77)[:, None],
              (x7 * _TWO_77)[:, None])  # fmt: skip
    return xm, xsum


@triton.jit
def _tile_x(
    x_ptrs, k0, w2, n2, N, K, GROUP: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr, FMT: tl.constexpr = 0
):
    # One K tile from k0: _x_planes of the activations of each of an element's WORDS words (x_ptrs [BW, 8] at
    # an element's first word), each element's group [BW, 1] and the elements' mask [BW, BN] (elements past
    # K, rows past N; the masks are not applied when EVEN). An element's words share one group.
    mask_x = k0 // (8 * WORDS) + w2 < K // (8 * WORDS)
    xa, xsum = _x_planes(masked_load(x_ptrs + k0, mask_x, EVEN).to(tl.float32), FMT)
    xb = xa
    if WORDS == 2:
        xb, xsum_b = _x_planes(masked_load(x_ptrs + k0 + 8, mask_x, EVEN).to(tl.float32), FMT)
        xsum += xsum_b
    return xa, xb, xsum, (k0 + w2 * (8 * WORDS)) // GROUP, (n2 < N) & mask_x


@triton.jit
def _nibble_dot(q, xm):
    # sum_j nibble_j(q) x_j 2^-49 for int32 words q: a nibble masked in place, read as float32, is the
    # subnormal code * 16^e * 2^-149, one LOP3 and one FMA a weight.
    h = q >> 12
    t = (q & 0xF).to(tl.float32, bitcast=True) * xm[0]
    t += (q & 0xF0).to(tl.float32, bitcast=True) * xm[1]
    t += (q & 0xF00).to(tl.float32, bitcast=True) * xm[2]
    t += (q & 0xF000).to(tl.float32, bitcast=True) * xm[3]
    t += (q & 0xF0000).to(tl.float32, bitcast=True) * xm[4]
    t += (h & 0xF00).to(tl.float32, bitcast=True) * xm[5]
    t += (h & 0xF000).to(tl.float32, bitcast=True) * xm[6]
    t += (h & 0xF0000).to(tl.float32, bitcast=True) * xm[7]
    return t


@triton.jit
def _e2m1(q, J: tl.constexpr):
    # nibble J of int32 words q as float32 e2m1 * 2^-126 (moved to bits 31..28 for triton_w4a16._e2m1_top)
    if J < 7:
        q = q << (28 - 4 * J)
    return _e2m1_top(q)


@triton.jit
def _e2m1_dot(q, xm):
    # sum_j e2m1_j(q) x_j 2^-49 for int32 words q and x planes times 2^77
    t = _e2m1(q, 0) * xm[0]
    t += _e2m1(q, 1) * xm[1]
    t += _e2m1(q, 2) * xm[2]
    t += _e2m1(q, 3) * xm[3]
    t += _e2m1(q, 4) * xm[4]
    t += _e2m1(q, 5) * xm[5]
    t += _e2m1(q, 6) * xm[6]
    t += _e2m1(q, 7) * xm[7]
    return t


@triton.jit
def _codes_dot(q, xm, FMT: tl.constexpr):
    if FMT == 0:
        return _nibble_dot(q, xm)
    return _e2m1_dot(q, xm)


@triton.jit
def _scaled_dot(q, xa, xb, xsum, scale, zero, WORDS: tl.constexpr, FMT: tl.constexpr = 0):
    # q [BW, BN] elements (int32 words, or int64 pairs of words when WORDS == 2), xa / xb / xsum from _tile_x,
    # float32 scale and zero [BW, BN] -> [BW, BN] 2^-49 * scale * sum_j (code_j - zero) x_j over the element
    # (FP4: 2^-49 * scale * sum_j e2m1_j x_j; zero unused).
    if WORDS == 2:
        t = _codes_dot(q.to(tl.int32), xa, FMT) + _codes_dot((q >> 32).to(tl.int32), xb, FMT)
    else:
        t = _codes_dot(q, xa, FMT)
    if FMT == 0:
        return scale * t - (scale * zero) * xsum
    return scale * t


@triton.jit
def _word_dot(q, xa, xb, xsum, s_ptrs, z_ptrs, grp, mask, HAS_ZEROS: tl.constexpr, EVEN: tl.constexpr,
              WORDS: tl.constexpr, FMT: tl.constexpr = 0):  # fmt: skip
    # _scaled_dot with the elements' scales (and zeros; symmetric: 8) loaded from their rows at group grp: int4 any
    # float dtype, mxfp4 E8M0 bytes, nvfp4 E4M3 bytes (its rows' global scales are applied by the kernels, once)
    scale = _scale_f32(masked_load(s_ptrs + grp, mask, EVEN), FMT)
    if HAS_ZEROS:
        zero = masked_load(z_ptrs + grp, mask, EVEN).to(tl.float32)
    else:
        zero = 8.0
    return _scaled_dot(q, xa, xb, xsum, scale, zero, WORDS, FMT)


@triton.jit
def _down_tiles(part, a_ptrs, q_ptrs, s_ptrs, z_ptrs, k_start, w2, n2, N, K, GROUP: tl.constexpr,
                HAS_ZEROS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr,
                FMT: tl.constexpr = 0):  # fmt: skip
    # part + the down kernel's K tiles from k_start for one slot group (pointers as in _token_down_kernel)
    for k0 in range(k_start, K, BLOCK_K):
        xa, xb, xsum, grp, mask_q = _tile_x(a_ptrs, k0, w2, n2, N, K, GROUP, EVEN, WORDS, FMT)
        q = masked_load(q_ptrs + k0 // (8 * WORDS), mask_q, EVEN)
        part += _word_dot(q, xa, xb, xsum, s_ptrs, z_ptrs, grp, mask_q, HAS_ZEROS, EVEN, WORDS, FMT)
    return part


@cached_launch
@triton.jit(do_not_specialize=["unit"])
def _token_gate_up_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, act_ptr, ids_ptr, N, K, unit,
    stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn, stride_ge, stride_x,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, WORDS: tl.constexpr = 1, FMT: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # act[p, n] = silu(x[t] @ w13[e, n]) * (x[t] @ w13[e, N + n]), e = ids[p], t = p // TOP_K (x's rows stride_x
    # apart), n < N = I, rounded to x's
    # dtype. `unit` (== 1, never specialized) hides q's contiguity so its load takes x's layout. WORDS == 2:
    # q is the int64 view of the words (strides in int64 elements), one 8-byte element a lane and row.
    # FMT 2 (nvfp4): gs_ptr is the experts' global scales [E, 2N] (row stride stride_ge).
    pdl_enter(USE_PDL)
    BW: tl.constexpr = BLOCK_K // (8 * WORDS)
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w2 = tl.arange(0, BW)[:, None]  # [BW, 1]
    n2 = offs_n[None, :]  # [1, BN]
    qg_ptrs = q_ptr + expert * stride_qe + n2 * stride_qn + w2 * unit  # [BW, BN]
    sg_ptrs = s_ptr + expert * stride_se + n2 * stride_sn
    zg_ptrs = z_ptr + expert * stride_ze + n2 * stride_zn
    x_ptrs = x_ptr + (pair // TOP_K) * stride_x + w2 * (8 * WORDS) + tl.arange(0, 8)[None, :]  # [BW, 8]
    if FMT == 2:  # the rows' global scales, issued ahead of the loop, applied after it
        gs_g = masked_load(gs_ptr + expert * stride_ge + offs_n, offs_n < N, EVEN)
        gs_u = masked_load(gs_ptr + expert * stride_ge + N + offs_n, offs_n < N, EVEN)
    acc_g = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xa, xb, xsum, grp, mask_q = _tile_x(x_ptrs, k0, w2, n2, N, K, GROUP, EVEN, WORDS, FMT)
        qg = masked_load(qg_ptrs + k0 // (8 * WORDS), mask_q, EVEN)
        qu = masked_load(qg_ptrs + N * stride_qn + k0 // (8 * WORDS), mask_q, EVEN)
        acc_g += _word_dot(qg, xa, xb, xsum, sg_ptrs, zg_ptrs, grp, mask_q, HAS_ZEROS, EVEN, WORDS, FMT)
        acc_u += _word_dot(qu, xa, xb, xsum, sg_ptrs + N * stride_sn, zg_ptrs + N * stride_zn, grp, mask_q,
                           HAS_ZEROS, EVEN, WORDS, FMT)  # fmt: skip
    gate = tl.sum(acc_g, axis=0) * _TWO_49  # [BN]
    up = tl.sum(acc_u, axis=0) * _TWO_49
    if FMT == 2:
        gate *= gs_g
        up *= gs_u
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair * N + offs_n, to_16bit(act, act_ptr.dtype.element_ty), mask=offs_n < N)


@cached_launch
@triton.jit(do_not_specialize=["unit"])
def _token_down_kernel(
    act_ptr, q_ptr, s_ptr, z_ptr, gs_ptr, out_ptr, ids_ptr, tw_ptr, N, K, unit,
    stride_qe, stride_qn, stride_se, stride_sn, stride_ze, stride_zn, stride_ge, stride_o,
    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr = 1,
    PRELOAD: tl.constexpr = False, FMT: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    # out[t, n] = sum_k tw[t, k] * (act[t K + k] @ w2[ids[t, k], n]), n < N = D, over K = I, t = program_id(1);
    # float32 until the store.
    # Word axis c = (slot - s0) * WI + element: lane c reads slot s0 + c // WI of each slot group s0. WORDS as
    # in the gate-up kernel. PRELOAD (one slot group, SLOTS == TOP_K): the routing (ids, tw) and the first K
    # tile's words, scales and zeros are loaded before the PDL wait. Only act comes from the predecessor
    # (the gate-up kernel, which read the same routing after its own wait), so those were written before it.
    # FMT 2 (nvfp4): gs_ptr is the experts' global scales [E, N] (row stride stride_ge), applied with the lane's
    # slot weight.
    WI: tl.constexpr = BLOCK_K // (8 * WORDS)
    BW: tl.constexpr = SLOTS * WI
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    ids_ptr += tok * TOP_K  # this token's routing, act rows and output row
    tw_ptr += tok * TOP_K
    act_ptr += tok * TOP_K * K
    out_ptr += tok * stride_o
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c2 = tl.arange(0, BW)[:, None]  # [BW, 1]
    w2 = c2 % WI
    n2 = offs_n[None, :]  # [1, BN]
    if PRELOAD:
        slot2 = c2 // WI  # [BW, 1]
        expert = tl.load(ids_ptr + slot2).to(tl.int64)
        tw = tl.load(tw_ptr + slot2)
        q_ptrs = q_ptr + expert * stride_qe + n2 * stride_qn + w2 * unit  # [BW, BN]
        s_ptrs = s_ptr + expert * stride_se + n2 * stride_sn
        z_ptrs = z_ptr + expert * stride_ze + n2 * stride_zn
        mask0 = (n2 < N) & (w2 < K // (8 * WORDS))
        grp0 = w2 * (8 * WORDS) // GROUP
        q0 = tl.load(q_ptrs, mask=mask0, other=0)
        s_raw0 = tl.load(s_ptrs + grp0, mask=mask0, other=0)  # decoded after the wait
        if FMT == 2:
            tw = tw * tl.load(gs_ptr + expert * stride_ge + n2, mask=n2 < N, other=0.0)  # [BW, BN]
        if HAS_ZEROS:
            zero0 = tl.load(z_ptrs + grp0, mask=mask0, other=0).to(tl.float32)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BW, BLOCK_N], dtype=tl.float32)
    if PRELOAD:
        if not HAS_ZEROS:
            zero0 = 8.0
        scale0 = _scale_f32(s_raw0, FMT)
        a_ptrs = act_ptr + slot2 * K + w2 * (8 * WORDS) + tl.arange(0, 8)[None, :]  # [BW, 8]
        xa, xb, xsum, _, _ = _tile_x(a_ptrs, 0, w2, n2, N, K, GROUP, EVEN, WORDS, FMT)
        part = _scaled_dot(q0, xa, xb, xsum, scale0, zero0, WORDS, FMT)
        part = _down_tiles(part, a_ptrs, q_ptrs, s_ptrs, z_ptrs, BLOCK_K, w2, n2, N, K, GROUP, HAS_ZEROS, BLOCK_K,
                           EVEN, WORDS, FMT)  # fmt: skip
        acc += part * tw  # the lane's slot weight (times its row's global scale)
    else:
        for s0 in range(0, TOP_K, SLOTS):
            slot2 = s0 + c2 // WI  # [BW, 1]
            expert = tl.load(ids_ptr + slot2).to(tl.int64)
            q_ptrs = q_ptr + expert * stride_qe + n2 * stride_qn + w2 * unit  # [BW, BN]
            s_ptrs = s_ptr + expert * stride_se + n2 * stride_sn
            z_ptrs = z_ptr + expert * stride_ze + n2 * stride_zn
            a_ptrs = act_ptr + slot2 * K + w2 * (8 * WORDS) + tl.arange(0, 8)[None, :]  # [BW, 8]
            tw = tl.load(tw_ptr + slot2)  # the lane's slot weight
            if FMT == 2:
                tw = tw * masked_load(gs_ptr + expert * stride_ge + n2, n2 < N, EVEN)  # times its rows' global scales
            part = _down_tiles(tl.zeros([BW, BLOCK_N], dtype=tl.float32), a_ptrs, q_ptrs, s_ptrs, z_ptrs, 0, w2, n2,
                               N, K, GROUP, HAS_ZEROS, BLOCK_K, EVEN, WORDS, FMT)  # fmt: skip
            acc += part * tw
    out = tl.sum(acc, axis=0) * _TWO_49  # [BN]
    tl.store(out_ptr + offs_n, to_16bit(out, out_ptr.dtype.element_ty), mask=offs_n < N)


def takes(hidden: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, top_k: int) -> bool:
    """Whether fused_moe_w4 runs this call here: experts of one format; int4 up to INT4_MAX_TOKENS tokens with
    D <= MAX_HIDDEN, FP4 (while FP4 is on) up to FP4_MAX_TOKENS tokens (FP4_WIDE_MAX_TOKENS where D > MAX_HIDDEN)
    with D <= FP4_MAX_HIDDEN."""
    if not ENABLED or w13.fmt != w2.fmt or hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    t, d = hidden.shape
    if w13.fmt == "int4":
        return 1 <= t <= INT4_MAX_TOKENS and d <= MAX_HIDDEN
    most = FP4_WIDE_MAX_TOKENS if d > MAX_HIDDEN else FP4_MAX_TOKENS
    return FP4 and w13.fmt in FOUR_BIT_FORMATS and 1 <= t <= most and d <= FP4_MAX_HIDDEN


def _weight_args(qw: QuantizedWeight, words: int) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The kernels' (scales, zeros, global scales) tensors, absent ones standing in as the scales (never read),
    and the strides after qweight's (in the kernel's elements, words int32 words each)."""
    s = qw.scales.view(torch.uint8) if qw.fmt == "nvfp4" else qw.scales
    z = qw.zeros if qw.zeros is not None else s
    gs = qw.global_scale if qw.fmt == "nvfp4" else None
    if gs is not None and (gs.dtype != torch.float32 or gs.dim() != 2 or gs.stride(1) != 1):
        raise ValueError(f"moe_w4_token: nvfp4 global_scale must be float32 [E, N], unit stride; got {gs.dtype} "
                         f"{tuple(gs.shape)} strides {gs.stride()}")  # fmt: skip
    g = gs if gs is not None else s
    strides = (qw.qweight.stride(0) // words, qw.qweight.stride(1) // words, s.stride(0), s.stride(1), z.stride(0),
               z.stride(1), g.stride(0))  # fmt: skip
    return (s, z, g), strides


def token_gate_up(hidden: torch.Tensor, w13: QuantizedWeight, ids: torch.Tensor, cfg: TokenGemvConfig,
                  act: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The first kernel: act [T * K, I] in hidden's dtype (into `act` when given), for hidden [T, D] (unit stride
    along D) and ids [T, K] contiguous."""
    (t, d), top_k, inter = hidden.shape, ids.shape[1], w13.out_features // 2
    if act is None:
        act = torch.empty(t * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    up_k = min(cfg.up_k, next_pow2(d))
    q, words = gemv_words(w13, cfg.up_words, up_k)
    tensors, strides = _weight_args(w13, words)
    _token_gate_up_kernel[(cdiv(inter, cfg.up_n), t * top_k)](
        hidden, q, *tensors, act, ids, inter, d, 1, *strides, hidden.stride(0),
        TOP_K=top_k, GROUP=w13.group_size, HAS_ZEROS=w13.zeros is not None, BLOCK_N=cfg.up_n, BLOCK_K=up_k,
        EVEN=d % up_k == 0 and inter % cfg.up_n == 0, WORDS=words, FMT=_FMT_ID[w13.fmt], num_warps=cfg.up_warps,
        **pdl_launch(hidden.device),
    )  # fmt: skip
    return act


def token_down(act: torch.Tensor, w2: QuantizedWeight, weights: torch.Tensor, ids: torch.Tensor,
               cfg: TokenGemvConfig, out: torch.Tensor | None = None, preload: bool = False) -> torch.Tensor:  # fmt: skip
    """The second kernel: [T, D] in act's dtype (into `out` when given, rows unit stride along D), for act
    [T * K, I], weights [T * K] and ids [T, K] contiguous. preload: the routing and first K tile are read before
    the PDL wait, so weights and ids must not come from the kernel launched just before this one (moe_w4_token's
    gate-up read them after its own wait, so after its call they qualify)."""
    d, inter, (t, top_k) = w2.out_features, w2.in_features, ids.shape
    if cfg.down_slots < 1 or cfg.down_slots & (cfg.down_slots - 1):
        raise ValueError(f"moe_w4_token: down_slots must be a power of two, got {cfg.down_slots}")
    slots = min(cfg.down_slots, top_k & -top_k)  # a power of two dividing top-k
    if out is None:
        out = torch.empty(t, d, dtype=act.dtype, device=act.device)
    down_k = min(cfg.down_k, next_pow2(inter))
    q, words = gemv_words(w2, cfg.down_words, down_k)
    tensors, strides = _weight_args(w2, words)
    _token_down_kernel[(cdiv(d, cfg.down_n), t)](
        act, q, *tensors, out, ids, weights, d, inter, 1, *strides, out.stride(0),
        GROUP=w2.group_size, HAS_ZEROS=w2.zeros is not None, TOP_K=top_k, SLOTS=slots, BLOCK_N=cfg.down_n,
        BLOCK_K=down_k, EVEN=inter % down_k == 0 and d % cfg.down_n == 0, WORDS=words, PRELOAD=preload and slots == top_k,
        FMT=_FMT_ID[w2.fmt], num_warps=cfg.down_warps, **pdl_launch(act.device),
    )  # fmt: skip
    return out


def moe_w4_token(
    hidden: torch.Tensor,  # [T, D] bf16 / fp16, unit stride along D
    w13: QuantizedWeight,  # int4 / mxfp4 / nvfp4 [E, 2I, D]
    w2: QuantizedWeight,  # the same format [E, D, I]
    weights: torch.Tensor,  # [T * K] float32 contiguous
    ids: torch.Tensor,  # [T, K] int
    cfg: TokenGemvConfig | None = None,
) -> torch.Tensor:  # [T, D] hidden.dtype
    """quant_moe_ref's function for 1 to MAX_TOKENS tokens, in the two kernels above."""
    t = hidden.shape[0]
    if not 1 <= t <= MAX_TOKENS or w13.fmt != w2.fmt or w13.fmt not in FOUR_BIT_FORMATS:
        raise ValueError(f"moe_w4_token: 1 to {MAX_TOKENS} tokens of 4-bit experts in one format "
                         f"({', '.join(FOUR_BIT_FORMATS)}), got {t} tokens, experts {w13.fmt} / {w2.fmt}")  # fmt: skip
    cfg = cfg or default_config()
    ids = ids.contiguous()
    return token_down(token_gate_up(hidden, w13, ids, cfg), w2, weights, ids, cfg, preload=DOWN_PRELOAD)
