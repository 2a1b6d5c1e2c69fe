"""Fused MoE over 4-bit experts (kernels/triton_fused_moe_w4.py) beside the bf16 fused MoE, one GPU.

Shapes: Qwen3-30B-A3B (E=128, top-8, D=2048, I=768) and DeepSeek-V3 routed experts (E=256, top-8,
D=7168, I=2048). Formats: int4 g128 sym and asym (the W4A16 target), int4 g32 sym (Kimi-K2 style),
mxfp4, nvfp4; random codes and scales (never zeros). Experts only (routing given).

Times are CUDA-graph replays of R calls per call, each call with its own hidden and routing; at T*K <=
E/2 call i avoids the experts of call i-1, and the stacked experts (0.3 GB int4 Qwen .. 5.6 GB int4
DeepSeek) are far past the 50 MB L2. bytes = distinct experts hit (counted on the real routings) * an
expert's quantized w13 + w2 bytes incl. scales / zeros / global scales + hidden in and out; floor =
bytes / the copy bandwidth measured here. The bf16 peer (`fused_moe`, same routings) is timed beside
each row with its own bytes. Before timing, each format is checked against quant_moe_ref (T=1, 16).
At T <= 16 both W4 paths are timed (pair, aligned); at T=1 a small sweep of pair-path tiles (each
kernel's tiles varied with the other at its default). T = 512, 2048: time and TFLOP/s beside bf16.
int4 rows also time the aligned path with the dequantizing kernel (`codes=False`) beside the default
codes kernel, and at T = 32, 64 sweep the codes kernel's tiles.
Usage: python benchmarks/bench_moe_w4.py --out FILE [--skip-deepseek] [--no-sweep] [--tokens 1,2] [--formats ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch
import triton
from ceilings import copy_bandwidth, matmul_rate
from ceilings import graph_ms as shared_graph_ms

from ftransformers.kernels import triton_fused_moe as tfm
from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_moe_ref

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}  # D, I, E, K
FORMATS = {"int4-g128-sym": ("int4", 128, False), "int4-g128-asym": ("int4", 128, True),
           "int4-g32-sym": ("int4", 32, False), "mxfp4": ("mxfp4", 32, False), "nvfp4": ("nvfp4", 16, False)}  # fmt: skip
DECODE_T, PREFILL_T = [1, 2, 4, 8, 16], [512, 2048]
UP_SWEEP = [(4, 512, 4), (8, 256, 4), (8, 1024, 4), (16, 512, 4), (16, 512, 8)]  # up_n, up_k, up_warps
# down_n, down_k, down_warps, each with down_split (programs per token and D block) 1, 2, 4, 8
DOWN_SWEEP = [(4, 256, 1), (8, 256, 2), (8, 512, 2), (16, 256, 2), (16, 512, 4)]
DOWN_SPLITS = (1, 2, 4, 8)
SWEEP_FORMATS = ("int4-g128-sym", "int4-g128-asym", "mxfp4")
SWEEP_T = (1, 2)
CODES_SWEEP_T = (32, 64)  # int4 aligned-path (codes kernel) tile sweep
DEV = "cuda"


def random_qw(fmt: str, group: int, zeros: bool, e: int, n: int, k: int) -> QuantizedWeight:
    """Random words (every int32 is 8 valid codes) and scales sized for unit-scale outputs."""
    q = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, device=DEV)
    z = gs = None
    if fmt == "int4":
        s = ((torch.rand(e, n, k // group, device=DEV) + 0.5) * 0.4 / k**0.5).to(torch.bfloat16)
        if zeros:
            z = torch.randint(4, 12, (e, n, k // group), dtype=torch.uint8, device=DEV)
    elif fmt == "mxfp4":
        base = 127 - int(torch.log2(torch.tensor(float(k))).item() / 2)
        s = torch.randint(base - 2, base + 1, (e, n, k // group), dtype=torch.uint8, device=DEV)
    else:
        s = (torch.rand(e, n, k // group, device=DEV) * 300 + 20).to(torch.float8_e4m3fn)
        gs = (torch.rand(e, n, device=DEV) + 0.5) / (200 * k**0.5)
    return QuantizedWeight(fmt, q, s, n, k, group, zeros=z, global_scale=gs)


def expert_weights(fname: str, shape: str) -> tuple[QuantizedWeight, QuantizedWeight]:
    """Random w13 [E, 2I, D] and w2 [E, D, I] of expert shape `shape` (SHAPES) in format `fname` (FORMATS)."""
    d, inter, e, _ = SHAPES[shape]
    fmt, group, zeros = FORMATS[fname]
    return random_qw(fmt, group, zeros, e, 2 * inter, d), random_qw(fmt, group, zeros, e, d, inter)


def routed_inputs(w13: QuantizedWeight, w2: QuantizedWeight, t: int, k: int, reps: int) -> tuple[list, list, torch.Tensor]:
    """`reps` bf16 hiddens [t, D] and routings (`routings`), and the reference output of the first."""
    e, d = w13.qweight.shape[0], w13.in_features
    hiddens = [torch.randn(t, d, dtype=torch.bfloat16, device=DEV) for _ in range(reps)]
    routes = routings(t, e, k, reps)
    return hiddens, routes, quant_moe_ref(hiddens[0], w13, w2, *routes[0])


def distinct_experts(routes: list) -> float:
    """Mean over the routings of the distinct experts they pick."""
    return sum(ids.unique().numel() for _, ids in routes) / len(routes)


def distinct_bytes(w13: QuantizedWeight, w2: QuantizedWeight, routes: list) -> float:
    """Mean over the routings of the distinct experts' weight bytes (scales and zeros included)."""
    return distinct_experts(routes) * (w13.nbytes() + w2.nbytes()) / w13.qweight.shape[0]


