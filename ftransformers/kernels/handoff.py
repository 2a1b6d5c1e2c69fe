"""A fused router's picks handed to the MoE kernel after it through flags in memory, not a kernel boundary.

With PDL (kernels/pdl.py) the MoE's first kernel is resident while the router runs, but its programs sit in
`griddepcontrol.wait` until the router grid has completed and its memory is flushed. The router's outputs are
written by one program, the last one out (kernels/tickets.py), so that program can say "done" itself:

- producer (`_fused_router_kernel` launched with a `RouteHandoff`): program 0 puts the flags to 0 after its PDL
  wait and before it signals `launch_dependents` (`producer_enter`); the last program stores the picks, then
  sets the flags with release semantics (`producer_publish`);
- consumer (the few-token 4-bit MoE's gate-up kernel): instead of waiting for the grid, each program polls one
  flag with acquire semantics until it reads 1, then signals `launch_dependents` (`consumer_enter`), does its
  work, and waits for the router grid only at its end (`consumer_exit`), so completion stays transitive down
  the stream. Its successor (the down kernel, which reads the routing ahead of its own wait) can start only
  after every consumer program has signalled, so after the picks were published.

Why no program can read a stale 1: the consumer's programs become resident only once every producer program has
signalled, and program 0 signals only after its reset has returned from L2 (its result feeds a branch). Why the
poll cannot hang: every producer program is resident before any consumer program is (they have all signalled), so
the last one out runs to its publish. FLAG_COPIES flags on separate 128-byte lines spread the pollers (a few
hundred to a few thousand programs) over L2. A flag stays 1 after its consumer; the next producer resets it.

The host side keeps the pairing explicit: a `RouteHandoff` is armed by the router launch that signals, and a
consumer waits on the flags only while it is armed (then disarms it), so a router that did not signal (unfused, on
the CPU) leaves the consumer on its ordinary PDL wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ftransformers.kernels.pdl import pdl_enter
from ftransformers.kernels.tickets import ticket_counters

FLAG_COPIES = 256  # the producer's flags; a consumer program polls flag (pid_0 + pid_1) % POLL_COPIES
FLAG_STRIDE = 32  # int32 words: one flag a 128-byte line
_COPIES: tl.constexpr = tl.constexpr(FLAG_COPIES)  # the same, for the kernels
_STRIDE: tl.constexpr = tl.constexpr(FLAG_STRIDE)
# The consumers' polling (module names, so that benchmarks/ab_decode.py's `set=handoff.NAME=V` can A/B them):
# how many of the flags they spread over, and whether they poll with volatile loads (then one acquire atomic)
# rather than acquire atomics
POLL_COPIES = 256
POLL_VOLATILE = True
# A/B toggles: whether the consumer waits for the producer's grid at its end (completion stays transitive), and
# whether it takes the handoff at all (0: the router still publishes, the consumer keeps its PDL wait)
EXIT_WAIT = True
CONSUME = True


def poll_args() -> dict[str, int | bool]:
    """The consumer kernels' polling constexprs, from the module's names."""
    if not 1 <= POLL_COPIES <= FLAG_COPIES:
        raise ValueError(f"handoff: POLL_COPIES must be in [1, {FLAG_COPIES}], got {POLL_COPIES}")
    return {"POLL_COPIES": POLL_COPIES, "POLL_VOLATILE": bool(POLL_VOLATILE), "EXIT_WAIT": bool(EXIT_WAIT)}


@dataclass
class RouteHandoff:
    """The flags of one router -> MoE handoff on a device, and whether the router launch signals on them."""

    flags: torch.Tensor  # [FLAG_COPIES * FLAG_STRIDE] int32
    armed: bool = False

    def take(self) -> bool:
        """For the consumer's launch: True (and disarmed) when the router before it signals on the flags."""
        armed, self.armed = self.armed, False
        return armed and CONSUME


def route_handoff(device: torch.device) -> RouteHandoff | None:
    """A handoff on `device`'s flags, or None where there are none (CPU, or a capture before they exist)."""
    if device.type != "cuda":
        return None
    flags = ticket_counters(device, "route_handoff", FLAG_COPIES * FLAG_STRIDE)
    return None if flags is None else RouteHandoff(flags)


@triton.jit
def producer_enter(flag_ptr, SIGNAL: tl.constexpr, USE_PDL: tl.constexpr):
    """The producer's pdl_enter: with SIGNAL, program 0 puts the flags to 0 between the wait and the signal."""
    if SIGNAL:
        if USE_PDL:
            gdc_wait()
        if tl.program_id(0) == 0:
            offs = tl.arange(0, _COPIES) * _STRIDE
            old = tl.atomic_xchg(flag_ptr + offs, tl.zeros([_COPIES], dtype=tl.int32), sem="relaxed")
            if tl.sum(old) < 0:  # never (flags are 0 or 1): the branch makes the exchanges return before the signal
                tl.store(flag_ptr, 0)
        if USE_PDL:
            gdc_launch_dependents()
    else:
        pdl_enter(USE_PDL)


@triton.jit
def producer_publish(flag_ptr, SIGNAL: tl.constexpr):
    """The producer's last program, after storing what the consumer reads: all flags to 1 (release)."""
    if SIGNAL:
        tl.debug_barrier()  # the CTA's stores are ordered before the release
        offs = tl.arange(0, _COPIES) * _STRIDE
        tl.atomic_xchg(flag_ptr + offs, tl.full([_COPIES], 1, dtype=tl.int32), sem="release")


@triton.jit
def consumer_enter(flag_ptr, HANDOFF: tl.constexpr, USE_PDL: tl.constexpr, POLL_COPIES: tl.constexpr,
                   POLL_VOLATILE: tl.constexpr):  # fmt: skip
    """The consumer's pdl_enter: with HANDOFF, poll this program's flag until the producer has published, then
    signal; the wait for the producer's grid moves to consumer_exit. POLL_VOLATILE: volatile loads (L2, no
    atomic unit), then one acquire atomic; else acquire atomics throughout."""
    if HANDOFF:
        flag = flag_ptr + ((tl.program_id(0) + tl.program_id(1)) % POLL_COPIES) * _STRIDE
        if POLL_VOLATILE:
            seen = tl.load(flag, volatile=True)
            while seen == 0:
                seen = tl.load(flag, volatile=True)
        seen = tl.atomic_add(flag, 0, sem="acquire")
        while seen == 0:
            seen = tl.atomic_add(flag, 0, sem="acquire")
        tl.debug_barrier()  # the CTA's loads are ordered after the acquire
        if USE_PDL:
            gdc_launch_dependents()
    else:
        pdl_enter(USE_PDL)


@triton.jit
def consumer_exit(HANDOFF: tl.constexpr, USE_PDL: tl.constexpr, EXIT_WAIT: tl.constexpr):
    """The consumer's last statement: with HANDOFF, wait for the producer's grid, so that completion stays
    transitive down the stream (the producer has published by then; the wait returns at once or nearly)."""
    if HANDOFF and EXIT_WAIT:
        if USE_PDL:
            gdc_wait()
