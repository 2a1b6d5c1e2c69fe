"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and newer GPUs.

A decode step is a chain of ~10 small kernels per layer. Normally each one starts only after the
previous one has completed and its results are flushed, so every boundary costs a launch gap and a
ramp-up. With PDL a kernel is launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
its programs may become resident while the previous kernel still runs, once every program of that
kernel has executed `griddepcontrol.launch_dependents`.

The contract every kernel launched through `pdl_launch` keeps (`pdl_enter` at its top does both):
  1. every program executes `griddepcontrol.wait` before it reads or writes any tensor another kernel
     of the stream may touch (the wait returns once the previous grid has completed and its memory is
     visible; as every kernel of the chain waits, completion is transitive down the stream);
  2. it then signals `launch_dependents`, so the next kernel's programs queue up behind its own.
A program may start before its predecessor completes, but never before the kernel before that one has:
so a tensor written only before the predecessor (a decode step's metadata, written by host copies and
torch ops before the step's first kernel) may be read ahead of the wait. Kernels doing so are listed,
with those tensors, in tests/test_pdl.py (READ_BEFORE_WAIT), which checks nothing is stored before it.
Kernels of other origins (cuBLAS, torch) in between are ordinary launches: full serialisation.

Early trigger (`pdl_trigger(EARLY_TRIGGER)` as a kernel's first statement, launched with
`pdl_launch(device, early=True)`): the program signals `launch_dependents` before its wait, so the next
kernel's programs may become resident (and start their reads ahead of their own wait) while this kernel still
waits for its predecessor. Completion stays transitive for everything after a wait (a wait returns only once the
predecessor completed, which needs the predecessor's own wait to have returned); what is lost is only the
guarantee above for reads ahead of the wait: the next kernel may then start before the kernel before this one
has completed. So a kernel may trigger early only if no kernel that can follow it reads, ahead of its wait,
anything a kernel of the step writes (tests/test_pdl.py, EARLY_TRIGGER, lists them with their successors).
It pays only where the next kernel has constant data to read ahead of its wait: the decoder layer's input RMSNorm
before a 4-bit qkv GEMV and decode attention's stage 2 before a 4-bit o GEMV, whose first weight tile then
streams in while the norm, or stage 1, still runs (LinearBase.reads_ahead_of_wait decides); the same before the
dense int4 mma kernel, which reads its first chunk of words ahead (gluon_w4a16_mma.PRELOAD_WORDS; H200, session
42, benchmarks/results/ab_preload_*_s42_h200.*: Qwen3-8B W4A16 B=1 / 4 2.165 / 2.531 against 2.174 / 2.566 ms,
Qwen3-30B-A3B B=2 2.275 against 2.313, B=4 level). H100, session 27,
benchmarks/results/ab_early*_h100.*: Qwen3-30B-A3B W4A16 B=1 1.803 against 1.845 ms, B=2 2.569 against 2.625;
the same early triggers before bf16 GEMVs, which read nothing ahead, cost 3.206 -> 3.263 ms, and early triggers
in the GEMVs, stage 1, the token MoE's down kernel or every norm were neutral or slower. The 8-bit row kernel
(triton_w8_row, all of its weight rows before the wait) gains the same way: W8A8 B=1 2.637 against 2.733 ms
(session 29, ab_w8row_30b_w8a8_h100.*).

L2 prefetch ahead of the wait (`l2_prefetch`, kernels launched with `pdl_launch(device, prefetch=FAMILY)`):
a program that is resident before its predecessor completes can already pull lines it will read from
DRAM into L2: constant weights, and the KV cache of earlier tokens, which no kernel of the step writes.
A prefetch is a hint with no value: L2 is the GPU's point of coherence, so a line prefetched before a
write to it reads the written value afterwards; a prefetch can make a kernel idle or early, never
wrong, as long as every address is in bounds (`prefetch.global.L2` of an unmapped address is
undefined). The values a kernel computes with are still loaded after the wait. Families:
  norm    the RMSNorm weight (one row), by the first program
  router  each program's rows of the fused router's gate
Both are one-wave, latency-bound kernels of a decode step, resident while their predecessor runs.
Measured and left out (H100, in-process A/B, Qwen3-30B-A3B bf16 B=1, benchmarks/results/
ab_prefetch_fam_30b_h100.log and ab_prefetch_final_30b_h100.log): the weight rows of the streaming
kernels of many waves, whole or their first tile (the one-row GEMV: 3.310 -> 3.487 ms; the MoE pair
down kernel: 3.573; their 4-bit forms slower too), and GQA decode stage 1's first K/V tile (neutral
alone, 3.306; with the q/k norm weights and the families above, 3.384 against 3.260 without it).
Also measured and left out (session 20, commit eaf4689 has the code; ab_ahead_30b_{bf16,w4a16}_h100.log):
hints for a *later* kernel's weights issued after the wait by a latency-bound kernel, so that DRAM
streams them while it idles: decode stage 1 hinting the o projection, the MoE pair gate-up hinting its
expert's down weights, per line or as one bulk prefetch a thread, at the start or after the stores. B=1
Qwen3-30B-A3B: bf16 3.251 ms without, 3.317-3.601 with; W4A16 2.155 without, 2.145-2.344 with. The
weight-streaming kernels at batch 1 are not bound by their first DRAM round trip.
`set_pdl_prefetch` chooses families (A/B runs); FTRANSFORMERS_DISABLE_PDL_PREFETCH=1 starts with none.

Measured and left out (session 35, commit 1358815 has the code, benchmarks/results/ab_handoff{,2,3}_30b_w4a16_h100.*):
a handoff through flags in memory in place of one boundary. The fused router's last program published its picks on
256 flags (release; program 0 reset them between its wait and its trigger), and the few-token 4-bit MoE's gate-up
programs polled a flag instead of waiting for the router's grid, waiting for it at their end. Correct (GPU tests
with a replayed graph of 6 layers), but W4A16 B=1 took 1.794-1.826 ms against 1.762-1.770 without: the gate-up's
critical path fell 58-69 us a step while the router's grew 84-105 us, 64 of them with the flags published and no
consumer at all (the reset ahead of program 0's work and the release at the end), whatever the polling (volatile
loads or atomics, 32 or 256 flags) and with or without the consumer's final wait. Session 36 (commit 6c20fb3,
benchmarks/results/ab_handoff{,2}_s36_30b_w4a16_h100.*): the same without the reset (the MoE's down kernel put
the flags back after its wait), the router signalling after its partials: with 32-64 flags still 19-32 us a step
slower on the critical path, with 1-8 flags 64-160 us slower. Its publish alone cost the router 25-27 us (a
release waits for the picks to reach L2), and with pollers its end slipped 40-55 us more, against 48-63 gained by
the gate-up.
The one-token 4-bit MoE down kernel hinting its later K tiles into L2 ahead of its wait (a "moe_down" family, session
36, ab_downpf_s36_30b_w4a16_h100.*): down 17 us a step faster, the gate-up whose tail it competes with 33 slower.

