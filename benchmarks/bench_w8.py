"""8-bit linears and MoE (FP8 block-scaled, W8A8 INT8; kernels/triton_fp8_gemm.py, triton_int8_gemm.py,
triton_fused_moe_w8.py) beside their floors and 16-bit / vendor peers in the same process, one GPU.

Dense, decode (M = 1, 4, 16): achieved GB/s = (weight + scale bytes + x + y) / median time, beside the
device-to-device copy bandwidth measured here and bf16 cuBLAS (F.linear) on the same shape. Each timed
graph runs the product over enough weight copies to exceed L2 several times.
Dense, prefill (M = 512, 2048): TFLOP/s end to end (activation quantization included) and GEMM only,
beside bf16 cuBLAS, torch._scaled_mm (fp8, row-wise scales, GEMM only) and torch._int_mm (int8 -> int32,
GEMM only), and beside each dtype's peak measured on an 8192^3 product.
MoE (Qwen3-30B-A3B experts: E=128, top-8, D=2048, I=768), T = 1, 8, 512: fp8 / int8 vs the bf16 fused
MoE; each of R calls in a graph has its own hidden and routing; floor = max(distinct experts hit *
expert bytes / copy bandwidth, FLOPs / peak).
Every kernel is checked against quant_linear_ref / quant_moe_ref before it is timed (rel err <= 2e-2).

    PYTHONPATH=. python benchmarks/bench_w8.py --out $OUT/w8_h100.json [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import best_rate, copy_bandwidth
from ceilings import graph_ms as shared_graph_ms

from ftransformers.kernels import triton_fp8_gemm as f8
from ftransformers.kernels import triton_int8_gemm as i8
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_linear_ref, quant_moe_ref
from ftransformers.kernels.triton_fused_moe import MoEConfig, fused_moe
from ftransformers.kernels.triton_fused_moe_w8 import W8PairConfig, fused_moe_w8

DEV = "cuda"
DT = torch.bfloat16
SHAPES = {  # name: (N, K)
    "qwen3-30b qkv": (5120, 2048), "qwen3-30b o": (2048, 4096), "qwen3-8b gate_up": (24576, 4096),
    "qwen3-8b down": (4096, 12288), "dsv3 q_a+kv_a": (2112, 7168), "dsv3 o": (7168, 16384),
}  # fmt: skip
SWEEP_SHAPES = ["dsv3 q_a+kv_a", "qwen3-30b qkv"]
L2_BYTES = 50 << 20
TOL = 2e-2


def quant_fp8(w: torch.Tensor) -> QuantizedWeight:
    *lead, n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    wp = F.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n)).view(*lead, nb, 128, kb, 128)
    s = (wp.abs().amax(dim=(-3, -1)) / 448.0).clamp_min(1e-10)
    q = (wp / s[..., :, None, :, None]).to(torch.float8_e4m3fn).view(*lead, nb * 128, kb * 128)
    return QuantizedWeight("fp8_block", q[..., :n, :k].contiguous(), s, n, k, 128)


def quant_int8(w: torch.Tensor) -> QuantizedWeight:
    s = (w.float().abs().amax(dim=-1) / 127.0).clamp_min(1e-10)
    q = torch.round(w.float() / s[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, s, w.shape[-2], w.shape[-1], w.shape[-1])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def graph_ms(fn: Callable[[int], Any], reps: int, rep_ms: int = 50) -> float:
    """Median ms per call of fn(i), i < reps, all captured in one CUDA graph (two eager calls first)."""
    return shared_graph_ms(fn, reps, warm_calls=2, rep_ms=rep_ms)


def ceilings() -> dict[str, float]:
    out = {"copy_GBps": copy_bandwidth(DEV)}  # benchmarks/ceilings.py
    s = 8192
    a = torch.randn(s, s, device=DEV, dtype=DT)
    a8, ai = a.to(torch.float8_e4m3fn), torch.randint(-127, 128, (s, s), device=DEV, dtype=torch.int8)
    one = torch.ones(s, 1, device=DEV)

    def rate(fn: Callable[[], Any]) -> float:
        return best_rate(2 * s**3 / 1e9, fn, DEV)

    out["bf16_TFLOPs"] = rate(lambda: a @ a)
    out["fp8_TFLOPs"] = rate(lambda: torch._scaled_mm(a8, a8.t(), scale_a=one, scale_b=one.t(), out_dtype=DT))
    out["int8_TOPs"] = rate(lambda: torch._int_mm(ai, ai.t()))
    return out


def checked_time(fn_for: Callable[[int], torch.Tensor], ref: torch.Tensor, copies: int) -> dict[str, Any]:
    try:
        err = rel_err(fn_for(0), ref)
        if not err <= TOL:
            return {"error": f"rel err {err:.3g}"}
        return {"ms": graph_ms(fn_for, copies), "rel_err": err}
    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}


def dense_weights(n: int, k: int, copies: int, gen: torch.Generator) -> dict[str, list]:
    ws = [torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k**0.5 for _ in range(copies)]
    return {"bf16": ws, "fp8_block": [quant_fp8(w) for w in ws], "int8": [quant_int8(w) for w in ws]}


LINEAR = {"fp8_block": f8.fp8_block_linear, "int8": i8.int8_linear}


def bench_dense(name: str, ceil: dict[str, float], rows_m: list[int], log: Callable[[dict], None]) -> None:
    n, k = SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(0)
    copies = max(2, -(-4 * L2_BYTES // (n * k)))  # by the fp8 size; bf16 copies are twice as large
    w = dense_weights(n, k, copies, gen)
    bw = ceil["copy_GBps"]
    for m in rows_m:
        x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
        io = 2 * m * (k + n)
        row: dict[str, Any] = {"shape": name, "N": n, "K": k, "M": m}
        t_bf16 = graph_ms(lambda i, x=x: F.linear(x, w["bf16"][i]), copies)
        row["bf16_cublas_ms"] = t_bf16
        flops = 2 * m * n * k
        for fmt in ("fp8_block", "int8"):
            nbytes = w[fmt][0].nbytes() + io
            r = checked_time(lambda i, x=x, f=fmt: LINEAR[f](x, w[f][i]), quant_linear_ref(x, w[fmt][0]), copies)
            row[fmt] = r
            if "ms" in r:
                r["GBps"] = nbytes / r["ms"] / 1e6
                r["pct_copy_bw"] = 100 * r["GBps"] / bw
                r["floor_ms"] = nbytes / bw / 1e6
                r["TFLOPs"] = flops / r["ms"] / 1e9
        row["bf16_cublas_GBps"] = (n * k * 2 + io) / t_bf16 / 1e6
        row["bf16_cublas_TFLOPs"] = flops / t_bf16 / 1e9
        if m >= 256:
            bench_prefill_peers(row, x, w, ceil)
        log(row)


def tflops_or_error(flops: int, fn: Callable[[int], Any]) -> float | str:
    try:
        return flops / graph_ms(fn, 1) / 1e9
    except Exception as e:  # noqa: BLE001 - a peer that does not run here is reported
        return f"{type(e).__name__}: {str(e)[:160]}"


def bench_prefill_peers(row: dict[str, Any], x: torch.Tensor, w: dict[str, list], ceil: dict[str, float]) -> None:
    m, k = x.shape
    n = w["bf16"][0].shape[0]
    flops = 2 * m * n * k
    xq8, xs8 = f8.quant_act_fp8(x)
    qw8, qwi = w["fp8_block"][0], w["int8"][0]
    xqi, xsi = i8.quant_act_int8(x)
    y = torch.empty(m, n, device=DEV, dtype=DT)
    sa = torch.rand(m, 1, device=DEV) + 0.5
    sb = torch.rand(1, n, device=DEV) + 0.5
    row["fp8_block"]["gemm_only_TFLOPs"] = tflops_or_error(flops, lambda i: f8.fp8_block_gemm(xq8, xs8, qw8, y))
    row["int8"]["gemm_only_TFLOPs"] = tflops_or_error(flops, lambda i: i8.int8_gemm(xqi, xsi, qwi, y))
    row["scaled_mm_fp8_rowwise_TFLOPs"] = tflops_or_error(
        flops, lambda i: torch._scaled_mm(xq8, qw8.qweight.t(), scale_a=sa, scale_b=sb, out_dtype=DT)
    )
    row["int_mm_int8_TFLOPs"] = tflops_or_error(flops, lambda i: torch._int_mm(xqi, qwi.qweight.t()))
    row["pct_of_peak"] = {
        "fp8_block": 100 * row["fp8_block"].get("TFLOPs", 0) / ceil["fp8_TFLOPs"],
        "int8": 100 * row["int8"].get("TFLOPs", 0) / ceil["int8_TOPs"],
        "bf16_cublas": 100 * row["bf16_cublas_TFLOPs"] / ceil["bf16_TFLOPs"],
    }


def moe_call(i: int, hs: list, rt: list, w13: QuantizedWeight, w2: QuantizedWeight, cfg: Any) -> torch.Tensor:
    return fused_moe_w8(hs[i], w13, w2, *rt[i], cfg)


def bench_moe(
    ceil: dict[str, float],
    tokens: list[int],
    log: Callable[[dict], None],
    d: int = 2048,
    inter: int = 768,
    e: int = 128,
    top_k: int = 8,
    sweep: bool = False,
) -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.randn(e, 2 * inter, d, device=DEV, dtype=DT, generator=gen) / d**0.5
    w2 = torch.randn(e, d, inter, device=DEV, dtype=DT, generator=gen) / inter**0.5
    qws = {"fp8_block": (quant_fp8(w13), quant_fp8(w2)), "int8": (quant_int8(w13), quant_int8(w2))}
    expert_bytes = {"bf16": 3 * inter * d * 2}
    for fmt, (a, b) in qws.items():
        expert_bytes[fmt] = (a.nbytes() + b.nbytes()) // e
    bw = ceil["copy_GBps"]
    for t in tokens:
        reps = 8 if t <= 64 else 2
        hs = [torch.randn(t, d, device=DEV, dtype=DT, generator=gen) for _ in range(reps)]
        routing = []
        for _ in range(reps):
            ids = torch.rand(t, e, device=DEV, generator=gen).topk(top_k, dim=-1).indices
            tw = torch.rand(t, top_k, device=DEV, generator=gen) + 0.1
            routing.append((tw / tw.sum(-1, keepdim=True), ids))
        hit = sum(torch.unique(r[1]).numel() for r in routing) / reps
        flops = 2 * t * top_k * 3 * inter * d
        row: dict[str, Any] = {"T": t, "experts_hit": hit, "reps": reps}
        t16 = graph_ms(lambda i, hs=hs, rt=routing: fused_moe(hs[i], w13, w2, *rt[i]), reps)
        row["bf16"] = {
            "ms": t16,
            "floor_ms": max(hit * expert_bytes["bf16"] / bw / 1e6, flops / ceil["bf16_TFLOPs"] / 1e9),
        }
        for fmt, (a, b) in qws.items():
            ref = quant_moe_ref(hs[0], a, b, *routing[0])
            peak = ceil["fp8_TFLOPs"] if fmt == "fp8_block" else ceil["int8_TOPs"]
            floor = max(hit * expert_bytes[fmt] / bw / 1e6, flops / peak / 1e9)
            for cfg in [None, *moe_sweep_configs(t)] if sweep else [None]:
                r = checked_time(partial(moe_call, hs=hs, rt=routing, w13=a, w2=b, cfg=cfg), ref, reps)
                if "ms" in r:
                    r.update(floor_ms=floor, GBps=hit * expert_bytes[fmt] / r["ms"] / 1e6, TFLOPs=flops / r["ms"] / 1e9)
                    r["speedup_vs_bf16"] = t16 / r["ms"]
                if cfg is None:
                    row[fmt] = r
                else:
                    row.setdefault(f"{fmt}_sweep", []).append({"config": cfg.__dict__, **r})
        log(row)


def decode_sweep(m: int) -> dict[str, list]:
    bm = triton.next_power_of_2(m)
    fp8: list
    if m > 4:
        fp8 = [
            f8.Fp8GemmConfig(16, bn, 1, w, st)
            for bn, w, st in ((32, 4, 4), (64, 4, 4), (128, 4, 4), (64, 4, 3), (128, 8, 3))
        ]
    else:
        fp8 = [f8.Fp8GemvConfig(bm, bn, max(64, bk // bm), late) for bn, bk, late in
               ((4, 512, False), (8, 512, False), (8, 512, True), (8, 1024, False), (16, 512, False), (16, 512, True),
                (4, 1024, True), (8, 256, True))]  # fmt: skip
    int8: list = [i8.Int8GemvConfig(16, bn, bk, True, True, False, 4, st) for bn, bk, st in
                  ((32, 256, 4), (32, 512, 4), (64, 256, 4), (64, 512, 3), (16, 512, 4))]  # fmt: skip
    if m == 1:
        int8 += [i8.Int8GemvConfig(1, bn, bk, False, False, late) for bn, bk, late in
                 ((8, 1024, False), (8, 1024, True), (16, 512, True), (4, 1024, True), (8, 512, True), (16, 1024, False))]  # fmt: skip
    return {"fp8_block": fp8, "int8": int8}


GEMM_SWEEP = [(128, 128, 8, 8, 3), (128, 256, 8, 8, 3), (128, 128, 8, 4, 4), (64, 128, 8, 4, 4), (256, 128, 8, 8, 3)]


def bench_sweep(ceil: dict[str, float], log: Callable[[dict], None], prefill: bool) -> None:
    """Decode tiles at M = 1, 4, 16 (or GEMM tiles at M = 2048) on SWEEP_SHAPES; best first."""
    bw = ceil["copy_GBps"]
    for name in SWEEP_SHAPES:
        n, k = SHAPES[name]
        gen = torch.Generator(device=DEV).manual_seed(2)
        copies = max(2, -(-4 * L2_BYTES // (n * k)))
        w = dense_weights(n, k, copies, gen)
        for m in (2048,) if prefill else (1, 4, 16):
            x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
            if prefill:
                sweep = {"fp8_block": [f8.Fp8GemmConfig(*c) for c in GEMM_SWEEP],
                         "int8": [i8.Int8GemmConfig(a, b, 128, g, nw, st) for a, b, g, nw, st in GEMM_SWEEP]}  # fmt: skip
            else:
                sweep = decode_sweep(m)
            for fmt, cfgs in sweep.items():
                nbytes = w[fmt][0].nbytes() + 2 * m * (k + n)
                ref = quant_linear_ref(x, w[fmt][0])
                res = []
                for cfg in cfgs:
                    r = checked_time(lambda i, x=x, w=w, f=fmt, c=cfg: LINEAR[f](x, w[f][i], None, c), ref, copies)
                    if "ms" in r:
                        r["pct_copy_bw"] = 100 * nbytes / r["ms"] / 1e6 / bw
                        r["TFLOPs"] = 2 * m * n * k / r["ms"] / 1e9
                    res.append({"config": cfg.__dict__, **r})
                ok = sorted((r for r in res if "ms" in r), key=lambda r: r["ms"])
                log({"shape": name, "M": m, "fmt": fmt, "best": ok[:3], "failed": [r for r in res if "error" in r][:3],
                     "all": [[list(r["config"].values()), round(r["ms"] * 1e3, 2)] for r in ok]})  # fmt: skip


def moe_sweep_configs(t: int) -> list:
    if t == 1:
        pair = [W8PairConfig(*c) for c in ((8, 512, 4, 512, False), (8, 512, 4, 512, True), (4, 1024, 4, 1024, False),
                                           (16, 512, 8, 512, False))]  # fmt: skip
        return [*pair, MoEConfig(16, 32, 128, 32, 128, 1, 4, 4), MoEConfig(16, 64, 128, 128, 128, 1, 4, 4)]
    if t <= 16:
        return [
            MoEConfig(16, a, 128, b, 128, 1, 4, st)
            for a, b, st in ((64, 64, 4), (32, 32, 4), (128, 128, 3), (64, 128, 4))
        ]
    return [MoEConfig(*c) for c in ((128, 128, 128, 128, 128, 8, 8, 3), (64, 128, 128, 128, 128, 8, 4, 4),
                                    (64, 64, 128, 128, 128, 8, 4, 4), (64, 64, 128, 64, 128, 8, 4, 4))]  # fmt: skip


def bench_diag(log: Callable[[dict], None]) -> None:
    """Where fp8 kernel-vs-reference differences come from: the reference on CUDA vs on CPU (IEEE
    float32), and the fake-quantized x and dequantized W on both devices; int8 alongside."""
    from ftransformers.kernels.quant_formats import _fake_quant_act, dequantize

    gen = torch.Generator(device=DEV).manual_seed(3)
    n, k = 2048, 4096
    w = torch.randn(n, k, device=DEV, generator=gen) / k**0.5
    x = torch.randn(16, k, device=DEV, dtype=DT, generator=gen)
    row: dict[str, Any] = {"tf32": torch.backends.cuda.matmul.allow_tf32,
                           "fp32_precision": str(getattr(torch.backends.cuda.matmul, "fp32_precision", None))}  # fmt: skip
    for fmt, qw in (("fp8_block", quant_fp8(w)), ("int8", quant_int8(w))):
        qc = QuantizedWeight(qw.fmt, qw.qweight.cpu(), qw.scales.cpu(), n, k, qw.group_size)
        for m in (1, 4, 16):
            xm = x[:m]
            y = LINEAR[fmt](xm, qw)
            xf_cuda, xf_cpu = _fake_quant_act(xm, qw), _fake_quant_act(xm.cpu(), qc)
            w_cuda, w_cpu = dequantize(qw), dequantize(qc)
            y64 = xf_cpu.double() @ w_cpu.double().t()
            row[f"{fmt} M={m}"] = {
                "kernel_vs_ref_cuda": rel_err(y, quant_linear_ref(xm, qw)),
                "kernel_vs_ref_cpu": rel_err(y.cpu(), quant_linear_ref(xm.cpu(), qc)),
                "kernel_vs_fp64": rel_err(y.cpu(), y64),
                "ref_cuda_fp32_vs_fp64": rel_err((xf_cuda @ w_cuda.t()).cpu(), y64),
                "ref_cpu_fp32_vs_fp64": rel_err(xf_cpu @ w_cpu.t(), y64),
                "xf_cuda_ne_cpu": int((xf_cuda.cpu() != xf_cpu).sum()),
                "w_cuda_ne_cpu": int((w_cuda.cpu() != w_cpu).sum()),
            }
    log(row)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--decode-rows", default="1,4,16")
    p.add_argument("--prefill-rows", default="512,2048")
    p.add_argument("--moe-tokens", default="1,8,512")
    p.add_argument("--sections", default="dense,moe", help="of dense,moe,moe_sweep,diag,decode_sweep,gemm_sweep")
    args = p.parse_args()
    sections = args.sections.split(",")
    ceil = ceilings()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__, **ceil,
        "dense": [], "moe": [], "sweep": [], "diag": [],
    }  # fmt: skip
    print(json.dumps(ceil), flush=True)

    def logger(key: str) -> Callable[[dict], None]:
        def log(row: dict) -> None:
            out[key].append(row)
            Path(args.out).write_text(json.dumps(out, indent=1, default=str))
            print(summary(key, row), flush=True)

        return log

    rows = [int(m) for m in args.decode_rows.split(",")] + [int(m) for m in args.prefill_rows.split(",") if m]
    if "dense" in sections:
        for name in args.shapes.split(","):
            bench_dense(name, ceil, rows, logger("dense"))
            torch.cuda.empty_cache()
    if "moe" in sections or "moe_sweep" in sections:
        tokens = [int(t) for t in args.moe_tokens.split(",")]
        bench_moe(ceil, tokens, logger("moe"), sweep="moe_sweep" in sections)
        torch.cuda.empty_cache()
    if "diag" in sections:
        bench_diag(logger("diag"))
    if "decode_sweep" in sections:
        bench_sweep(ceil, logger("sweep"), prefill=False)
    if "gemm_sweep" in sections:
        bench_sweep(ceil, logger("sweep"), prefill=True)


def _fmt(r: dict[str, Any], key: str) -> str:
    if "ms" not in r:
        return f"{key}: {r.get('error')}"
    extra = f"{r['pct_copy_bw']:3.0f}% bw" if "pct_copy_bw" in r else ""
    if "TFLOPs" in r and "pct_copy_bw" not in r:
        extra = f"{r['TFLOPs']:6.1f} TF"
    return f"{key} {r['ms'] * 1e3:8.1f} us {extra}"


def _num(v: object) -> str:
    return f"{v:.0f}" if isinstance(v, float) else str(v)[:60]


def summary(key: str, row: dict[str, Any]) -> str:
    if key == "diag":
        return json.dumps(row, indent=0)
    if key == "dense":
        s = f"{row['shape']:18s} M={row['M']:<5d} bf16 {row['bf16_cublas_ms'] * 1e3:8.1f} us"
        for fmt in ("fp8_block", "int8"):
            r = row[fmt]
            s += "  |  " + _fmt(r, fmt)
            if "ms" in r:
                s += f" (floor {r['floor_ms'] * 1e3:.1f} us, {r['TFLOPs']:.0f} TF)"
        if "scaled_mm_fp8_rowwise_TFLOPs" in row:
            s += (f"  | bf16 {row['bf16_cublas_TFLOPs']:.0f} TF, scaled_mm {_num(row['scaled_mm_fp8_rowwise_TFLOPs'])} TF,"
                  f" int_mm {_num(row['int_mm_int8_TFLOPs'])} TF, gemm-only fp8 {_num(row['fp8_block'].get('gemm_only_TFLOPs'))}"
                  f" int8 {_num(row['int8'].get('gemm_only_TFLOPs'))}")  # fmt: skip
        return s
    if key == "moe":
        s = f"moe T={row['T']:<4d} hit {row['experts_hit']:.0f}  bf16 {row['bf16']['ms'] * 1e3:.1f} us (floor {row['bf16']['floor_ms'] * 1e3:.1f})"
        for fmt in ("fp8_block", "int8"):
            r = row[fmt]
            s += "  |  " + (f"{fmt} {r['ms'] * 1e3:.1f} us (floor {r['floor_ms'] * 1e3:.1f}, {r['speedup_vs_bf16']:.2f}x bf16)"
                            if "ms" in r else f"{fmt}: {r['error']}")  # fmt: skip
        for fmt in ("fp8_block", "int8"):
            ok = sorted((v for v in row.get(f"{fmt}_sweep", []) if "ms" in v), key=lambda v: v["ms"])
            s += "".join(f"\n    {fmt} {v['ms'] * 1e3:.1f} us {list(v['config'].values())}" for v in ok[:3])
        return s
    best = row["best"][0] if row["best"] else {}
    return f"sweep {row['shape']:18s} M={row['M']:<3d} {row['fmt']:9s} best {best.get('config')} {best.get('ms', 0) * 1e3:.1f} us ({best.get('pct_copy_bw', 0):.0f}% bw)"


if __name__ == "__main__":
    main()
