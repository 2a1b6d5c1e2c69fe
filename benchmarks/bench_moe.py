"""Fused Triton MoE and the small fusions (RMSNorm+residual, SiLU-and-mul) on one GPU, bf16.

Every time is printed beside its floor, both measured in this run:
  bytes floor   = (expected distinct experts hit * expert bytes + hidden in + out) / copy bandwidth
                  distinct experts under uniform routing = E * (1 - (1 - K/E)^T)
  compute floor = 6 * T * K * I * D FLOPs / bf16 matmul rate (8192^3 torch.matmul)
Fused MoE is timed as CUDA-graph replays of R calls on R different routings (per-call time = replay/R);
torch_native eagerly. Usage: python benchmarks/bench_moe.py [--out DIR] [--skip-deepseek]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import torch
import triton
from triton.testing import do_bench

from ftransformers.kernels import triton_fused_moe as tfm
from ftransformers.kernels.triton_activation import silu_and_mul
from ftransformers.kernels.triton_norm import rms_norm
from ftransformers.layers.activation import silu_and_mul as silu_and_mul_ref
from ftransformers.layers.moe.experts import moe_forward_native
from ftransformers.layers.norm import RMSNorm

SHAPES = {"qwen3-30b-a3b": {"D": 2048, "I": 768, "E": 128, "K": 8}, "deepseek-v3": {"D": 7168, "I": 2048, "E": 256, "K": 8}}
TOKENS = [1, 8, 32, 64, 128, 1024, 8192]
NATIVE_TOKENS = {1, 8, 64, 1024}
SWEEP = {  # alternatives to the default tiles, timed at a few sizes
    1: [tfm.MoEConfig(16, 64, 128, 128, 128, 1, 4, 4), tfm.MoEConfig(16, 32, 256, 64, 256, 1, 4, 3)],
    128: [tfm.MoEConfig(32, 64, 128, 128, 64, 1, 4, 3)],
    1024: [tfm.MoEConfig(32, 64, 128, 128, 64, 1, 4, 3), tfm.MoEConfig(64, 128, 64, 256, 64, 8, 8, 3)],
    8192: [tfm.MoEConfig(64, 64, 64, 128, 64, 8, 4, 4), tfm.MoEConfig(128, 128, 64, 256, 64, 8, 8, 4),
           tfm.MoEConfig(128, 128, 64, 128, 64, 8, 8, 3)],
}


def measure_ceilings() -> tuple[float, float]:
    x = torch.randn(256 * 2**20, dtype=torch.bfloat16, device="cuda")  # 512 MiB
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    tflops = 2 * 8192**3 / do_bench(lambda: a @ b, return_mode="median") / 1e9
    return copy_gbs, tflops


def routing(t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices  # uniform, duplicate-free
    w = torch.rand(t, k, device="cuda") + 0.1
    return w / w.sum(-1, keepdim=True), ids


def _moe_call(inputs: list, w13: torch.Tensor, w2: torch.Tensor, cfg: tfm.MoEConfig, i: int) -> torch.Tensor:
    hidden, topk_weights, topk_ids = inputs[i]
    return tfm.fused_moe(hidden, w13, w2, topk_weights, topk_ids, cfg)


def graph_time_ms(fn, reps: int) -> float:
    """Median ms per call of `fn(i)` for i < reps, captured once as one CUDA graph."""
    for i in range(reps):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    return do_bench(graph.replay, return_mode="median") / reps


def host_us(fn, n: int = 50) -> float:
    """Host time to enqueue one call (launch overhead that eager extend batches pay)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def breakdown(h, w13, w2, tw, ti, cfg: tfm.MoEConfig) -> dict:
    """Graph-replay ms of each stage alone: alignment, gate-up GEMM (+SiLU), down GEMM, top-k sum."""
    t, d = h.shape
    e, k, inter = w13.shape[0], ti.shape[1], w13.shape[1] // 2
    sorted_ids, expert_ids, num_post = tfm.moe_align(ti, e, cfg.block_m)
    act = torch.randn(t * k, inter, dtype=h.dtype, device=h.device)
    y = torch.randn(t * k, d, dtype=h.dtype, device=h.device)
    out = torch.empty_like(h)
    wf = tw.reshape(-1).float().contiguous()
    gemm = {"group_m": cfg.group_m, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    stages = {
        "align": lambda i: tfm.moe_align(ti, e, cfg.block_m),
        "gate_up": lambda i: tfm.moe_gemm(h, w13, act, sorted_ids, expert_ids, num_post, k, cfg.block_m, cfg.up_n,
                                          cfg.up_k, fuse_silu=True, **gemm),
        "down": lambda i: tfm.moe_gemm(act, w2, y, sorted_ids, expert_ids, num_post, 1, cfg.block_m, cfg.down_n,
                                       cfg.down_k, weights=wf, **gemm),
        "sum": lambda i: tfm.moe_sum(y.view(t, k, d), out),
    }
    return {name: graph_time_ms(fn, 1) for name, fn in stages.items()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_shape(name: str, s: dict, copy_gbs: float, tflops: float, log) -> list[dict]:
    d, inter, e, k = s["D"], s["I"], s["E"], s["K"]
    w13 = torch.randn(e, 2 * inter, d, dtype=torch.bfloat16, device="cuda") / d**0.5
    w2 = torch.randn(e, d, inter, dtype=torch.bfloat16, device="cuda") / inter**0.5
    expert_bytes = 3 * inter * d * 2
    rows = []
    for t in TOKENS:
        reps = 8 if t <= 128 else 1
        inputs = [(torch.randn(t, d, dtype=torch.bfloat16, device="cuda"), *routing(t, e, k)) for _ in range(reps)]
        distinct = e * (1 - (1 - k / e) ** t)
        nbytes = distinct * expert_bytes + 2 * t * d * 2
        flops = 6 * t * k * inter * d
        floor_ms = max(nbytes / copy_gbs / 1e6, flops / tflops / 1e9)
        row = {"shape": name, "T": t, "distinct_experts": distinct, "bytes": nbytes, "flops": flops,
                   "bytes_floor_ms": nbytes / copy_gbs / 1e6, "flops_floor_ms": flops / tflops / 1e9, "configs": {}}
        default = tfm.default_config(t, e, k)
        for cfg in [default, *SWEEP.get(t, [])]:
            call = partial(_moe_call, inputs, w13, w2, cfg)
            row["configs"][str(cfg)] = graph_time_ms(call, reps)
        best_cfg, best_ms = min(row["configs"].items(), key=lambda kv: kv[1])
        h, tw, ti = inputs[0]
        eager_ms = do_bench(partial(tfm.fused_moe, h, w13, w2, tw, ti), return_mode="median")
        row["host_us_per_call"] = host_us(partial(tfm.fused_moe, h, w13, w2, tw, ti))
        if t in (1, 64, 128):
            row["breakdown_ms"] = breakdown(h, w13, w2, tw, ti, default)
        row.update(default_ms=row["configs"][str(default)], best_ms=best_ms, best_config=best_cfg, eager_ms=eager_ms)
        row["GBps"] = nbytes / row["default_ms"] / 1e6
        row["TFLOPs"] = flops / row["default_ms"] / 1e9
        row["x_floor"] = row["default_ms"] / floor_ms
        if t in NATIVE_TOKENS:
            native = partial(moe_forward_native, h, w13, w2, tw, ti)
            row["native_ms"] = do_bench(native, return_mode="median", rep=200)
            row["rel_err_vs_native"] = rel_err(tfm.fused_moe(h, w13, w2, tw, ti), moe_forward_native(h, w13, w2, tw, ti))
        log(
            f"{name:14s} T={t:5d} fused {row['default_ms']*1e3:9.1f} us (best {best_ms*1e3:9.1f}) eager "
            f"{eager_ms*1e3:9.1f} us | floor {floor_ms*1e3:8.1f} us x{row['x_floor']:.2f} | {row['GBps']:7.0f} GB/s "
            f"{row['TFLOPs']:6.1f} TF/s | native {row.get('native_ms', float('nan'))*1e3:9.1f} us "
            f"err {row.get('rel_err_vs_native', float('nan')):.1e} | host {row['host_us_per_call']:.0f} us"
        )
        if "breakdown_ms" in row:
            log("    stages (us): " + ", ".join(f"{n} {ms * 1e3:.1f}" for n, ms in row["breakdown_ms"].items()))
        rows.append(row)
    return rows


def bench_fusions(copy_gbs: float, log) -> list[dict]:
    rows = []
    for t in (1, 64, 8192):
        for d in (2048, 7168):
            norm = RMSNorm(d).to("cuda", torch.bfloat16)
            x, r = (torch.randn(t, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            nbytes = 4 * t * d * 2 + d * 2
            tri_fn = partial(rms_norm, x, norm.weight, 1e-6, r)
            tri = do_bench(tri_fn, return_mode="median")
            ref = do_bench(partial(norm, x, r), return_mode="median")
            tri_g = graph_time_ms(lambda i, fn=tri_fn: fn(), 10)
            rows.append({"op": "rmsnorm_residual", "T": t, "D": d, "triton_ms": tri, "triton_graph_ms": tri_g, "torch_ms": ref,
                             "bytes_floor_ms": nbytes / copy_gbs / 1e6})
        for inter in (768, 2048, 18432):
            x = torch.randn(t, 2 * inter, dtype=torch.bfloat16, device="cuda")
            nbytes = 3 * t * inter * 2
            tri_fn = partial(silu_and_mul, x)
            tri = do_bench(tri_fn, return_mode="median")
            ref = do_bench(partial(silu_and_mul_ref, x), return_mode="median")
            tri_g = graph_time_ms(lambda i, fn=tri_fn: fn(), 10)
            rows.append({"op": "silu_and_mul", "T": t, "I": inter, "triton_ms": tri, "triton_graph_ms": tri_g, "torch_ms": ref,
                             "bytes_floor_ms": nbytes / copy_gbs / 1e6})
    for r in rows:
        log(f"{r['op']:17s} T={r['T']:5d} {r.get('D', r.get('I')):6d}: triton {r['triton_ms']*1e3:7.1f} us "
            f"(graph {r['triton_graph_ms']*1e3:6.1f}) torch {r['torch_ms']*1e3:7.1f} us floor {r['bytes_floor_ms']*1e3:6.1f} us")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-deepseek", action="store_true")
    ap.add_argument("--skip-fusions", action="store_true")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T values")
    ap.add_argument("--name", default="moe_h100.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    t0 = time.time()
    copy_gbs, tflops = measure_ceilings()
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    log(f"copy bandwidth {copy_gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_GBps": copy_gbs,
                  "matmul_TFLOPs": tflops, "command": "python benchmarks/bench_moe.py", "moe": [], "fusions": []}
    path = os.path.join(args.out, args.name)
    TOKENS[:] = [int(t) for t in args.tokens.split(",")]
    os.makedirs(args.out, exist_ok=True)
    result["fusions"] = [] if args.skip_fusions else bench_fusions(copy_gbs, log)
    for name, s in SHAPES.items():
        if name == "deepseek-v3" and args.skip_deepseek:
            continue
        result["moe"] += bench_shape(name, s, copy_gbs, tflops, log)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    result["seconds"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
