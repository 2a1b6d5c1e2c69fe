"""4-bit-weight GEMM (kernels/triton_w4a16.py) on the dense shapes of the issue's models, beside the bf16
peers in the same process: the one-row Triton GEMV (`triton_gemv.gemv`, M <= 16) and cuBLAS (`F.linear`).

Decode (M <= 16): achieved GB/s = (qweight + scales + zeros + global scale + x + y bytes) / median time,
beside the device-to-device copy bandwidth measured in the same run. Each timed call runs the product
over enough weight copies to exceed L2 several times, inside a CUDA graph, and reports the median per
product. Prefill (M = 512, 2048): TFLOP/s beside cuBLAS bf16 on the dequantized weight and beside the
bf16 matmul rate measured on an 8192^3 product. Every config is checked against `quant_linear_ref`
before it is timed. Kernels are compiled first in a process pool (Triton's disk cache), so the run
spends its time measuring.

    PYTHONPATH=. python benchmarks/bench_w4a16.py --out $OUT/w4a16_h100.json [--sweep]
    PYTHONPATH=. python benchmarks/bench_w4a16.py --out $OUT/w4a16_mid_h100.json --mid-sweep [--shapes ...]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import copy_bandwidth, matmul_rate

from ftransformers.kernels import gluon_w4a16_mma as mma_path
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_linear_ref
from ftransformers.kernels.triton_gemv import gemv
from ftransformers.kernels.triton_w4a16 import w4a16_config, w4a16_linear

DEV = torch.device("cuda")
DT = torch.bfloat16
SHAPES = {  # name: (N, K) of the weight [N, K]
    "qwen3-30b qkv": (5120, 2048), "qwen3-30b o": (2048, 4096), "qwen3-8b gate_up": (24576, 4096),
    "qwen3-8b down": (4096, 12288), "dsv3 q_b": (24576, 1536), "dsv3 o": (7168, 16384),
    "dsv3 shared gate_up": (4096, 7168), "dsv3 shared down": (7168, 2048), "qwen3-8b qkv": (6144, 4096),
    "qwen3-8b o": (4096, 4096),
}  # fmt: skip
DEFAULT_SHAPES = list(SHAPES)
SHAPES |= {"dsv3 q_a kv_a": (2112, 7168), "dsv3 dense gate_up": (36864, 7168), "dsv3 dense down": (7168, 18432)}
# int4-g32-sym: Kimi-K2's int4 format (compressed-tensors pack-quantized, symmetric, group 32)
VARIANTS = {"int4-sym": ("int4", 128, False), "int4-asym": ("int4", 128, True), "mxfp4": ("mxfp4", 32, False),
            "nvfp4": ("nvfp4", 16, False), "int4-g32-sym": ("int4", 32, False)}  # fmt: skip
ROWS = [1, 2, 4, 8, 16]
PREFILL_ROWS = [512, 2048]
L2_BYTES = 50 << 20
SWEEP_SHAPES = ["qwen3-30b qkv", "qwen3-30b o", "qwen3-8b gate_up"]  # prefill rows: on every sweep shape
SWEEP_VARIANTS = ["int4-asym", "nvfp4"]
SWEEP_ROWS = [1, 2, 4, 8, 16]


def make_weight(variant: str, N: int, K: int, gen: torch.Generator) -> QuantizedWeight:
    fmt, group, has_zeros = VARIANTS[variant]
    q = torch.randint(-(2**31), 2**31, (N, K // 8), device=DEV, dtype=torch.int32, generator=gen)
    zeros = gs = None
    if fmt == "int4":
        scales = (torch.rand(N, K // group, device=DEV, generator=gen) * 0.01 + 0.005).half()
        if has_zeros:
            zeros = torch.randint(0, 16, (N, K // group), device=DEV, dtype=torch.uint8, generator=gen)
    elif fmt == "mxfp4":
        scales = torch.randint(119, 124, (N, K // group), device=DEV, dtype=torch.uint8, generator=gen)
    else:
        scales = (torch.rand(N, K // group, device=DEV, generator=gen) * 440 + 1).to(torch.float8_e4m3fn)
        gs = torch.rand(N, device=DEV, generator=gen) * 1e-5 + 5e-6
    return QuantizedWeight(fmt, q, scales, N, K, group, zeros=zeros, global_scale=gs)


def quant_copies(variant: str, N: int, K: int, gen: torch.Generator) -> list[QuantizedWeight]:
    """Enough distinct random weights that a graph of products over them reads past L2 four times."""
    qws = [make_weight(variant, N, K, gen)]
    return qws + [make_weight(variant, N, K, gen) for _ in range(max(2, -(-4 * L2_BYTES // qws[0].nbytes())) - 1)]


def bf16_copies(N: int, K: int, gen: torch.Generator) -> list[torch.Tensor]:
    """quant_copies' bf16 peer: distinct [N, K] weights, four times L2 in all."""
    return [torch.randn(N, K, device=DEV, dtype=DT, generator=gen) / K**0.5 for _ in range(max(2, -(-4 * L2_BYTES // (2 * N * K))))]  # fmt: skip


def header(bw: float, peak: float | None = None) -> dict[str, Any]:
    """The result file's head: device, date, command, versions and the ceilings measured in this run."""
    out = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": bw}  # fmt: skip
    if peak is not None:
        out["bf16_matmul_TFLOPs"] = peak
    return out


def sweep_configs(M: int) -> list[dict[str, int]]:
    def dot(bn: int, bk: int, warps: int = 4, split_k: int = 1) -> dict[str, int]:
        return {"GEMV": 0, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k, "GROUP_M": 1,
                "num_warps": warps, "num_stages": 3}  # fmt: skip

    def fma(bn: int, bk: int, split_k: int = 1) -> dict[str, int]:
        return {"GEMV": 1, "BLOCK_M": triton.next_power_of_2(M), "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split_k,
                "num_warps": bk // 256, "num_stages": 2}  # fmt: skip

    if M <= 2:
        deep = [{**fma(4, 2048), "num_warps": w} for w in (4, 8)]
        return [fma(bn, bk) for bn in (4, 8, 16) for bk in (512, 1024)] + [fma(8, 1024, 2)] + deep
    if M <= 4:
        return [fma(bn, bk) for bn in (4, 8) for bk in (512, 1024)] + [dot(16, 256), dot(32, 256), dot(64, 128)]
    extra = [fma(4, 1024)] if M <= 8 else []
    return (
        [dot(bn, bk) for bn in (16, 32, 64) for bk in (128, 256)] + [dot(32, 256, split_k=2), dot(64, 128, 8)] + extra
    )


def codes_configs() -> list[dict[str, int]]:
    """The int4 codes kernel (kernels/triton_w4a16_codes.py, <= 16 rows) over tiles, splits and warps."""
    return [{"CODES": 1, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": w, "num_stages": 3}
            for bn in (64, 128) for bk in (64, 128) for sk in (1, 2, 4, 8) for w in (4, 8)]  # fmt: skip


CODES_ROWS = [("int4-sym", [2, 4, 8, 16]), ("int4-asym", [8])]


def sweep_rows(out: dict[str, Any], path: str, workers: int, bw: float, shapes: list[str], fmts: list[str],
               rows: list[int], cfgs: list[dict[str, int]], tag: str, gen: torch.Generator) -> list[dict[str, Any]]:  # fmt: skip
    """Each config of `cfgs` on each (shape, format, rows), beside the default config and the bf16 GEMV;
    rows appended to out["codes_sweep"]. Sweep timings use 5 ms of repeats (rankings), the rest 20 ms."""
    precompile([(v, *SHAPES[s], M, c) for s in shapes for v in fmts for M in rows for c in cfgs + [None]], workers)
    res = []
    for name in shapes:
        N, K = SHAPES[name]
        w16 = bf16_copies(N, K, gen)
        for v in fmts:
            qws = quant_copies(v, N, K, gen)
            probe = qws[0]
            for M in rows:
                x = torch.randn(M, K, device=DEV, dtype=DT, generator=gen)
                nbytes = probe.nbytes() + 2 * M * (K + N)
                t_def = checked_time(x, qws, None)
                t_gemv = time_per_call(lambda i, x=x, w=w16: gemv(x, w[i]), len(w16))
                timed = [(c, checked_time(x, qws, c, rep=5)) for c in cfgs]
                ok = sorted(((t, c) for c, t in timed if not isinstance(t, str)), key=lambda r: r[0])
                row = {"phase": tag, "shape": name, "fmt": v, "M": M, "bytes": nbytes, "floor_ms": nbytes / bw / 1e6,
                       "default": w4a16_config(M, N, K, *VARIANTS[v][:2]), "default_ms": t_def, "gemv_bf16_ms": t_gemv,
                       "results": [[c, t] for c, t in timed]}  # fmt: skip
                res.append(row)
                pd = f"{100 * nbytes / t_def / 1e6 / bw:3.0f}%" if not isinstance(t_def, str) else t_def
                for t, c in ok[:3]:
                    print(f"  {tag} {name:20s} {v:9s} M={M:<3d} {t * 1e3:6.1f} us ({100 * nbytes / t / 1e6 / bw:3.0f}% copy) "
                          f"default {pd}  bf16 gemv {t_gemv * 1e3:6.1f} us  {c}", flush=True)  # fmt: skip
                for c, t in timed:
                    if isinstance(t, str):
                        print(f"  {tag} FAILED {name} {v} M={M} {c}: {t}", flush=True)
                out["codes_sweep"] = out.get("codes_sweep", []) + [row]
                Path(path).write_text(json.dumps(out, indent=1))
        del qws, probe, w16
    return res


def codes_sweep(out: dict[str, Any], path: str, workers: int, bw: float) -> None:
    """The codes kernel's tiles and splits on every shape (CODES_ROWS formats and rows), beside the default
    config and the bf16 GEMV; then the SASS opcode mix of the loop of the best config on the first shape.
    (The sweeps behind the kernel's design, with operand-order, code-order, split-order, prefetch and
    x-sum variants, are in benchmarks/results/w4a16_codes_{sweep,explore,sweep2}_h100.json.)"""
    gen = torch.Generator(device=DEV).manual_seed(1)
    res = []
    for fmt, rows in CODES_ROWS:
        res += sweep_rows(out, path, workers, bw, list(SHAPES), [fmt], rows, codes_configs(), "codes", gen)
    top = min(((t, c) for c, t in res[0]["results"] if not isinstance(t, str)), key=lambda r: r[0])[1]
    out["sass_config"] = top
    out["sass_opcodes"] = sass_opcodes(top, res[0]["shape"], Path(path).with_suffix(".sass"))
    print(f"SASS opcodes of {top}: {out['sass_opcodes']}", flush=True)
    Path(path).write_text(json.dumps(out, indent=1))


def sass_opcodes(cfg: dict[str, int], shape: str, sass_path: Path) -> dict[str, int]:
    """Opcode counts of the codes kernel compiled for cfg on `shape` at M = 8 (its SASS written to sass_path)."""
    from ftransformers.kernels import triton_w4a16_codes as mod

    N, K = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(3)
    mod._w4a16_codes_kernel.device_caches.clear()
    w4a16_linear(torch.randn(8, K, device=DEV, dtype=DT, generator=gen), make_weight("int4-sym", N, K, gen), config=cfg)
    texts = []
    for cache in mod._w4a16_codes_kernel.device_caches.values():
        for kernel in cache[0].values():
            try:
                texts.append(kernel.asm["sass"])
            except Exception as e:  # noqa: BLE001 - nvdisasm may be missing
                return {"error": f"{type(e).__name__}: {e}"[:200]}
    sass_path.write_text("\n\n".join(texts))
    return loop_opcodes(texts[0]) if texts else {}


def loop_opcodes(sass: str) -> dict[str, int]:
    """Opcode counts of the longest backward-branch loop of a Triton SASS listing (lines `ctrl\tOP ...`)."""
    from collections import Counter

    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if "\t" in line:
            tok = line.split("\t", 1)[1].split()
            ins.append(tok[1] if tok[0].startswith("@") and len(tok) > 1 else tok[0])
            if ins[-1].startswith("BRA"):
                ins[-1] = "BRA " + tok[-1].rstrip(";")
        elif line.strip().endswith(":"):
            labels[line.strip()[:-1]] = len(ins)
    loops = [
        (labels[op[4:]], i) for i, op in enumerate(ins) if op.startswith("BRA ") and labels.get(op[4:], i + 1) <= i
    ]
    if not loops:
        return {}
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    ops = Counter(op.split(".")[0].split()[0] for op in ins[lo : hi + 1])
    return {"loop_instructions": hi + 1 - lo, **dict(ops.most_common(30))}


MID_ROWS = [4, 8, 16, 32, 64]
MID_VARIANTS = ["int4-asym", "mxfp4", "nvfp4"]


def decoded_configs(M: int, group: int = 128) -> list[dict[str, int]]:
    """The int4 codes kernel's decoded form (DEQUANT: weights decoded with their scales before one dot a tile) at M
    rows: weight tiles of 64 / 128 rows, K tiles of 64 / 128 inside a group, K split 1-4, 4 warps (8 too on 128-row
    tiles), 3 or 4 stages."""
    bm = max(16, triton.next_power_of_2(M))
    bks = [bk for bk in (64, 128) if group % bk == 0] or [32]
    return [{"CODES": 1, "DEQUANT": 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": w,
             "num_stages": st} for bn in (64, 128) for bk in bks for sk in (1, 2, 4)
            for w in ((4,) if bn == 64 else (4, 8)) for st in (3, 4)]  # fmt: skip


def mid_configs(M: int, fmt: str, group: int = 128, decoded: bool = False) -> list[dict[str, int]]:
    """Tiles at M rows: int4 on the codes kernel (kernels/triton_w4a16_codes.py; x tiles of max(16, M) rows,
    weight tiles of 64 / 128 rows and 64 / 128 K (32 at group 32: a K tile lies in a group), K split 1-8, 4 warps, 8
    too on 128-row tiles); FP4, and int4 at groups under 64 or past 32 rows, on the dequantizing GEMM's decode-shaped
    tiles (one row tile of max(16, M) rows, 16-64 columns, K split 1-8). `decoded`: int4 on `decoded_configs` only."""
    if decoded:
        return decoded_configs(M, group) if fmt == "int4" else []
    bm = max(16, triton.next_power_of_2(M))
    dequant = [{"GEMV": 0, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "GROUP_M": 1, "num_warps": 4,
                "num_stages": 3} for bn, bk in ((16, 256), (32, 256), (64, 128)) for sk in (1, 2, 4, 8)]  # fmt: skip
    if fmt != "int4":
        return dequant
    bks = (64, 128) if group >= 64 else (32,)
    codes = [{"CODES": 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": w,
              "num_stages": 3} for bn in (64, 128) for bk in bks for sk in (1, 2, 4, 8)
             for w in ((4,) if bn == 64 else (4, 8))]  # fmt: skip
    return codes + (dequant if group < 64 or M > 32 else [])


def legacy_config(M: int) -> dict[str, int] | None:
    """The config w4a16_linear ran at M rows before session 30 took 17-64 rows to the codes kernel (int4) and
    to decode-shaped dequantizing tiles (FP4): up to 16 rows the default (None), then 64 x 128 x 128 tiles."""
    if M <= 16:
        return None
    return {"GEMV": 0, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 3}  # fmt: skip


def mid_sweep(out: dict[str, Any], path: str, workers: int, bw: float, peak: float, shapes: list[str],
              variants: list[str], rows: list[int], decoded: bool = False) -> None:  # fmt: skip
    """3-64 rows (decode at batch 3-64): the default config beside the pre-session-30 one, mid_configs' tiles and
    cuBLAS bf16, each beside its floor max(bytes / copy, FLOPs / matmul rate); rows appended to
    out["mid"]."""
    jobs = [(v, *SHAPES[s], M, c) for s in shapes for v in variants for M in rows
            for c in [None, legacy_config(M)] + mid_configs(M, *VARIANTS[v][:2], decoded)]  # fmt: skip
    precompile(jobs, workers)
    gen = torch.Generator(device=DEV).manual_seed(2)
    for name in shapes:
        N, K = SHAPES[name]
        w16 = bf16_copies(N, K, gen)
        xs = {M: torch.randn(M, K, device=DEV, dtype=DT, generator=gen) for M in rows}
        cublas = {M: time_per_call(lambda i, x=xs[M], w=w16: F.linear(x, w[i]), len(w16)) for M in rows}
        for v in variants:
            qws = quant_copies(v, N, K, gen)
            probe = qws[0]
            for M in rows:
                x = xs[M]
                nbytes = probe.nbytes() + 2 * M * (K + N)
                floor = max(nbytes / bw / 1e6, 2 * M * N * K / peak / 1e9)
                b16_floor = max((2 * N * K + 2 * M * (K + N)) / bw / 1e6, 2 * M * N * K / peak / 1e9)
                legacy = legacy_config(M)
                t_def, t_old = checked_time(x, qws, None), checked_time(x, qws, legacy)
                timed = [(c, checked_time(x, qws, c, rep=5)) for c in mid_configs(M, *VARIANTS[v][:2], decoded)]
                ok = sorted(((t, c) for c, t in timed if not isinstance(t, str)), key=lambda r: r[0])
                row = {"shape": name, "fmt": v, "M": M, "bytes": nbytes, "floor_ms": floor, "default": w4a16_config(
                       M, N, K, *VARIANTS[v][:2]), "default_ms": t_def, "legacy": legacy, "legacy_ms": t_old,
                       "cublas_bf16_ms": cublas[M], "cublas_bf16_floor_ms": b16_floor, "results": [[c, t] for c, t in timed]}  # fmt: skip
                out.setdefault("mid", []).append(row)

                def us(t: float | str, floor: float = floor) -> str:
                    return f"{t * 1e3:6.1f} us (x{t / floor:4.2f})" if not isinstance(t, str) else t[:60]

                best = f"best {us(ok[0][0])} {ok[0][1]}" if ok else "no config ran"
                print(f"mid {name:20s} {v:9s} M={M:<3d} floor {floor * 1e3:5.1f} us | default {us(t_def)} | before "
                      f"{us(t_old)} | cublas bf16 {cublas[M] * 1e3:6.1f} us (x{cublas[M] / b16_floor:4.2f} its floor) | {best}",
                      flush=True)  # fmt: skip
                for c, t in timed:
                    if isinstance(t, str):
                        print(f"  mid FAILED {name} {v} M={M} {c}: {t}", flush=True)
                Path(path).write_text(json.dumps(out, indent=1))
            del qws, probe
        del w16


def prefill_sweep() -> list[dict[str, int]]:
    return [{"GEMV": 0, "SPLIT_K": 1, "GROUP_M": 8, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w,
             "num_stages": s} for bm, bn, bk, w, s in [(128, 128, 128, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                                      (256, 128, 128, 8, 2), (128, 128, 64, 8, 4), (256, 64, 128, 8, 3)]]  # fmt: skip


def _compile_job(job: tuple[str, int, int, int, dict[str, int] | None]) -> str:
    variant, N, K, M, cfg = job
    try:
        gen = torch.Generator(device=DEV).manual_seed(0)
        qw = make_weight(variant, N, K, gen)
        x = torch.randn(M, K, device=DEV, dtype=DT, generator=gen)
        w4a16_linear(x, qw, config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing pass
        return f"{variant} {N}x{K} M={M} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def precompile(jobs: list[tuple[str, int, int, int, dict[str, int] | None]], workers: int) -> None:
    seen: set[str] = set()
    unique = []
    for v, N, K, M, cfg in jobs:
        c = cfg or w4a16_config(M, N, K, *VARIANTS[v][:2])
        key = f"{v} {sorted(c.items())} {K % c['BLOCK_K'] == 0} {M == 1} {N % 16 == 0}"
        if key not in seen:
            seen.add(key)
            unique.append((v, N, K, M, cfg))
    run_pool(_compile_job, unique, workers)


def run_pool(job_fn: Any, jobs: list, workers: int, initializer: Any = None, initargs: tuple = ()) -> None:
    """Run job_fn on each job in spawned processes (compiling into Triton's disk cache; initializer(*initargs)
    first in each); job_fn returns "" or an error line, the first ten of which are printed."""
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers, initializer, initargs) as pool:
        errors = [e for e in pool.map(job_fn, jobs, chunksize=1) if e]
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.0f} s; {len(errors)} failed", flush=True)
    for e in errors[:10]:
        print("  ", e, flush=True)


def time_per_call(fn_for: Any, copies: int, rep: int = 20) -> float:
    """Median ms of one product, from a graph of `copies` products over distinct weights."""
    return do_bench_cudagraph(lambda: [fn_for(i) for i in range(copies)], rep=rep) / copies


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def checked_time(x: torch.Tensor, qws: list[QuantizedWeight], cfg: dict[str, int] | None, rep: int = 20) -> float | str:
    try:
        err = rel_err(w4a16_linear(x, qws[0], config=cfg), quant_linear_ref(x, qws[0]))
        if not err < 1e-2:
            return f"rel err {err:.3g}"
        return time_per_call(lambda i: w4a16_linear(x, qws[i], config=cfg), len(qws), rep)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
        return f"{type(e).__name__}: {str(e)[:160]}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rows", default=",".join(map(str, ROWS + PREFILL_ROWS)))
    p.add_argument("--sweep", action="store_true", help="also time a tile sweep")
    p.add_argument("--sweep-shapes", default=",".join(SWEEP_SHAPES))
    p.add_argument("--sweep-rows", default=",".join(map(str, SWEEP_ROWS + PREFILL_ROWS)))
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--codes-sweep", action="store_true", help="only sweep the int4 codes kernel (codes_sweep)")
    p.add_argument("--mid-sweep", action="store_true", help="only the 3-64-row comparison (mid_sweep; --shapes, "
                   "--variants default to its own, --rows to MID_ROWS)")  # fmt: skip
    p.add_argument("--decoded", action="store_true", help="with --mid-sweep: time the codes kernel's decoded form "
                   "(decoded_configs) instead of mid_configs' tiles")  # fmt: skip
    args = p.parse_args()
    if args.mid_sweep:
        bw, peak = copy_bandwidth(), matmul_rate()
        out = header(bw, peak)
        print(f"{out['device']}  copy {bw:.0f} GB/s  bf16 matmul {peak:.0f} TFLOP/s", flush=True)
        rows = MID_ROWS if args.rows == p.get_default("rows") else [int(m) for m in args.rows.split(",")]
        variants = MID_VARIANTS if args.variants == p.get_default("variants") else args.variants.split(",")
        mid_sweep(out, args.out, args.workers, bw, peak, args.shapes.split(","), variants, rows, args.decoded)
        return
    if args.codes_sweep:
        bw = copy_bandwidth()
        out = header(bw)
        print(f"{out['device']}  copy {bw:.0f} GB/s", flush=True)
        codes_sweep(out, args.out, args.workers, bw)
        return
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    rows = [int(m) for m in args.rows.split(",")]
    sweep_shapes, sweep_rows = args.sweep_shapes.split(","), [int(m) for m in args.sweep_rows.split(",")]
    jobs = [(v, *SHAPES[s], M, None) for s, v, M in itertools.product(shapes, variants, rows)]
    if args.sweep:
        jobs += [(v, *SHAPES[s], M, c) for s, v, M in itertools.product(sweep_shapes, SWEEP_VARIANTS, sweep_rows)
                 for c in (sweep_configs(M) if M <= 16 else prefill_sweep())]  # fmt: skip
    precompile(jobs, args.workers)

    bw, peak = copy_bandwidth(), matmul_rate()
    out: dict[str, Any] = {**header(bw, peak), "rows": [], "prefill": [], "sweep": []}
    print(f"{out['device']}  copy {bw:.0f} GB/s  bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    peers: dict[tuple[str, int], tuple[float, float]] = {}
    for name in shapes:
        N, K = SHAPES[name]
        w16 = bf16_copies(N, K, gen)
        for v in variants:
            qws = quant_copies(v, N, K, gen)
            probe = qws[0]
            for M in rows:
                x = torch.randn(M, K, device=DEV, dtype=DT, generator=gen)
                t = checked_time(x, qws, None)
                if (name, M) not in peers:  # the bf16 peers on the same x, once per shape and M
                    t_gemv = time_per_call(lambda i, x=x, w=w16: gemv(x, w[i]), len(w16)) if M <= 16 else float("nan")
                    peers[name, M] = (t_gemv, time_per_call(lambda i, x=x, w=w16: F.linear(x, w[i]), len(w16)))
                t_gemv, t_cublas = peers[name, M]
                cfg_row: Any = w4a16_config(M, N, K, *VARIANTS[v][:2])
                if mma_path.takes(M, N, K, probe.zeros is not None) and mma_path.supported(
                        x, probe.qweight, probe.group_size, mma_path.default_config(M, N, K)):  # fmt: skip
                    cfg_row = {"MMA": 1, **asdict(mma_path.default_config(M, N, K))}  # gluon_w4a16_mma
                row: dict[str, Any] = {"shape": name, "N": N, "K": K, "M": M, "fmt": v, "config": cfg_row}
                if isinstance(t, str):
                    row["error"] = t
                    print(f"{name:20s} {v:9s} M={M:<4d} ERROR {t}", flush=True)
                elif M <= 16:
                    nbytes = probe.nbytes() + 2 * M * (K + N)
                    b16 = 2 * N * K + 2 * M * (K + N)
                    row.update(bytes=nbytes, floor_ms=nbytes / bw / 1e6, ms=t, GBps=nbytes / t / 1e6, pct_copy=100 * nbytes / t / 1e6 / bw,
                               gemv_bf16_ms=t_gemv, gemv_bf16_pct_copy=100 * b16 / t_gemv / 1e6 / bw, cublas_bf16_ms=t_cublas,
                               cublas_bf16_pct_copy=100 * b16 / t_cublas / 1e6 / bw, speedup_vs_best_bf16=min(t_gemv, t_cublas) / t)  # fmt: skip
                    print(f"{name:20s} {v:9s} M={M:<4d} floor {row['floor_ms'] * 1e3:6.1f} us  w4 {t * 1e3:6.1f} us "
                          f"({row['pct_copy']:3.0f}% copy)  bf16 gemv {t_gemv * 1e3:6.1f} us ({row['gemv_bf16_pct_copy']:3.0f}%)  "
                          f"cublas {t_cublas * 1e3:6.1f} us ({row['cublas_bf16_pct_copy']:3.0f}%)  x{row['speedup_vs_best_bf16']:.2f}", flush=True)  # fmt: skip
                else:
                    flops = 2 * M * N * K
                    row.update(ms=t, TFLOPs=flops / t / 1e9, pct_matmul_rate=100 * flops / t / 1e9 / peak, floor_ms=flops / peak / 1e9,
                               cublas_bf16_ms=t_cublas, cublas_bf16_TFLOPs=flops / t_cublas / 1e9)  # fmt: skip
                    print(f"{name:20s} {v:9s} M={M:<4d} floor {row['floor_ms'] * 1e3:7.1f} us  w4 {t * 1e3:7.1f} us "
                          f"({row['TFLOPs']:4.0f} TFLOP/s, {row['pct_matmul_rate']:3.0f}%)  cublas bf16 {t_cublas * 1e3:7.1f} us "
                          f"({row['cublas_bf16_TFLOPs']:4.0f} TFLOP/s)", flush=True)  # fmt: skip
                out["rows" if M <= 16 else "prefill"].append(row)
                Path(args.out).write_text(json.dumps(out, indent=1))
            if args.sweep and name in sweep_shapes and v in SWEEP_VARIANTS:
                for M in sweep_rows:
                    x = torch.randn(M, K, device=DEV, dtype=DT, generator=gen)
                    res = [(c, checked_time(x, qws, c)) for c in (sweep_configs(M) if M <= 16 else prefill_sweep())]
                    ok = sorted(((t, c) for c, t in res if not isinstance(t, str)), key=lambda r: r[0])
                    out["sweep"].append({"shape": name, "fmt": v, "M": M, "default": w4a16_config(M, N, K, *VARIANTS[v][:2]),
                                         "results": [[c, t] for c, t in res]})  # fmt: skip
                    for t, c in ok[:3]:
                        print(f"  sweep {name} {v} M={M} {t * 1e3:7.1f} us {c}", flush=True)
                    for c, t in res:
                        if isinstance(t, str):
                            print(f"  sweep {name} {v} M={M} FAILED {c}: {t}", flush=True)
                    Path(args.out).write_text(json.dumps(out, indent=1))
            del qws, probe


if __name__ == "__main__":
    main()
