"""The int4 MoE kernels on mma.sync, in Gluon, that kernels/gluon_moe_w4_mma.py configures and launches (its
docstring: the contract, why mma.sync, and the eight spans of a pair's token); the register layouts, the LOP3
decode and a chunk's scaled sum are kernels/gluon_w4_mma_tiles.py's.

Gate-up (`_gate_up_kernel`): program (pair, 8 rows of I), W warps each over D / W of K in chunks; rows
0..7 of a warp's A are gate rows, 8..15 the matching up rows (so one thread holds both); the warps'
float32 sums are added in shared memory (gl.sum over axis 0); act = silu(gate) * up, rounded to x's
dtype, is stored [pairs, I].
Down (`_down_kernel`): program (token, 16 rows of D), warp w = slot w (W = TOP_K), over all of I in
chunks; out = sum_w weight_w * y_w, rounded once.
Both loop over chunks with the next AHEAD chunks' words and x requested before a chunk's mmas.
Grouped gate-up (`_grouped_gate_up_kernel`, from GROUPED_FROM_TOKENS tokens): the same act, a program
per (pair, rows) running the group of up to 8 / S pairs of one expert its pair leads (kernels/triton_moe_groups.py,
one launch before it) with columns (pair, span), S spans a chunk; programs of pairs that lead no group leave at once.
Grouped down (`_grouped_down_kernel`, with the grouped gate-up, GROUPED_DOWN): the same out over the same groups,
program (pair, W x ROWS rows of D), each warp its own rows over all of I; each pair's weighted float32 rows go to a
[pairs, D] scratch, and the last of a token's TOP_K pairs in (a ticket counter per token and row tile,
kernels/tickets.py's protocol) adds them in slot order and stores out. So an expert's down rows are decoded once a
group, not once a pair (the per-token down decodes them once a pair: 4 times at 64 tokens on 128 experts).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ftransformers.kernels.gluon_mla_decode import _cta_barrier, pdl_enter
from ftransformers.kernels.gluon_w4_mma_tiles import _chunk, _load_x, word_offsets
from ftransformers.kernels.launch import cached_launch


@gluon.jit
def _offsets(w_l: gl.constexpr, x_l: gl.constexpr, mma: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr,
             RW: gl.constexpr, S: gl.constexpr = 8):  # fmt: skip
    # Index tensors of one chunk: words ([W,1,1,1] warp, [1,ROWS,1,1] row, [1,1,4,RW] word RW t + r), x [W, 8, KC]
    # ([W,1,1] warp, [1,8,1] column, [1,1,KC] element) with the mask of each column's span (column c holds memory
    # elements [(c % S) KC / S, (c % S + 1) KC / S): runs of KC / S >= 16, so the masked loads keep their 16-byte
    # vectors), C-side ([W,1,1] warp, [1,ROWS,1] row, [1,1,8] column)
    ww, wrow, word = word_offsets(w_l, W, ROWS, RW)

    x2: gl.constexpr = gl.SliceLayout(2, x_l)
    xw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, x2)), 1), 2)
    xc = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, x2)), 0), 2)
    xk = gl.expand_dims(gl.expand_dims(gl.arange(0, 32 * RW, layout=gl.SliceLayout(0, gl.SliceLayout(0, x_l))), 0), 0)
    x_mask = (xk // (32 * RW // S)) == xc % S  # [1, 8, KC]

    m2: gl.constexpr = gl.SliceLayout(2, mma)
    mw = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, m2)), 1), 2)
    mrow = gl.expand_dims(gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, m2)), 0), 2)
    mspan = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, mma))), 0), 0)
    return ww, wrow, word, xw, xc * 0 + xk, x_mask, mw, mrow, mspan


@gluon.jit
def _first_chunks(q_ptrs, x_ptrs, x_mask, ZEROED: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
                  AHEAD: gl.constexpr):  # fmt: skip
    # words and x of chunk 0, and of chunk 1 when AHEAD = 2 (else chunk 0's again, unused)
    q = gl.load(q_ptrs)
    x = _load_x(x_ptrs, x_mask, ZEROED)
    if CHUNKS > 1 and AHEAD == 2:
        q1 = gl.load(q_ptrs + KC // 8)
        x1 = _load_x(x_ptrs + KC, x_mask, ZEROED)
    else:
        q1 = q
        x1 = x
    return q, x, q1, x1


@gluon.jit
def _sum_chunks(q_ptrs, x_ptrs, x_mask, s_rows, z_rows, span_k, magic, offset, HAS_ZERO: gl.constexpr,
                GROUP: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr, AHEAD: gl.constexpr, DT: gl.constexpr,
                W: gl.constexpr, ROWS: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr,
                ZEROED: gl.constexpr, S: gl.constexpr = 8):  # fmt: skip
    # [W, ROWS, 8] float32 sums over CHUNKS chunks: q_ptrs / x_ptrs at chunk 0 (x [W, 8, KC], column c's span c % S
    # of S a chunk only where ZEROED), s_rows / z_rows [., ROWS, 1] each row's scales and zeros, span_k [., 1, 8]
    # the K of each column's span start in chunk 0. Chunks c + 1 .. c + AHEAD are requested before chunk c's mmas
    # (the last one reloads itself).
    ones = gl.full([W, 16, KC], 1.0, DT, a_l)
    tot = gl.zeros([W, ROWS, 8], gl.float32, mma)
    q, x, q1, x1 = _first_chunks(q_ptrs, x_ptrs, x_mask, ZEROED, KC, CHUNKS, AHEAD)
    for c in range(CHUNKS):
        q_c, x_c = q, x
        if AHEAD == 2:
            q, x = q1, x1
            if CHUNKS > 2:
                q1 = gl.load(q_ptrs + gl.minimum(c + 2, CHUNKS - 1) * (KC // 8))
                x1 = _load_x(x_ptrs + gl.minimum(c + 2, CHUNKS - 1) * KC, x_mask, ZEROED)
        elif CHUNKS > 1:
            q = gl.load(q_ptrs + gl.minimum(c + 1, CHUNKS - 1) * (KC // 8))
            x = _load_x(x_ptrs + gl.minimum(c + 1, CHUNKS - 1) * KC, x_mask, ZEROED)
        g = (span_k + c * KC) // GROUP  # each span's group
        tot = _chunk(q_c, x_c, s_rows + g, z_rows + g, ones, magic, offset, tot, HAS_ZERO, DT, W, ROWS, 8,
                     KC // 32, S, mma, a_l, b_l, ZEROED)  # fmt: skip
    return tot


@cached_launch
@gluon.jit
def _gate_up_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, act_ptr, ids_ptr, magic, offset, N, num_pairs,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn,
    HAS_ZERO: gl.constexpr, GROUP: gl.constexpr, TOP_K: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
    AHEAD: gl.constexpr, ROWS: gl.constexpr, W: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, w_l: gl.constexpr,
    x_l: gl.constexpr, MASK_X: gl.constexpr = False, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # act[pair, n] = silu(x[t] @ w13[e, n]) * (x[t] @ w13[e, N + n]) in x's dtype, t = pair // TOP_K,
    # e = ids[pair]; program (pair, rows n0..n0+ROWS/2-1), warp w over K [w KS, (w + 1) KS), KS = CHUNKS * KC.
    pdl_enter(USE_PDL)
    RW: gl.constexpr = KC // 32
    KS: gl.constexpr = CHUNKS * KC
    GC: gl.constexpr = KC // 8
    HALF: gl.constexpr = ROWS // 2
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid = gl.program_id(0)
    pair = pid % num_pairs
    n0 = (pid // num_pairs) * HALF
    expert = gl.load(ids_ptr + pair).to(gl.int64)
    ww, wrow, word, xw, xk, x_mask, mw, mrow, mspan = _offsets(w_l, x_l, mma, W, ROWS, RW)
    q_rows = n0 + wrow % HALF + (wrow // HALF) * N  # logical rows: gate, then the matching up rows
    q_ptrs = q_ptr + expert * stride_qe + q_rows.to(gl.int64) * stride_qn + ww * (KS // 8) + word
    x_ptrs = x_ptr + (pair // TOP_K).to(gl.int64) * stride_xm + xw * KS + xk  # every column: the pair's token
    s_rows = expert * stride_se + (n0 + mrow % HALF + (mrow // HALF) * N).to(gl.int64) * stride_sn
    tot = _sum_chunks(q_ptrs, x_ptrs, x_mask, s_ptr + s_rows, z_ptr + s_rows, mw * KS + mspan * GC, magic, offset,
                      HAS_ZERO, GROUP, KC, CHUNKS, AHEAD, DT, W, ROWS, mma, a_l, b_l, MASK_X)  # fmt: skip
    y = gl.sum(gl.sum(tot, axis=2), axis=0)  # [ROWS]: gate rows, then up rows
    gate, up = gl.split(gl.permute(gl.reshape(y, [2, HALF]), (1, 0)))
    act = (gate / (1.0 + gl.exp(-gate)) * up).to(DT)
    rows = gl.arange(0, HALF, layout=act.type.layout)
    gl.store(act_ptr + pair.to(gl.int64) * N + n0 + rows, act)


@cached_launch
@gluon.jit
def _down_kernel(
    act_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ids_ptr, tw_ptr, magic, offset, num_tokens,
    stride_qe, stride_qn, stride_se, stride_sn, stride_om,
    HAS_ZERO: gl.constexpr, GROUP: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr, AHEAD: gl.constexpr,
    ROWS: gl.constexpr, W: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, w_l: gl.constexpr,
    x_l: gl.constexpr, MASK_X: gl.constexpr = False, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # out[t, n] = sum_w tw[t, w] * (act[t W + w] @ w2[e_w, n]), e_w = ids[t, w], W = TOP_K slots, one a
    # warp, each over all of K = CHUNKS * KC; program (token, ROWS rows from n0)
    pdl_enter(USE_PDL)
    RW: gl.constexpr = KC // 32
    K: gl.constexpr = CHUNKS * KC
    GC: gl.constexpr = KC // 8
    DT: gl.constexpr = act_ptr.dtype.element_ty
    pid = gl.program_id(0)
    t = pid % num_tokens
    n0 = (pid // num_tokens) * ROWS
    ww, wrow, word, xw, xk, x_mask, mw, mrow, mspan = _offsets(w_l, x_l, mma, W, ROWS, RW)
    e4 = gl.load(ids_ptr + t * W + ww).to(gl.int64)  # [W, 1, 1, 1]
    q_ptrs = q_ptr + e4 * stride_qe + (n0 + wrow).to(gl.int64) * stride_qn + word
    x_ptrs = act_ptr + (t * W + xw).to(gl.int64) * K + xk  # warp w: slot w's act row
    e3 = gl.load(ids_ptr + t * W + mw).to(gl.int64)  # [W, 1, 1]
    s_rows = e3 * stride_se + (n0 + mrow).to(gl.int64) * stride_sn
    tot = _sum_chunks(q_ptrs, x_ptrs, x_mask, s_ptr + s_rows, z_ptr + s_rows, mspan * GC, magic, offset,
                      HAS_ZERO, GROUP, KC, CHUNKS, AHEAD, DT, W, ROWS, mma, a_l, b_l, MASK_X)  # fmt: skip
    wl: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, mma))
    tw = gl.load(tw_ptr + t * W + gl.arange(0, W, layout=wl))  # [W] float32
    y = gl.sum(gl.sum(tot, axis=2) * gl.expand_dims(tw, 1), axis=0).to(out_ptr.dtype.element_ty)  # [ROWS]
    rows = gl.arange(0, ROWS, layout=y.type.layout)
    gl.store(out_ptr + t.to(gl.int64) * stride_om + n0 + rows, y)


@gluon.jit
def _group_program(pid, num_pairs, bound, leaders_ptr, COMPACT: gl.constexpr):
    # A grouped kernel's program -> (pair, row tile): program (pair, tile) over pairs, or with COMPACT (g-th group,
    # tile) over group_leaders' list [1 + pairs] (the count, then the leading pairs), up to bound groups a tile; pair
    # -1 past the list's count
    if COMPACT:
        g = pid % bound
        tile = pid // bound
        pair = gl.to_tensor(-1)
        if g < gl.load(leaders_ptr):
            pair = gl.load(leaders_ptr + 1 + g)
    else:
        pair = gl.to_tensor(pid % num_pairs)
        tile = pid // num_pairs
    return pair, tile


@gluon.jit
def _group_columns(group, pair, x_mask, x_l: gl.constexpr, S: gl.constexpr):
    # A group row's 8 B columns (column c: the group's pair c // S, kernels/triton_moe_groups.py's row layout): each
    # column's pair [1, 8, 1] (the leading pair where the slot is past the group's end) and x's mask [W, 8, KC] with
    # those slots off, so they load no x (their columns stay zero where MASK_X) and are not stored
    xcl: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, x_l))  # [8] columns, as x's
    col_pair = gl.load(group + 1 + gl.arange(0, 8, layout=xcl) // S)
    live = gl.expand_dims(gl.expand_dims(col_pair >= 0, 0), 2)
    return gl.expand_dims(gl.expand_dims(gl.where(col_pair >= 0, col_pair, pair), 0), 2), x_mask & live


@cached_launch
@gluon.jit
def _grouped_gate_up_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, act_ptr, groups_ptr, leaders_ptr, magic, offset, N, num_pairs, bound,
    stride_xm, stride_qe, stride_qn, stride_se, stride_sn,
    HAS_ZERO: gl.constexpr, GROUP: gl.constexpr, TOP_K: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
    AHEAD: gl.constexpr, S: gl.constexpr, ROWS: gl.constexpr, W: gl.constexpr, mma: gl.constexpr,
    a_l: gl.constexpr, b_l: gl.constexpr, w_l: gl.constexpr, x_l: gl.constexpr, MASK_X: gl.constexpr = False,
    COMPACT: gl.constexpr = False, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # _gate_up_kernel's act over groups of up to P = 8 / S pairs of one expert (kernels/triton_moe_groups.py's
    # groups [pairs, 1 + P]): program (pair, rows n0..n0+ROWS/2-1) runs the group its pair leads, and leaves where
    # the pair leads none. The B operand's column c is (the group's pair c // S, span c % S of the chunk, KC / S
    # long, inside one quantization group), as gluon_w4a16_mma's (row of x, span): the expert's rows are decoded
    # once a group, not once a pair. A slot past the group's end loads no x (where MASK_X) and is not stored.
    pdl_enter(USE_PDL)
    RW: gl.constexpr = KC // 32
    KS: gl.constexpr = CHUNKS * KC
    HALF: gl.constexpr = ROWS // 2
    P: gl.constexpr = 8 // S
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pair, tile = _group_program(gl.program_id(0), num_pairs, bound, leaders_ptr, COMPACT)
    if pair < 0:
        return
    n0 = tile * HALF
    group = groups_ptr + pair * (1 + P)
    expert = gl.load(group)
    if expert < 0:
        return
    ww, wrow, word, xw, xk, x_mask, mw, mrow, mspan = _offsets(w_l, x_l, mma, W, ROWS, RW, S)
    col_pair, x_mask = _group_columns(group, pair, x_mask, x_l, S)
    q_rows = n0 + wrow % HALF + (wrow // HALF) * N  # logical rows: gate, then the matching up rows
    q_ptrs = q_ptr + expert.to(gl.int64) * stride_qe + q_rows.to(gl.int64) * stride_qn + ww * (KS // 8) + word
    x_ptrs = x_ptr + (col_pair // TOP_K).to(gl.int64) * stride_xm + xw * KS + xk  # each column's token
    s_rows = expert.to(gl.int64) * stride_se + (n0 + mrow % HALF + (mrow // HALF) * N).to(gl.int64) * stride_sn
    tot = _sum_chunks(q_ptrs, x_ptrs, x_mask, s_ptr + s_rows, z_ptr + s_rows, mw * KS + (mspan % S) * (KC // S),
                      magic, offset, HAS_ZERO, GROUP, KC, CHUNKS, AHEAD, DT, W, ROWS, mma, a_l, b_l, MASK_X,
                      S)  # fmt: skip
    if S > 1:  # each slot's spans first, inside a lane quad, so the warps add P columns, not 8
        tot = gl.sum(gl.reshape(tot, [W, ROWS, P, S]), axis=3)  # [W, ROWS, P]
    y = gl.sum(tot, axis=0)  # [ROWS, P]: gate rows, then up rows
    gate, up = gl.split(gl.permute(gl.reshape(y, [2, HALF, P]), (1, 2, 0)))
    act = (gate / (1.0 + gl.exp(-gate)) * up).to(DT)  # [HALF, P]
    a2: gl.constexpr = act.type.layout
    rows = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(1, a2)), 1)
    slot_pair = gl.expand_dims(gl.load(group + 1 + gl.arange(0, P, layout=gl.SliceLayout(0, a2))), 0)  # [1, P]
    gl.store(act_ptr + slot_pair.to(gl.int64) * N + n0 + rows, act, mask=(slot_pair >= 0) & (rows < HALF))


@cached_launch
@gluon.jit
def _grouped_down_kernel(
    act_ptr, q_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, groups_ptr, leaders_ptr, tw_ptr, magic, offset, D,
    num_pairs, bound, stride_qe, stride_qn, stride_se, stride_sn, stride_om,
    HAS_ZERO: gl.constexpr, GROUP: gl.constexpr, TOP_K: gl.constexpr, KC: gl.constexpr, CHUNKS: gl.constexpr,
    AHEAD: gl.constexpr, S: gl.constexpr, ROWS: gl.constexpr, W: gl.constexpr, mma: gl.constexpr,
    a_l: gl.constexpr, b_l: gl.constexpr, w_l: gl.constexpr, x_l: gl.constexpr, MASK_X: gl.constexpr = False,
    COMPACT: gl.constexpr = False, USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # _down_kernel's out over the gate-up's groups of up to P = 8 / S pairs of one expert: program (pair, rows
    # n0..n0+W ROWS-1) runs the group its pair leads (leaves where none), warp w rows n0 + w ROWS.., each over all of
    # K = CHUNKS * KC, columns (the group's pair c // S, span c % S) as the grouped gate-up's, so the expert's rows are
    # decoded once a group, not once a pair. Each pair's tw-weighted float32 rows go to part [pairs, D]; a ticket per
    # (token, row tile) counts its TOP_K pairs in, and the program holding the last adds the token's TOP_K partials in
    # slot order (deterministic), stores out and puts the counter back to 0 (kernels/tickets.py's protocol).
    pdl_enter(USE_PDL)
    RW: gl.constexpr = KC // 32
    K: gl.constexpr = CHUNKS * KC
    P: gl.constexpr = 8 // S
    TILE: gl.constexpr = W * ROWS
    pair, tile = _group_program(gl.program_id(0), num_pairs, bound, leaders_ptr, COMPACT)
    if pair < 0:
        return
    n0 = tile * TILE
    group = groups_ptr + pair * (1 + P)
    expert = gl.load(group)
    if expert < 0:
        return
    ww, wrow, word, xw, xk, x_mask, mw, mrow, mspan = _offsets(w_l, x_l, mma, W, ROWS, RW, S)
    col_pair, x_mask = _group_columns(group, pair, x_mask, x_l, S)
    q_ptrs = q_ptr + expert.to(gl.int64) * stride_qe + (n0 + ww * ROWS + wrow).to(gl.int64) * stride_qn + word
    x_ptrs = act_ptr + col_pair.to(gl.int64) * K + xw * 0 + xk  # every warp the same act rows (L1 serves all but one)
    s_rows = expert.to(gl.int64) * stride_se + (n0 + mw * ROWS + mrow).to(gl.int64) * stride_sn
    tot = _sum_chunks(q_ptrs, x_ptrs, x_mask, s_ptr + s_rows, z_ptr + s_rows, mw * 0 + (mspan % S) * (KC // S),
                      magic, offset, HAS_ZERO, GROUP, KC, CHUNKS, AHEAD, act_ptr.dtype.element_ty, W, ROWS, mma, a_l,
                      b_l, MASK_X, S)  # fmt: skip
    if S > 1:
        tot = gl.sum(gl.reshape(tot, [W, ROWS, P, S]), axis=3)  # [W, ROWS, P]
    st_l: gl.constexpr = gl.BlockedLayout([1, 1], [32 // P, P], [W, 1], [1, 0])
    y = gl.convert_layout(gl.reshape(tot, [TILE, P]), st_l)  # row n0 + r, slot p
    rows = gl.expand_dims(gl.arange(0, TILE, layout=gl.SliceLayout(1, st_l)), 1)  # [TILE, 1]
    slot_pair = gl.expand_dims(gl.load(group + 1 + gl.arange(0, P, layout=gl.SliceLayout(0, st_l))), 0)  # [1, P]
    live = slot_pair >= 0
    tw = gl.load(tw_ptr + slot_pair, mask=live, other=0.0)
    gl.store(part_ptr + slot_pair.to(gl.int64) * D + n0 + rows, y * tw, mask=live & (rows < TILE))
    _cta_barrier()  # every warp's partials are stored before the release tickets
    tok = slot_pair // TOP_K
    cnt = cnt_ptr + tok * (D // TILE) + tile  # [1, P]: one counter a (token, row tile)
    last = (gl.atomic_add(cnt, live.to(gl.int32), mask=live, sem="acq_rel") == TOP_K - 1) & live
    if gl.max(gl.max(last.to(gl.int32), axis=1), axis=0) > 0:
        gl.store(cnt, 0, mask=last)
        mask = last & (rows < TILE)
        first = part_ptr + (tok * TOP_K).to(gl.int64) * D + n0 + rows
        total = gl.load(first, mask=mask, other=0.0, cache_modifier=".cg")
        for k in gl.static_range(1, TOP_K):
            total += gl.load(first + k * D, mask=mask, other=0.0, cache_modifier=".cg")
        gl.store(out_ptr + tok.to(gl.int64) * stride_om + n0 + rows, total.to(out_ptr.dtype.element_ty), mask=mask)
