"""What a kernel pays to read data the kernel before it has just written, against reading it a second time.

Session 45 found MLA decode's stage 2 reading its partials in 3.3 us the first time and 1.4 the second; session 49
found the fused router 3 us slower a layer once each of its 64 programs read a 4 KB vector that 1024 GEMV programs
had just written 4 bytes each, and only 0.2 us slower with 256 writers (benchmarks/results/ab_fold*_s49_h200.log).
This separates the suspects: how many programs wrote the lines, in what pieces, and how many programs read them.

A CUDA graph of LAYERS links, each: `_write_kernel` (P programs, each storing its CHUNK contiguous bytes of an S-byte
buffer; P = S / CHUNK; in some cases 1024 programs first stream 16 MB from DRAM, as a GEMV would), then
`_read_kernel` twice (R programs; `all`: each loads all S bytes, `split`: each its S / R contiguous, `rows`: each its
[128, 32] tile of 2 KB rows, as MLA decode's stage 2 reads its partials).
A reader program stamps %globaltimer at entry (after its PDL wait, with --pdl) and once its loads have landed (the
stamp's asm takes the loaded sum as an operand, so it cannot run earlier); its load time is the difference. Figures
are medians over the programs of every link, and the slowest program, of the last replay: "first" is the reader
right after the writer, "again" the same reader launched once more on the same bytes.

    PYTHONPATH=$PWD python benchmarks/bench_first_read.py --out $OUT/first_read_h200.json [--pdl]

H200 (first_read*_s49_h200.log): no case pays more than 0.4 us on a first read over the second, stage 2's own tiles
behind a PDL wait included (0.96 against 0.90 us), except one combination: behind a stream larger than the L2
(128 MB), stage 2's tiles gathering 2 KB rows written by 2048 programs, 1.47-1.50 against 0.90 us (32 KB blocks by
128 programs: 0.99), whatever the store hint (evict_last, .cg, .cs, .wt) or load modifier (.cg): 1.47-1.54 us.
The folded router's +3 us is in no case here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import Report

from ftransformers.kernels.pdl import pdl_enter, pdl_launch

LAYERS = 8
REPLAYS = 5
# (mode, S bytes, writer's chunk bytes (0: one program writes it all), readers, MB the writer streams first)
CASES = [
    *(("all", s, c, 64, 0) for s in (1024, 4096, 16384) for c in (4, 16, 128, 0)),
    ("all", 4096, 4, 1, 0),
    ("all", 4096, 4, 16, 0),
    ("all", 4096, 4, 132, 0),
    ("all", 4096, 0, 132, 0),
    *(("split", 4 << 20, c, 256, 0) for c in (4, 1024, 32768)),  # stage 2's 4 MB of MLA partials, 16 KB a reader
    # the folded router's case after its GEMV: 1024 programs stream 16 MB, then write 4 B each
    ("all", 4096, 4, 64, 16),
    ("all", 4096, 0, 64, 16),
    ("split", 4 << 20, 32768, 256, 16),
]
# with --pdl: the writer and readers as the decode step launches its kernels (programmatic dependent launch: a
# reader's programs may be resident before the writer ends, and are timed from their wait's return)
PDL_CASES = [
    ("rows", 4 << 20, 2048, 256, 16),  # stage 2 itself: 16 heads x 128 splits x 512 floats, 2 KB rows written
    ("split", 4 << 20, 2048, 256, 16),  # the same bytes with each reader's tile contiguous
    ("all", 4096, 4, 64, 16),
    ("all", 4096, 0, 64, 16),
    ("split", 4 << 20, 32768, 256, 16),
    ("split", 4 << 20, 32768, 256, 0),
    ("all", 4096, 4, 64, 0),
    # 128 MB streamed first: more than the L2 holds, so the reader's code (and anything else not just written) is
    # fetched from DRAM again, as after MLA stage 1's 37.7 MB a layer
    # (writers' pieces x readers' pattern: 2 KB rows or 32 KB blocks written, read as stage 2's tiles or contiguous)
    ("rows", 4 << 20, 2048, 256, 128),
    ("rows", 4 << 20, 32768, 256, 128),
    ("split", 4 << 20, 2048, 256, 128),
    ("split", 4 << 20, 32768, 256, 128),
    ("all", 4096, 4, 64, 128),
]
STREAM_PROGRAMS = 1024


@triton.jit
def _write_kernel(buf, big, zero, writers, CHUNK: tl.constexpr, P_CHUNKS: tl.constexpr, STREAM: tl.constexpr,
                  HINT: tl.constexpr = "", USE_PDL: tl.constexpr = False):  # fmt: skip
    # program p < writers writes floats [p * CHUNK * P_CHUNKS, (p + 1) * CHUNK * P_CHUNKS), CHUNK at a time; with
    # STREAM > 0 every program first reads its STREAM floats of `big` (a GEMV's weight stream) into what it writes
    pdl_enter(USE_PDL)
    p = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    extra = 0.0
    if STREAM > 0:
        SPAN: tl.constexpr = min(STREAM, 4096)
        for j in range(STREAM // SPAN):
            extra += tl.sum(tl.load(big + p * STREAM + j * SPAN + tl.arange(0, SPAN)).to(tl.float32), axis=0) * zero
    if p < writers:
        for i in range(P_CHUNKS):
            base = (p * P_CHUNKS + i) * CHUNK
            val = (base + offs).to(tl.float32) * 0.5 + extra
            if HINT == "evict_last":
                tl.store(buf + base + offs, val, eviction_policy="evict_last")
            elif HINT == "":
                tl.store(buf + base + offs, val)
            else:  # a cache modifier: .cg, .cs, .wt
                tl.store(buf + base + offs, val, cache_modifier=HINT)


@triton.jit
def _read_kernel(buf, out, stamps, N: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr = 0,
                 HINT: tl.constexpr = "", USE_PDL: tl.constexpr = False):  # fmt: skip
    # N floats a program: the whole buffer (SPLIT False) or program r's share; timed from its PDL wait's return.
    # ROWS > 0: stage 2's pattern instead, the buffer a [H, ROWS, L] block of rows of L = 512 floats and program r
    # the [ROWS, N / ROWS] tile of head r // chunks at column chunk r % chunks (a row of the tile a 128-byte line)
    pdl_enter(USE_PDL)
    r = tl.program_id(0)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    if ROWS > 0:
        CW: tl.constexpr = N // ROWS
        chunks: tl.constexpr = 512 // CW
        base = (r // chunks).to(tl.int64) * ROWS * 512 + (r % chunks) * CW
        offs = tl.arange(0, ROWS)[:, None] * 512 + tl.arange(0, CW)[None, :]
        s = tl.sum(tl.sum(tl.load(buf + base + offs, cache_modifier=HINT), axis=1), axis=0)
    else:
        base = r.to(tl.int64) * N if SPLIT else 0
        s = tl.sum(tl.load(buf + base + tl.arange(0, N)), axis=0)
    t1 = tl.inline_asm_elementwise(
        "{ .reg .f32 t; mov.f32 t, $1; mov.u64 $0, %globaltimer; }", "=l,f", [s], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(stamps + r * 2, t0)
    tl.store(stamps + r * 2 + 1, t1)
    tl.store(out + r, s)


def run_case(
    mode: str, size: int, chunk: int, readers: int, stream_mb: int, dev: torch.device, pdl: bool,
    hints: tuple[str, str] = ("", ""),
) -> dict:  # fmt: skip
    floats = size // 4
    chunk_f = floats if chunk == 0 else chunk // 4
    # one program writes at most 64 KB a store: longer whole-buffer writes loop over chunks of it
    store_f = min(chunk_f, 16384)
    writers = floats // chunk_f
    per_reader = floats if mode == "all" else floats // readers
    rows = 128 if mode == "rows" else 0  # splits: the rows of a stage-2 tile
    grid = max(writers, STREAM_PROGRAMS) if stream_mb else writers
    stream_f = (stream_mb << 20) // 2 // grid if stream_mb else 0  # bf16 elements a program
    bigs = [torch.randn(max(1, stream_f * grid), device=dev).to(torch.bfloat16) for _ in range(LAYERS)]
    bufs = [torch.zeros(floats, device=dev) for _ in range(LAYERS)]
    out = torch.empty(readers, device=dev)
    stamps = [[torch.zeros(readers, 2, dtype=torch.int64, device=dev) for _ in range(2)] for _ in range(LAYERS)]

    launch = pdl_launch(dev) if pdl else {}

    def step() -> None:
        for buf, big, (first, again) in zip(bufs, bigs, stamps):
            _write_kernel[(grid,)](buf, big, 0.0, writers, CHUNK=store_f, P_CHUNKS=chunk_f // store_f, STREAM=stream_f,
                                   HINT=hints[0], num_warps=4, **launch)  # fmt: skip
            for st in (first, again):
                _read_kernel[(readers,)](buf, out, st, N=per_reader, SPLIT=mode == "split", ROWS=rows, HINT=hints[1],
                                         num_warps=4, **launch)  # fmt: skip

    step()  # compile
    torch.cuda.synchronize()
    values = torch.arange(floats, device=dev, dtype=torch.float32) * 0.5
    if rows:  # [H, rows, chunks, CW] -> [H, chunks, rows, CW]: a reader's tile contiguous
        values = values.view(-1, rows, 512 // (per_reader // rows), per_reader // rows).transpose(1, 2)
    expect = values.reshape(-1, per_reader).sum(-1)
    got = out if mode != "all" else out[:1]
    assert torch.allclose(got, expect[: got.numel()], rtol=1e-4), (mode, size, chunk)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    row = {"mode": mode, "bytes": size, "chunk": chunk or size, "writers": writers, "readers": readers,
           "stream_mb": stream_mb, "pdl": bool(launch), "store_hint": hints[0], "load_hint": hints[1]}  # fmt: skip
    for k, name in enumerate(("first", "again")):
        us = torch.cat([(s[k][:, 1] - s[k][:, 0]).float() / 1e3 for s in stamps]).tolist()
        row[name] = {"median_us": statistics.median(us), "max_us": max(us)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="result .json (a .log beside it)")
    ap.add_argument("--pdl", action="store_true", help="also PDL_CASES with programmatic dependent launch")
    ap.add_argument("--hints", default="", help="STORE/LOAD,...: only stage 2's case behind 128 MB (PDL), the writer's "
                    "store hint (evict_last, .cg, .cs, .wt or none) and the reader's load modifier (.cg, .cv or none)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rep = Report("cuda", layers=LAYERS, replays=REPLAYS)
    rows = []
    cases = [(*c, False, ("", "")) for c in CASES] + ([(*c, True, ("", "")) for c in PDL_CASES] if args.pdl else [])
    if args.hints:
        pairs = [tuple("" if h == "none" else h for h in pair.split("/")) for pair in args.hints.split(",")]
        cases = [("rows", 4 << 20, 2048, 256, 128, True, pair) for pair in pairs]
    for mode, size, chunk, readers, stream_mb, pdl, hints in cases:
        r = run_case(mode, size, chunk, readers, stream_mb, dev, pdl, hints)
        rows.append(r)
        f, a = r["first"], r["again"]
        after = (f" after {stream_mb} MB streamed" if stream_mb else "") + (" (PDL)" if r["pdl"] else "")
        after += f" [store {hints[0] or 'plain'}, load {hints[1] or 'plain'}]" if any(hints) else ""
        rep.log(f"{mode:5s} {size / 1024:7.0f} KB written{after} {r['chunk']:6d} B a program by {r['writers']:5d}, "
                f"read by {readers:3d}: first {f['median_us']:5.2f} us (max {f['max_us']:5.2f}), "
                f"again {a['median_us']:5.2f} (max {a['max_us']:5.2f})")  # fmt: skip
    rep.out["rows"] = rows
    rep.save(args.out)


if __name__ == "__main__":
    main()
