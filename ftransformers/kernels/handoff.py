"""A fused router's picks handed to the MoE kernel after it through flags in memory, not a kernel boundary.

With PDL (kernels/pdl.py) the MoE's first kernel is resident while the router runs, but its programs sit in
`griddepcontrol.wait` until the router grid has completed and its memory is flushed. The router's outputs are
written by one program, the last one out (kernels/tickets.py), so that program can say "done" itself. Three
kernels take part, in stream order:

- producer (`_fused_router_kernel` with SIGNAL): its last program stores the picks, then sets COPIES flags to 1
  with release semantics (`producer_publish`). With LATE_SIGNAL its programs signal `launch_dependents` only once
  their own partial logits are stored (`producer_enter`, `producer_signal`), so that the consumer's programs,
  which have nothing to read before the picks, are not resident and polling while the router computes;
- consumer (the few-token 4-bit MoE's gate-up kernel with HANDOFF): instead of waiting for the router's grid,
  each program polls one flag (volatile loads, then one acquire atomic) until it reads 1, then signals
  `launch_dependents` (`consumer_enter`), does its work, and waits for the router's grid only at its end
  (`consumer_exit`), so that completion stays transitive down the stream;
- resetter (the same MoE's down kernel with RESET): program 0 puts the flags back to 0 after its own PDL wait
  (`consumer_reset`), when every consumer program has finished polling.

Why no consumer can read a stale 1: flags are 0 between handoffs (the resetter runs after every consume, and the
buffer starts zeroed). The consumer's programs become resident only after every producer program has passed its
PDL wait, which returns only once everything before the producer has completed, the last resetter included.
Why the poll cannot hang: every producer program is resident before any consumer program is (they have all
signalled), so the last one out runs to its publish.

Measured before (session 35, commit 1358815): the same handoff with the reset done by the router's program 0,
between its wait and its signal, and 256 flags published, cost the router 64 us a step with no consumer at all;
the consumer gained 58-69 us. Here the router only publishes, and the reset moves off the critical path.

The host side keeps the pairing explicit: the one `RouteHandoff` of a device is armed by the router launch that
signals, and disarmed by the consumer that takes it. A router launched while it is still armed (a publish no
consumer took) zeroes the flags first, stream-ordered, so a missed pairing costs a memset, never a stale read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ftransformers.kernels.pdl import pdl_enter
from ftransformers.kernels.tickets import ticket_counters

MAX_COPIES = 64  # flags in the buffer, one a 128-byte line
FLAG_STRIDE = 32  # int32 words
_STRIDE: tl.constexpr = tl.constexpr(FLAG_STRIDE)
# Module names, so that benchmarks/ab_decode.py's `set=handoff.NAME=V` can A/B them: how many flags the producer
# publishes (consumer program p polls flag p % COPIES), nanoseconds a poller sleeps between polls (0: none), and
# whether consumers take the handoff at all (0: the router still publishes, the consumers keep their PDL wait and
# the down kernel still resets)
COPIES = 32
POLL_SLEEP_NS = 0
CONSUME = True
# whether the producer signals `launch_dependents` only after its phase-1 partials are stored (so the consumer's
# programs become resident, and poll, only while the last program selects), rather than right after its wait
LATE_SIGNAL = True


def handoff_args() -> dict[str, int]:
    """The kernels' handoff constexprs, from the module's names (all three kernels must agree on COPIES)."""
    if not 1 <= COPIES <= MAX_COPIES or COPIES & (COPIES - 1):
        raise ValueError(f"handoff: COPIES must be a power of two in [1, {MAX_COPIES}], got {COPIES}")
    if not 0 <= POLL_SLEEP_NS < 1 << 20:
        raise ValueError(f"handoff: POLL_SLEEP_NS must be in [0, 2^20), got {POLL_SLEEP_NS}")
    return {"COPIES": COPIES, "POLL_SLEEP_NS": POLL_SLEEP_NS}


def producer_args() -> dict[str, int | bool]:
    """The producer's handoff constexprs."""
    return {"COPIES": handoff_args()["COPIES"], "LATE_SIGNAL": bool(LATE_SIGNAL)}


def consumes() -> bool:
    """Whether a consumer handed the flags polls them (CONSUME, read at each launch)."""
    return bool(CONSUME)


