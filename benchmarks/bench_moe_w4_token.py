"""One token's int4 MoE in one launch (kernels/gluon_moe_w4_token.py) beside the two-kernel pair paths it
would replace (the CUDA-core pair path, fused_moe_w4's default at one token, and the mma pair path), in
one process.

Per shape and int4 g128 format (sym, asym): every path and every swept config is checked against
quant_moe_ref on the first routing (relative error, printed; a config over 1e-2 is reported and not
timed), then timed as a CUDA graph of REPS calls over different routings and hiddens (each call's experts
avoid the previous one's, so the weights come from DRAM). Floor = the distinct experts' bytes / the copy
bandwidth measured in the same process (benchmarks/ceilings.py). The token kernel is also run twice on the
same input (bitwise equal: its partials are added in a fixed order) and its barrier counters are read
back (zero between launches).

    PYTHONPATH=$PWD python benchmarks/bench_moe_w4_token.py --out $OUT/moe_w4_token_h100.json
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
from bench_moe_w4_mma import REPS, distinct_bytes

from ftransformers.kernels import gluon_moe_w4_mma as mma
from ftransformers.kernels import gluon_moe_w4_token as tok
from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.quant_formats import quant_moe_ref
from ftransformers.kernels.tickets import ticket_counters

FORMATS = ("int4-g128-asym", "int4-g128-sym")


def bench(shape: str, sweep: bool, copy_gbs: float, out: dict[str, Any], log) -> None:
    d, inter, e, k = bm.SHAPES[shape]
    for fname in FORMATS:
        fmt, group, zeros = bm.FORMATS[fname]
        w13 = bm.random_qw(fmt, group, zeros, e, 2 * inter, d)
        w2 = bm.random_qw(fmt, group, zeros, e, d, inter)
        hiddens = [torch.randn(1, d, dtype=torch.bfloat16, device=bm.DEV) for _ in range(REPS)]
        routes = bm.routings(1, e, k, REPS)
        flat = [(r[0].reshape(-1).float().contiguous(), r[1].contiguous()) for r in routes]
        ref = quant_moe_ref(hiddens[0], w13, w2, *routes[0])
        floor_us = distinct_bytes(w13, w2, routes, e) / copy_gbs / 1e3
        pair_cfg = w4.default_w4_pair_config(1, d, fmt)
        paths: dict[str, Any] = {
            "pair": lambda i, h=hiddens, r=routes, a=w13, b=w2, c=pair_cfg: w4.fused_moe_w4(h[i], a, b, *r[i], c),
            "mma": lambda i, h=hiddens, f=flat, a=w13, b=w2: mma.moe_w4_mma(h[i], a, b, *f[i]),
        }
        configs = tok.SWEEP if sweep else [tok.TokenConfig()]
        for cfg in configs:
            if tok.supported(hiddens[0], w13, w2, k, cfg):
                paths[f"token {cfg}"] = lambda i, h=hiddens, f=flat, a=w13, b=w2, c=cfg: tok.moe_w4_token(
                    h[i], a, b, *f[i], c
                )
        row: dict[str, Any] = {"shape": shape, "format": fname, "floor_us": floor_us, "paths": {}}
        for name, call in paths.items():
            got = call(0)
            err = bm.rel_err(got, ref)
            entry: dict[str, Any] = {"rel_err": err}
            row["paths"][name] = entry
            if name.startswith("token"):
                entry["deterministic"] = bool(torch.equal(got, call(0)))
                entry["counters_zero"] = bool((ticket_counters(got.device, "moe_w4_token", 2) == 0).all())
            if not err < 1e-2:
                log(f"{shape} {fname} {name} FAILED rel err {err:.3g}")
                continue
            entry["us"] = bm.graph_ms(call, REPS) * 1e3
            extra = "".join(f" {k_}={v}" for k_, v in entry.items() if k_ in ("deterministic", "counters_zero"))
            log(f"{shape:14s} {fname:15s} T=1 floor {floor_us:5.2f} us  {name:55s} {entry['us']:7.2f} us "
                f"({100 * floor_us / entry['us']:3.0f}% of copy) err {err:.1e}{extra}")  # fmt: skip
        out["rows"].append(row)
        w13 = w2 = paths = None
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    ap.add_argument("--sweep", action="store_true", help="every tok.SWEEP config, not only the default")
    args = ap.parse_args()
    copy_gbs, _ = bm.ceilings()
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                           "command": " ".join(sys.argv), "copy_gbs": copy_gbs, "rows": []}  # fmt: skip
    log(f"{out['device']} copy {copy_gbs:.0f} GB/s")
    for shape in args.shapes.split(","):
        bench(shape, args.sweep, copy_gbs, out, log)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
