"""Skinny GEMM (decode linears, M <= 16 rows): the Triton kernel's tile sweep against cuBLAS
(`F.linear`) in the same process, on the dense weight shapes of the issue's models, bf16.

Achieved GB/s = weight bytes (+ x, y) / median time, beside the device-to-device copy bandwidth
measured in the same run. Each timed call runs the product over enough weight copies to exceed L2
several times, inside a CUDA graph (decode steps run as graphs), and reports the median per product.
Every config is checked against the float32 reference before it is timed.

    PYTHONPATH=. python benchmarks/bench_gemv.py --out $OUT/gemv_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import copy_bandwidth

from ftransformers.kernels.triton_gemv import gemv, gemv_config, gemv_ref

DEV = torch.device("cuda")
DT = torch.bfloat16
SHAPES = {  # name: (N, K) of the weight [N, K]
    "qwen3-30b qkv": (5120, 2048), "qwen3-30b o": (2048, 4096), "qwen3-30b router": (128, 2048),
    "qwen3-8b qkv": (6144, 4096), "qwen3-8b o": (4096, 4096), "qwen3-8b gate_up": (24576, 4096),
    "qwen3-8b down": (4096, 12288), "dsv3 q_a+kv_a": (2112, 7168), "dsv3 q_b": (24576, 1536),
    "dsv3 o": (7168, 16384), "dsv3 shared gate_up": (4096, 7168), "dsv3 shared down": (7168, 2048),
    "qwen3-30b lm_head": (151936, 2048), "qwen3-8b lm_head": (151936, 4096),
}  # fmt: skip
ROWS = [1, 2, 4, 8, 16]
L2_BYTES = 50 << 20


def sweep(M: int) -> list[dict[str, int]]:
    if M == 1:  # whole 4096-wide rows in one step too (session 31: 2048-4096 beat 1024 in a whole step)
        return [{"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": s}
                for bn, bk, s in itertools.product((2, 4, 8), (1024, 2048, 4096), (2, 3, 4))]  # fmt: skip
    if M <= 4:
        bm = triton.next_power_of_2(M)
        return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
                for bn, bk, w, s in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4,), (2, 4))
                if bm * bn * bk <= 16384]  # fmt: skip
    return [{"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
            for bn, bk, w, s in itertools.product((16, 32), (128, 256, 512), (4, 8), (3,))]  # fmt: skip


def time_per_call(fn_for: Any, copies: int) -> float:
    """Median ms of one product, from a graph of `copies` products over distinct weights."""
    return do_bench_cudagraph(lambda: [fn_for(i) for i in range(copies)], rep=20) / copies


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = p.parse_args()
    bw = copy_bandwidth()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": bw, "rows": []}  # fmt: skip
    print(f"{out['device']}  copy {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        wbytes = N * K * 2
        copies = max(2, -(-4 * L2_BYTES // wbytes))
        ws = [torch.randn(N, K, device=DEV, dtype=DT, generator=gen) / K**0.5 for _ in range(copies)]
        for M in [int(m) for m in args.rows.split(",")]:
            x = torch.randn(M, K, device=DEV, dtype=DT, generator=gen)
            nbytes = wbytes + 2 * M * (K + N)
            ref = gemv_ref(x, ws[0])
            t_cublas = time_per_call(lambda i: F.linear(x, ws[i]), copies)
            results = []
            for cfg in sweep(M):
                try:
                    err = ((gemv(x, ws[0], config=cfg).double() - ref.double()).norm() / ref.double().norm()).item()
                    if not err < 1e-2:
                        results.append({"config": cfg, "error": f"rel err {err:.3g}"})
                        continue
                    t = time_per_call(lambda i: gemv(x, ws[i], config=cfg), copies)
                    results.append({"config": cfg, "ms": t, "GBps": nbytes / t / 1e6})
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                    results.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            ok = [r for r in results if "ms" in r]
            best = min(ok, key=lambda r: r["ms"])
            default = gemv_config(M, N, K)
            t_default = time_per_call(lambda i: gemv(x, ws[i]), copies)
            row = {"shape": name, "N": N, "K": K, "M": M, "floor_ms": nbytes / bw / 1e6,
                   "cublas_ms": t_cublas, "cublas_GBps": nbytes / t_cublas / 1e6,
                   "default_config": default, "default_ms": t_default, "default_GBps": nbytes / t_default / 1e6,
                   "best": best, "failed": [r for r in results if "error" in r][:5], "num_configs": len(results),
                   "all": [[r["config"]["BLOCK_N"], r["config"]["BLOCK_K"], r["config"]["num_warps"],
                            r["config"]["num_stages"], round(r["ms"] * 1e3, 2)] for r in ok]}  # fmt: skip
            out["rows"].append(row)
            print(f"{name:22s} M={M:<3d} floor {row['floor_ms'] * 1e3:7.1f} us  cublas {t_cublas * 1e3:7.1f} us "
                  f"({100 * row['cublas_GBps'] / bw:3.0f}%)  default {t_default * 1e3:7.1f} us "
                  f"({100 * row['default_GBps'] / bw:3.0f}%)  best {best['ms'] * 1e3:7.1f} us "
                  f"({100 * best['GBps'] / bw:3.0f}%) {best['config']}", flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
