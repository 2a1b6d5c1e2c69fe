"""The GPU ends of a captured decode step: its inputs (future placeholders resolved, the new tokens'
KV slots recorded) and its greedy tokens (first argmax of each logits row, stored into the future table).

`decode_inputs`, one program, over the graph's static input rows (cuda_graph_runner.FIELDS, [F, n]):
  ids[i] < 0 is a future placeholder (runtime/step_io): ids[i] = future[-ids[i] - 1], in place;
  req_to_token[req_pool_indices[i], positions[i]] = out_cache_loc[i] (a decode row's one new slot).
Padding rows name the dummy request row and slot 0, so they write the 0 that row already holds.
It is a captured step's first kernel and the embedding, a torch op (no PDL: it starts only once this
kernel has completed), follows it, so the kernels that read req_to_token ahead of their PDL wait
(tests/test_pdl.py) still find it written before their predecessor started.

`greedy_tokens`: program (r, s) scans the columns [s * chunk, (s + 1) * chunk) of row r in BLOCK
tiles, keeping per lane the best value and the first column holding it; with one split per row that is
the token, otherwise each program publishes (max, first column of it) and the last program of the row
(kernels/tickets.py) takes the first column of the row's max. Equal values resolve to the smallest
column, as torch.argmax does. NaN counts as +inf (torch ranks NaN above +inf; the two differ only on a
row holding both, where this takes whichever comes first). Graph-safe: sizes come from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.tickets import last_one_out, ticket_counters

BLOCK = 2048  # columns per tile (4 KB of bf16 logits; 8 warps load 16 bytes a lane)
TARGET_PROGRAMS = 512  # split rows until about this many programs (a few per SM on an H100)
_INT_MAX = tl.constexpr(2**31 - 1)


@cached_launch
@triton.jit
def _decode_inputs_kernel(
    inputs_ptr, n, future_ptr, req_to_token_ptr, stride_r2t,
    IDS: tl.constexpr, POS: tl.constexpr, LOC: tl.constexpr, POOL: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
    # inputs: [F, n] int64 contiguous; field f of row i at f * n + i
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    ids = tl.load(inputs_ptr + IDS * n + offs, mask=mask, other=0)
    fut = tl.load(future_ptr + tl.maximum(-ids - 1, 0), mask=mask & (ids < 0), other=0)
    tl.store(inputs_ptr + IDS * n + offs, tl.where(ids < 0, fut, ids), mask=mask)
    pos = tl.load(inputs_ptr + POS * n + offs, mask=mask, other=0)
    loc = tl.load(inputs_ptr + LOC * n + offs, mask=mask, other=0)
    pool = tl.load(inputs_ptr + POOL * n + offs, mask=mask, other=0)
    tl.store(req_to_token_ptr + pool * stride_r2t + pos, loc, mask=mask)


def decode_inputs(
    inputs: torch.Tensor,  # [F, n] int64 contiguous: a decode graph's static input rows
    fields: tuple[str, ...],  # the name of each of the F rows
    future: torch.Tensor,  # [num_future_slots] int64
    req_to_token: torch.Tensor,  # [R, C] int64
) -> None:
    n = inputs.shape[1]
    assert inputs.is_contiguous() and req_to_token.stride(1) == 1
    _decode_inputs_kernel[(1,)](
        inputs, n, future, req_to_token, req_to_token.stride(0),
        IDS=fields.index("input_ids"), POS=fields.index("positions"), LOC=fields.index("out_cache_loc"),
        POOL=fields.index("req_pool_indices"), BLOCK_N=next_pow2(n), num_warps=1,
        **pdl_launch(inputs.device),
    )  # fmt: skip


@cached_launch
@triton.jit
def _greedy_kernel(
    logits_ptr, V, stride_row, chunk, part_max_ptr, part_idx_ptr, counter_ptr, tokens_ptr, future_ptr, slots_ptr,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK: tl.constexpr, HAS_FUTURE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], _INT_MAX, tl.int32)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        ok = cols < hi
        x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # noqa: PLR0124 (NaN test)
        # a lane's columns only grow, so ">" keeps its first best; "best_col == MAX" takes a first -inf
        take = ok & ((x > best) | (best_col == _INT_MAX))
        best = tl.where(take, x, best)
        best_col = tl.where(take, cols, best_col)
    m = tl.max(best, axis=0)
    col = tl.min(tl.where(best == m, best_col, _INT_MAX), axis=0)
    if SPLIT == 1:
        _emit(tokens_ptr, future_ptr, slots_ptr, row, col, HAS_FUTURE)
    else:
        tl.store(part_max_ptr + row * SPLIT + s, m)
        tl.store(part_idx_ptr + row * SPLIT + s, col)
        if last_one_out(counter_ptr + row, SPLIT):
            offs_s = tl.arange(0, SPLIT_P2)
            ok_s = offs_s < SPLIT
            pm = tl.load(part_max_ptr + row * SPLIT + offs_s, mask=ok_s, other=float("-inf"), cache_modifier=".cg")
            pc = tl.load(part_idx_ptr + row * SPLIT + offs_s, mask=ok_s, other=_INT_MAX, cache_modifier=".cg")
            top = tl.max(pm, axis=0)
            _emit(tokens_ptr, future_ptr, slots_ptr, row, tl.min(tl.where(pm == top, pc, _INT_MAX), axis=0), HAS_FUTURE)


@triton.jit
def _emit(tokens_ptr, future_ptr, slots_ptr, row, col, HAS_FUTURE: tl.constexpr):
    tok = col.to(tl.int64)
    tl.store(tokens_ptr + row, tok)
    if HAS_FUTURE:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:
            tl.store(future_ptr + slot, tok)


def greedy_split(rows: int, vocab: int) -> int:
    """Programs per row: enough for about TARGET_PROGRAMS in all, at most one per BLOCK columns."""
    return max(1, min(cdiv(vocab, BLOCK), cdiv(TARGET_PROGRAMS, max(rows, 1))))


def greedy_tokens(
    logits: torch.Tensor,  # [S, V] float32 / bfloat16 / float16, unit stride along V
    out: torch.Tensor | None = None,  # [S] int64
    future: torch.Tensor | None = None,  # [F] int64: with slots, tokens[i] goes to future[slots[i]]
    slots: torch.Tensor | None = None,  # [S] int64, -1 where the row has no future slot
    split: int | None = None,  # programs per row (tests); default greedy_split
) -> torch.Tensor:  # [S] int64: the first argmax of each row
    S, V = logits.shape
    assert logits.stride(1) == 1 and (future is None) == (slots is None)
    tokens = torch.empty(S, dtype=torch.int64, device=logits.device) if out is None else out
    if S == 0:
        return tokens
    split = greedy_split(S, V) if split is None else split
    counters = ticket_counters(logits.device, "greedy", S) if split > 1 else None
    if counters is None:  # a capture before the pool exists: one program a row
        split = 1
    chunk = cdiv(cdiv(V, split), BLOCK) * BLOCK
    split = cdiv(V, chunk)  # no program without columns
    part_max = torch.empty(S, split, dtype=torch.float32, device=logits.device) if split > 1 else tokens
    part_idx = torch.empty(S, split, dtype=torch.int32, device=logits.device) if split > 1 else tokens
    _greedy_kernel[(S, split)](
        logits, V, logits.stride(0), chunk, part_max, part_idx, tokens if counters is None else counters,
        tokens, tokens if future is None else future, tokens if slots is None else slots,
        SPLIT=split, SPLIT_P2=next_pow2(split), BLOCK=BLOCK, HAS_FUTURE=future is not None,
        num_warps=8, **pdl_launch(logits.device),
    )  # fmt: skip
    return tokens