Loads of constant weights into registers ahead of the wait (values, not hints; listed in READ_BEFORE_WAIT):
the 4-bit GEMV's first K tile of words (triton_w4a16.PRELOAD_FIRST_TILE; with GEMV_PRELOAD_SZ, session 26, that
tile of its scale_zero copy too; session 22, in-process A/B on the
H100, benchmarks/results/ab_preload_*_h100.json: Qwen3-30B-A3B W4A16 B=1 2.122 against 2.138 ms, Qwen3-8B
2.829 against 2.857). The same for the bf16 GEMV was slower (Qwen3-8B bf16 5.881 against 5.749, Qwen3-30B-A3B
3.309 against 3.282) and is not kept. The one-token int4 MoE's down kernel (triton_moe_w4_gemv, DOWN_PRELOAD)
reads the routing and its first K tile of expert words, scales and zeros before its wait: its predecessor,
the gate-up kernel, read the same routing after its own wait, so whatever wrote it had completed (session 26,
Qwen3-30B-A3B W4A16 B=1 1.853 against 1.901 ms, benchmarks/results/ab_dpre_30b_w4a16_h100.*).

Off on the CPU, in Triton's interpreter, below compute capability 9.0, with FTRANSFORMERS_DISABLE_PDL=1,
or through `set_pdl_enabled(False)` (`--disable-pdl`). CUDA graphs capture the launch attribute as a
programmatic edge, so replays keep the overlap.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ftransformers.kernels.launch import cdiv, next_pow2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_enabled = os.environ.get("FTRANSFORMERS_DISABLE_PDL", "0") in ("", "0") and not _INTERPRET
_by_device: dict[int, dict[str, bool]] = {}
_OFF: dict[str, bool] = {}
_ON: dict[str, bool] = {"USE_PDL": True, "launch_pdl": True}
_ON_PREFETCH: dict[str, bool] = {**_ON, "PREFETCH": True}
_ON_FLAGS: dict[tuple[bool, bool], dict[str, bool]] = {  # (prefetch, early trigger) -> launch arguments
    (False, False): _ON,
    (True, False): _ON_PREFETCH,
    (False, True): {**_ON, "EARLY_TRIGGER": True},
    (True, True): {**_ON_PREFETCH, "EARLY_TRIGGER": True},
}
PREFETCH_FAMILIES = frozenset({"norm", "router"})
_prefetch: frozenset[str] = (
    PREFETCH_FAMILIES if os.environ.get("FTRANSFORMERS_DISABLE_PDL_PREFETCH", "0") in ("", "0") else frozenset()
)
MAX_PREFETCH_LINES = 512  # a row's prefetch stops after this many 128-byte lines


