"""Launches one int4 decode kernel a few times so Nsight Compute can profile it: where the time of the dense
int4 product (kernels/gluon_w4a16_mma.py) and of the int4 MoE pair path at one token goes, by hardware
counters (the issue 5 targets they miss). Dummy weights of the benches' shapes; the first calls compile.

    ncu --clock-control none --kernel-name regex:'w4a16_mma|w4a16_wgmma|w4a16_rs|_pair_' \
        --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy \
        python benchmarks/ncu_w4.py --case "dense:dsv3 o:16"      # or "moe:qwen3-30b-a3b:1", "wgmma:qwen3-8b qkv:16",
                                                                  # "gate-up:qwen3-30b-a3b:16", "gate-up-8:qwen3-30b-a3b:16",
                                                                  # "rs:qwen3-8b gate_up:32"

(`--clock-control none` leaves the GPU's clocks as they are; benchmarks/results/ncu_w4_*_h100.txt.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe_w4 import SHAPES as MOE_SHAPES
from bench_moe_w4 import random_qw, routings
from bench_w4a16 import SHAPES as DENSE_SHAPES
from bench_w4a16 import make_weight

from ftransformers.kernels import gluon_w4a16_mma as mma
from ftransformers.kernels import gluon_w4a16_wgmma as wg
from ftransformers.kernels import triton_fused_moe_w4 as w4

CALLS = 6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--case",
        required=True,
        help="dense:<bench_w4a16 shape>:<rows>, wgmma:<the same>:<rows>, moe:<bench_moe_w4 shape>:<T>, or "
        "gate-up:<the same>:<T> (the mma path's gate-up) / gate-up-S:... (its grouped form, S spans a chunk), or "
        "rs:<bench_w4a16 shape>:<rows> (kernels/gluon_w4a16_rs.py on its engine config)",
    )
    kind, shape, rows = p.parse_args().case.split(":")
    m = int(rows)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if kind == "dense":
        n, k = DENSE_SHAPES[shape]
        qw = make_weight("int4-asym", n, k, gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        print(f"dense {shape} M={m}: {mma.default_config(m, n, k)}", flush=True)
        for _ in range(CALLS):
            mma.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size)
    elif kind == "wgmma":  # the wgmma kernel on its engine tiles (kernels/gluon_w4a16_wgmma.py)
        n, k = DENSE_SHAPES[shape]
        qw = make_weight("int4-asym", n, k, gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        cfg = wg.default_config(m, n, k, qw.group_size, wg.ENGINE_TILES)
        print(f"wgmma {shape} M={m}: {cfg}", flush=True)
        for _ in range(CALLS):
            wg.w4a16_wgmma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, None, cfg)
    elif kind == "rs":  # the register-operand kernel on the engine's config (kernels/gluon_w4a16_rs.py)
        from ftransformers.kernels import gluon_w4a16_rs as rs

        n, k = DENSE_SHAPES[shape]
        qw = make_weight("int4-asym", n, k, gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        cfg = rs.engine_config(m, n, k, qw.group_size) or rs.default_config(m, n, k, qw.group_size)
        print(f"rs {shape} M={m}: {cfg}", flush=True)
        for _ in range(CALLS):
            rs.w4a16_rs(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, None, cfg)
    elif kind == "moe":
        d, inter, e, top_k = MOE_SHAPES[shape]
        w13 = random_qw("int4", 128, True, e, 2 * inter, d)
        w2 = random_qw("int4", 128, True, e, d, inter)
        routes = routings(m, e, top_k, CALLS)
        for tw, ti in routes:
            w4.fused_moe_w4(torch.randn(m, d, device="cuda", dtype=torch.bfloat16), w13, w2, tw, ti)
    elif kind.startswith("gate-up"):  # the mma path's gate-up alone: "gate-up" the pair form, "gate-up-S" grouped
        from ftransformers.kernels import gluon_moe_w4_mma as moe_mma

        d, inter, e, top_k = MOE_SHAPES[shape]
        w13 = random_qw("int4", 128, True, e, 2 * inter, d)
        cfg = moe_mma.default_config(m, d)
        spans = int(kind.removeprefix("gate-up").lstrip("-") or 0)
        print(f"gate-up {shape} T={m}: {cfg}, {'spans ' + str(spans) if spans else 'pair form'}", flush=True)
        for _, ti in routings(m, e, top_k, CALLS):
            x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
            if spans:
                moe_mma.gate_up_grouped(x, w13, ti.contiguous(), cfg, spans)
            else:
                moe_mma.gate_up(x, w13, ti.contiguous(), cfg)
    else:
        raise SystemExit(f"ncu_w4: unknown case kind {kind!r} (dense, wgmma, rs, moe, gate-up or gate-up-S)")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
