"""The whole MoE block per layer (router + experts + top-k combine), old path vs new path, one GPU, bf16.

Shapes: Qwen3-30B-A3B (E=128, top-8, D=2048, I=768, softmax router renormalised) and DeepSeek-V3 routed
experts (E=256, top-8, D=7168, I=2048, noaux_tc router: 8 groups keep 4, bias, scale 2.5).

  old: router GEMV as F.linear (DeepSeek: float32 casts of hidden and weight first), one-program top-k
       kernel, single-program (or torch sort) alignment, two aligned GEMMs, moe_sum: 6-8 launches.
  new: fused router (GEMV + top-k in one launch, T <= triton_router.max_fused_tokens), then at one token
       the pair path (two one-row GEMV kernels, down+sum fused: 3 launches), else the multi-program
       alignment, the two aligned GEMMs and moe_sum. Experts alone, pair against aligned, at T <= 16.

Times are CUDA-graph replays of R calls (R "layers": each call has its own hidden and router-weight
copy; experts come from one stacked weight of 1.2 GB / 22.5 GB, far past the 50 MB L2), per call.
floor = (distinct experts hit, counted on the real routings, * expert bytes + router weight bytes
         + hidden in/out) / measured copy bandwidth.
Usage: python benchmarks/bench_moe.py [--out DIR] [--tokens 1,2,...] [--skip-deepseek]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from ceilings import copy_bandwidth, graph_ms, matmul_rate

from ftransformers.kernels import triton_fused_moe as tfm
from ftransformers.kernels.triton_router import fused_router_topk, grouped_topk_sigmoid, max_fused_tokens, softmax_topk
from ftransformers.layers.moe.grouped_topk import grouped_topk_torch
from ftransformers.layers.moe.topk import select_experts_softmax_torch

SHAPES = {
    "qwen3-30b-a3b": {"D": 2048, "I": 768, "E": 128, "K": 8, "router": "softmax"},
    "deepseek-v3": {"D": 7168, "I": 2048, "E": 256, "K": 8, "router": "noaux_tc"},
}
TOKENS = {"qwen3-30b-a3b": [1, 2, 4, 8, 16, 32, 64, 128, 1024], "deepseek-v3": [1, 2, 4, 8, 16, 32, 64, 128]}
CHECK_TOKENS = {1, 8, 16, 64}
DEV = "cuda"


# ---- the previous alignment (single program, torch sort past 2^18 pairs x experts), kept to time it ----
@triton.jit
def _legacy_align_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_experts, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr,
    PAIR_CHUNKS: tl.constexpr, PAD_CHUNKS: tl.constexpr, BLK_CHUNKS: tl.constexpr,
):  # fmt: skip
    e_range = tl.arange(0, E_P2)
    c_range = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for ci in range(PAIR_CHUNKS):
        c = ci * CHUNK
        ids = tl.load(ids_ptr + c + c_range, mask=c + c_range < num_pairs, other=E_P2)
        counts += tl.sum((ids[:, None] == e_range[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    for pi in range(PAD_CHUNKS):
        p = pi * CHUNK
        tl.store(sorted_ptr + p + c_range, tl.zeros([CHUNK], tl.int32) + num_pairs, mask=p + c_range < max_padded)
    for bi in range(BLK_CHUNKS):
        b = bi * CHUNK
        blk = (b + c_range) * BLOCK_M
        hit = (ends[None, :] <= blk[:, None]) & (e_range[None, :] < num_experts)
        tl.store(expert_ids_ptr + b + c_range, tl.sum(hit.to(tl.int32), axis=1), mask=b + c_range < max_blocks)
    tl.debug_barrier()
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for ci in range(PAIR_CHUNKS):
        c = ci * CHUNK
        ids = tl.load(ids_ptr + c + c_range, mask=c + c_range < num_pairs, other=E_P2)
        onehot = (ids[:, None] == e_range[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]
        dest = tl.sum(onehot * (before + starts[None, :]), axis=1)
        tl.store(sorted_ptr + dest, c + c_range, mask=c + c_range < num_pairs)
        seen += tl.sum(onehot, axis=0)


def legacy_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    n = topk_ids.numel()
    e_p2 = triton.next_power_of_2(num_experts + 1)
    if n * e_p2 > 1 << 18:
        return tfm.align_reference(topk_ids, num_experts, block_m)
    max_padded = tfm.max_padded_rows(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    chunk = max(1, min(32, 4096 // e_p2))
    bucket = tfm.max_padded_rows(triton.next_power_of_2(n), num_experts, block_m)
    _legacy_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, expert_ids, num_post, n, num_experts, max_padded, max_padded // block_m,
        BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, PAIR_CHUNKS=triton.cdiv(triton.next_power_of_2(n), chunk),
        PAD_CHUNKS=triton.cdiv(bucket, chunk), BLK_CHUNKS=triton.cdiv(bucket // block_m, chunk), num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_post


def legacy_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    t, d = hidden.shape
    e, inter, k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    cfg = tfm.default_config(t, e, k)
    sorted_ids, expert_ids, num_post = legacy_align(topk_ids, e, cfg.block_m)
    act = torch.empty(t * k, inter, dtype=hidden.dtype, device=hidden.device)
    tfm.moe_gemm(hidden, w13, act, sorted_ids, expert_ids, num_post, k, cfg.block_m, cfg.up_n, cfg.up_k,
                 cfg.group_m, cfg.num_warps, cfg.num_stages, fuse_silu=True)  # fmt: skip
    y = torch.empty(t * k, d, dtype=hidden.dtype, device=hidden.device)
    wf = topk_weights.reshape(-1).float().contiguous()
    tfm.moe_gemm(act, w2, y, sorted_ids, expert_ids, num_post, 1, cfg.block_m, cfg.down_n, cfg.down_k,
                 cfg.group_m, cfg.num_warps, cfg.num_stages, weights=wf)  # fmt: skip
    return tfm.moe_sum(y.view(t, k, d), torch.empty_like(hidden))


# ---- routers ----
def old_router(s: dict, hidden, weight, bias=None):
    if s["router"] == "softmax":
        return softmax_topk(F.linear(hidden, weight), s["K"], True)
    return grouped_topk_sigmoid(F.linear(hidden.float(), weight.float()), s["K"], 8, 4, bias, True, 2.5)


def new_router(s: dict, hidden, weight, bias=None):
    if hidden.shape[0] > max_fused_tokens(weight):
        return old_router(s, hidden, weight, bias)
    if s["router"] == "softmax":
        return fused_router_topk(hidden, weight, s["K"], softmax=True, renormalize=True, round_logits=True)
    return fused_router_topk(hidden, weight, s["K"], softmax=False, renormalize=True, num_expert_group=8,
                             topk_group=4, correction_bias=bias, routed_scaling_factor=2.5)  # fmt: skip


def ref_router(s: dict, hidden, weight, bias):
    if s["router"] == "softmax":
        return select_experts_softmax_torch(F.linear(hidden, weight), s["K"], True)
    return grouped_topk_torch(F.linear(hidden.float(), weight.float()), s["K"], 8, 4, bias, True, 2.5)


def ref_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float32 reference over the hit experts only (an fp32 copy of all DeepSeek experts would not fit)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        x = hidden[tok].float()
        gu = x @ w13[e].float().t()
        g, u = gu.chunk(2, dim=-1)
        y = (F.silu(g) * u) @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].unsqueeze(-1))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def per_layer(fn, *per_call_args: list):
    """i -> fn(*(args[i] for args in per_call_args)): call i reads layer i's inputs."""
    return lambda i: fn(*(args[i] for args in per_call_args))