def set_pdl_enabled(enabled: bool) -> None:
    """Turn PDL on or off for launches from now on (a captured CUDA graph keeps what it captured)."""
    global _enabled
    _enabled = bool(enabled) and not _INTERPRET


def pdl_enabled() -> bool:
    return _enabled


def set_pdl_prefetch(families: bool | frozenset[str]) -> None:
    """L2 prefetch ahead of the PDL wait for launches from now on (A/B measurements): on (True), off
    (False) or for some kernel families only."""
    global _prefetch
    chosen = PREFETCH_FAMILIES if families is True else frozenset() if families is False else frozenset(families)
    if chosen - PREFETCH_FAMILIES:
        raise ValueError(f"unknown prefetch families {sorted(chosen - PREFETCH_FAMILIES)}; valid: {sorted(PREFETCH_FAMILIES)}")
    _prefetch = chosen


def pdl_prefetch_families() -> frozenset[str]:
    return _prefetch


def pdl_launch(device: torch.device, prefetch: str | None = None, early: bool = False) -> dict[str, bool]:
    """Extra launch arguments for a kernel taking `USE_PDL: tl.constexpr = False`: none where PDL is off,
    else the constexpr and Triton's `launch_pdl` option; with `prefetch` (the family of a kernel that
    also takes `PREFETCH: tl.constexpr = False`) PREFETCH=True while that family's prefetch is on; with
    `early` (a kernel taking `EARLY_TRIGGER: tl.constexpr = False`, see the contract) EARLY_TRIGGER=True."""
    if not _enabled or device.type != "cuda":
        return _OFF
    index = device.index if device.index is not None else torch.cuda.current_device()
    args = _by_device.get(index)
    if args is None:
        args = _ON if torch.cuda.get_device_capability(index)[0] >= 9 else _OFF
        _by_device[index] = args
    if args is not _ON:
        return args
    return _ON_FLAGS[prefetch in _prefetch, early]


def early_trigger_on(mode: int, asked: bool) -> bool:
    """A kernel module's EARLY_TRIGGER toggle (0 never, 1 where the caller asks, 2 always) for one call."""
    return mode == 2 or (mode == 1 and asked)


@triton.jit
def pdl_trigger(EARLY_TRIGGER: tl.constexpr):
    # first statement of a kernel that triggers early (see the contract above); pdl_enter's own signal after
    # the wait is then a repeat, which griddepcontrol allows
    if EARLY_TRIGGER:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    # first statement of a kernel launched through pdl_launch (see the contract above)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def prefetch_lines(row_elems: int, element_size: int) -> dict[str, int]:
    """PF_STRIDE (elements per 128-byte line) and PF_LINES (lines to cover a row of `row_elems`, a power
    of two for tl.arange, at most MAX_PREFETCH_LINES) for a kernel prefetching whole rows."""
    stride = max(1, 128 // element_size)
    lines = min(MAX_PREFETCH_LINES, next_pow2(cdiv(row_elems, stride)))
    return {"PF_STRIDE": stride, "PF_LINES": lines}


@triton.jit
def l2_prefetch(ptrs, PREFETCH: tl.constexpr):
    # pull the 128-byte lines holding `ptrs` (in-bounds addresses, one per line is enough) into L2; a
    # hint with no value, issued ahead of pdl_enter by kernels launched with pdl_launch(prefetch=FAMILY)
    if PREFETCH:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
