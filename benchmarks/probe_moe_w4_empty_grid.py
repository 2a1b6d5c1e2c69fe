"""What the grouped int4 MoE kernels' grids cost on their own (kernels/gluon_moe_w4_mma.py's gate_up_grouped and
down_grouped launch a program per (pair, row tile) and the programs of pairs that lead no group leave at once): each
kernel timed on real groups (up / down) and on groups where no pair leads one (up_empty / down_empty: every program
leaves at once), int4 g128 asymmetric, spans 2, Qwen3-30B-A3B's and DeepSeek-V3's experts at 16 / 32 / 64 tokens,
uniform routings (bench_moe_w4), CUDA graphs of 8 calls (us). `groups`: groups led a call, on average.

    PYTHONPATH=$PWD python benchmarks/probe_moe_w4_empty_grid.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_moe_w4 as bm

from ftransformers.kernels import gluon_moe_w4_mma as mma
from ftransformers.kernels.triton_moe_groups import group_pairs

R = 8
for shape in ("qwen3-30b-a3b", "deepseek-v3"):
    d, inter, e, k = bm.SHAPES[shape]
    w13, w2 = bm.expert_weights("int4-g128-asym", shape)
    for t in (16, 32, 64):
        h = [torch.randn(t, d, dtype=torch.bfloat16, device=bm.DEV) for _ in range(R)]
        routes = bm.routings(t, e, k, R)
        ids = [r[1].contiguous().to(torch.int32) for r in routes]
        flat = [r[0].reshape(-1).float().contiguous() for r in routes]
        cfg = mma.default_config(t, d)
        g = [group_pairs(i, 4) for i in ids]
        none = torch.full_like(g[0], -1)
        acts = [mma.gate_up_grouped(h[i], w13, ids[i], cfg, 2, g[i]) for i in range(R)]
        res = {}
        res["up"] = bm.graph_ms(lambda i: mma.gate_up_grouped(h[i], w13, ids[i], cfg, 2, g[i]), R) * 1e3
        res["up_empty"] = bm.graph_ms(lambda i: mma.gate_up_grouped(h[i], w13, ids[i], cfg, 2, none), R) * 1e3
        res["down"] = bm.graph_ms(lambda i: mma.down_grouped(acts[i], h[i], w2, flat[i], ids[i], g[i], 2, cfg), R) * 1e3
        res["down_empty"] = bm.graph_ms(lambda i: mma.down_grouped(acts[i], h[i], w2, flat[i], ids[i], none, 2, cfg), R) * 1e3
        res["groups"] = sum(int((x[:, 0] >= 0).sum()) for x in g) / R
        print(shape, "T", t, " ".join(f"{n} {v:.2f}" for n, v in res.items()), flush=True)
    w13 = w2 = None
    torch.cuda.empty_cache()
