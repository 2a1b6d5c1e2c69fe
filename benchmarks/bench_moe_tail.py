"""Probe: what a one-launch few-token MoE with its down projection summed by float32 atomics would cost.

Today one Qwen3-30B-A3B token's 4-bit MoE is two launches (triton_moe_w4_gemv: gate-up, then down after a PDL
wait for the gate-up grid), 13.35 us alone against a 6.5 us byte floor. A single launch could have each program
read its expert's gate/up rows *and* the matching columns of the down weight at once (only the expert id is
needed to address them), form its slice of act, multiply it into a [D] partial and add that into the output with
atomics, so no program waits for another. Whether that can win depends on two things this script measures in
isolation, with no MoE arithmetic:

- how fast P programs stream the token's 19.5 MB when each reads a contiguous 1/P of it (one launch, no
  dependent round trip but the first);
- what P x D float32 atomic adds into one [D] row cost on top (`tl.atomic_add`, relaxed), against storing the
  same partials to distinct rows (what a "last one out" reduction would read back).

Each variant runs as a CUDA graph of launches over enough copies of the bytes to exceed L2 four times (ceilings.graph_ms);
figures are us a launch, beside the byte floor (bytes / the copy bandwidth measured in the same process, ceilings.py).
That is the timer of bench_moe_w4 and bench_w4_b1, whose one-token MoE figure (13.35 us) this compares with. The
script first timed 20 back-to-back replays with CUDA events (commit 93a4a8a, moe_tail_events*_h100.*): about 1 us
a launch lower, not comparable.

    PYTHONPATH=$PWD python benchmarks/bench_moe_tail.py --out /tmp/r/moe_tail_h100.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from ceilings import Report, graph_ms

MB = 19.5e6  # one Qwen3-30B-A3B token's int4 experts: 8 x (gate+up 1536 x 2048 + down 2048 x 768) nibbles + scales
D = 2048


@triton.jit
def _stream_kernel(src, out, part, WORDS: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    # program p reads int32 words [p * WORDS, (p + 1) * WORDS) of src; MODE 0: stores a [D] row of partials to
    # part[p], 1: adds it into out with relaxed float32 atomics, 2: reads nothing and adds (atomics alone)
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if MODE != 2:
        base = src + pid.to(tl.int64) * WORDS
        for off in range(0, WORDS, BLOCK):
            acc += tl.load(base + off + tl.arange(0, BLOCK), mask=off + tl.arange(0, BLOCK) < WORDS, other=0)
    s = tl.sum(acc).to(tl.float32)
    vals = tl.full([D], 1.0, dtype=tl.float32) + s * 1e-30  # depends on every load, so the adds come after them
    offs = tl.arange(0, D)
    if MODE == 0:
        tl.store(part + pid * D + offs, vals)
    else:
        tl.atomic_add(out + offs, vals, sem="relaxed")


def launcher(src: list[torch.Tensor], out: torch.Tensor, part: torch.Tensor, p: int, words: int, mode: int,
             block: int, warps: int) -> Callable[[int], None]:  # fmt: skip
    def launch(i: int) -> None:  # over copy i of the bytes
        _stream_kernel[(p,)](src[i], out, part, WORDS=words, BLOCK=block, D=D, MODE=mode, num_warps=warps)

    return launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--programs", default="132,264,528,1056,1584")
    ap.add_argument("--block", type=int, default=2048, help="int32 words a program loads an iteration")
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    dev = "cuda"
    copies = max(2, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // int(MB)))
    report = Report(dev, bytes=MB, block_words=args.block, warps=args.warps, copies=copies)
    floor_us = MB / report.copy_gbs / 1e3
    report.out["floor_us"] = floor_us
    report.log(f"bytes {MB / 1e6:.1f} MB  floor {floor_us:.2f} us  copies {copies}")
    rows = report.out["rows"] = []
    for p in (int(x) for x in args.programs.split(",")):
        words = -(-int(MB) // (4 * p))
        src = [torch.randint(-(2**30), 2**30, (p * words,), dtype=torch.int32, device=dev) for _ in range(copies)]
        out = torch.zeros(D, dtype=torch.float32, device=dev)
        part = torch.empty(p, D, dtype=torch.float32, device=dev)
        row = {"programs": p, "bytes_per_program": 4 * words}
        for mode, name in ((0, "stream_store"), (1, "stream_atomic"), (2, "atomic_only")):
            row[name] = graph_ms(launcher(src, out, part, p, words, mode, args.block, args.warps), copies) * 1e3
        row["pct_of_copy_store"] = 100 * floor_us / row["stream_store"]
        row["pct_of_copy_atomic"] = 100 * floor_us / row["stream_atomic"]
        rows.append(row)
        report.log(f"P={p:5d} {4 * words / 1e3:7.1f} KB a program: stream+store {row['stream_store']:6.2f} us "
                   f"({row['pct_of_copy_store']:.0f}% of copy), stream+atomics {row['stream_atomic']:6.2f} us "
                   f"({row['pct_of_copy_atomic']:.0f}%), atomics alone {row['atomic_only']:6.2f} us")  # fmt: skip
        del src
    report.save(args.out)


if __name__ == "__main__":
    main()
