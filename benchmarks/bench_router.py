"""Microbenchmark of the MoE router: the whole router (GEMV + top-k) and the top-k alone.

Qwen3-30B-A3B (softmax, E=128, D=2048, top-8, renormalised) and DeepSeek-V3 (noaux_tc, E=256, D=7168,
8 groups keep 4, top-8). Times are CUDA-graph replays (decode runs as graphs), median µs per call.

  whole router, old: F.linear (bf16 logits; DeepSeek: float32 casts of hidden and weight first) + the
                     one-program-per-token top-k kernel;  fused: fused_router_topk, one launch.
  top-k alone: the Triton kernel vs the torch reference ops, on given logits.

Every whole-router call in a graph reads its own copy of the gate weight, with enough copies (>= 128 MB)
that they cannot stay in the 50 MB L2 between replays, as in a decode step. Floors: the weight bytes
over the measured copy bandwidth, and an empty-kernel graph node measured in the same run.

    PYTHONPATH=. python benchmarks/bench_router.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import copy_bandwidth

from ftransformers.kernels.triton_router import fused_router_topk, grouped_topk_sigmoid, softmax_topk
from ftransformers.layers.moe.grouped_topk import grouped_topk_torch
from ftransformers.layers.moe.topk import select_experts_softmax_torch

REPS = 48  # one call per layer, a step's worth, in one graph


@triton.jit
def _empty_kernel(x_ptr):
    pass


def per_call_us(fn, reps: int = REPS) -> float:
    """fn(i) for i < reps in one graph; µs per call."""

    def step() -> None:
        for i in range(reps):
            fn(i)

    return do_bench_cudagraph(step, rep=200) * 1e3 / reps


def routers(name: str, hidden: torch.Tensor, gates: list[torch.Tensor], bias: torch.Tensor):
    """(old, fused, torch reference) whole routers, each i -> router on gates[i]."""
    if name.startswith("qwen"):
        return (
            lambda i: softmax_topk(F.linear(hidden, gates[i]), 8, True),
            lambda i: fused_router_topk(hidden, gates[i], 8, softmax=True, renormalize=True, round_logits=True),
            lambda i: select_experts_softmax_torch(F.linear(hidden, gates[i]), 8, True),
        )
    return (
        lambda i: grouped_topk_sigmoid(F.linear(hidden.float(), gates[i].float()), 8, 8, 4, bias, True, 2.5),
        lambda i: fused_router_topk(hidden, gates[i], 8, softmax=False, renormalize=True, num_expert_group=8,
                                    topk_group=4, correction_bias=bias, routed_scaling_factor=2.5),
        lambda i: grouped_topk_torch(F.linear(hidden.float(), gates[i].float()), 8, 8, 4, bias, True, 2.5),
    )  # fmt: skip


def topk_only(name: str, logits: torch.Tensor, bias: torch.Tensor):
    """(triton, torch) top-k on given logits."""
    if name.startswith("qwen"):
        return lambda i: softmax_topk(logits, 8, True), lambda i: select_experts_softmax_torch(logits, 8, True)
    return (lambda i: grouped_topk_sigmoid(logits, 8, 8, 4, bias, True, 2.5),
            lambda i: grouped_topk_torch(logits, 8, 8, 4, bias, True, 2.5))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tokens", default="1,4,8,16")
    parser.add_argument("--cases", default="qwen3_softmax_topk8,deepseek_grouped_topk8")
    parser.add_argument("--name", default="router_h100.json")
    args = parser.parse_args()
    dummy = torch.empty(1, device="cuda")
    copy_gbs = copy_bandwidth()
    floor = per_call_us(lambda i: _empty_kernel[(1,)](dummy))
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, empty kernel node {floor:.2f} µs")
    rows: list[dict] = []
    shapes = {"qwen3_softmax_topk8": (128, 2048), "deepseek_grouped_topk8": (256, 7168)}
    shapes = {k: v for k, v in shapes.items() if k in args.cases.split(",")}
    for name, (e, d) in shapes.items():
        copies = max(REPS, -(-128 * 2**20 // (e * d * 2)))
        gates = [torch.randn(e, d, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in range(copies)]
        bias = torch.randn(e, device="cuda") * 0.3
        for t in (int(x) for x in args.tokens.split(",")):
            hidden = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
            old, fused, ref = routers(name, hidden, gates, bias)
            (w, ids), (w_ref, ids_ref) = fused(0), ref(0)
            ids_match = float((ids.sort(-1)[0] == ids_ref.sort(-1)[0]).all(-1).float().mean())
            row = {"case": name, "T": t, "whole_old_us": per_call_us(old, copies), "whole_fused_us": per_call_us(fused, copies),
                   "weight_floor_us": e * d * 2 / copy_gbs / 1e3, "floor_us": floor, "ids_match_vs_torch": ids_match,
                   "w_maxdiff_vs_torch": float((w.sort(-1)[0] - w_ref.sort(-1)[0]).abs().max())}  # fmt: skip
            logits = F.linear(hidden.float(), gates[0].float())
            topk_triton, topk_torch = topk_only(name, logits, bias)
            row["topk_triton_us"], row["topk_torch_us"] = per_call_us(topk_triton), per_call_us(topk_torch)
            rows.append(row)
            print(f"{name:24s} T={t:3d} router: old {row['whole_old_us']:6.2f} µs  fused {row['whole_fused_us']:6.2f} µs "
                  f"(weight floor {row['weight_floor_us']:.2f}, empty kernel {floor:.2f}) ids match {ids_match:.2f} | "
                  f"top-k alone: triton {row['topk_triton_us']:6.2f} torch {row['topk_torch_us']:6.2f} µs")  # fmt: skip
        del gates
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    meta = {"device": device, "copy_GBps": copy_gbs, "rows": rows}
    (out / args.name).write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
