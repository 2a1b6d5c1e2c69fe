"""The int4 MoE pair path on mma.sync (kernels/gluon_moe_w4_mma.py) beside the CUDA-core pair path
(kernels/triton_fused_moe_w4.py), in one process, at decode token counts.

For each shape (Qwen3-30B-A3B, DeepSeek-V3), int4 format (g128 sym and asym; `--formats` for others) and T, both
paths are checked against quant_moe_ref on the first routing (relative error, printed), then timed as a CUDA graph of
REPS calls over different routings and hiddens (each call's experts differ from the previous one's, so
weights come from DRAM). Floor = the distinct experts' bytes (expected count under uniform routing is
not used: the routings here are drawn, and their distinct experts counted) / the copy bandwidth measured
in the same process (benchmarks/ceilings.py). `--parts` also times the mma path's two kernels alone; `--ab NAME=V`
the mma path again with the module value gluon_moe_w4_mma.NAME set to V (e.g. SPAN_MASKED_X=0; `+` joins settings
of one variant, `,` separates variants, each timed in turn). `--routing`
draws the routings otherwise: `distinct` gives every pair its own expert (T * top_k <= E), `shared` gives every
token the same top_k experts (a new set each call), to see what a pair sharing its expert with another costs.

    PYTHONPATH=$PWD python benchmarks/bench_moe_w4_mma.py --out $OUT/moe_w4_mma_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_moe_w4 as bm
from ceilings import module_settings, module_values

from ftransformers.kernels import gluon_moe_w4_mma as mma
from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.quant_formats import quant_moe_ref
from ftransformers.kernels.triton_moe_groups import group_pairs

REPS = 8
FORMATS = ("int4-g128-asym", "int4-g128-sym")


def routings(kind: str, t: int, e: int, k: int, reps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`reps` routings (weights [t, k] float32 summing to 1 a token, ids [t, k]): bench_moe_w4's uniform draw, or
    `distinct` (t * k different experts) / `shared` (one set of k experts for every token), each call's experts
    avoiding the previous call's where there are enough."""
    if kind == "uniform":
        return bm.routings(t, e, k, reps)
    n = t * k if kind == "distinct" else k
    if n > e:
        raise SystemExit(f"--routing {kind}: {t} tokens x top-{k} need {n} experts, the model has {e}")
    out, prev = [], torch.zeros(e, dtype=torch.bool, device=bm.DEV)
    for _ in range(reps):
        key = torch.rand(e, device=bm.DEV) - (2.0 * prev.float() if 2 * n <= e else 0.0)
        pick = key.topk(n).indices
        if kind == "distinct":
            ids = pick.reshape(t, k)
        else:  # every token the same k experts, each in its own order
            ids = pick[torch.stack([torch.randperm(k, device=bm.DEV) for _ in range(t)])]
        prev = torch.zeros(e, dtype=torch.bool, device=bm.DEV).scatter_(0, pick, True)
        w = torch.rand(t, k, device=bm.DEV)
        out.append(((w / w.sum(-1, keepdim=True)).float(), ids))
    return out


def _text(variant: list[tuple[str, int]]) -> str:
    return "+".join(f"{n}={v}" for n, v in variant)


