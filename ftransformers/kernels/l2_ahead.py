"""L2 prefetch of a later kernel's weights ("ahead"), issued by a latency-bound kernel of the decode step.

At batch 1 a decode layer alternates weight-streaming kernels (GEMVs, the MoE pair path) with kernels
that read little and wait a lot (decode attention, router, norms), so DRAM idles through the latter. A
kernel launched with `ahead_args(tensors)` spreads `prefetch.global.L2` hints for the 128-byte lines of
up to three tensors (a later kernel's weight, scales, zeros) over its programs, so the later kernel
reads them from L2. Families, by the kernel that prefetches and the weight it pulls:
  o     decode attention stage 1 (GQA): the attention's output projection
  down  the MoE pair path's gate-up kernel: the down weights of its program's expert (its share of them)

A prefetch is a hint with no value: it never changes a result, as long as every address is in bounds
(the ranges are whole tensors, or one expert's block of a stacked tensor). Unlike kernels/pdl.py's
`l2_prefetch` (a kernel's own first reads, before its PDL wait), these lines are for another kernel,
and they are issued after the wait.

`set_l2_ahead` picks families and where in the prefetching kernel the hints go (A/B runs:
benchmarks/ab_decode.py); none is on by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

AHEAD_FAMILIES = frozenset({"o", "down"})
_families: frozenset[str] = frozenset()
_bulk = False  # one cp.async.bulk.prefetch.L2 a thread instead of a prefetch.global.L2 a line
_at_end = False  # after the kernel's own stores instead of right after its PDL wait


def set_l2_ahead(families: frozenset[str] | set[str], bulk: bool = False, at_end: bool = False) -> None:
    """Families whose kernels prefetch ahead from now on (captured graphs keep what they captured)."""
    global _families, _bulk, _at_end
    chosen = frozenset(families)
    if chosen - AHEAD_FAMILIES:
        raise ValueError(
            f"unknown L2-ahead families {sorted(chosen - AHEAD_FAMILIES)}; valid: {sorted(AHEAD_FAMILIES)}"
        )
    _families, _bulk, _at_end = chosen, bool(bulk), bool(at_end)


def l2_ahead_settings() -> tuple[frozenset[str], bool, bool]:
    return _families, _bulk, _at_end


def l2_ahead_on(family: str) -> bool:
    return family in _families


def ahead_args(tensors: Sequence[torch.Tensor] | None, anchor: torch.Tensor, num_warps: int) -> dict[str, Any]:
    """Launch arguments AH0-2 (tensors), AN0-2 (bytes of each, or of one block of a stacked tensor, its
    stride along dim 0), AHEAD (0 off, 1 lines, 2 bulk), AHEAD_END, AHEAD_LANES for a kernel calling
    `l2_ahead`. `anchor` fills unused slots (never read). Off on the CPU and below compute capability 9.0
    (bulk prefetch is Hopper's)."""
    if not tensors or not anchor.is_cuda or torch.cuda.get_device_capability(anchor.device)[0] < 9:
        return {"AH0": anchor, "AN0": 0, "AH1": anchor, "AN1": 0, "AH2": anchor, "AN2": 0,
                "AHEAD": 0, "AHEAD_END": False, "AHEAD_LANES": 32}  # fmt: skip
    ts = list(tensors)[:3]
    sizes = [_block_bytes(t) for t in ts] + [0] * (3 - len(ts))
    ts += [anchor] * (3 - len(ts))
    return {
        "AH0": ts[0], "AN0": sizes[0], "AH1": ts[1], "AN1": sizes[1], "AH2": ts[2], "AN2": sizes[2],
        "AHEAD": 2 if _bulk else 1, "AHEAD_END": _at_end, "AHEAD_LANES": 32 * num_warps,
    }  # fmt: skip


def _block_bytes(t: torch.Tensor) -> int:
    # whole tensor (2-D weight) or one expert's block (stacked [E, ...], contiguous): its dim-0 stride
    if not t.is_contiguous():
        raise ValueError(f"L2 ahead needs contiguous tensors, got shape {tuple(t.shape)} strides {t.stride()}")
    return (t.stride(0) if t.dim() == 3 else t.numel()) * t.element_size()


@triton.jit
def _range_share(base, nbytes, block, part, parts, AHEAD: tl.constexpr, LANES: tl.constexpr):
    # program `part` of `parts` hints its share of bytes [block * nbytes, (block + 1) * nbytes) of `base`
    ptr = base.to(tl.pointer_type(tl.int8)) + block * nbytes
    lanes = tl.arange(0, LANES)
    if AHEAD == 1:
        nlines = tl.cdiv(nbytes, 128)
        per = tl.cdiv(nlines, parts)
        lo = part * per
        hi = tl.minimum(lo + per, nlines)
        for i in range(lo, hi, LANES):
            line = tl.minimum(i + lanes, hi - 1).to(tl.int64)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; // $0", "=r,l", [ptr + line * 128], dtype=tl.int32, is_pure=False, pack=1
            )
    else:
        # per lane one bulk prefetch of a 16-byte-aligned chunk (a tail under 16 bytes is left out)
        per = tl.cdiv(tl.cdiv(nbytes, parts), 16) * 16
        lo = part * per
        hi = tl.minimum(lo + per, (nbytes // 16) * 16)
        chunk = tl.cdiv(tl.cdiv(per, LANES), 16) * 16
        start = lo + lanes * chunk
        size = tl.maximum(tl.minimum(hi - start, chunk), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } // $0",
            "=r,l,r", [ptr + tl.minimum(start, hi).to(tl.int64), size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def l2_ahead(AH0, AN0, AH1, AN1, AH2, AN2, block, part, parts, AHEAD: tl.constexpr, LANES: tl.constexpr):
    # each program of a launch with ahead_args calls this once (where AHEAD_END says): block 0 for whole
    # tensors, the expert for stacked ones
    if AHEAD != 0:
        _range_share(AH0, AN0, block, part, parts, AHEAD, LANES)
        _range_share(AH1, AN1, block, part, parts, AHEAD, LANES)
        _range_share(AH2, AN2, block, part, parts, AHEAD, LANES)
