"""Dense 16-bit linears at decode batches of 32-256 rows: cuBLAS (F.linear, what the engine runs there) against the
split-K Triton GEMM (kernels/triton_splitk_gemm.py) over a sweep of its tiles, in one process.

For each weight shape and row count it prints cuBLAS's time and every config's, each as us per product and share
of its floors: bytes (weight + x + y) over the copy bandwidth measured in the same process, and FLOPs over the bf16
matmul rate measured there. Times are medians of one CUDA graph of products over distinct weight copies (enough to
exceed L2 4x), so every product streams its weight from DRAM. Every config is checked against a float32 reference
first (relative error < 1e-2). Configs are compiled first in parallel processes (Triton's disk cache).

    PYTHONPATH=$PWD python benchmarks/bench_splitk_gemm.py --out $OUT/splitk_gemm.json --rows 64,128
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ceilings import Report, graph_ms, matmul_rate

from ftransformers.kernels.launch import cdiv
from ftransformers.kernels.triton_splitk_gemm import SplitKConfig, fits, splitk_gemm

SHAPES = {  # name: (N, K) of the weight
    "qwen3-8b qkv": (6144, 4096),
    "qwen3-8b o": (4096, 4096),
    "qwen3-8b gate_up": (24576, 4096),
    "qwen3-8b down": (4096, 12288),
    "qwen3-30b qkv": (5120, 2048),
    "qwen3-30b o": (2048, 4096),
}
# (BLOCK_N, BLOCK_K, warps, stages, swap); BLOCK_M follows the rows and the split the tile count (`configs`)
BASES = [(128, 64, 4, 4, False), (128, 64, 4, 4, True), (128, 128, 8, 3, False), (256, 64, 8, 3, False),
         (64, 128, 4, 4, False), (64, 64, 4, 5, True), (128, 64, 8, 4, True), (256, 64, 8, 3, True),
         (128, 64, 8, 4, False), (128, 64, 4, 6, False), (64, 64, 4, 8, False)]  # fmt: skip
L2_BYTES = 64 << 20
DEV = "cuda"
DT = torch.bfloat16


def configs(m: int, n: int, k: int, sms: int, loads: tuple[bool, ...] = (False, True)) -> list[SplitKConfig]:
    """Every base with BLOCK_M the rows padded (16-128; 64 at least unless swapped) and splits 1, 2, 4 and those
    filling one or two waves of the SMs with one program each, with pointer loads and / or TMA (`loads`)."""
    out = []
    for (bn, bk, warps, stages, swap), tma in itertools.product(BASES, loads):
        bm = min(128, max(16 if swap else 64, 1 << (m - 1).bit_length()))
        tiles = cdiv(m, bm) * cdiv(n, bn)
        splits = {1, 2, 4} | {max(1, round(w * sms / tiles)) for w in (1, 2)}
        for s in sorted(splits):
            cfg = SplitKConfig(bm, bn, bk, s, warps, stages, swap, tma)
            if s <= 16 and fits(m, n, k, cfg):
                out.append(cfg)
    return out


def _compile_job(job: tuple[int, int, int, SplitKConfig]) -> str:
    m, n, k, cfg = job
    try:
        x = torch.randn(m, k, device=DEV, dtype=DT)
        w = torch.randn(n, k, device=DEV, dtype=DT)
        splitk_gemm(x, w, None, cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported, and the timing pass reports it again
        return f"{n}x{k} M={m} {cfg.name()}: {type(e).__name__}: {str(e)[:200]}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def timed(fn, x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor) -> float | str:
    """ms per product of fn(x, w) over the copies ws, after checking it on ws[0]; a string says why not timed."""
    try:
        err = rel_err(fn(x, ws[0]), ref)
        if not err < 1e-2:
            return f"rel err {err:.3g}"
        return graph_ms(lambda i: fn(x, ws[i % len(ws)]), reps=2 * len(ws), warm_calls=2)
    except Exception as e:  # noqa: BLE001 - a config that does not run is reported
        return f"{type(e).__name__}: {str(e)[:120]}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    p.add_argument("--rows", default="64,128")
    p.add_argument("--workers", type=int, default=12, help="processes compiling the configs first")
    p.add_argument("--loads", default="pointer,tma", help="comma-separated: pointer loads, TMA descriptors, or both")
    args = p.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    loads = tuple(x.strip() == "tma" for x in args.loads.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rep = Report(DEV, args=vars(args))
    tflops = matmul_rate(DEV)
    rep.out["matmul_tflops"] = tflops
    rep.log(f"bf16 matmul {tflops:.0f} TFLOP/s")
    jobs = [(m, *SHAPES[s], c) for s in shapes for m in rows for c in configs(m, *SHAPES[s], sms, loads)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for e in pool.map(_compile_job, jobs, chunksize=1) if e]
    rep.log(f"precompiled {len(jobs)} configs in {time.time() - t0:.0f} s; {len(errors)} failed")
    for e in errors[:10]:
        rep.log(f"  {e}")
    results = []
    for name in shapes:
        n, k = SHAPES[name]
        copies = max(2, min(32, cdiv(4 * L2_BYTES, n * k * 2)))
        gen = torch.Generator(device=DEV).manual_seed(n + k)
        ws = [(torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k**0.5) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
            ref = (x.float() @ ws[0].float().T).to(DT)
            nbytes = (n * k + m * k + m * n) * 2
            floor_us = nbytes / rep.copy_gbs / 1e3
            mm_us = 2 * m * n * k / tflops / 1e6
            rep.log(f"\n{name} {n}x{k}, M={m}: floor {floor_us:.1f} us (bytes), {mm_us:.1f} us (matmul)")
            row = {"shape": name, "N": n, "K": k, "M": m, "floor_us": floor_us, "matmul_floor_us": mm_us, "configs": {}}
            cublas = timed(F.linear, x, ws, ref)
            row["cublas_us"] = cublas * 1e3 if isinstance(cublas, float) else cublas
            rep.log(f"  cuBLAS                          {fmt(cublas, floor_us)}")
            best = None
            for cfg in configs(m, n, k, sms, loads):
                t = timed(lambda a, b, c=cfg: splitk_gemm(a, b, None, c), x, ws, ref)
                row["configs"][cfg.name()] = t * 1e3 if isinstance(t, float) else t
                rep.log(f"  {cfg.name():32s}{fmt(t, floor_us)}")
                if isinstance(t, float) and (best is None or t < best[1]):
                    best = (cfg.name(), t)
            if best is not None:
                row["best"] = {"config": best[0], "us": best[1] * 1e3}
                vs = f", {cublas / best[1]:.2f}x cuBLAS" if isinstance(cublas, float) else ""
                rep.log(f"  best: {best[0]} {fmt(best[1], floor_us)}{vs}")
            results.append(row)
    rep.out["rows"] = results
    rep.save(args.out)


def fmt(t: float | str, floor_us: float) -> str:
    if isinstance(t, str):
        return t[:60]
    return f"{t * 1e3:7.1f} us ({100 * floor_us / (t * 1e3):3.0f}% of the byte floor)"


if __name__ == "__main__":
    main()
