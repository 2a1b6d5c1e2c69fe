"""What a kernel boundary costs in a decode step, against what a persistent decode layer would pay instead.

A batch-1 decode step is a chain of ~9 kernels a layer, each waiting for the one before (programmatic
dependent launch, kernels/pdl.py) and then paying a few dependent trips to L2 (its inputs, a reduction,
its stores). Three chains of L links, each a CUDA graph timed by triton's do_bench_cudagraph, µs per link:

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
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_w4a16 import make_weight
from ceilings import copy_bandwidth

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


def stream_rows(dev: str, sms: int, copy_gbs: float) -> list[dict]:
    rows: list[dict] = []
    out = torch.zeros(8 * 4096, dtype=torch.int32, device=dev)
    kw = pdl_launch(torch.device(dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    n, k = 5120, 2048
    qws = [make_weight("int4-asym", n, k, gen) for _ in range(STREAM_LINKS)]
    gemv_bytes = sum(t.numel() * t.element_size() for t in (qws[0].qweight, qws[0].scales, qws[0].zeros))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)

    def gemv_chain() -> None:
        for qw in qws:
            w4a16_linear(x, qw)

    gemv_us = us_per(gemv_chain, STREAM_LINKS)
    print(f"one-row 4-bit GEMV 5120x2048 (qkv): {gemv_us:.2f} us a link, floor {gemv_bytes / copy_gbs / 1e3:.2f} us")
    for label, total_chunks, programs in (("qkv-sized", 10 * sms, (sms, 2 * sms, 5 * sms, 10 * sms)),
                                          ("gate-up-sized", 24 * sms, (sms, 2 * sms, 4 * sms, 8 * sms, 24 * sms))):  # fmt: skip
        size = total_chunks * CHUNK * 4
        pool = torch.randint(0, 1000, (STREAM_LINKS, total_chunks * CHUNK), device=dev, dtype=torch.int32)
        floor = size / copy_gbs / 1e3
        for g in programs:
            per = total_chunks // g * CHUNK
            warps = 4 if per <= 8 * CHUNK else 8

            def chain(g: int = g, pool: torch.Tensor = pool, per: int = per, warps: int = warps) -> None:
                for i in range(STREAM_LINKS):
                    _stream_kernel[(g,)](pool[i], out, PER=per, CHUNK=CHUNK, num_warps=warps, **kw)

            us = us_per(chain, STREAM_LINKS)
            row = {"stream": label, "bytes": size, "programs": g, "bytes_a_program": per * 4, "num_warps": warps,
                   "us": us, "floor_us": floor, "gemv_qkv_us": gemv_us, "gemv_qkv_bytes": gemv_bytes}  # fmt: skip
            rows.append(row)
            print(f"{label:13s} {size / 1e6:5.2f} MB  G={g:5d} ({per * 4 // 1024:3d} KB a program, {warps} warps)  "
                  f"{us:6.2f} us a link  floor {floor:5.2f} us  ({floor / us:4.0%} of copy)")  # fmt: skip
        del pool
    return rows


def chase_buffer(device: str) -> torch.Tensor:
    """buf[i] = the next slot, 33 lines (of 32 int32) on, so that consecutive loads never share a line."""
    idx = torch.arange(CHASE, device=device, dtype=torch.int32)
    return (idx + 33 * 32) % CHASE


def us_per(fn, count: int) -> float:
    return do_bench_cudagraph(fn, rep=200) * 1e3 / count


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = "cuda"
    buf = chase_buffer(dev)
    out = torch.zeros(2048, dtype=torch.int32, device=dev)
    counter = torch.zeros(2, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = torch.cuda.get_device_name(0)
    rows: list[dict] = []

    chase_steps = LINKS * 16
    trip = us_per(lambda: _chase_kernel[(1,)](buf, out, CHASE, chase_steps, num_warps=4), chase_steps)
    print(f"{name}: one dependent L2 round trip (pointer chase, one program) {trip:.3f} us")

    for g in (1, sms, 2 * sms, 4 * sms, 8 * sms):
        for r in (0, 2, 4):
            row = {"programs": g, "round_trips": r}
            for pdl in (True, False):
                kw = pdl_launch(torch.device(dev)) if pdl else {}

                def chain(g: int = g, r: int = r, kw: dict = kw) -> None:
                    for _ in range(LINKS):
                        _link_kernel[(g,)](buf, out, CHASE, R=r, num_warps=4, **kw)

                row["launch_pdl_us" if pdl else "launch_plain_us"] = us_per(chain, LINKS)
            row["barrier_us"] = us_per(
                lambda g=g, r=r: _barrier_kernel[(g,)](buf, out, counter, CHASE, g, LINKS, R=r, num_warps=4), LINKS
            )
            assert int(counter.sum().item()) == 0, "the barrier counters must be back at zero"
            rows.append(row)
            print(
                f"G={g:5d} R={r}  launch, PDL {row['launch_pdl_us']:6.2f} us  plain {row['launch_plain_us']:6.2f} us"
                f"  grid barrier {row['barrier_us']:6.2f} us  (R round trips alone {r * trip:5.2f} us)"
            )
    copy_gbs = copy_bandwidth(dev)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    streams = stream_rows(dev, sms, copy_gbs)
    result = {"device": name, "date": datetime.date.today().isoformat(), "sms": sms, "links": LINKS, "round_trip_us": trip, "rows": rows,
              "copy_gbs": copy_gbs, "stream_links": STREAM_LINKS, "streams": streams,
              "command": "PYTHONPATH=$PWD python benchmarks/bench_launch_chain.py --out ..."}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
