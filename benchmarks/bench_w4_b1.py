"""The 4-bit kernels of a batch-1 decode step, one GPU: tiles, register caps and occupancy.

At one token each 4-bit kernel of a Qwen3-30B-A3B layer (qkv and o projections on the CUDA-core GEMV,
the MoE pair path's gate-up and down) reads 5-13 MB, a few microseconds of bandwidth, so how many of
its programs are resident at once (registers per thread x threads per program against the SM's 64K
registers and 2048 threads) decides whether it runs in one wave or two. For each config this prints
the time per call (CUDA graph of calls over distinct weights, past L2), its share of the copy bandwidth
measured in the same process, and each compiled kernel's registers, spills, resident programs per SM
and waves. Every config is checked against the plain-PyTorch reference first.

    PYTHONPATH=$PWD python benchmarks/bench_w4_b1.py --out $OUT/w4_b1_h100.json

The "token" section runs one token's 4-bit MoE on the GEMV-form kernels (kernels/triton_moe_w4_gemv.py) over
a sweep of their tiles beside the pair path, and times their two kernels alone, for each of `--token-formats`
(bench_moe_w4's format names: int4 asymmetric and symmetric, mxfp4, nvfp4).

The "codes" section runs the MoE at one token on the aligned path's int4 codes kernels (tensor cores)
beside the pair path, and times their four kernels alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_moe_w4 as bm
import bench_w4a16 as bw

from ftransformers.kernels import gluon_moe_w4_mma as mma_path
from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels import triton_moe_w4_gemv as tok
from ftransformers.kernels import triton_w4a16 as tw
from ftransformers.kernels.triton_fused_moe import moe_align, moe_sum

GEMV_SHAPES = {"qwen3-30b qkv": (5120, 2048), "qwen3-30b o": (2048, 4096)}
FORMATS = {"int4-asym": "int4-g128-asym", "int4-sym": "int4-g128-sym"}  # bench_w4a16 name: bench_moe_w4 name


def gemv_configs(K: int) -> list[dict[str, int]]:
    """The one-row GEMV's tiles: rows, K tile, warps, register cap, then two words a thread (WORDS=2)."""

    def c(bn: int, bk: int, warps: int, maxnreg: int = 0, words: int = 1) -> dict[str, int]:
        cfg = {"GEMV": 1, "BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "WORDS": words, "num_warps": warps,
               "num_stages": 2}  # fmt: skip
        return {**cfg, "maxnreg": maxnreg} if maxnreg else cfg

    cfgs = [c(4, 1024, 4), c(4, 2048, 4), c(2, 2048, 4), c(4, 1024, 2), c(8, 2048, 8), c(4, 2048, 4, words=2),
            c(4, 1024, 2, words=2), c(8, 2048, 4, words=2), c(2, 2048, 4, words=2), c(4, 4096, 8, words=2),
            c(8, 4096, 8, words=2), c(2, 1024, 2, words=2)]  # fmt: skip
    if K >= 4096:
        cfgs += [c(4, 4096, 8), c(2, 4096, 4), c(4, 4096, 4, words=2)]
    return cfgs


def pair_configs() -> list[w4.W4PairConfig]:
    base = w4.default_w4_pair_config(1, 2048, "int4")
    r = lambda **kw: w4.W4PairConfig(**{**base.__dict__, **kw})
    ups = [r(up_n=8, up_k=2048), r(up_n=4, up_k=2048), r(up_n=4, up_k=2048, up_warps=2), r(up_n=16, up_k=2048, up_warps=8),
           r(up_n=8, up_k=2048, up_warps=8), r(up_n=4, up_k=1024), r(up_maxnreg=64), r(up_maxnreg=80)]  # fmt: skip
    downs = [r(down_k=512), r(down_k=1024), r(down_k=1024, down_warps=4), r(down_n=8, down_k=1024),
             r(down_n=32, down_k=1024, down_warps=4), r(down_maxnreg=64), r(down_k=1024, down_warps=4, down_split=4),
             r(down_n=32, down_k=1024, down_warps=4, down_split=4), r(down_n=8, down_k=256, down_warps=1)]  # fmt: skip
    both = [r(up_k=2048, down_k=1024, down_warps=4), r(up_n=4, up_k=2048, down_k=1024)]
    return [base] + ups + downs + both