def experts(impl, w13, w2, hidden, routing, cfg=None) -> torch.Tensor:
    return impl(hidden, w13, w2, *routing, cfg) if cfg is not None else impl(hidden, w13, w2, *routing)


def measure_ceilings() -> tuple[float, float]:
    return copy_bandwidth(DEV), matmul_rate(DEV)  # benchmarks/ceilings.py


def bench_shape(name: str, s: dict, tokens: list[int], copy_gbs: float, tflops: float, log,
                sweep: bool = False) -> list[dict]:
    d, inter, e, k = s["D"], s["I"], s["E"], s["K"]
    w13 = torch.randn(e, 2 * inter, d, dtype=torch.bfloat16, device=DEV) / d**0.5
    w2 = torch.randn(e, d, inter, dtype=torch.bfloat16, device=DEV) / inter**0.5
    bias = torch.randn(e, device=DEV) * 0.1
    expert_bytes, router_bytes = 3 * inter * d * 2, e * d * 2
    rows = []
    for t in tokens:
        reps = 8 if t <= 128 else 2
        gates = [torch.randn(e, d, dtype=torch.bfloat16, device=DEV) / d**0.5 for _ in range(reps)]
        hiddens = [torch.randn(t, d, dtype=torch.bfloat16, device=DEV) for _ in range(reps)]

        old_block = per_layer(lambda h, g: legacy_experts(h, w13, w2, *old_router(s, h, g, bias)), hiddens, gates)
        new_block = per_layer(lambda h, g: tfm.fused_moe(h, w13, w2, *new_router(s, h, g, bias)), hiddens, gates)
        routings = [new_router(s, hiddens[i], gates[i], bias) for i in range(reps)]
        distinct = sum(torch.unique(ti).numel() for _, ti in routings) / reps
        nbytes = distinct * expert_bytes + router_bytes + 2 * t * d * 2
        flops = 6 * t * k * inter * d + 2 * t * d * e
        floor_ms = max(nbytes / copy_gbs / 1e6, flops / tflops / 1e9)
        row = {"shape": name, "T": t, "reps": reps, "distinct_experts": distinct, "bytes": nbytes,
               "bytes_floor_ms": nbytes / copy_gbs / 1e6, "flops_floor_ms": flops / tflops / 1e9}  # fmt: skip
        if t in CHECK_TOKENS:  # GPU correctness: routers vs torch, experts vs float32 on the same routing
            tw, ti = new_router(s, hiddens[0], gates[0], bias)
            rw, ri = ref_router(s, hiddens[0], gates[0], bias)
            row["router_ids_match"] = float((ti.sort(-1)[0] == ri.sort(-1)[0]).all(-1).float().mean())
            row["router_w_maxdiff"] = float((tw.sort(-1)[0] - rw.sort(-1)[0]).abs().max())
            ref = ref_experts(hiddens[0], w13, w2, rw, ri)
            row["rel_err_new"] = rel_err(tfm.fused_moe(hiddens[0], w13, w2, rw, ri), ref)
            row["rel_err_old"] = rel_err(legacy_experts(hiddens[0], w13, w2, rw, ri), ref)
            row["new_vs_old_block"] = rel_err(new_block(0), old_block(0))
        row["old_ms"] = graph_ms(old_block, reps)
        row["new_ms"] = graph_ms(new_block, reps)
        row["old_x_floor"], row["new_x_floor"] = row["old_ms"] / floor_ms, row["new_ms"] / floor_ms
        row["new_GBps"] = nbytes / row["new_ms"] / 1e6
        if t == 1:  # the two halves of each path alone
            row["stages_ms"] = {
                "new_router": graph_ms(per_layer(partial(new_router, s, bias=bias), hiddens, gates), reps),
                "old_router": graph_ms(per_layer(partial(old_router, s, bias=bias), hiddens, gates), reps),
                "new_experts": graph_ms(per_layer(partial(experts, tfm.fused_moe, w13, w2), hiddens, routings), reps),
                "old_experts": graph_ms(per_layer(partial(experts, legacy_experts, w13, w2), hiddens, routings), reps),
            }
        if t <= 16:  # the pair path against the aligned one, experts only
            pair_cfg = tfm.default_pair_config(t, d)
            pair = partial(experts, tfm.fused_moe, w13, w2, cfg=pair_cfg)
            aligned = partial(experts, tfm.fused_moe, w13, w2, cfg=tfm.default_config(t, e, k))
            row["experts_pair_ms"] = graph_ms(per_layer(pair, hiddens, routings), reps)
            row["experts_aligned_ms"] = graph_ms(per_layer(aligned, hiddens, routings), reps)
            rw, ri = routings[0]
            ref = ref_experts(hiddens[0], w13, w2, rw, ri)
            row["rel_err_pair"] = rel_err(tfm.fused_moe(hiddens[0], w13, w2, rw, ri, pair_cfg), ref)
        if t <= 2 and sweep:  # the down kernel's tiles and slot split, gate-up at its default
            row["pair_sweep"] = []
            for dn, dk, split in itertools.product((2, 4, 8), (512, 1024), (1, 2, 4, 8)):
                cfg = dataclasses.replace(tfm.default_pair_config(t, d), down_n=dn, down_k=dk, down_split=split)
                ms = graph_ms(per_layer(partial(experts, tfm.fused_moe, w13, w2, cfg=cfg), hiddens, routings), reps)
                row["pair_sweep"].append({"down_n": dn, "down_k": dk, "down_split": split, "us": ms * 1e3})
            best = min(row["pair_sweep"], key=lambda r: r["us"])
            log(f"    pair sweep best {best}")
        msg = (f"{name:14s} T={t:5d} old {row['old_ms']*1e3:8.1f} us  new {row['new_ms']*1e3:8.1f} us | floor "
               f"{floor_ms*1e3:7.1f} us  old x{row['old_x_floor']:.2f} new x{row['new_x_floor']:.2f} | "
               f"{row['new_GBps']:5.0f} GB/s")  # fmt: skip
        if "rel_err_new" in row:
            msg += (f" | err new {row['rel_err_new']:.1e} old {row['rel_err_old']:.1e} ids {row['router_ids_match']:.2f}"
                    f" dw {row['router_w_maxdiff']:.0e}")  # fmt: skip
        log(msg)
        if "stages_ms" in row:
            log("    stages (us): " + ", ".join(f"{n} {v*1e3:.1f}" for n, v in row["stages_ms"].items()))
        if "experts_pair_ms" in row:
            log(f"    experts only: pair {row['experts_pair_ms']*1e3:.1f} us (err {row['rel_err_pair']:.1e}), "
                f"aligned {row['experts_aligned_ms']*1e3:.1f} us")
        rows.append(row)
    return rows


