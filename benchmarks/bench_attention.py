"""Microbenchmark of the Triton attention kernels at the issue's shapes (bf16, one GPU).

Decode (paged, split-K): achieved GB/s = KV bytes read / median time, printed beside the
device-to-device copy bandwidth measured in the same run (bytes read + written / time).
Extend (prefill, causal, no prefix): achieved TFLOP/s beside the bf16 matmul rate of the same run,
and torch SDPA (flash, contiguous, unpaged) on the same shapes as a peer.
Each timed call runs the kernel over enough layer buffers to exceed L2 several times, captured in a
CUDA graph (decode steps run as graphs), and reports the median per layer.

    PYTHONPATH=. python benchmarks/bench_attention.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ftransformers.attention.triton_backend import num_kv_splits  # noqa: E402
from ftransformers.kernels.triton_decode_attention import (  # noqa: E402
    decode_attention_fwd,
    decode_attention_ref,
    decode_scratch,
)
from ftransformers.kernels.triton_extend_attention import extend_attention_fwd  # noqa: E402
from ftransformers.kernels.triton_mla_attention import mla_attention_ref, mla_decode_fwd, mla_extend_fwd  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16
GQA_SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "qwen3-8b": (32, 8, 128)}  # (H, H_kv, D)
MLA_SHAPE = (128, 512, 64)  # DeepSeek-V3: H, kv_lora_rank, rope dim
BATCHES = [1, 8, 32, 64, 128]
CONTEXTS = [512, 4096]
LONG = 32768  # batch 1 only
L2_MULT = 200 << 20  # bytes touched per timed call, ~4x the H100's 50 MB L2
CHECK_ONLY = False  # --check: run each case once eagerly (for compute-sanitizer), time nothing


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() / ms / 1e6  # GB/s


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    b = torch.randn(8192, 8192, device=DEV, dtype=DT)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / ms / 1e9  # TFLOP/s


def graph_ms(fn, layers: int) -> float:
    return do_bench_cudagraph(fn, rep=100, return_mode="median") / layers


def contiguous_table(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """req_to_token with each sequence's slots contiguous after the previous one's (a fresh server)."""
    r2t = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    start = 1
    for i, n in enumerate(lens):
        r2t[i, :n] = torch.arange(start, start + n)
        start += n
    return r2t.to(DEV), torch.arange(len(lens), device=DEV), start


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item() if torch.isfinite(out).all() else float("inf")


def bench_gqa_decode(name: str, H: int, H_kv: int, D: int, B: int, ctx: int, sms: int, variants: list[dict]) -> list[dict]:
    r2t, rows, n_slots = contiguous_table([ctx] * B)
    kv_bytes = B * ctx * H_kv * 2 * D * 2
    layers = max(1, min(32, math.ceil(L2_MULT / kv_bytes)))
    ks = [torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT) for _ in range(layers)]
    vs = [torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT) for _ in range(layers)]
    q = torch.randn(B, H, D, device=DEV, dtype=DT)
    seq_lens = torch.full((B,), ctx, device=DEV, dtype=torch.int64)
    group = H // H_kv
    splits = num_kv_splits(B, H_kv * triton.cdiv(group, max(16, triton.next_power_of_2(group))), sms)
    mid_o, mid_lse = decode_scratch(B, H, D, splits, DEV)
    out = torch.empty_like(q)
    ref = decode_attention_ref(q, ks[0], vs[0], r2t, rows, seq_lens, D**-0.5) if B * ctx <= 8 * 4096 else None
    rows_out = []
    for var in variants:
        def run(var: dict = var) -> None:
            for k, v in zip(ks, vs):
                decode_attention_fwd(q, k, v, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, D**-0.5, **var)

        out.fill_(float("nan"))
        decode_attention_fwd(q, ks[0], vs[0], out, r2t, rows, seq_lens, mid_o, mid_lse, splits, D**-0.5, **var)
        torch.cuda.synchronize()
        err = rel_err(out, ref) if ref is not None else None
        ms = graph_ms(run, layers) if not CHECK_ONLY else float("nan")
        rows_out.append(dict(kernel="gqa_decode", model=name, batch=B, context=ctx, splits=splits, variant=var,
                             us=ms * 1e3, bytes=kv_bytes, gbps=kv_bytes / ms / 1e6, rel_err=err))  # fmt: skip
    return rows_out


def bench_mla_decode(B: int, ctx: int, sms: int, variants: list[dict]) -> list[dict]:
    H, L, R = MLA_SHAPE
    r2t, rows, n_slots = contiguous_table([ctx] * B)
    kv_bytes = B * ctx * (L + R) * 2
    layers = max(1, min(32, math.ceil(L2_MULT / kv_bytes)))
    bufs = [torch.randn(n_slots, L + R, device=DEV, dtype=DT) for _ in range(layers)]
    q_nope = torch.randn(B, H, L, device=DEV, dtype=DT)
    q_rope = torch.randn(B, H, R, device=DEV, dtype=DT)
    seq_lens = torch.full((B,), ctx, device=DEV, dtype=torch.int64)
    scale = (192) ** -0.5
    ref = (
        mla_attention_ref(q_nope, q_rope, bufs[0], r2t, rows, [ctx - 1] * B, [1] * B, scale)
        if B * ctx <= 8 * 4096 else None
    )  # fmt: skip
    out = torch.empty_like(q_nope)
    rows_out = []
    for var in variants:
        splits = num_kv_splits(B, triton.cdiv(H, var["block_h"]), sms)
        mid_o, mid_lse = decode_scratch(B, H, L, splits, DEV)

        def run(var: dict = var, splits: int = splits, mid_o: torch.Tensor = mid_o, mid_lse: torch.Tensor = mid_lse) -> None:
            for buf in bufs:
                mla_decode_fwd(q_nope, q_rope, buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale, **var)

        out.fill_(float("nan"))
        mla_decode_fwd(q_nope, q_rope, bufs[0], out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale, **var)
        torch.cuda.synchronize()
        err = rel_err(out, ref) if ref is not None else None
        ms = graph_ms(run, layers) if not CHECK_ONLY else float("nan")
        rows_out.append(dict(kernel="mla_decode", model="deepseek-v3", batch=B, context=ctx, splits=splits, variant=var,
                             us=ms * 1e3, bytes=kv_bytes, gbps=kv_bytes / ms / 1e6, rel_err=err))  # fmt: skip
    return rows_out


def bench_extend(kind: str, T: int) -> list[dict]:
    """One fresh prompt of T tokens (prefix 0), causal. FLOPs: QK^T and PV over the causal half."""
    r2t, rows, n_slots = contiguous_table([T])
    ext = torch.tensor([T], device=DEV)
    zero, start = torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
    res = []
    if kind == "mla":
        H, L, R = MLA_SHAPE
        q_nope, q_rope = torch.randn(T, H, L, device=DEV, dtype=DT), torch.randn(T, H, R, device=DEV, dtype=DT)
        buf = torch.randn(n_slots, L + R, device=DEV, dtype=DT)
        latent = buf[1 : T + 1]
        out = torch.empty_like(q_nope)
        flops = 2 * H * (T * (T + 1) / 2) * ((L + R) + L)
        ms = do_bench(lambda: mla_extend_fwd(q_nope, q_rope, latent, out, buf, r2t, rows, zero, ext, start, T, 192**-0.5),
                      warmup=25, rep=200, return_mode="median")  # fmt: skip
        res.append(dict(kernel="mla_extend", model="deepseek-v3", tokens=T, us=ms * 1e3, tflops=flops / ms / 1e9))
        return res
    H, H_kv, D = GQA_SHAPES[kind]
    q = torch.randn(T, H, D, device=DEV, dtype=DT)
    k_buf, v_buf = torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT), torch.randn(n_slots, H_kv, D, device=DEV, dtype=DT)
    k_new, v_new = k_buf[1 : T + 1], v_buf[1 : T + 1]
    out = torch.empty_like(q)
    flops = 2 * 2 * H * D * (T * (T + 1) / 2)
    ms = do_bench(lambda: extend_attention_fwd(q, k_new, v_new, out, k_buf, v_buf, r2t, rows, zero, ext, start, T, D**-0.5),
                  warmup=25, rep=200, return_mode="median")  # fmt: skip
    res.append(dict(kernel="gqa_extend", model=kind, tokens=T, us=ms * 1e3, tflops=flops / ms / 1e9))
    qs = q.transpose(0, 1)[None]  # [1, H, T, D]
    ks = k_new.transpose(0, 1)[None].repeat_interleave(H // H_kv, 1)
    vs = v_new.transpose(0, 1)[None].repeat_interleave(H // H_kv, 1)
    ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                  warmup=25, rep=200, return_mode="median")  # fmt: skip
    res.append(dict(kernel="sdpa_flash_peer", model=kind, tokens=T, us=ms * 1e3, tflops=flops / ms / 1e9))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and variants")
    ap.add_argument("--only", default="", help="decode cases B:CTX[,B:CTX...] instead of the full table")
    ap.add_argument("--kernels", default="gqa,mla,extend", help="which groups to run")
    ap.add_argument("--check", action="store_true", help="run each decode case once, untimed")
    args = ap.parse_args()
    global CHECK_ONLY
    CHECK_ONLY = args.check
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    sms = props.multi_processor_count
    copy_gbps, mm_tflops = copy_bandwidth(), matmul_rate()
    print(f"device {props.name}, {sms} SMs; copy {copy_gbps:.0f} GB/s; bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    cases = [(b, c) for b in BATCHES for c in CONTEXTS] + [(1, LONG)]
    if args.quick:
        cases = [(1, 4096), (1, LONG), (32, 4096)]
    if args.only:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.only.split(",")]  # type: ignore[misc]
    groups = set(args.kernels.split(","))
    gqa_vars = [dict(block_n=32), dict(block_n=64)]
    mla_vars = [dict(block_h=16, block_n=32), dict(block_h=32, block_n=32, num_warps=4),
                dict(block_h=64, block_n=16, num_warps=8), dict(block_h=64, block_n=32, num_warps=8),
                dict(block_h=64, block_n=32, num_warps=8, num_stages=3)]  # fmt: skip
    results: list[dict] = []
    t0 = time.time()
    for name, (H, H_kv, D) in GQA_SHAPES.items() if "gqa" in groups else ():
        for B, ctx in cases:
            results += bench_gqa_decode(name, H, H_kv, D, B, ctx, sms, gqa_vars)
            r = results[-len(gqa_vars):]
            best = max(r, key=lambda x: x["gbps"])
            print(f"gqa_decode {name:14s} B={B:<4d} ctx={ctx:<6d} " + "  ".join(
                f"{x['variant']}: {x['us']:8.1f} us {x['gbps']:6.0f} GB/s ({x['gbps'] / copy_gbps:4.0%})" for x in r
            ) + f"  err={best['rel_err']}", flush=True)  # fmt: skip
    for B, ctx in cases if "mla" in groups else ():
        results += bench_mla_decode(B, ctx, sms, mla_vars)
        r = results[-len(mla_vars):]
        print(f"mla_decode B={B:<4d} ctx={ctx:<6d} " + "  ".join(
            f"h{x['variant']['block_h']}n{x['variant']['block_n']}w{x['variant'].get('num_warps', 4)}s{x['variant'].get('num_stages', 2)}: {x['us']:8.1f} us {x['gbps']:5.0f} GB/s "
            f"({x['gbps'] / copy_gbps:4.0%}) err={x['rel_err'] if x['rel_err'] is None else round(x['rel_err'], 4)}"
            for x in r), flush=True)  # fmt: skip
    for kind in ("qwen3-8b", "mla") if "extend" in groups else ():
        for T in (1024, 8192):
            for x in bench_extend(kind, T):
                results.append(x)
                print(f"{x['kernel']:16s} {x['model']:12s} T={T:<5d} {x['us']:9.1f} us {x['tflops']:6.1f} TFLOP/s "
                      f"({x['tflops'] / mm_tflops:4.0%} of matmul)", flush=True)  # fmt: skip
    doc = dict(device=props.name, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, triton=triton.__version__,
               copy_gbps=copy_gbps, matmul_tflops=mm_tflops, seconds=time.time() - t0,
               command="PYTHONPATH=. python benchmarks/bench_attention.py", results=results)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "attention_h100.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