def routings(t: int, e: int, k: int, reps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, prev = [], torch.zeros(e, dtype=torch.bool, device=DEV)
    for _ in range(reps):
        logits = torch.rand(t, e, device=DEV)
        if t * k <= e // 2:
            logits = logits - 2.0 * prev.float()  # avoid the previous call's experts
        w, ids = logits.topk(k, dim=-1)
        prev = torch.zeros(e, dtype=torch.bool, device=DEV).scatter_(0, ids.reshape(-1), True)
        out.append(((w / w.sum(-1, keepdim=True)).float(), ids))
    return out


def graph_ms(fn, reps: int) -> float:
    """Median ms per call of fn(i), i < reps, captured as one CUDA graph (do_bench 10 ms warm-up, 50 ms)."""
    return shared_graph_ms(fn, reps, warmup_ms=10, rep_ms=50)


def warm(name: str, fname: str, tokens: list[int], sweep: bool) -> None:
    """Compile (into Triton's disk cache) every kernel variant bench_shape runs for one shape and
    format ("bf16": the peer), on uninitialised weights: run in parallel processes before timing."""
    d, inter, e, k = SHAPES[name]
    if fname == "bf16":
        w13b = torch.empty(e, 2 * inter, d, dtype=torch.bfloat16, device=DEV)
        w2b = torch.empty(e, d, inter, dtype=torch.bfloat16, device=DEV)
        for t in tokens:
            tw, ti = routings(t, e, k, 1)[0]
            tfm.fused_moe(torch.randn(t, d, dtype=torch.bfloat16, device=DEV), w13b, w2b, tw, ti)
        torch.cuda.synchronize()
        return
    fmt, group, zeros = FORMATS[fname]
    w13, w2 = empty_qw(fmt, group, zeros, e, 2 * inter, d), empty_qw(fmt, group, zeros, e, d, inter)
    for t in tokens:
        tw, ti = routings(t, e, k, 1)[0]
        h = torch.randn(t, d, dtype=torch.bfloat16, device=DEV)
        cfgs = [None]
        if t <= 16:
            cfgs += [w4.W4PairConfig(), w4.default_w4_config(t, e, k, group, fmt == "int4")]
        if t in SWEEP_T and sweep and fname in SWEEP_FORMATS:
            cfgs += sweep_configs()
        for cfg in cfgs:
            w4.fused_moe_w4(h, w13, w2, tw, ti, cfg)
        if fmt == "int4":
            w4.fused_moe_w4(h, w13, w2, tw, ti, w4.default_w4_config(t, e, k, group), codes=False)
            if t in CODES_SWEEP_T and sweep:
                for cfg in codes_configs(t, e, k, group):
                    w4.fused_moe_w4(h, w13, w2, tw, ti, cfg)
    torch.cuda.synchronize()


def empty_qw(fmt: str, group: int, zeros: bool, e: int, n: int, k: int) -> QuantizedWeight:
    z = torch.empty(e, n, k // group, dtype=torch.uint8, device=DEV) if zeros else None
    sd = {"int4": torch.bfloat16, "mxfp4": torch.uint8, "nvfp4": torch.float8_e4m3fn}[fmt]
    gs = torch.empty(e, n, device=DEV) if fmt == "nvfp4" else None
    q = torch.empty(e, n, k // 8, dtype=torch.int32, device=DEV)
    return QuantizedWeight(fmt, q, torch.empty(e, n, k // group, dtype=sd, device=DEV), n, k, group, z, gs)


def codes_configs(t: int, e: int, k: int, group: int) -> list[tfm.MoEConfig]:
    """Aligned-path tiles around the default for the int4 codes kernels: (up_n, down_n) and warps."""
    c = w4.default_w4_config(t, e, k, group)
    return [dataclasses.replace(c, up_n=un, down_n=dn, num_warps=nw, num_stages=3)
            for un, dn in ((32, 64), (64, 64), (64, 128), (128, 128)) for nw in (4, 8)]  # fmt: skip


def sweep_configs() -> list[w4.W4PairConfig]:
    return [w4.W4PairConfig(up_n=n, up_k=k, up_warps=nw) for n, k, nw in UP_SWEEP] + [
        w4.W4PairConfig(down_n=n, down_k=k, down_warps=nw, down_split=s) for n, k, nw in DOWN_SWEEP for s in DOWN_SPLITS
    ]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def ceilings() -> tuple[float, float]:
    return copy_bandwidth(DEV), matmul_rate(DEV)  # benchmarks/ceilings.py


def bench_shape(name: str, copy_gbs: float, tflops: float, tokens: list[int], sweep: bool, log,
                formats: list[str]) -> list[dict]:  # fmt: skip
    d, inter, e, k = SHAPES[name]
    w13b = torch.randn(e, 2 * inter, d, dtype=torch.bfloat16, device=DEV).mul_(d**-0.5)
    w2b = torch.randn(e, d, inter, dtype=torch.bfloat16, device=DEV).mul_(inter**-0.5)
    bf16_expert = 3 * inter * d * 2
    rows = []
    for fname, (fmt, group, zeros) in FORMATS.items():
        if fname not in formats:
            continue
        w13 = random_qw(fmt, group, zeros, e, 2 * inter, d)
        w2 = random_qw(fmt, group, zeros, e, d, inter)
        expert_bytes = (w13.nbytes() + w2.nbytes()) / e
        for t in tokens:
            reps = 8 if t <= 16 else 2
            hiddens = [torch.randn(t, d, dtype=torch.bfloat16, device=DEV) for _ in range(reps)]
            routes = routings(t, e, k, reps)
            distinct = sum(torch.unique(ids).numel() for _, ids in routes) / reps
            io = 2 * t * d * 2
            nbytes, bbytes = distinct * expert_bytes + io, distinct * bf16_expert + io
            flops = 6 * t * k * inter * d
            row = {"shape": name, "format": fname, "T": t, "reps": reps, "distinct_experts": distinct,
                   "bytes": nbytes, "floor_us": nbytes / copy_gbs / 1e3, "bf16_bytes": bbytes}  # fmt: skip
            if t in (1, 16, 512):
                tw, ti = routes[0]
                ref = quant_moe_ref(hiddens[0], w13, w2, tw, ti)
                row["rel_err"] = rel_err(w4.fused_moe_w4(hiddens[0], w13, w2, tw, ti), ref)
                if t <= 16:
                    aligned = w4.default_w4_config(t, e, k, group, fmt == "int4")
                    other = w4.W4PairConfig() if t * k > w4.W4_PAIR_MAX_PAIRS else aligned
                    row["rel_err_other_path"] = rel_err(w4.fused_moe_w4(hiddens[0], w13, w2, tw, ti, other), ref)
                assert row["rel_err"] < 1e-2, row

            def call(cfg=None, codes=True, w13=w13, w2=w2, hiddens=hiddens, routes=routes):
                return lambda i: w4.fused_moe_w4(hiddens[i], w13, w2, *routes[i], cfg, codes=codes)

            row["w4_us"] = graph_ms(call(), reps) * 1e3
            bf16 = lambda i, hiddens=hiddens, routes=routes: tfm.fused_moe(hiddens[i], w13b, w2b, *routes[i])
            row["bf16_us"] = graph_ms(bf16, reps) * 1e3
            row["w4_GBps"] = nbytes / row["w4_us"] / 1e3
            row["w4_pct_copy"] = 100 * row["w4_GBps"] / copy_gbs
            row["bf16_GBps"] = bbytes / row["bf16_us"] / 1e3
            row["speedup_vs_bf16"] = row["bf16_us"] / row["w4_us"]
            msg = (f"{name:13s} {fname:14s} T={t:5d} distinct {distinct:6.1f} | w4 {row['w4_us']:8.1f} us  floor "
                   f"{row['floor_us']:7.1f} us  {row['w4_GBps']:5.0f} GB/s = {row['w4_pct_copy']:4.0f}% copy | bf16 "
                   f"{row['bf16_us']:8.1f} us {row['bf16_GBps']:5.0f} GB/s | x{row['speedup_vs_bf16']:.2f}")  # fmt: skip
            if t > 16:
                row["w4_TFLOPs"] = flops / row["w4_us"] / 1e6
                row["bf16_TFLOPs"] = flops / row["bf16_us"] / 1e6
                msg += f" | {row['w4_TFLOPs']:.0f} vs bf16 {row['bf16_TFLOPs']:.0f} TFLOP/s (matmul {tflops:.0f})"
            if t <= 16:
                row["pair_us"] = graph_ms(call(w4.W4PairConfig()), reps) * 1e3
                row["aligned_us"] = graph_ms(call(w4.default_w4_config(t, e, k, group, fmt == "int4")), reps) * 1e3
                msg += f" | pair {row['pair_us']:.1f} aligned {row['aligned_us']:.1f}"
            if fmt == "int4":  # the aligned path with the dequantizing kernel instead of the codes kernel
                row["aligned_dequant_us"] = graph_ms(call(w4.default_w4_config(t, e, k, group), False), reps) * 1e3
                msg += f" | aligned dequant {row['aligned_dequant_us']:.1f}"
            if "rel_err" in row:
                msg += f" | err {row['rel_err']:.1e}"
            log(msg)
            if fmt == "int4" and t in CODES_SWEEP_T and sweep:
                row["codes_sweep"] = [{**dataclasses.asdict(cfg), "us": graph_ms(call(cfg), reps) * 1e3}
                                      for cfg in codes_configs(t, e, k, group)]  # fmt: skip
                log("    codes sweep us (up_n,down_n,warps): " + ", ".join(
                    f"{r['up_n']},{r['down_n']},{r['num_warps']} {r['us']:.1f}" for r in row["codes_sweep"]))  # fmt: skip
            if t in SWEEP_T and sweep and fname in SWEEP_FORMATS:
                row["sweep"] = [
                    {**dataclasses.asdict(cfg), "us": graph_ms(call(cfg), reps) * 1e3} for cfg in sweep_configs()
                ]
                log("    sweep us (up_n,up_k,up_warps | down_n,down_k,down_warps,down_split): " + ", ".join(
                    f"{r['up_n']},{r['up_k']},{r['up_warps']}|{r['down_n']},{r['down_k']},{r['down_warps']},"
                    f"{r['down_split']} {r['us']:.1f}" for r in row["sweep"]))  # fmt: skip
            rows.append(row)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/moe_w4_h100.json")
    ap.add_argument("--skip-deepseek", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tokens", default="", help="comma-separated T (default: 1,2,4,8,16,512,2048)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated FORMATS keys")
    ap.add_argument("--warm", nargs=2, metavar=("SHAPE", "FORMAT"), help="only compile one shape x format")
    ap.add_argument("--no-warm", action="store_true", help="skip the parallel compile pass")
    args = ap.parse_args()
    torch.manual_seed(0)
    tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else DECODE_T + PREFILL_T
    shapes = [n for n in SHAPES if not (n == "deepseek-v3" and args.skip_deepseek)]
    formats = args.formats.split(",")
    if any(f not in FORMATS for f in formats):
        sys.exit(f"bench_moe_w4: --formats takes {', '.join(FORMATS)}; got {args.formats}")
    if args.warm:
        warm(*args.warm, tokens, not args.no_sweep)
        return
    if not args.no_warm:  # compile every variant in parallel processes, then time with a warm cache
        t_warm = time.time()
        common = ["--tokens", ",".join(map(str, tokens))] + (["--no-sweep"] if args.no_sweep else [])
        procs = [subprocess.Popen([sys.executable, __file__, "--warm", n, f, *common])
                 for n in shapes for f in [*formats, "bf16"]]  # fmt: skip
        bad = [p.args[3:5] for p in procs if p.wait() != 0]
        print(f"compiled in {time.time() - t_warm:.0f} s" + (f"; warm-up failed for {bad}" if bad else ""), flush=True)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    t0 = time.time()
    copy_gbs, tflops = ceilings()
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    log(
        f"copy bandwidth {copy_gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s, W4_PAIR_MAX_PAIRS {w4.W4_PAIR_MAX_PAIRS}"
    )
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "command": "python " + " ".join(sys.argv), "copy_GBps": copy_gbs, "matmul_TFLOPs": tflops,
              "pair_config": dataclasses.asdict(w4.W4PairConfig()), "rows": []}  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for name in shapes:
        result["rows"] += bench_shape(name, copy_gbs, tflops, tokens, not args.no_sweep, log, formats)
        result["seconds"], result["log"] = time.time() - t0, lines
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()
    log(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