def bench_align(log) -> list[dict]:
    """Alignment alone (E=128, K=8, the block_m fused_moe uses): previous vs multi-program kernel."""
    rows = []
    for t in (16, 32, 64, 128, 1024, 8192):
        e, k = 128, 8
        bm = tfm.default_config(t, e, k).block_m
        ids = [torch.rand(t, e, device=DEV).topk(k, dim=-1).indices for _ in range(8)]
        for i in range(2):
            for a, b in zip(tfm.moe_align(ids[i], e, bm), tfm.align_reference(ids[i], e, bm)):
                assert torch.equal(a, b), f"alignment mismatch at T={t}"
        old = graph_ms(per_layer(partial(legacy_align, num_experts=e, block_m=bm), ids), 8)
        new = graph_ms(per_layer(partial(tfm.moe_align, num_experts=e, block_m=bm), ids), 8)
        rows.append({"T": t, "pairs": t * k, "block_m": bm, "old_us": old * 1e3, "new_us": new * 1e3})
        log(f"align E={e} T={t:5d} pairs {t*k:6d} bm {bm:3d}: old {old*1e3:7.1f} us  new {new*1e3:7.1f} us (matches torch)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-deepseek", action="store_true")
    ap.add_argument("--tokens", default="", help="comma-separated T values (default: per shape)")
    ap.add_argument("--name", default="moe_h100.json")
    ap.add_argument("--pair-sweep", action="store_true", help="time the down kernel's tiles and slot split at T=1, 2")
    ap.add_argument("--skip-align", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    t0 = time.time()
    copy_gbs, tflops = measure_ceilings()
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    log(f"copy bandwidth {copy_gbs:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s, PAIR_MAX_PAIRS {tfm.PAIR_MAX_PAIRS}")
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_GBps": copy_gbs,
              "matmul_TFLOPs": tflops, "command": "python benchmarks/bench_moe.py", "moe_block": [], "align": []}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, args.name)
    result["align"] = [] if args.skip_align else bench_align(log)
    for name, s in SHAPES.items():
        if name == "deepseek-v3" and args.skip_deepseek:
            continue
        tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else TOKENS[name]
        result["moe_block"] += bench_shape(name, s, tokens, copy_gbs, tflops, log, sweep=args.pair_sweep)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()
    result["seconds"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