def bench(shape: str, tokens: list[int], copy_gbs: float, parts: bool, out: dict[str, Any], log,
          ab: list[list[tuple[str, int]]] | None = None, routing: str = "uniform", grouped: tuple[int, ...] = (),
          formats: tuple[str, ...] = FORMATS) -> None:  # fmt: skip
    d, _, e, k = bm.SHAPES[shape]
    for fname in formats:
        fmt, group, _ = bm.FORMATS[fname]
        w13, w2 = bm.expert_weights(fname, shape)
        for t in tokens:
            hiddens = [torch.randn(t, d, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
            routes = routings(routing, t, e, k, REPS)
            ref = quant_moe_ref(hiddens[0], w13, w2, *routes[0])
            nbytes = bm.distinct_bytes(w13, w2, routes)
            floor_us = nbytes / copy_gbs / 1e3
            flat = [(r[0].reshape(-1).float().contiguous(), r[1]) for r in routes]
            cfg = w4.default_w4_pair_config(t, d, fmt)
            paths = {
                "pair": lambda i, h=hiddens, r=routes, c=cfg: w4.fused_moe_w4(h[i], w13, w2, *r[i], c),
                "mma": lambda i, h=hiddens, r=flat: mma.moe_w4_mma(h[i], w13, w2, *r[i]),
            }
            if t * k > w4.W4_PAIR_MAX_PAIRS:  # the aligned path (codes kernels), the default at this size
                acfg = w4.default_w4_config(t, e, k, group, codes=True)
                paths = {"aligned": lambda i, h=hiddens, r=routes, c=acfg: w4.fused_moe_w4(h[i], w13, w2, *r[i], c),
                         "mma": paths["mma"]}  # fmt: skip
            row: dict[str, Any] = {"shape": shape, "format": fname, "T": t, "routing": routing,
                                   "distinct_experts": bm.distinct_experts(routes), "bytes": nbytes, "floor_us": floor_us}
            for name, call in paths.items():
                err = bm.rel_err(call(0), ref)
                row[f"{name}_err"] = err
                if not err < 1e-2:
                    log(f"{shape} {fname} T={t} {name} FAILED rel err {err:.3g}")
                    continue
                row[f"{name}_us"] = bm.graph_ms(call, REPS) * 1e3
            for variant in ab if ab and "mma_us" in row else []:  # the mma path again with module values changed
                with module_values(mma, variant):
                    err = bm.rel_err(paths["mma"](0), ref)
                    us = bm.graph_ms(paths["mma"], REPS) * 1e3 if err < 1e-2 else None
                row.setdefault("ab", []).append({"variant": _text(variant), "err": err, "us": us})
            if parts and "mma_us" in row:
                mc = mma.default_config(t, d)
                acts = [mma.gate_up(hiddens[i], w13, routes[i][1].contiguous(), mc) for i in range(REPS)]
                up = lambda i, h=hiddens, r=routes, c=mc: mma.gate_up(h[i], w13, r[i][1].contiguous(), c)
                dn = lambda i, h=hiddens, f=flat, a=acts, c=mc: mma.down(a[i], h[i], w2, f[i][0], f[i][1].contiguous(), c)
                row["mma_gate_up_us"] = bm.graph_ms(up, REPS) * 1e3
                row["mma_down_us"] = bm.graph_ms(dn, REPS) * 1e3
                for spans in grouped:  # the gate-up over groups of 8 / spans pairs (with its grouping launch)
                    if mma.chunk_k(d // mc.up_warps, group, mc.up_kc, spans):
                        gu = lambda i, h=hiddens, r=routes, c=mc, s=spans: mma.gate_up_grouped(h[i], w13, r[i][1].contiguous(), c, s)
                        ok = all(bm.rel_err(gu(i), acts[i]) < 1e-2 for i in range(REPS))
                        row[f"grouped{spans}_gate_up_us"] = bm.graph_ms(gu, REPS) * 1e3 if ok else None
                    if mma.grouped_down_takes(hiddens[0], w2, mc, spans):
                        gs = [group_pairs(routes[i][1].contiguous(), 8 // spans) for i in range(REPS)]
                        gd = lambda i, h=hiddens, f=flat, a=acts, c=mc, s=spans, g=gs: mma.down_grouped(
                            a[i], h[i], w2, f[i][0], f[i][1].contiguous(), g[i], s, c)
                        ok = all(bm.rel_err(gd(i), dn(i)) < 1e-2 for i in range(REPS))
                        row[f"grouped{spans}_down_us"] = bm.graph_ms(gd, REPS) * 1e3 if ok else None
                if grouped:
                    gp = lambda i, r=routes: group_pairs(r[i][1], 4)
                    row["group_pairs_us"] = bm.graph_ms(gp, REPS) * 1e3
            out["rows"].append(row)
            pct = lambda us: f"{us:7.2f} us {100 * floor_us / us:4.0f}%" if us else "   -   "
            peer = next(iter(paths))
            log(f"{shape:14s} {fname:15s} T={t:2d} {routing} {row['distinct_experts']:5.1f} experts floor {floor_us:6.2f} us | {peer} {pct(row.get(f'{peer}_us'))} "
                f"err {row[f'{peer}_err']:.1e} | mma {pct(row.get('mma_us'))} err {row['mma_err']:.1e}"
                + (f" | mma gate-up {row['mma_gate_up_us']:.2f} down {row['mma_down_us']:.2f}" if "mma_gate_up_us" in row else "")
                + "".join(f" | {n.removesuffix('_us')} {v:.2f}" if v else f" | {n} FAILED" for n, v in row.items()
                          if n.startswith(("grouped", "group_pairs")))
                + "".join(f" | {v['variant']} {pct(v['us'])} err {v['err']:.1e}" for v in row.get("ab", [])))  # fmt: skip
        w13 = w2 = None  # free before the next format (the lambdas above are done with them)
        torch.cuda.empty_cache()


UP_SWEEP = [dict(up_kc=512), dict(up_kc=512, up_ahead=2), dict(up_kc=256), dict(up_kc=256, up_ahead=2),
            dict(up_kc=512, up_rows=16), dict(up_kc=512, up_warps=2), dict(up_kc=256, up_warps=8),
            dict(up_kc=128, up_ahead=2), dict(up_kc=256, up_warps=8, up_rows=16), dict(up_kc=128, up_warps=8),
            dict(up_kc=128, up_warps=8, up_ahead=2), dict(up_kc=256, up_warps=4, up_rows=16)]  # fmt: skip
DOWN_SWEEP = [dict(down_kc=256), dict(down_kc=256, down_ahead=2), dict(down_kc=128), dict(down_kc=128, down_ahead=2),
              dict(down_kc=512), dict(down_kc=256, down_rows=32), dict(down_kc=128, down_ahead=2, down_rows=32),
              dict(down_kc=128, down_rows=32), dict(down_kc=512, down_rows=32), dict(down_kc=256, down_ahead=2, down_rows=32)]  # fmt: skip


def sweep(shape: str, tokens: list[int], copy_gbs: float, out: dict[str, Any], log) -> None:
    """Each kernel of the mma path alone under the configs above (asym int4 g128), the whole MoE checked
    against the reference first with that config."""
    d, inter, e, k = bm.SHAPES[shape]
    fmt, group, zeros = bm.FORMATS["int4-g128-asym"]
    w13 = bm.random_qw(fmt, group, zeros, e, 2 * inter, d)
    w2 = bm.random_qw(fmt, group, zeros, e, d, inter)
    for t in tokens:
        hiddens = [torch.randn(t, d, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
        routes = bm.routings(t, e, k, REPS)
        flat = [(r[0].reshape(-1).float().contiguous(), r[1].contiguous()) for r in routes]
        ref = quant_moe_ref(hiddens[0], w13, w2, *routes[0])
        n_exp = sum(ids.unique().numel() for _, ids in routes) / REPS
        acts = [mma.gate_up(hiddens[i], w13, flat[i][1]) for i in range(REPS)]
        for kw in UP_SWEEP + DOWN_SWEEP:
            cfg = mma.MmaMoEConfig(**kw)
            part = "gate_up" if "up_kc" in kw else "down"
            if not mma.supported(hiddens[0], w13, w2, k, cfg):
                continue
            err = bm.rel_err(mma.moe_w4_mma(hiddens[0], w13, w2, *flat[0], cfg), ref)
            if not err < 1e-2:
                log(f"sweep {shape} T={t} {kw} FAILED rel err {err:.3g}")
                continue
            if part == "gate_up":
                call = lambda i, c=cfg, h=hiddens, f=flat: mma.gate_up(h[i], w13, f[i][1], c)
                nbytes = n_exp * w13.nbytes() / e
            else:
                call = lambda i, c=cfg, h=hiddens, f=flat, a=acts: mma.down(a[i], h[i], w2, *f[i], c)
                nbytes = n_exp * w2.nbytes() / e
            us = bm.graph_ms(call, REPS) * 1e3
            floor_us = nbytes / copy_gbs / 1e3
            out["rows"].append({"kind": "sweep", "shape": shape, "T": t, "part": part, "config": kw, "us": us,
                                "floor_us": floor_us, "rel_err": err})  # fmt: skip
            log(f"sweep {shape:14s} T={t:2d} {part:7s} {us:8.2f} us {100 * floor_us / us:4.0f}% floor {floor_us:7.2f} {kw}")
    w13 = w2 = None
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--sweep", default="", help="tokens for a per-kernel config sweep, e.g. 1,8 (then no table)")
    ap.add_argument("--routing", choices=("uniform", "distinct", "shared"), default="uniform")
    ap.add_argument("--ab", default="", help="NAME=V[+NAME=V][,...]: also time the mma path with gluon_moe_w4_mma.NAME "
                    "= V (integers; decimals for float values), each comma-separated variant in turn, e.g. "
                    "GROUPED_FROM_TOKENS=0,GROUPED_SPANS_NARROW=4+GROUPED_SPANS_WIDE=4")  # fmt: skip
    ap.add_argument("--grouped-spans", default="", help="with --parts: also time the gate-up over groups of pairs "
                    "(gate_up_grouped, with its grouping launch) and the down over them (down_grouped, without) at "
                    "these span counts, e.g. 2,4; and the grouping alone")  # fmt: skip
    ap.add_argument("--formats", default=",".join(FORMATS), help="int4 formats of bench_moe_w4.FORMATS, e.g. "
                    "int4-g32-sym (Kimi-K2's experts)")  # fmt: skip
    args = ap.parse_args()
    formats = tuple(args.formats.split(","))
    int4 = [n for n in bm.FORMATS if n.startswith("int4-")]
    for f in formats:
        if f not in int4:
            ap.error(f"--formats: int4 formats of bench_moe_w4.FORMATS ({', '.join(int4)}), got {f!r}")
    try:
        ab = [module_settings(text, mma) for text in filter(None, args.ab.split(","))]
    except ValueError as e:
        ap.error(f"--ab: {e}")
    grouped = tuple(int(s) for s in args.grouped_spans.split(",") if s)
    copy_gbs, _ = bm.ceilings()
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "copy_gbs": copy_gbs,
        "rows": [],
    }
    log(f"{out['device']} copy {copy_gbs:.0f} GB/s")
    for shape in args.shapes.split(","):
        if args.sweep:
            sweep(shape, [int(t) for t in args.sweep.split(",")], copy_gbs, out, log)
            continue
        tokens = [int(t) for t in args.tokens.split(",")]
        bench(shape, tokens, copy_gbs, args.parts, out, log, ab, args.routing, grouped, formats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
