"""Microbenchmark of the MoE router top-k: Triton (one launch) vs the torch reference ops.

Times one router call per layer in a CUDA graph (decode runs as graphs), median µs per call, for
Qwen3-30B-A3B (softmax, E=128, top-8, renormalised) and DeepSeek-V3 (noaux_tc, E=256, 8 groups, keep
4, top-8). The floor is launch-bound, not bytes: T·E·4 bytes in and T·K·12 out are a few KB, so the
"floor" printed is an empty-kernel graph node measured in the same run.

    PYTHONPATH=. python benchmarks/bench_router.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ftransformers.kernels.triton_router import grouped_topk_sigmoid, softmax_topk
from ftransformers.layers.moe.grouped_topk import grouped_topk_torch
from ftransformers.layers.moe.topk import select_experts_softmax_torch

REPS = 48  # one call per layer, a step's worth, in one graph


@triton.jit
def _empty_kernel(x_ptr):
    pass


def per_call_us(fn) -> float:
    def step() -> None:
        for _ in range(REPS):
            fn()

    return do_bench_cudagraph(step, rep=200) * 1e3 / REPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    dummy = torch.empty(1, device="cuda")
    rows: list[dict] = []
    floor = per_call_us(lambda: _empty_kernel[(1,)](dummy))
    for t in (1, 8, 32, 128):
        q = torch.randn(t, 128, device="cuda", dtype=torch.bfloat16)
        d = torch.randn(t, 256, device="cuda")
        bias = torch.randn(256, device="cuda") * 0.3
        cases = {
            "qwen3_softmax_topk8": (
                partial(softmax_topk, q, 8, True), partial(select_experts_softmax_torch, q, 8, True)),
            "deepseek_grouped_topk8": (
                partial(grouped_topk_sigmoid, d, 8, 8, 4, bias, True, 2.5),
                partial(grouped_topk_torch, d, 8, 8, 4, bias, True, 2.5)),
        }  # fmt: skip
        for name, (fast, ref) in cases.items():
            row = {
                "case": name,
                "T": t,
                "triton_us": per_call_us(fast),
                "torch_us": per_call_us(ref),
                "floor_us": floor,
            }
            rows.append(row)
            print(f"{name:24s} T={t:4d} triton {row['triton_us']:6.2f} µs  torch {row['torch_us']:6.2f} µs  "
                  f"(floor: empty kernel {floor:.2f} µs)")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (out / "router_h100.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
