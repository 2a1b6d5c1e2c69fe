"""How fast one token's routed int4 expert words can reach shared memory by TMA: the floor of a MoE kernel
that stages its weights in shared memory, beside the pair path's own kernels in the same process.

Qwen3-30B-A3B experts (D 2048, I 768, 128 experts, top-8), int4 g128. `_stage_kernel` only moves words: a
program issues every TMA box of its share at once (one mbarrier a box), then waits for each in turn and
reads it from shared memory into registers (as a compute stage would; an xor keeps the reads), and stores one
word. Gate-up: program (pair, BLK rows of I), boxes of BOX_R rows of the gate and of the up half, all of D.
Down: program (group of SLOTS slots, BLK rows of D), a box of BOX_R rows of all of I a slot. Floor = the words
moved / the copy bandwidth measured in this run (the scales and zeros, 1/16 of the words' bytes at g128
with zeros, are not moved here and not counted). Times: CUDA graph of REPS calls over routings that avoid
the previous call's experts (so every word comes from DRAM), median; the pair path's gate-up and down
kernels (default config at one token) are timed the same way on the same weights.

    PYTHONPATH=$PWD python benchmarks/bench_moe_stage.py --out $OUT/moe_stage_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_moe_w4 as bm
import bench_w4_b1 as b1
from ceilings import Report

from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.gluon_mla_decode import pdl_enter
from ftransformers.kernels.pdl import pdl_launch

REPS = 8


@gluon.jit
def _stage_kernel(
    desc, ids_ptr, sink_ptr, rows_e, half, num_groups,
    SLOTS: gl.constexpr, SEGS: gl.constexpr, BLK: gl.constexpr, BOX_R: gl.constexpr, BOX_C: gl.constexpr,
    CB: gl.constexpr, SUB: gl.constexpr, TPW_C: gl.constexpr, W: gl.constexpr, PRE_WAIT: gl.constexpr,
    USE_PDL: gl.constexpr = False,
):  # fmt: skip
    # desc: the words [E * rows_e, CB * BOX_C] int32, boxes [BOX_R, BOX_C]; program (group g, block b): for slot
    # s < SLOTS, segment j < SEGS, rows ids[g SLOTS + s] rows_e + j half + b BLK + [0, BLK), all CB column boxes.
    # PRE_WAIT: the copies are issued before the PDL wait (no kernel here writes ids or the words)
    if not PRE_WAIT:
        pdl_enter(USE_PDL)
    NB: gl.constexpr = BLK // BOX_R
    NBOX: gl.constexpr = SLOTS * SEGS * NB * CB
    pid = gl.program_id(0)
    grp = pid % num_groups
    blk = pid // num_groups
    smem = gl.allocate_shared_memory(gl.int32, [NBOX, BOX_R, BOX_C], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NBOX, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NBOX):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()
    for b in gl.static_range(NBOX):
        rb = b // CB  # (slot, segment, part) of box b; column box b % CB
        expert = gl.load(ids_ptr + grp * SLOTS + rb // (SEGS * NB))
        row = expert * rows_e + ((rb // NB) % SEGS) * half + blk * BLK + (rb % NB) * BOX_R
        mbarrier.expect(bars.index(b), BOX_R * BOX_C * 4)
        tma.async_copy_global_to_shared(desc, [row, (b % CB) * BOX_C], bars.index(b), smem.index(b))
    if PRE_WAIT:
        pdl_enter(USE_PDL)
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPW_C, TPW_C], [W, 1], [1, 0])
    acc = gl.zeros([SUB, BOX_C], gl.int32, lay)
    for b in gl.static_range(NBOX):
        mbarrier.wait(bars.index(b), 0)
        for r in gl.static_range(0, BOX_R, SUB):
            acc ^= smem.index(b).slice(r, SUB, dim=0).load(lay)
    for b in gl.static_range(NBOX):
        mbarrier.invalidate(bars.index(b))
    gl.store(sink_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _spin_kernel(ns, USE_PDL: gl.constexpr = False):
    # a latency-bound predecessor: each program waits `ns` nanoseconds of the global timer
    pdl_enter(USE_PDL)
    t0 = _now()
    t = t0
    while t - t0 < ns:
        t = _now()


def spin(ns: int, device: torch.device) -> None:
    _spin_kernel[(SPIN_PROGRAMS,)](ns, num_warps=1, **pdl_launch(device))


def stage(words: torch.Tensor, ids: torch.Tensor, slots: int, segs: int, blk: int, box_r: int, box_c: int,
          warps: int, pre_wait: bool = False) -> None:  # fmt: skip
    """words [E, R, C] int32 (R = segs halves), ids [G * slots] int32: one launch of `_stage_kernel`."""
    e, rows_e, cols = words.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = TensorDescriptor.from_tensor(words.view(e * rows_e, cols), [box_r, box_c], layout)
    groups = ids.numel() // slots
    half = rows_e // segs
    sink = torch.empty(groups * (half // blk), dtype=torch.int32, device=words.device)
    _stage_kernel[(sink.numel(),)](
        desc, ids, sink, rows_e, half, groups, SLOTS=slots, SEGS=segs, BLK=blk, BOX_R=box_r, BOX_C=box_c,
        CB=cols // box_c, SUB=min(16, box_r), TPW_C=min(32, box_c // 4), W=warps, PRE_WAIT=pre_wait, num_warps=warps,
        **pdl_launch(words.device),
    )  # fmt: skip


SPIN_PROGRAMS = 16
SPIN_NS = 4000
# (name, slots a program, segments, BLK, BOX_R, BOX_C (words), warps); gate-up rows are 256 words, down's 96
GATE_UP = [("up blk64 box64x256", 1, 2, 64, 64, 256, 4), ("up blk64 box16x256", 1, 2, 64, 16, 256, 4),
           ("up blk32 box32x256", 1, 2, 32, 32, 256, 4), ("up blk32 box8x256", 1, 2, 32, 8, 256, 4),
           ("up blk16 box16x256", 1, 2, 16, 16, 256, 4), ("up blk64 box16x256 w8", 1, 2, 64, 16, 256, 8),
           ("up blk32 box32x64", 1, 2, 32, 32, 64, 4)]  # fmt: skip
DOWN = [("down slots8 blk32 box32x32", 8, 1, 32, 32, 32, 4), ("down slots8 blk16 box16x32", 8, 1, 16, 16, 32, 4),
        ("down slots4 blk32 box32x32", 4, 1, 32, 32, 32, 4), ("down slots2 blk64 box64x32", 2, 1, 64, 64, 32, 4),
        ("down slots8 blk32 box8x32", 8, 1, 32, 8, 32, 4)]  # fmt: skip


def cases(fname: str) -> list[tuple[str, Any, int]]:
    """(name, call(i), bytes) for the pair path's two kernels and every staging config, on fresh weights."""
    d, _, e, k = bm.SHAPES["qwen3-30b-a3b"]
    fmt = bm.FORMATS[fname][0]
    w13, w2, hiddens, routes, _ = b1.pair_inputs(fname, REPS)
    ids = [r[1].reshape(-1).to(torch.int32).contiguous() for r in routes]
    cfg = w4.default_w4_pair_config(1, d, fmt)
    acts = [w4.pair_gate_up(hiddens[i], w13, routes[i][1], cfg) for i in range(REPS)]
    up_words, down_words = k * w13.qweight[0].nbytes, k * w2.qweight[0].nbytes
    out: list[tuple[str, Any, int]] = [
        ("pair gate_up (all bytes)", lambda i: w4.pair_gate_up(hiddens[i], w13, routes[i][1], cfg), k * w13.nbytes() // e),
        ("pair down (all bytes)", lambda i: w4.pair_down(acts[i], hiddens[i], w2, *routes[i], cfg), k * w2.nbytes() // e),
    ]  # fmt: skip
    for cname, *a in GATE_UP:
        out.append((cname, lambda i, a=a: stage(w13.qweight, ids[i], *a), up_words))
    for cname, *a in DOWN:
        out.append((cname, lambda i, a=a: stage(w2.qweight, ids[i], *a), down_words))
    # a latency-bound kernel, then staging issued after or before the PDL wait: how much of the copy hides
    dev = w13.qweight.device
    out.append((f"spin {SPIN_NS} ns alone", lambda i: spin(SPIN_NS, dev), 0))
    for cname, words, a, nbytes in [(*GATE_UP[2][:1], w13.qweight, GATE_UP[2][1:], up_words),
                                    (*DOWN[3][:1], w2.qweight, DOWN[3][1:], down_words)]:  # fmt: skip
        for pre in (False, True):
            call = lambda i, w=words, a=a, pre=pre: (spin(SPIN_NS, dev), stage(w, ids[i], *a, pre_wait=pre))
            out.append((f"spin + {cname}" + (" pre-wait" if pre else ""), call, nbytes))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = Report(bm.DEV, rows=[])
    bw, out, log = report.copy_gbs, report.out, report.log
    fname = "int4-g128-asym"
    for cname, call, nbytes in cases(fname):
        try:
            us = bm.graph_ms(call, REPS) * 1e3
        except Exception as exc:  # noqa: BLE001 - a config the device refuses (shared memory): say so, go on
            log(f"{fname} {cname:26s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        floor = nbytes / bw / 1e3
        out["rows"].append({"format": fname, "case": cname, "bytes": nbytes, "floor_us": floor, "us": us})
        log(f"{fname} {cname:40s} {us:6.2f} us  floor {floor:5.2f} us  {100 * floor / us:4.0f}% of copy")
    report.save(args.out)


if __name__ == "__main__":
    main()
