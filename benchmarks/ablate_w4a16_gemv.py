"""Where the one-row 4-bit GEMV's time goes inside a decode step's chain of launches, against a pure stream of
the same bytes in the same chain (bench_launch_chain.py measured such a stream of Qwen3-30B-A3B qkv's 5.4 MB at
3.0-3.7 µs a link, the GEMV at 4.7).

Each figure: µs a link of a CUDA graph of 48 launches, each on its own weight (no L2 reuse), one bf16 row of x,
programmatic dependent launch on as in the engine; beside the floor (words + scales + zeros over the copy
bandwidth measured in this run) and the stream kernel reading the same bytes (one 4 KB chunk a program).
Weights: Qwen3-30B-A3B's qkv (5120 x 2048) and o (2048 x 4096), int4 g128 asymmetric.

Ablations (triton_w4a16.py's source with lines replaced, imported as a module of its own; their results are
wrong by design and never checked, the unablated kernel is checked against quant_linear_ref first):
  no-scale-zero-loads  a constant scale and zero instead of their loads
  no-unpack            the word (masked finite) read as float32 for every nibble instead of the nibbles masked out
                       (the FMAs stay)
  no-x-reloads         every K tile reads the first tile's x (L1 hits after the first)
  words-only           no-scale-zero-loads and no-unpack together
Beside them, "scale-zero-copy": the unablated kernel on weights that carry QuantizedWeight.scale_zero (as the
engine's dense int4 layers do on CUDA), so that a thread's rows' scales and zeros are one vector load.
Then the GEMV's tiles in the chain: BLOCK_N 4, 8, 16 x BLOCK_K 512, 1024, 2048 x 2, 4 or 8 warps (a lane a word
column), on the weights as the engine holds them (with the copy; `--tiles-without-copy` for the row-major ones).

    PYTHONPATH=$PWD python benchmarks/ablate_w4a16_gemv.py --out $OUT/r/ablate_w4a16_gemv_h100.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ablate_w4a16_mma import ablated
from bench_launch_chain import CHUNK, STREAM_LINKS, gemv_us, stream_us
from bench_w4a16 import make_weight, rel_err
from ceilings import Report

from ftransformers.kernels import triton_w4a16
from ftransformers.kernels.pdl import pdl_launch
from ftransformers.kernels.quant_formats import quant_linear_ref, scale_zero_copy

SCALE = "scale = tl.reshape(_scale_f32(tl.load(s_rows + grp, mask=mask_q, other=0), FMT), [BW, BLOCK_N, 1])"
ZERO = "zero = tl.reshape(tl.load(z_rows + grp, mask=mask_q, other=0).to(tl.float32), [BW, BLOCK_N, 1])"
UNPACK = "d = (tl.where(j4 < 5, q, q >> 12) & nib_mask).to(tl.float32, bitcast=True)"
X = "x = tl.load(x_ptrs + k0, mask=mask_x, other=0.0).to(tl.float32)"
CONST_SCALE = "scale = tl.full([BW, BLOCK_N, 1], 0.01, tl.float32)"
CONST_ZERO = "zero = tl.full([BW, BLOCK_N, 1], 8.0, tl.float32)"
WORD = "d = (q & 0x0FFFFFFF).to(tl.float32, bitcast=True)"  # one AND a word (finite values) instead of 9 ops
ABLATIONS: dict[str, list[tuple[str, str]]] = {
    "no-scale-zero-loads": [(SCALE, CONST_SCALE), (ZERO, CONST_ZERO)],
    "no-unpack": [(UNPACK, WORD)],
    "no-x-reloads": [(X, "x = tl.load(x_ptrs, mask=mask_x, other=0.0).to(tl.float32)")],
    "words-only": [(SCALE, CONST_SCALE), (ZERO, CONST_ZERO), (UNPACK, WORD)],
}
SHAPES = {"qwen3-30b qkv": (5120, 2048), "qwen3-30b o": (2048, 4096)}


def gemv_config(
    n: int, k: int, bn: int | None = None, bk: int | None = None, warps: int | None = None
) -> dict[str, int]:
    cfg = triton_w4a16.w4a16_config(1, n, k, "int4")
    assert cfg.get("GEMV") == 1, cfg
    return {**cfg, **({"BLOCK_N": bn} if bn else {}), **({"BLOCK_K": bk} if bk else {}),
            **({"num_warps": warps} if warps else {})}  # fmt: skip


def stream_chain_us(size: int, dev: str) -> float:
    """µs a link of a pure stream of `size` bytes in the chain, one 4 KB chunk a program."""
    chunks = -(-size // (CHUNK * 4))
    pool = torch.randint(0, 1000, (STREAM_LINKS, chunks * CHUNK), device=dev, dtype=torch.int32)
    return stream_us(pool, chunks, CHUNK, 4, pdl_launch(torch.device(dev)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiles-without-copy", action="store_true", help="sweep the tiles on the row-major scales")
    args = p.parse_args()
    dev = "cuda"
    report = Report(dev, shapes=[])
    bw, out, log = report.copy_gbs, report.out, report.log
    tmp = Path(tempfile.mkdtemp())
    mods = {"kernel": triton_w4a16}
    for k, reps in ABLATIONS.items():
        mods[k] = ablated(k, *reps[0], tmp, module=triton_w4a16, more=tuple(reps[1:]))
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape, (n, k) in SHAPES.items():
        qws = [make_weight("int4-asym", n, k, gen) for _ in range(STREAM_LINKS)]
        copies = [replace(qw, scale_zero=scale_zero_copy(qw)) for qw in qws]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=gen)
        cfg = gemv_config(n, k)
        for w in (qws[0], copies[0]):
            err = rel_err(triton_w4a16.w4a16_linear(x, w, config=cfg), quant_linear_ref(x, qws[0]))
            assert err < 1e-2, f"{shape}: the GEMV is off the reference ({err:.2e})"
        size = sum(t.numel() * t.element_size() for t in (qws[0].qweight, qws[0].scales, qws[0].zeros))
        floor = size / bw / 1e3
        peer = stream_chain_us(size, dev)
        size_copy = sum(t.numel() * t.element_size() for t in (copies[0].qweight, copies[0].scale_zero))
        row: dict[str, Any] = {"shape": shape, "n": n, "k": k, "bytes": size, "floor_us": floor, "stream_us": peer,
                               "bytes_with_copy": size_copy, "floor_with_copy_us": size_copy / bw / 1e3,
                               "default_config": cfg, "variants": {}, "configs": []}  # fmt: skip
        log(f"{shape} {n}x{k}: floor {floor:.2f} us, a pure stream of its {size / 1e6:.2f} MB {peer:.2f} us a link; "
            f"words + scale_zero {size_copy / 1e6:.2f} MB, floor {size_copy / bw / 1e3:.2f} us")
        variants = [(label, mod, qws) for label, mod in mods.items()] + [("scale-zero-copy", triton_w4a16, copies)]
        for label, mod, ws in variants:
            us = gemv_us(mod.w4a16_linear, x, ws, cfg)
            row["variants"][label] = us
            log(f"  {label:22s} {us:6.2f} us a link ({floor / us:4.0%} of copy)")
        swept = qws if args.tiles_without_copy else copies
        for bn in (4, 8, 16):
            for bk in (512, 1024, 2048):
                for warps in (2, 4, 8):
                    if bk // 8 < 32 * warps:  # a warp's lanes each take one word column of the tile
                        continue
                    c = gemv_config(n, k, bn, bk, warps)
                    us = gemv_us(triton_w4a16.w4a16_linear, x, swept, c)
                    row["configs"].append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "us": us})
                    log(f"  BLOCK_N {bn:2d} BLOCK_K {bk:4d} {warps} warps  {us:6.2f} us")
        out["shapes"].append(row)
    report.save(args.out)


if __name__ == "__main__":
    main()