@dataclass
class RouteHandoff:
    """The flags of a device's router -> MoE handoffs, and whether a router launch published on them that no
    consumer has taken yet."""

    flags: torch.Tensor  # [MAX_COPIES * FLAG_STRIDE] int32, 0 between handoffs
    armed: bool = False

    def arm(self) -> None:
        """For the producer's launch, before it: a previous publish nobody took is cleared first."""
        if self.armed:
            self.flags.zero_()
        self.armed = True

    def take(self) -> torch.Tensor | None:
        """For the consumer's launch: the flags (and disarmed) when the router before it published on them. The
        consumer polls them (unless `consumes()` is off for an A/B: it keeps its PDL wait) and its down kernel
        resets them."""
        armed, self.armed = self.armed, False
        return self.flags if armed else None

    def discard(self) -> None:
        """For a path that does not consume: clear an unconsumed publish now (a memset)."""
        if self.armed:
            self.flags.zero_()
            self.armed = False


_HANDOFFS: dict[torch.device, RouteHandoff] = {}


def route_handoff(device: torch.device) -> RouteHandoff | None:
    """The handoff of `device`, or None where there is none (CPU, or a capture before its flags exist)."""
    if device.type != "cuda":
        return None
    flags = ticket_counters(device, "route_handoff", MAX_COPIES * FLAG_STRIDE)
    if flags is None:
        return None
    handoff = _HANDOFFS.get(flags.device)
    if handoff is None:
        handoff = _HANDOFFS[flags.device] = RouteHandoff(flags)
    return handoff


@triton.jit
def producer_enter(SIGNAL: tl.constexpr, LATE_SIGNAL: tl.constexpr, USE_PDL: tl.constexpr):
    """The producer's pdl_enter: with SIGNAL and LATE_SIGNAL, only the wait (producer_signal signals later)."""
    if SIGNAL and LATE_SIGNAL:
        if USE_PDL:
            gdc_wait()
    else:
        pdl_enter(USE_PDL)


@triton.jit
def producer_signal(SIGNAL: tl.constexpr, LATE_SIGNAL: tl.constexpr, USE_PDL: tl.constexpr):
    """Every producer program, once its own part is stored: the late `launch_dependents` (see producer_enter)."""
    if SIGNAL and LATE_SIGNAL:
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit
def producer_publish(flag_ptr, SIGNAL: tl.constexpr, COPIES: tl.constexpr):
    """The producer's last program, after storing what the consumer reads: the flags to 1 (release)."""
    if SIGNAL:
        tl.debug_barrier()  # the CTA's stores are ordered before the release
        offs = tl.arange(0, COPIES) * _STRIDE
        tl.atomic_xchg(flag_ptr + offs, tl.full([COPIES], 1, dtype=tl.int32), sem="release")


@triton.jit
def _sleep(ns):
    # nanosleep for about `ns` (an int32 scalar) nanoseconds: a poller's backoff, leaving its scheduler's issue slots
    tl.inline_asm_elementwise("nanosleep.u32 $1; // $0", "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def consumer_enter(flag_ptr, HANDOFF: tl.constexpr, USE_PDL: tl.constexpr, COPIES: tl.constexpr,
                   POLL_SLEEP_NS: tl.constexpr):  # fmt: skip
    """The consumer's pdl_enter: with HANDOFF, poll this program's flag until the producer has published, then
    signal; the wait for the producer's grid moves to consumer_exit. Volatile loads poll (L2, no atomic unit);
    one acquire atomic then orders the program's loads after the publish."""
    if HANDOFF:
        flag = flag_ptr + ((tl.program_id(0) + tl.program_id(1)) % COPIES) * _STRIDE
        seen = tl.load(flag, volatile=True)
        while seen == 0:
            if POLL_SLEEP_NS > 0:
                _sleep(seen + POLL_SLEEP_NS)  # seen is 0 here
            seen = tl.load(flag, volatile=True)
        seen = tl.atomic_add(flag, 0, sem="acquire")
        while seen == 0:  # never (the volatile load saw 1, and only the resetter, later, writes 0): keeps the atomic
            seen = tl.atomic_add(flag, 0, sem="acquire")
        tl.debug_barrier()  # the CTA's loads are ordered after the acquire
        if USE_PDL:
            gdc_launch_dependents()
    else:
        pdl_enter(USE_PDL)


@triton.jit
def consumer_exit(HANDOFF: tl.constexpr, USE_PDL: tl.constexpr):
    """The consumer's last statement: with HANDOFF, wait for the producer's grid, so that completion stays
    transitive down the stream (the producer has published by then; the wait returns at once or nearly)."""
    if HANDOFF:
        if USE_PDL:
            gdc_wait()


@triton.jit
def consumer_reset(flag_ptr, RESET: tl.constexpr, COPIES: tl.constexpr):
    """The resetter, after its PDL wait (every consumer program has finished): program 0 puts the flags to 0."""
    if RESET:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(flag_ptr + tl.arange(0, COPIES) * _STRIDE, tl.zeros([COPIES], dtype=tl.int32))
