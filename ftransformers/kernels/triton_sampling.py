"""Sort-free sampling: temperature, top-k, top-p and min-p draws in one kernel launch.

What it draws is `runtime.sampler`'s distribution (the torch path, which sorts the whole vocabulary):
probabilities w = exp((x - max x) / T) of the (penalised) logits x; top-k keeps the k best tokens, top-p
the smallest best-first prefix of those whose mass reaches top_p times the top-k mass, min-p the tokens
with w >= min_p; the token is drawn from w restricted to what all three keep.

"Best first" is a total order: j is above i when x_j > x_i, or x_j == x_i and j < i (the order of a
stable descending sort, which decides ties at a top-k or top-p boundary by the lower token id).
Values compare as monotone integer keys of their bits: 16-bit for bfloat16 logits, 32-bit otherwise.

A row is split over P programs (grid (S, P)), each owning a chunk of whole BLOCK-column tiles. The
programs of a row work in phases and meet at a row barrier after each (a counter they spin on; the
launch is cooperative, so all are resident). After a barrier every program reads all P partials of the
phase in chunk order and takes the same decision, so no result needs broadcasting. The phases:
1. each chunk's maximum and first column of it: the row's maximum m and argmax (the token of a
   greedy row: temperature 0 or top_k 1);
2. top-k only: the k-th best key by radix select (256-bin histograms of each key byte, added across
   chunks with integer atomics), then the column of the last tied token the k keep (chunk tie counts,
   then the owning chunk finds it); the kept set is everything at or above (key, column) in the order;
3. the allowed mass (top-k and min-p) of each tile and chunk, and the top-k mass W;
4. a draw by inverse CDF with one uniform u at u * (allowed mass): the chunk whose running mass crosses
   it, and inside it (its program alone) the tile, then the column (no per-token noise);
5. top-p only, a rejection loop: the mass M strictly above the drawn token x, summed over chunks. If
   M < top_p * W, top-p keeps x and it is the answer. Otherwise top-p keeps nothing at or below x, and
   the next draw is among the tokens above x, whose masses that phase just produced.
   Why it is exact: every draw is from a set holding all of the kept set, so conditioned on landing in
   the kept set it is distributed as w restricted to it. The mass above a w-proportional draw is about
   uniform over [0, mass of its set], so each round halves the set's mass on average: about
   1 + log2(1 / top_p) rounds (one at top_p 0.9).
The uniforms come from Philox keyed by the row's seed (`seeds`), one per draw (`draw_uniforms`).

With P = 1 (rows beyond the SM count, Triton's interpreter, where programs run one after another) a
row's program sweeps the whole row in each phase and meets no barrier.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.tickets import exit_ticket, grid_barrier, ticket_counters

# (columns per tile, warps) below and from LARGE_ROWS rows: measured best on an H100
# (benchmarks/results/sampler_split_h100.json: 2048 x 8 at 1-8 rows, 4096 x 16 at 32-128 rows)
BLOCK, NUM_WARPS = 2048, 8
LARGE_ROWS, LARGE_BLOCK, LARGE_WARPS = 16, 4096, 16
MAX_ROUNDS = 64  # rejection rounds cap (a NaN row would otherwise loop); ~4 are typical at top_p 0.1
_INT_MAX = tl.constexpr(2**31 - 1)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile(row_ptr, start, hi, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr):
    """Columns, validity (< hi), float32 values and monotone keys (int64, KEY_BITS wide) of the tile at
    column `start`."""
    cols = start + tl.arange(0, BLOCK)
    ok = cols < hi
    x = tl.load(row_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF  # the bits, unsigned
    key = tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)  # negatives reversed below positives
    if KEY_BITS == 16:  # bfloat16 upcast: the low 16 bits carry nothing
        key = key >> 16
    return cols, ok, x, key


@triton.jit
def _top_k_kept(key, cols, tk_key, tk_col):
    """At or above (tk_key, tk_col) in the order: what top-k keeps."""
    return (key > tk_key) | ((key == tk_key) & (cols <= tk_col))


@triton.jit
def _allowed(key, cols, ok, w, tk_key, tk_col, min_p, lo_key, lo_col):
    """Tokens a draw may take: top-k kept, min-p kept, strictly above (lo_key, lo_col) in the order."""
    above = (key > lo_key) | ((key == lo_key) & (cols < lo_col))
    return ok & _top_k_kept(key, cols, tk_key, tk_col) & (w >= min_p) & above


@triton.jit
def _tile_masses(
    row_ptr, lo, hi, m, scale, tk_key, tk_col, min_p, lo_key, lo_col,
    NT_P2: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr,
):  # fmt: skip
    """Over the chunk [lo, hi): [NT_P2] allowed mass of each of its tiles (0 past the last) and its
    top-k mass."""
    tix = tl.arange(0, NT_P2)
    part = tl.zeros([NT_P2], tl.float32)
    top_k_mass = 0.0
    for t in range(tl.cdiv(hi - lo, BLOCK)):
        cols, ok, x, key = _tile(row_ptr, lo + t * BLOCK, hi, BLOCK, KEY_BITS)
        w = tl.exp2((x - m) * scale)
        top_k_mass += tl.sum(tl.where(ok & _top_k_kept(key, cols, tk_key, tk_col), w, 0.0), axis=0)
        keep = _allowed(key, cols, ok, w, tk_key, tk_col, min_p, lo_key, lo_col)
        part = tl.where(tix == t, tl.sum(tl.where(keep, w, 0.0), axis=0), part)
    return part, top_k_mass


@triton.jit
def _chunk_draw(
    row_ptr, lo, hi, part, target, m, scale, tk_key, tk_col, min_p, lo_key, lo_col,
    NT_P2: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr,
):  # fmt: skip
    """Inverse CDF inside the chunk [lo, hi) whose tile masses are `part`: the first allowed column (in
    column order) where the running mass exceeds `target` (< the chunk's mass up to rounding, which
    falls back to the last allowed column); -1 when nothing is allowed. Returns (column, key)."""
    tix = tl.arange(0, NT_P2)
    run = tl.cumsum(part, axis=0)
    t = tl.min(tl.where(run > target, tix, NT_P2), axis=0)
    t = tl.where(t == NT_P2, tl.max(tl.where(part > 0, tix, -1), axis=0), t)
    base = tl.sum(tl.where(tix == t, run - part, 0.0), axis=0)
    cols, ok, x, key = _tile(row_ptr, lo + t * BLOCK, hi, BLOCK, KEY_BITS)
    w = tl.exp2((x - m) * scale)
    w = tl.where(_allowed(key, cols, ok, w, tk_key, tk_col, min_p, lo_key, lo_col) & (t >= 0), w, 0.0)
    cum = base + tl.cumsum(w, axis=0)
    col = tl.min(tl.where((cum > target) & (w > 0), cols, _INT_MAX), axis=0)
    col = tl.where(col == _INT_MAX, tl.max(tl.where(w > 0, cols, -1), axis=0), col)
    col_key = tl.max(tl.where(cols == col, key, -1), axis=0)
    return col, col_key


@triton.jit
def _row_draw(
    row_ptr, lo, hi, pc, programs, part, chunk_mass, u, m, scale, tk_key, tk_col, min_p, lo_key, lo_col,
    fallback_col, slot_ptr, counter, passed,
    P_P2: tl.constexpr, NT_P2: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr,
):  # fmt: skip
    """A draw over the row: the chunk is chosen from `chunk_mass` [P_P2] (identical in every program),
    its program finds the column and publishes it. Nothing allowed (a NaN row): the argmax, with a key
    above every key so that no mass lies above it. Returns (column, key, barriers passed)."""
    pix = tl.arange(0, P_P2)
    run = tl.cumsum(chunk_mass, axis=0)
    target = u * tl.sum(chunk_mass, axis=0)
    c = tl.min(tl.where(run > target, pix, P_P2), axis=0)
    c = tl.where(c == P_P2, tl.max(tl.where(chunk_mass > 0, pix, -1), axis=0), c)
    if pc == c:
        base = tl.sum(tl.where(pix == c, run - chunk_mass, 0.0), axis=0)
        col, col_key = _chunk_draw(
            row_ptr, lo, hi, part, target - base, m, scale, tk_key, tk_col, min_p, lo_key, lo_col,
            NT_P2, BLOCK, KEY_BITS,
        )  # fmt: skip
        tl.store(slot_ptr, col.to(tl.int64))
        tl.store(slot_ptr + 1, col_key)
    passed = grid_barrier(counter, programs, passed)
    col = tl.load(slot_ptr, cache_modifier=".cg").to(tl.int32)
    col_key = tl.load(slot_ptr + 1, cache_modifier=".cg")
    nothing = (c < 0) | (col < 0)
    col = tl.where(nothing, fallback_col, col)
    col_key = tl.where(nothing, 2**32, col_key)
    return col, col_key, passed


@triton.jit
def _masses_phase(
    row_ptr, lo, hi, pc, programs, m, scale, tk_key, tk_col, min_p, lo_key, lo_col, ws_f, counter, passed,
    P_P2: tl.constexpr, NT_P2: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr,
):  # fmt: skip
    """Allowed and top-k masses of every chunk (ws_f: this row's [P, 3] float32 partials, fields 1 and 2).
    Returns (own tile masses [NT_P2], chunk allowed masses [P_P2], row top-k mass, barriers passed)."""
    part, top_k_mass = _tile_masses(
        row_ptr, lo, hi, m, scale, tk_key, tk_col, min_p, lo_key, lo_col, NT_P2, BLOCK, KEY_BITS
    )
    tl.store(ws_f + pc * 3 + 1, top_k_mass)
    tl.store(ws_f + pc * 3 + 2, tl.sum(part, axis=0))
    passed = grid_barrier(counter, programs, passed)
    pix = tl.arange(0, P_P2)
    chunk_top_k = tl.load(ws_f + pix * 3 + 1, mask=pix < programs, other=0.0, cache_modifier=".cg")
    chunk_mass = tl.load(ws_f + pix * 3 + 2, mask=pix < programs, other=0.0, cache_modifier=".cg")
    return part, chunk_mass, tl.sum(chunk_top_k, axis=0), passed


@triton.jit
def _top_k_threshold(
    row_ptr, lo, hi, pc, programs, k, hist_ptr, ws_i, tk_slot, counter, passed,
    P_P2: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """(key, column) of the row's k-th best token: radix select over the key bytes (hist_ptr: this
    row's zeroed [KEY_BITS / 8, 256] int32 counts), then the column of the tie that closes the k."""
    bins = tl.arange(0, 256)
    n_tiles = tl.cdiv(hi - lo, BLOCK)
    prefix = tl.zeros([], tl.int64)
    rest = k  # tokens still to take at or below the prefix found so far
    for byte in tl.static_range(KEY_BITS // 8):
        shift = KEY_BITS - 8 * (byte + 1)
        hist = tl.zeros([256], tl.int32)
        for t in range(n_tiles):
            cols, ok, _x, key = _tile(row_ptr, lo + t * BLOCK, hi, BLOCK, KEY_BITS)
            match = ok & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        tl.atomic_add(hist_ptr + byte * 256 + bins, hist, sem="relaxed")
        passed = grid_barrier(counter, programs, passed)
        hist = tl.load(hist_ptr + byte * 256 + bins, cache_modifier=".cg")
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [256] count in bins >= b
        b = tl.max(tl.where(at_or_above >= rest, bins, -1), axis=0)
        rest -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix = prefix * 256 + b
    # rest >= 1 tokens with key == prefix are among the k: the rest-th of them by column closes the set
    ties = tl.zeros([], tl.int32)
    for t in range(n_tiles):
        cols, ok, _x, key = _tile(row_ptr, lo + t * BLOCK, hi, BLOCK, KEY_BITS)
        ties += tl.sum((ok & (key == prefix)).to(tl.int32), axis=0)
    tl.store(ws_i + pc * 2 + 1, ties)
    passed = grid_barrier(counter, programs, passed)
    pix = tl.arange(0, P_P2)
    counts = tl.load(ws_i + pix * 2 + 1, mask=pix < programs, other=0, cache_modifier=".cg")
    upto = tl.cumsum(counts, axis=0)
    owner = tl.min(tl.where(upto >= rest, pix, P_P2), axis=0)
    if pc == owner:
        seen = tl.sum(tl.where(pix == owner, upto - counts, 0), axis=0)
        last = tl.full([], -1, tl.int32)
        for t in range(n_tiles):
            cols, ok, _x, key = _tile(row_ptr, lo + t * BLOCK, hi, BLOCK, KEY_BITS)
            tie = (ok & (key == prefix)).to(tl.int32)
            nth = seen + tl.cumsum(tie, axis=0)
            last = tl.maximum(last, tl.max(tl.where((tie > 0) & (nth == rest), cols, -1), axis=0))
            seen += tl.sum(tie, axis=0)
        tl.store(tk_slot, last.to(tl.int64))
    passed = grid_barrier(counter, programs, passed)
    return prefix, tl.load(tk_slot, cache_modifier=".cg").to(tl.int32), passed


@triton.jit
def _uniform(seed, draw):
    """One uniform in [0, 1) from Philox keyed by seed, counter `draw`."""
    return tl.sum(tl.rand(seed, tl.full([1], 0, tl.int32) + draw), axis=0)


@cached_launch
@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, V, chunk, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, out_ptr,
    ws_f_ptr, ws_i_ptr, hist_ptr, slot_ptr, counter_ptr,
    P_P2: tl.constexpr, NT_P2: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    pc = tl.program_id(1)
    programs = tl.num_programs(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lo = pc * chunk
    hi = tl.minimum(lo + chunk, V)
    ws_f = ws_f_ptr + row * programs * 3  # [P, 3] float32: chunk max, top-k mass, allowed mass
    ws_i = ws_i_ptr + row * programs * 2  # [P, 2] int32: chunk argmax, tie count
    slot = slot_ptr + row * 3  # int64: drawn column, its key, top-k tie column
    counter = counter_ptr + row * 2  # int32: barrier arrivals, exit tickets
    pix = tl.arange(0, P_P2)
    passed = tl.zeros([], tl.int32)

    # 1. maximum and its first column (NaN counts as +inf, as in triton_greedy)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], _INT_MAX, tl.int32)
    for t in range(tl.cdiv(hi - lo, BLOCK)):
        cols, ok, x, _key = _tile(row_ptr, lo + t * BLOCK, hi, BLOCK, KEY_BITS)
        x = tl.where(x != x, float("inf"), x)  # noqa: PLR0124 (NaN test)
        take = ok & ((x > best) | (best_col == _INT_MAX))
        best = tl.where(take, x, best)
        best_col = tl.where(take, cols, best_col)
    chunk_max = tl.max(best, axis=0)
    tl.store(ws_f + pc * 3, chunk_max)
    tl.store(ws_i + pc * 2, tl.min(tl.where(best == chunk_max, best_col, _INT_MAX), axis=0))
    passed = grid_barrier(counter, programs, passed)
    maxima = tl.load(ws_f + pix * 3, mask=pix < programs, other=float("-inf"), cache_modifier=".cg")
    firsts = tl.load(ws_i + pix * 2, mask=pix < programs, other=_INT_MAX, cache_modifier=".cg")
    m = tl.max(maxima, axis=0)
    token = tl.min(tl.where(maxima == m, firsts, _INT_MAX), axis=0)

    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)  # int32, outside 2..V-1: no top-k (1 is greedy)
    top_p = tl.load(top_p_ptr + row)  # >= 1: no top-p
    min_p = tl.load(min_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    if (temperature > 0) & (k != 1):
        scale = _LOG2E / temperature
        # 2. top-k: everything at or above (tk_key, tk_col) is kept; off: every key > -1
        tk_key = tl.full([], -1, tl.int64)
        tk_col = tl.full([], -1, tl.int32)
        if (k > 1) & (k < V):
            tk_key, tk_col, passed = _top_k_threshold(
                row_ptr, lo, hi, pc, programs, k, hist_ptr + row * (KEY_BITS // 8) * 256, ws_i, slot + 2,
                counter, passed, P_P2, KEY_BITS, BLOCK,
            )  # fmt: skip
        # 3. masses; no draw yet: lo = (-1, 0) is below every key
        lo_key = tl.full([], -1, tl.int64)
        lo_col = tl.zeros([], tl.int32)
        part, chunk_mass, top_k_mass, passed = _masses_phase(
            row_ptr, lo, hi, pc, programs, m, scale, tk_key, tk_col, min_p, lo_key, lo_col, ws_f, counter,
            passed, P_P2, NT_P2, BLOCK, KEY_BITS,
        )  # fmt: skip
        # 4. the first draw
        token, tok_key, passed = _row_draw(
            row_ptr, lo, hi, pc, programs, part, chunk_mass, _uniform(seed, 0), m, scale, tk_key, tk_col, min_p,
            lo_key, lo_col, token, slot, counter, passed, P_P2, NT_P2, BLOCK, KEY_BITS,
        )  # fmt: skip
        # 5. top-p by rejection: a token is kept when the mass strictly above it is < top_p * W
        rounds = 0
        searching = top_p < 1.0
        while searching:
            lo_key = tok_key
            lo_col = token
            part, chunk_mass, _, passed = _masses_phase(
                row_ptr, lo, hi, pc, programs, m, scale, tk_key, tk_col, min_p, lo_key, lo_col, ws_f, counter,
                passed, P_P2, NT_P2, BLOCK, KEY_BITS,
            )  # fmt: skip
            rounds += 1
            searching = (tl.sum(chunk_mass, axis=0) >= top_p * top_k_mass) & (rounds < MAX_ROUNDS)
            if searching:
                token, tok_key, passed = _row_draw(
                    row_ptr, lo, hi, pc, programs, part, chunk_mass, _uniform(seed, rounds), m, scale, tk_key,
                    tk_col, min_p, lo_key, lo_col, token, slot, counter, passed, P_P2, NT_P2, BLOCK, KEY_BITS,
                )  # fmt: skip
    if pc == 0:
        tl.store(out_ptr + row, token.to(tl.int64))
    exit_ticket(counter, programs)


def sample_split(rows: int, vocab: int, block: int, device: torch.device) -> int:
    """Programs per row: one per tile up to one program per SM in all (all resident at once, which the
    row barrier needs); 1 on the CPU (Triton's interpreter runs programs one after another)."""
    if device.type != "cuda":
        return 1
    return _split_for(rows, vocab, block, _num_sms(device.index))


def _split_for(rows: int, vocab: int, block: int, sms: int) -> int:
    return max(1, min(cdiv(vocab, block), sms // max(rows, 1)))


def _tile_for(rows: int) -> tuple[int, int]:
    """The default (columns a tile, warps) at `rows` rows."""
    return (LARGE_BLOCK, LARGE_WARPS) if rows >= LARGE_ROWS else (BLOCK, NUM_WARPS)


@functools.cache
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class SamplePlan(NamedTuple):
    """A launch of `_sample_kernel` over S rows of V columns."""

    block: int  # columns a tile
    num_warps: int
    split: int  # programs a row, each owning `chunk` columns (whole tiles); the last may own fewer
    chunk: int

    def key(self) -> tuple[int, int, int, int, bool]:
        """What Triton specializes the kernel on besides the logits' dtype (constexprs, the cooperative launch;
        `chunk`, a multiple of the block, is always divisible by 16)."""
        return (self.block, self.num_warps, next_pow2(self.split), next_pow2(self.chunk // self.block),
                self.split > 1)  # fmt: skip


def sample_plan(rows: int, vocab: int, split: int, block: int | None = None,
                num_warps: int | None = None) -> SamplePlan:  # fmt: skip
    """The launch `sample_tokens` makes for `rows` rows given `split` programs a row wanted (sample_split)."""
    default_block, default_warps = _tile_for(rows)
    block = block or default_block
    chunk = cdiv(cdiv(vocab, split), block) * block
    return SamplePlan(block, num_warps or default_warps, cdiv(vocab, chunk), chunk)


def plans_up_to(max_rows: int, vocab: int, sms: int) -> dict[tuple[int, int, int, int, bool], int]:
    """Each distinct specialization key that 1..max_rows rows of `vocab` columns launch on a GPU of `sms` SMs,
    with the fewest rows that launch it."""
    first: dict[tuple[int, int, int, int, bool], int] = {}
    for rows in range(1, max_rows + 1):
        split = _split_for(rows, vocab, _tile_for(rows)[0], sms)
        first.setdefault(sample_plan(rows, vocab, split).key(), rows)
    return first


def warm_sample_kernel(vocab: int, dtypes: tuple[torch.dtype, ...], device: torch.device, max_rows: int,
                       seed: int = 0, threads: int | None = None) -> list[int]:  # fmt: skip
    """Launch `sample_tokens` once for each specialization that 1..max_rows rows of these logits dtypes meet, on
    random logits, so that Triton compiles them now and not under a step (a server's start-up warmup: its
    model steps reach only the row counts their batches had). Returns the row counts launched, per dtype in
    order. The row counts that share a specialization share the compiled kernel; a CUDA device only.

    The compiles run on `threads` threads first (Triton's compile leaves Python for most of its time: four of
    them took 6.1 s on two threads against 10.1 s one after another, on this project's two-core machine), then
    each plan is launched once."""
    assert device.type == "cuda", device
    gen = torch.Generator(device=device).manual_seed(seed)
    cases = []  # (rows, inputs of sample_tokens), per dtype
    for dtype in dtypes:
        for rows in plans_up_to(max_rows, vocab, _num_sms(device.index)).values():
            logits = torch.randn(rows, vocab, generator=gen, device=device).to(dtype)
            temperature = torch.full((rows,), 0.8, dtype=torch.float32, device=device)
            top_k = torch.full((rows,), 50, dtype=torch.int32, device=device)  # every phase: top-k, draw, top-p
            top_p = torch.full((rows,), 0.95, dtype=torch.float32, device=device)
            min_p = torch.zeros(rows, dtype=torch.float32, device=device)
            seeds = torch.arange(rows, dtype=torch.int64, device=device)
            cases.append((rows, (logits, temperature, top_k, top_p, min_p, seeds)))
    compiles = [_prepare(*inputs, torch.empty(rows, dtype=torch.int64, device=device)) for rows, inputs in cases]

    index = device.index if device.index is not None else torch.cuda.current_device()

    def compile_one(c: tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]) -> None:
        grid, args, kwargs = c
        with torch.cuda.device(index):  # Triton compiles for the thread's current device (a new thread: 0)
            _sample_kernel.warmup(*args, grid=grid, **kwargs)

    if compiles:
        compile_one(compiles[0])  # the first alone: Triton makes its per-device caches once
        workers = max(1, min(threads or os.cpu_count() or 1, 16, len(compiles) - 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="warm_sample") as pool:
            list(pool.map(compile_one, compiles[1:]))
    for _, inputs in cases:
        sample_tokens(*inputs)
    return [rows for rows, _ in cases]


def _prepare(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    seeds: torch.Tensor, tokens: torch.Tensor, block: int | None = None, num_warps: int | None = None,
    split: int | None = None,
) -> tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]:
    """`_sample_kernel`'s (grid, arguments, launch keywords) for `sample_tokens` on these inputs (S >= 1), writing
    the tokens [S] int64 into `tokens`."""
    S, V = logits.shape
    dev = logits.device
    if split is None or dev.type != "cuda":
        split = sample_split(S, V, block or _tile_for(S)[0], dev)
    counters = ticket_counters(dev, "sampling", 2 * S) if split > 1 else None
    if counters is None:
        split = 1
    plan = sample_plan(S, V, split, block, num_warps)
    key_bits = 16 if logits.dtype == torch.bfloat16 else 32
    args = (
        logits, logits.stride(0), V, plan.chunk, temperature, top_k, top_p, min_p, seeds, tokens,
        torch.empty(S, plan.split, 3, dtype=torch.float32, device=dev),
        torch.empty(S, plan.split, 2, dtype=torch.int32, device=dev),
        torch.zeros(S, key_bits // 8, 256, dtype=torch.int32, device=dev),
        torch.empty(S, 3, dtype=torch.int64, device=dev),
        tokens if counters is None else counters,
    )  # fmt: skip
    kwargs = {"P_P2": next_pow2(plan.split), "NT_P2": next_pow2(plan.chunk // plan.block), "BLOCK": plan.block,
              "KEY_BITS": key_bits, "MAX_ROUNDS": MAX_ROUNDS, "num_warps": plan.num_warps,
              "launch_cooperative_grid": plan.split > 1}  # fmt: skip
    return (S, plan.split), args, kwargs


def sample_tokens(
    logits: torch.Tensor,  # [S, V] bfloat16 / float16 / float32, unit stride along V (penalties applied)
    temperature: torch.Tensor,  # [S] float32; 0: greedy (the first argmax)
    top_k: torch.Tensor,  # [S] int32; outside 2..V-1: off (1: greedy)
    top_p: torch.Tensor,  # [S] float32 in (0, 1]; 1: off
    min_p: torch.Tensor,  # [S] float32 in [0, 1]
    seeds: torch.Tensor,  # [S] int64: Philox key of each row's draws
    out: torch.Tensor | None = None,  # [S] int64
    block: int | None = None,  # columns per tile; default by S (BLOCK or LARGE_BLOCK)
    num_warps: int | None = None,
    split: int | None = None,  # programs per row (benchmarks, tests); default sample_split
) -> torch.Tensor:  # [S] int64 tokens
    S, V = logits.shape
    dev = logits.device
    assert logits.stride(1) == 1 and V < 2**31 - 1
    for t, dtype in ((temperature, torch.float32), (top_k, torch.int32), (top_p, torch.float32),
                     (min_p, torch.float32), (seeds, torch.int64)):  # fmt: skip
        assert t.shape == (S,) and t.dtype == dtype and t.device == dev, (t.shape, t.dtype)
    tokens = torch.empty(S, dtype=torch.int64, device=dev) if out is None else out
    if S == 0:
        return tokens
    grid, args, kwargs = _prepare(logits, temperature, top_k, top_p, min_p, seeds, tokens, block, num_warps, split)
    _sample_kernel[grid](*args, **kwargs)
    return tokens


@cached_launch
@triton.jit
def _uniforms_kernel(seed_ptr, out_ptr, DRAWS: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    for r in tl.static_range(DRAWS):
        tl.store(out_ptr + row * DRAWS + r, _uniform(seed, r))


def draw_uniforms(seeds: torch.Tensor, draws: int) -> torch.Tensor:
    """[S, draws] float32: the uniforms `sample_tokens` uses for rows of these seeds, draw by draw (the
    first draw, then one per rejection round), so a reference can replay its draws exactly."""
    out = torch.empty(seeds.shape[0], draws, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniforms_kernel[(seeds.shape[0],)](seeds, out, DRAWS=draws, num_warps=1)
    return out
