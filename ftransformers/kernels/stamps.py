"""Timestamps a kernel's programs write at chosen points: where a short kernel's microseconds go, phase by phase
(a diagnostic; kernels take it behind a constexpr, so a launch without a stamps tensor compiles none of it).

A stamp is two int64s at stamps[program, slot]: %globaltimer (nanoseconds, one clock for every SM, so programs and
kernels line up) and %clock64 (the SM's cycles, for durations inside a program). The asm is volatile, so it stays
in order with the loads, stores, waits and barriers around it. Every thread of a program stores the same slot (a
race whose winner is one of the program's threads); slots nobody reaches keep what the caller filled them with.
benchmarks/diag_mla_phases.py reads them for MLA decode's two stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - a Triton without Gluon: tl_stamp only
    gluon = None


def stamp_buffer(programs: int, slots: int, device: torch.device) -> torch.Tensor:
    """int64 [programs, slots, 2] (globaltimer ns, clock64 cycles), -1 where no program stamped."""
    return torch.full((programs, slots, 2), -1, dtype=torch.int64, device=device)


class StampSink:
    """Stamp buffers for every launch of a kernel in a captured step: `take` gives each launch its own zero-copy
    [programs, slots, 2] view of one preallocated buffer (so a CUDA graph captured with them writes each launch's
    stamps to its own place on every replay), and `views` keeps them in launch order."""

    def __init__(self, programs: int, slots: int, device: torch.device) -> None:
        self.buf = stamp_buffer(programs, slots, device)
        self.used = 0
        self.views: list[torch.Tensor] = []

    def take(self, programs: int, slots: int) -> torch.Tensor:
        if slots != self.buf.shape[1] or self.used + programs > self.buf.shape[0]:
            raise ValueError(f"StampSink: {programs} programs x {slots} slots do not fit {tuple(self.buf.shape)} "
                             f"with {self.used} programs taken")  # fmt: skip
        view = self.buf[self.used : self.used + programs]
        self.used += programs
        self.views.append(view)
        return view


@triton.jit
def tl_stamp(stamps, program, slot: tl.constexpr, SLOTS: tl.constexpr):
    ns = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    cyc = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    at = stamps + (program.to(tl.int64) * SLOTS + slot) * 2
    tl.store(at, ns)
    tl.store(at + 1, cyc)


if gluon is not None:

    @gluon.jit
    def gl_stamp(stamps, program, slot: gl.constexpr, SLOTS: gl.constexpr):
        ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        cyc = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        at = stamps + (program.to(gl.int64) * SLOTS + slot) * 2
        gl.store(at, ns)
        gl.store(at + 1, cyc)
