"""What a kernel boundary costs in a decode step, against what a persistent decode layer would pay instead.

A batch-1 decode step is a chain of ~9 kernels a layer, each waiting for the one before (programmatic
dependent launch, kernels/pdl.py) and then paying a few dependent trips to L2 (its inputs, a reduction,
its stores). Three chains of L links, each a CUDA graph timed by bench_router.per_call_us (triton's do_bench_cudagraph),
µs per link:

  launch   L launches of `_link_kernel`: G programs, each waits for the previous launch (PDL on, or plain
           stream order with PDL off), then R dependent loads through L2 (`.cg`: a pointer chase, each address
           the previous load's value) and a store
  barrier  one launch of G programs (all resident) meeting L times at a grid barrier (kernels/tickets.py
           grid_barrier: an atomic arrival, then polling the counter), R dependent loads before each: the
           synchronisation a persistent kernel would use instead of a boundary
  chase    one launch, one program, L x R dependent loads: the latency of one L2 round trip, the peer every
           other figure is read against (no bandwidth floor applies: nothing here moves bytes in bulk)

G: 1 program and 1, 2, 4, 8 an SM (132 SMs on the H100); R: 0, 2, 4.

Then what a weight-streaming link costs in such a chain, by how many programs share its bytes:

  stream   48 launches (a layer each), each reading its own S bytes (no L2 reuse between links) with G
           programs of S / G bytes, a program's loads in one unrolled block, PDL on; beside S over the copy
           bandwidth measured in the same run, and beside the engine's one-row 4-bit GEMV (`w4a16_linear`,
           Qwen3-30B-A3B's qkv: 5120 x 2048 int4 g128 asym, 5.49 MB with its scales and zeros) in the same
           chain. S: 10 or 24 chunks of 4 KB an SM, 5.41 MB (about that GEMV's bytes) and 12.98 MB (about the
           MoE gate-up's at one token, 12.6 MB of words).

    PYTHONPATH=$PWD python benchmarks/bench_launch_chain.py --out $OUT/r/launch_chain_h100.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_router import per_call_us
from bench_w4a16 import make_weight
from ceilings import Report

from ftransformers.kernels.pdl import pdl_enter, pdl_launch
from ftransformers.kernels.tickets import exit_ticket, grid_barrier
from ftransformers.kernels.triton_w4a16 import w4a16_linear

LINKS = 64
CHASE = 4096  # int32 slots of the pointer chase (16 KB: L2-resident, each load a new line)


@triton.jit
def _link_kernel(buf, out, n, R: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    i = (pid * 37) % n
    for _ in tl.static_range(R):
        i = tl.load(buf + i, cache_modifier=".cg")
    tl.store(out + pid, i)


@triton.jit
def _barrier_kernel(buf, out, counter, n, programs, L, R: tl.constexpr):
    pid = tl.program_id(0)
    i = (pid * 37) % n
    passed = 0
    for _ in range(L):
        for _ in tl.static_range(R):
            i = tl.load(buf + i, cache_modifier=".cg")
        passed = grid_barrier(counter, programs, passed)
    tl.store(out + pid, i)
    exit_ticket(counter, programs)


@triton.jit
def _chase_kernel(buf, out, n, steps):
    i = 0
    for _ in range(steps):
        i = tl.load(buf + i, cache_modifier=".cg")
    tl.store(out, i)


@triton.jit
def _stream_kernel(src, out, PER: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # program pid reads int32 [pid * PER, (pid + 1) * PER) of src, all its chunks requested before any is used
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    base = src + pid.to(tl.int64) * PER
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for c in tl.static_range(PER // CHUNK):
        acc += tl.load(base + c * CHUNK + tl.arange(0, CHUNK))
    tl.store(out + pid, tl.sum(acc, axis=0))


STREAM_LINKS = 48
CHUNK = 1024  # int32 a chunk: 4 KB, two 16-byte loads a thread at 4 warps


def stream_us(pool: torch.Tensor, programs: int, per: int, warps: int, kw: dict) -> float:
    """µs a link of len(pool) launches: link i reads pool[i] with `programs` programs of `per` int32 each."""
    out = torch.empty(programs, dtype=torch.int32, device=pool.device)
    return per_call_us(
        lambda i: _stream_kernel[(programs,)](pool[i], out, PER=per, CHUNK=CHUNK, num_warps=warps, **kw), len(pool)
    )


def gemv_us(linear: Callable[..., torch.Tensor], x: torch.Tensor, qws: list, config: dict | None = None) -> float:
    """µs a link of len(qws) launches: link i is linear(x, qws[i]) (`w4a16_linear`, or an ablated copy of it)."""
    return per_call_us(lambda i: linear(x, qws[i], config=config), len(qws))


def stream_rows(dev: str, sms: int, report: Report) -> list[dict]:
    rows: list[dict] = []
    copy_gbs = report.copy_gbs
    kw = pdl_launch(torch.device(dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    n, k = 5120, 2048
    qws = [make_weight("int4-asym", n, k, gen) for _ in range(STREAM_LINKS)]
    gemv_bytes = sum(t.numel() * t.element_size() for t in (qws[0].qweight, qws[0].scales, qws[0].zeros))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    gemv = gemv_us(w4a16_linear, x, qws)
    report.log(f"one-row 4-bit GEMV 5120x2048 (qkv): {gemv:.2f} us a link, floor {gemv_bytes / copy_gbs / 1e3:.2f} us")
    for label, total_chunks, programs in (("qkv-sized", 10 * sms, (sms, 2 * sms, 5 * sms, 10 * sms)),
                                          ("gate-up-sized", 24 * sms, (sms, 2 * sms, 4 * sms, 8 * sms, 24 * sms))):  # fmt: skip
        size = total_chunks * CHUNK * 4
        pool = torch.randint(0, 1000, (STREAM_LINKS, total_chunks * CHUNK), device=dev, dtype=torch.int32)
        floor = size / copy_gbs / 1e3
        for g in programs:
            per = total_chunks // g * CHUNK
            warps = 4 if per <= 8 * CHUNK else 8
            us = stream_us(pool, g, per, warps, kw)
            row = {"stream": label, "bytes": size, "programs": g, "bytes_a_program": per * 4, "num_warps": warps,
                   "us": us, "floor_us": floor, "gemv_qkv_us": gemv, "gemv_qkv_bytes": gemv_bytes}  # fmt: skip
            rows.append(row)
            report.log(f"{label:13s} {size / 1e6:5.2f} MB  G={g:5d} ({per * 4 // 1024:3d} KB a program, {warps} warps)  "
                       f"{us:6.2f} us a link  floor {floor:5.2f} us  ({floor / us:4.0%} of copy)")  # fmt: skip
        del pool
    return rows


def chase_buffer(device: str) -> torch.Tensor:
    """buf[i] = the next slot, 33 lines (of 32 int32) on, so that consecutive loads never share a line."""
    idx = torch.arange(CHASE, device=device, dtype=torch.int32)
    return (idx + 33 * 32) % CHASE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = "cuda"
    buf = chase_buffer(dev)
    out = torch.zeros(2048, dtype=torch.int32, device=dev)
    counter = torch.zeros(2, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = Report(dev, sms=sms, links=LINKS, rows=[], stream_links=STREAM_LINKS,
                    command="PYTHONPATH=$PWD python benchmarks/bench_launch_chain.py --out ...")  # fmt: skip

    chase_steps = LINKS * 16
    trip = per_call_us(lambda _i: _chase_kernel[(1,)](buf, out, CHASE, chase_steps, num_warps=4), 1) / chase_steps
    report.out["round_trip_us"] = trip
    report.log(f"one dependent L2 round trip (pointer chase, one program) {trip:.3f} us")

    for g in (1, sms, 2 * sms, 4 * sms, 8 * sms):
        for r in (0, 2, 4):
            row = {"programs": g, "round_trips": r}
            for pdl in (True, False):
                kw = pdl_launch(torch.device(dev)) if pdl else {}
                row["launch_pdl_us" if pdl else "launch_plain_us"] = per_call_us(
                    lambda _i, g=g, r=r, kw=kw: _link_kernel[(g,)](buf, out, CHASE, R=r, num_warps=4, **kw), LINKS
                )
            row["barrier_us"] = (
                per_call_us(
                    lambda _i, g=g, r=r: _barrier_kernel[(g,)](buf, out, counter, CHASE, g, LINKS, R=r, num_warps=4), 1
                )
                / LINKS
            )
            assert int(counter.sum().item()) == 0, "the barrier counters must be back at zero"
            report.out["rows"].append(row)
            report.log(
                f"G={g:5d} R={r}  launch, PDL {row['launch_pdl_us']:6.2f} us  plain {row['launch_plain_us']:6.2f} us"
                f"  grid barrier {row['barrier_us']:6.2f} us  (R round trips alone {r * trip:5.2f} us)"
            )
    report.out["streams"] = stream_rows(dev, sms, report)
    report.save(args.out)


if __name__ == "__main__":
    main()
