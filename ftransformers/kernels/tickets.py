"""Zeroed int32 ticket counters for kernels whose last program finishes the work ("last one out"), and
the grid barrier of cooperative launches (all programs resident) built on them.

A program publishes its partial result, then takes a ticket (an acq_rel atomic add on a counter); the
program holding the last ticket reduces the partials and puts the counter back to 0. So a counter
is zero between launches, which lets one buffer serve every launch of a kernel family and CUDA graph
replays. Invariant: launches sharing a family's counters never overlap in time, i.e. that family's
kernels of one device are issued on one stream (the runner's model stream; graphs replay on it).
With PDL (kernels/pdl.py) this still holds: each kernel waits for the previous grid to complete
before it touches memory.

Buffers are allocated once per (family, device) at `POOL_SIZE` counters and never reallocated, since
a captured graph keeps their address. During a capture nothing is allocated (memory allocated there
belongs to the graph's pool): `ticket_counters` returns None and the caller uses a launch shape that
needs none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POOL_SIZE = 1 << 16
_POOLS: dict[tuple[str, torch.device], torch.Tensor] = {}


def ticket_counters(device: torch.device, family: str, count: int) -> torch.Tensor | None:
    """The first `count` (<= POOL_SIZE) zeroed counters of `family` on `device`, or None while a CUDA
    graph is being captured and the pool does not exist yet."""
    if count > POOL_SIZE:
        raise ValueError(f"{family}: {count} ticket counters asked, the pool holds {POOL_SIZE}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pool = _POOLS.get((family, device))
    if pool is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        pool = _POOLS[(family, device)] = torch.zeros(POOL_SIZE, dtype=torch.int32, device=device)
    return pool[:count]


def split_scratch(
    device: torch.device, family: str, count: int, split: int, rows: int, cols: int
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """For a kernel split `split` ways whose last program adds the float32 partials: (split, `count`
    counters of `family`, partials [split, rows, cols]). With split 1, or where no counters can be had
    (a capture before the pool exists), the kernel runs unsplit: (1, None, None)."""
    counters = ticket_counters(device, family, count) if split > 1 else None
    if counters is None:
        return 1, None, None
    return split, counters, torch.empty(split, rows, cols, dtype=torch.float32, device=device)


@triton.jit
def last_one_out(counter, PROGRAMS: tl.constexpr):
    """Called by each of PROGRAMS programs after storing its partials: take a ticket on `counter`.
    True for the program holding the last ticket, which has put the counter back to 0 and may read
    every program's partials (with .cg loads: L2, where the release tickets made them visible)."""
    tl.debug_barrier()  # the CTA's partial stores are ordered before its release ticket
    last = tl.atomic_add(counter, 1, sem="acq_rel") == PROGRAMS - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def publish_and_sum(acc, part_row, pid_s, split_stride, mask, counter, SPLIT: tl.constexpr):
    """Last one out over SPLIT programs: store this program's float32 partial `acc` at
    part_row + pid_s * split_stride, take a ticket on `counter`; the program with the last ticket
    sums all SPLIT partials in split order (deterministic).
    Returns (is_last, the sum; zeros on the other programs)."""
    tl.store(part_row + pid_s * split_stride, acc, mask=mask)
    last = last_one_out(counter, SPLIT)
    total = tl.zeros_like(acc)
    if last:
        for s in tl.static_range(SPLIT):
            total += tl.load(part_row + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return last, total


@triton.jit
def grid_barrier(counter, programs, passed):
    """Every one of `programs` programs arrives here before any leaves; they must all be resident (a
    cooperative launch). The CTA's stores before it are visible to the others after it, through L2:
    read them with .cg. `passed`: barriers met so far in this launch, the same in every program.
    `counter` = [arrivals, exit tickets], zero at launch; the launch ends in exit_ticket. Returns
    passed + 1."""
    tl.debug_barrier()
    if programs > 1:
        tl.atomic_add(counter, 1, sem="release")
        target = programs * (passed + 1)
        seen = tl.atomic_add(counter, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()
    return passed + 1


@triton.jit
def exit_ticket(counter, programs):
    """The end of a launch with grid_barrier: the last program out puts both counters back to 0
    (every program is past every barrier by then)."""
    if programs > 1:
        tl.debug_barrier()
        if tl.atomic_add(counter + 1, 1, sem="acq_rel") == programs - 1:
            tl.store(counter, 0)
            tl.store(counter + 1, 0)