def compiled(fn: Any) -> dict[str, Any]:
    """{cache key: compiled kernel} of a JIT function on the current device (Triton 3.x caches)."""
    out: dict[str, Any] = {}
    for entry in fn.device_caches.values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                out.update({str(k): v for k, v in part.items() if hasattr(v, "metadata")})
    return out


def occupancy(kernel: Any, programs: int) -> dict[str, Any]:
    kernel._init_handles()
    threads = 32 * kernel.metadata.num_warps
    regs = kernel.n_regs
    props = torch.cuda.get_device_properties(0)
    per_sm = min(2048 // threads, 65536 // (max(8, -(-regs // 8) * 8) * threads), 32)
    smem = kernel.metadata.shared
    if smem:
        per_sm = min(per_sm, (227 << 10) // smem)
    resident = per_sm * props.multi_processor_count
    return {"regs": regs, "spills": kernel.n_spills, "warps": kernel.metadata.num_warps, "programs_per_sm": per_sm,
            "programs": programs, "waves": round(programs / resident, 2)}  # fmt: skip


def new_kernels(fns: list[Any], before: list[set[str]]) -> list[Any]:
    return [k for fn, seen in zip(fns, before) for key, k in compiled(fn).items() if key not in seen]


def bench_gemv(out: dict[str, Any], bw_gbs: float, log) -> None:
    gen = torch.Generator(device=bw.DEV).manual_seed(0)
    for name, (N, K) in GEMV_SHAPES.items():
        for v in FORMATS:
            probe = bw.make_weight(v, N, K, gen)
            qws = [probe] + [bw.make_weight(v, N, K, gen) for _ in range(-(-4 * bw.L2_BYTES // probe.nbytes()) - 1)]
            x = torch.randn(1, K, device=bw.DEV, dtype=bw.DT, generator=gen)
            nbytes = probe.nbytes() + 2 * (K + N)
            for cfg in gemv_configs(K):
                before = [set(compiled(tw._w4a16_gemv_kernel))]
                t = bw.checked_time(x, qws, cfg)
                ks = new_kernels([tw._w4a16_gemv_kernel], before)
                occ = occupancy(ks[0], triton.cdiv(N, cfg["BLOCK_N"])) if ks else {}
                row = {"kind": "gemv", "shape": name, "fmt": v, "N": N, "K": K, "config": cfg, "bytes": nbytes,
                       "floor_us": nbytes / bw_gbs / 1e3, "us": t * 1e3 if isinstance(t, float) else t, **occ}  # fmt: skip
                out["rows"].append(row)
                pct = f"{100 * nbytes / (t * 1e6) / bw_gbs:4.0f}%" if isinstance(t, float) else t
                log(f"gemv {name:14s} {v:9s} {row['us'] if isinstance(t, str) else round(row['us'], 2):>6} us {pct} "
                    f"floor {row['floor_us']:.2f} | {occ} | {cfg}")  # fmt: skip
            del qws, probe


REPS = 8  # routings per CUDA graph of pair-path calls


def pair_inputs(fname: str, reps: int) -> tuple[Any, Any, list[torch.Tensor], list[Any], torch.Tensor]:
    """Qwen3-30B-A3B experts in bench_moe_w4 format `fname`, `reps` one-token hiddens and routings (each
    avoiding the previous one's experts), and the reference output of the first."""
    w13, w2 = bm.expert_weights(fname, "qwen3-30b-a3b")
    return w13, w2, *bm.routed_inputs(w13, w2, 1, bm.SHAPES["qwen3-30b-a3b"][3], reps)


def time_parts(parts: dict[str, tuple[Any, float]], kind: str, tag: str, fname: str, bw_gbs: float,
               out: dict[str, Any], log, **extra: Any) -> None:  # fmt: skip
    """Each {name: (call(i), bytes)} timed alone as a CUDA graph of REPS calls: a row of `kind` and a log line
    (share of copy and floor where it moves bytes)."""
    for name, (call, nbytes) in parts.items():
        us = bm.graph_ms(call, REPS) * 1e3
        floor = nbytes / bw_gbs / 1e3
        out["rows"].append({"kind": kind, "format": fname, "part": name, "T": 1, "bytes": nbytes, "us": us,
                            "floor_us": floor, **extra})  # fmt: skip
        pct = f"{100 * nbytes / (us * 1e3) / bw_gbs:4.0f}% floor {floor:.2f}" if nbytes else ""
        log(f"{tag} {fname:15s} {name:8s} {us:6.2f} us {pct}")


def t1_row(kind: str, tag: str, fname: str, path: str, cfg: Any, nbytes: float, us: float, err: float, bw_gbs: float,
           out: dict[str, Any], log, note: str = "", **extra: Any) -> None:  # fmt: skip
    """One timed one-token MoE path: a row of `kind` and a log line with its share of copy and floor."""
    floor = nbytes / bw_gbs / 1e3
    out["rows"].append({"kind": kind, "format": fname, "path": path, "T": 1, "config": cfg.__dict__, "bytes": nbytes,
                        "floor_us": floor, "us": us, "rel_err": err, **extra})  # fmt: skip
    log(f"{tag} {fname:15s} {path:5s} {us:6.2f} us {100 * nbytes / (us * 1e3) / bw_gbs:4.0f}% floor {floor:.2f} "
        f"err {err:.1e}{note} | {cfg}")  # fmt: skip


def checked_moe_us(cfg: Any, w13, w2, hiddens, routes, ref) -> tuple[float, float | None]:
    """fused_moe_w4 at one token with `cfg`: its relative error against `ref` (the first routing), and its time
    per call over the REPS routings (None when the error is not under 1e-2)."""
    err = bm.rel_err(w4.fused_moe_w4(hiddens[0], w13, w2, *routes[0], cfg), ref)
    if not err < 1e-2:
        return err, None
    call = lambda i: w4.fused_moe_w4(hiddens[i], w13, w2, *routes[i], cfg)
    return err, bm.graph_ms(call, REPS) * 1e3


def checked_with_occupancy(cfg: Any, fns: list[Any], grids: tuple[int, int], w13, w2, hiddens, routes,
                           ref) -> tuple[float, float | None, list[dict[str, Any]]]:  # fmt: skip
    """checked_moe_us, and the occupancy of the kernels of `fns` (gate-up, down) it compiled, at `grids`
    (gate-up's programs, down's programs); no occupancy for kernels compiled by an earlier config."""
    before = [set(compiled(f)) for f in fns]
    err, us = checked_moe_us(cfg, w13, w2, hiddens, routes, ref)
    occ = []
    for kern in new_kernels(fns, before):
        name = kern.name if hasattr(kern, "name") else kern.metadata.name
        occ.append({"kernel": name, **occupancy(kern, grids[0] if "gate_up" in name else grids[1])})
    return err, us, occ


def bench_pair(out: dict[str, Any], bw_gbs: float, log) -> None:
    d, inter, e, k = bm.SHAPES["qwen3-30b-a3b"]
    fns = [w4._pair_gate_up_w4_kernel, w4._pair_down_sum_w4_kernel]
    for fname in FORMATS.values():
        w13, w2, hiddens, routes, ref = pair_inputs(fname, REPS)
        nbytes = k * (w13.nbytes() + w2.nbytes()) / e + 4 * d
        for cfg in pair_configs():
            grids = (k * triton.cdiv(inter, cfg.up_n), cfg.down_split * triton.cdiv(d, cfg.down_n))
            err, us, occ = checked_with_occupancy(cfg, fns, grids, w13, w2, hiddens, routes, ref)
            if us is None:
                log(f"pair {fname} FAILED rel err {err:.3g} {cfg}")
                continue
            row = {"kind": "moe_pair", "format": fname, "T": 1, "config": cfg.__dict__, "bytes": nbytes,
                   "floor_us": nbytes / bw_gbs / 1e3, "us": us, "rel_err": err, "kernels": occ}  # fmt: skip
            out["rows"].append(row)
            log(f"pair {fname:15s} {us:6.2f} us {100 * nbytes / (us * 1e3) / bw_gbs:4.0f}% floor {row['floor_us']:.2f} | "
                f"{[(o['kernel'][6:14], o['regs'], o['spills'], o['programs_per_sm'], o['waves']) for o in occ]} | "
                f"up {cfg.up_n},{cfg.up_k},{cfg.up_warps},{cfg.up_maxnreg} down {cfg.down_n},{cfg.down_k},"
                f"{cfg.down_warps},{cfg.down_split},{cfg.down_maxnreg}")  # fmt: skip
        del w13, w2
        torch.cuda.empty_cache()


def bench_parts(out: dict[str, Any], bw_gbs: float, log) -> None:
    """The pair path's two kernels timed alone and together (one token, default config): how the MoE
    time splits between gate-up (2/3 of the bytes) and down (1/3). Commit 838f607 also timed two
    variants that overlap the down kernel with gate-up (prefetch_down, down_preload); neither paid."""
    d, _inter, e, k = bm.SHAPES["qwen3-30b-a3b"]
    cfg = w4.default_w4_pair_config(1, d, "int4")
    for fname in FORMATS.values():
        w13, w2, hiddens, routes, ref = pair_inputs(fname, REPS)
        err = bm.rel_err(w4.fused_moe_w4(hiddens[0], w13, w2, *routes[0], cfg), ref)
        if not err < 1e-2:
            log(f"part {fname} FAILED rel err {err:.3g}")
            continue
        acts = [w4.pair_gate_up(hiddens[i], w13, routes[i][1], cfg) for i in range(REPS)]
        up_bytes, down_bytes = k * w13.nbytes() / e, k * w2.nbytes() / e
        parts = {  # called within this iteration only
            "gate_up": (lambda i: w4.pair_gate_up(hiddens[i], w13, routes[i][1], cfg), up_bytes),  # noqa: B023
            "down": (lambda i: w4.pair_down(acts[i], hiddens[i], w2, *routes[i], cfg), down_bytes),  # noqa: B023
            "pair": (lambda i: w4.fused_moe_w4(hiddens[i], w13, w2, *routes[i], cfg), up_bytes + down_bytes),  # noqa: B023
        }
        time_parts(parts, "pair_part", "part", fname, bw_gbs, out, log, rel_err=err)
        torch.cuda.empty_cache()


# The aligned path's int4 codes kernels (tensor cores on raw codes, kernels/triton_fused_moe_codes.py) forced
# at one token: one expert block of 16 rows (1 used) per slot.
CODES_CONFIGS = [w4.MoEConfig(16, 64, 128, 128, 128, 1, 4, 3), w4.MoEConfig(16, 128, 128, 128, 128, 1, 4, 3),
                 w4.MoEConfig(16, 64, 128, 64, 128, 1, 4, 3), w4.MoEConfig(16, 64, 128, 128, 128, 1, 4, 4)]  # fmt: skip


def bench_codes(out: dict[str, Any], bw_gbs: float, log) -> None:
    """The aligned path's int4 codes kernels (tensor cores on raw codes) forced at one token, beside the pair
    path in one process, each config checked against the reference, timed as the pair rows are; then the
    codes path's four kernels alone. Commit 21f304d also timed a one-launch kernel here (slower)."""
    d, _inter, e, k = bm.SHAPES["qwen3-30b-a3b"]
    for fname in FORMATS.values():
        w13, w2, hiddens, routes, ref = pair_inputs(fname, REPS)
        nbytes = k * (w13.nbytes() + w2.nbytes()) / e + 4 * d
        for cfg in [w4.default_w4_pair_config(1, d, "int4"), *CODES_CONFIGS]:
            err, us = checked_moe_us(cfg, w13, w2, hiddens, routes, ref)
            name = "pair" if isinstance(cfg, w4.W4PairConfig) else "codes"
            if us is None:
                log(f"t1 {fname} {name} FAILED rel err {err:.3g} {cfg}")
                continue
            t1_row("moe_t1_path", "t1", fname, name, cfg, nbytes, us, err, bw_gbs, out, log)
        codes_parts(w13, w2, hiddens, routes, fname, bw_gbs, out, log)
        del w13, w2
        torch.cuda.empty_cache()


def codes_parts(w13, w2, hiddens, routes, fname, bw_gbs, out, log) -> None:
    """The codes path's four kernels at one token, each alone: moe_align, gate-up, down, moe_sum."""
    d, inter, e, k = bm.SHAPES["qwen3-30b-a3b"]
    cfg = CODES_CONFIGS[0]
    aligns = [moe_align(routes[i][1], e, cfg.block_m) for i in range(REPS)]
    acts = [torch.empty(k, inter, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
    ys = [torch.empty(k, d, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
    wts = [routes[i][0].reshape(-1).float().contiguous() for i in range(REPS)]
    parts = {
        "align": (lambda i: moe_align(routes[i][1], e, cfg.block_m), 0),
        "gate_up": (lambda i: w4._moe_gemm_w4(hiddens[i], w13, acts[i], aligns[i], k, cfg.up_n, cfg.up_k, cfg),
                    k * w13.nbytes() / e),
        "down": (lambda i: w4._moe_gemm_w4(acts[i], w2, ys[i], aligns[i], 1, cfg.down_n, cfg.down_k, cfg, wts[i]),
                 k * w2.nbytes() / e),
        "sum": (lambda i: moe_sum(ys[i].view(1, k, d), torch.empty_like(hiddens[i])), 0),
    }  # fmt: skip
    time_parts(parts, "codes_part", "codes-part", fname, bw_gbs, out, log)


def token_configs() -> list[tok.TokenGemvConfig]:
    """The GEMV-form kernels' tiles around the default (gate-up on two words a lane): gate-up (rows, K tile,
    warps, words; first session 25's one-word default), then down (rows, K tile a slot, slots a tile, warps,
    words), each with the other kernel's default."""
    base = tok.TokenGemvConfig()
    r = lambda **kw: dataclasses.replace(base, **kw)
    ups = [r(up_n=n, up_k=k, up_warps=w, up_words=ws) for n, k, w, ws in
           [(8, 512, 2, 1), (4, 1024, 4, 1), (8, 1024, 2, 2), (2, 1024, 2, 2), (4, 1024, 1, 2), (4, 2048, 2, 2),
            (4, 2048, 4, 2), (4, 1024, 4, 2)]]  # fmt: skip
    downs = [r(down_n=n, down_k=k, down_slots=sl, down_warps=w, down_words=ws) for n, k, sl, w, ws in
             [(2, 256, 8, 8, 1), (8, 256, 8, 8, 1), (4, 128, 8, 4, 1), (4, 256, 8, 4, 2), (2, 256, 8, 4, 2)]]  # fmt: skip
    return [base] + ups + downs + [base]


def bench_token(out: dict[str, Any], bw_gbs: float, log, formats: list[str]) -> None:
    """One token's 4-bit MoE on the GEMV-form kernels (kernels/triton_moe_w4_gemv.py) beside the pair path's
    default in the same process, each config checked against the reference and timed as the pair rows; then
    the default's two kernels alone beside the pair path's."""
    d, inter, e, k = bm.SHAPES["qwen3-30b-a3b"]
    fns = [tok._token_gate_up_kernel, tok._token_down_kernel]
    for fname in formats:
        w13, w2, hiddens, routes, ref = pair_inputs(fname, REPS)
        nbytes = k * (w13.nbytes() + w2.nbytes()) / e + 4 * d
        # the pair path, the engine's tiles for these experts, then the sweep
        engine = tok.default_config()
        for cfg in [w4.default_w4_pair_config(1, d, w13.fmt), engine, *token_configs()]:
            grids = (k * triton.cdiv(inter, cfg.up_n), triton.cdiv(d, cfg.down_n))
            err, us, occ = checked_with_occupancy(cfg, fns, grids, w13, w2, hiddens, routes, ref)
            name = "pair" if isinstance(cfg, w4.W4PairConfig) else "token"
            if us is None:
                log(f"token {fname} {name} FAILED rel err {err:.3g} {cfg}")
                continue
            regs = [(o["kernel"][7:14], o["regs"], o["spills"], o["programs_per_sm"], o["waves"]) for o in occ]
            t1_row("moe_t1_token", "token", fname, name, cfg, nbytes, us, err, bw_gbs, out, log, f" | {regs}",
                   kernels=occ)  # fmt: skip
        token_parts(w13, w2, hiddens, routes, fname, bw_gbs, out, log)
        del w13, w2
        torch.cuda.empty_cache()


def bench_token_tokens(out: dict[str, Any], bw_gbs: float, log, formats: list[str], tokens: list[int],
                       shapes: list[str]) -> None:  # fmt: skip
    """The GEMV-form kernels at T tokens (forced by their config, whatever `takes` says) beside the pair path's,
    the mma path's (int4) and the aligned path's default tiles (each forced too) and fused_moe_w4's own choice
    ("engine") in the same process, per expert shape and format: each checked against the reference, then timed
    over REPS routings; bytes = the distinct experts each routing reads, averaged."""
    for shape in shapes:
        d, _, _, k = bm.SHAPES[shape]
        for fname in formats:
            w13, w2 = bm.expert_weights(fname, shape)
            for t in tokens:
                hiddens, routes, ref = bm.routed_inputs(w13, w2, t, k, REPS)
                distinct = bm.distinct_experts(routes)
                nbytes = bm.distinct_bytes(w13, w2, routes) + 4 * t * d
                floor = nbytes / bw_gbs / 1e3
                paths = [("pair", w4.default_w4_pair_config(t, d, w13.fmt)), ("token", tok.default_config()),
                         ("aligned", w4.aligned_config(t, w13, w2, k)),
                         ("engine", None)]  # fmt: skip
                if w13.fmt == "int4":  # the tensor-core pair path, forced at any count (its `takes` starts above)
                    paths.insert(2, ("mma", mma_path.default_config(t, d)))
                for path, cfg in paths:
                    try:
                        err, us = checked_moe_us(cfg, w13, w2, hiddens, routes, ref)
                    except (ValueError, RuntimeError) as exc:  # a path that does not take these shapes
                        log(f"tokens {shape} {fname} T={t} {path} not run: {str(exc).splitlines()[0]}")
                        continue
                    if us is None:
                        log(f"tokens {shape} {fname} T={t} {path} FAILED rel err {err:.3g}")
                        continue
                    out["rows"].append({"kind": "moe_tokens", "shape": shape, "format": fname, "path": path, "T": t,
                                        "config": None if cfg is None else cfg.__dict__, "distinct_experts": distinct,
                                        "bytes": nbytes, "floor_us": floor, "us": us, "rel_err": err})  # fmt: skip
                    log(f"tokens {shape:13s} {fname:6s} T={t:2d} {path:7s} {us:7.2f} us "
                        f"{100 * floor / us:4.0f}% floor {floor:.2f} err {err:.1e}")  # fmt: skip
            del w13, w2
            torch.cuda.empty_cache()


def token_parts(w13, w2, hiddens, routes, fname, bw_gbs, out, log) -> None:
    """The engine's GEMV-form tiles for these experts, each kernel alone: gate-up, down (on its act; without
    moe_w4_token's preload, since alone it has no gate-up kernel before it to overlap)."""
    d, inter, e, k = bm.SHAPES["qwen3-30b-a3b"]
    cfg = tok.default_config()
    wts = [routes[i][0].reshape(-1).float().contiguous() for i in range(REPS)]
    acts = [torch.empty(k, inter, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
    outs = [torch.empty(1, d, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
    up_bytes, down_bytes = k * w13.nbytes() / e, k * w2.nbytes() / e
    parts = {
        "gate_up": (lambda i: tok.token_gate_up(hiddens[i], w13, routes[i][1], cfg, acts[i]), up_bytes),
        "down": (lambda i: tok.token_down(acts[i], w2, wts[i], routes[i][1], cfg, outs[i]), down_bytes),
    }
    time_parts(parts, "token_part", "token-part", fname, bw_gbs, out, log)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: gemv, parts, pair, codes, token")
    p.add_argument("--token-formats", default=",".join(FORMATS.values()),
                   help=f"the token section's expert formats, of {', '.join(bm.FORMATS)}")  # fmt: skip
    p.add_argument("--tokens", default="",
                   help="the 'tokens' section (skipped when empty): the GEMV-form kernels beside the pair path at "
                        "these token counts, for --token-formats on --token-shapes")  # fmt: skip
    p.add_argument("--token-shapes", default="qwen3-30b-a3b", help=f"expert shapes of {', '.join(bm.SHAPES)}")
    args = p.parse_args()
    formats = [f for f in args.token_formats.split(",") if f]
    if unknown := [f for f in formats if f not in bm.FORMATS]:
        p.error(f"--token-formats: unknown {unknown}; known {', '.join(bm.FORMATS)}")
    shapes = [sh for sh in args.token_shapes.split(",") if sh]
    if unknown := [sh for sh in shapes if sh not in bm.SHAPES]:
        p.error(f"--token-shapes: unknown {unknown}; known {', '.join(bm.SHAPES)}")
    try:
        tokens = [int(v) for v in args.tokens.split(",") if v]
    except ValueError:
        p.error(f"--tokens: comma-separated integers, got {args.tokens!r}")
    bw_gbs = bw.copy_bandwidth()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
                           "copy_GBps": bw_gbs, "rows": []}  # fmt: skip
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    log(f"{out['device']}  copy {bw_gbs:.0f} GB/s  torch {torch.__version__}  triton {triton.__version__}")
    skip = set(filter(None, args.skip.split(",")))
    if "gemv" not in skip:
        bench_gemv(out, bw_gbs, log)
    if "parts" not in skip:
        bench_parts(out, bw_gbs, log)
    if "pair" not in skip:
        bench_pair(out, bw_gbs, log)
    if "codes" not in skip:
        bench_codes(out, bw_gbs, log)
    if "token" not in skip:
        bench_token(out, bw_gbs, log, formats)
    if tokens:
        bench_token_tokens(out, bw_gbs, log, formats, tokens, shapes)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
