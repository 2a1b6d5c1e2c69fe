"""Where the one-launch int4 MoE token kernel's time goes (kernels/gluon_moe_w4_fused.py): the kernel timed as
a CUDA graph of calls over distinct routings (past L2), with parts removed through its DIAG switch (results
wrong by design; the full kernel is checked against quant_moe_ref first), beside the two-kernel token path in
the same process. Qwen3-30B-A3B experts, int4 g128 asymmetric.

    PYTHONPATH=$PWD python benchmarks/ablate_moe_w4_fused.py --out $OUT/ablate_moe_w4_fused_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import bench_moe_w4 as bm

from ftransformers.kernels import gluon_moe_w4_fused as fz
from ftransformers.kernels import triton_moe_w4_gemv as tok

REPS = 8
VARIANTS = {0: "full kernel", 2: "no grid barrier", 3: "no copies"}  # (DIAG 1 does not compile on Triton 3.6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="int4-g128-asym")
    args = p.parse_args()
    bw_gbs, _ = bm.ceilings()
    w13, w2 = bm.expert_weights(args.format, "qwen3-30b-a3b")
    k = bm.SHAPES["qwen3-30b-a3b"][3]
    hiddens, routes, ref = bm.routed_inputs(w13, w2, 1, k, REPS)
    tws = [r[0].reshape(-1).float().contiguous() for r in routes]
    nbytes = bm.distinct_bytes(w13, w2, routes) + 4 * w13.in_features
    floor = nbytes / bw_gbs / 1e3
    out = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "triton": triton.__version__, "copy_GBps": bw_gbs, "format": args.format, "bytes": nbytes, "floor_us": floor,
           "rows": []}  # fmt: skip
    print(f"{out['device']}  copy {bw_gbs:.0f} GB/s  triton {triton.__version__}  {args.format}  floor {floor:.2f} us")
    err = bm.rel_err(fz.moe_w4_fused(hiddens[0], w13, w2, tws[0], routes[0][1]), ref)
    print(f"fused kernel rel err {err:.1e}", flush=True)

    def fused(diag: int):
        def call(i: int) -> torch.Tensor:
            fz.DIAG = diag
            return fz.moe_w4_fused(hiddens[i], w13, w2, tws[i], routes[i][1])

        return call

    calls = {"token path (two kernels)": lambda i: tok.moe_w4_token(hiddens[i], w13, w2, tws[i], routes[i][1])}
    calls.update({f"fused, {name}": fused(diag) for diag, name in VARIANTS.items()})
    for name, call in calls.items():
        try:
            us = bm.graph_ms(call, REPS) * 1e3
        except RuntimeError as exc:  # a DIAG variant the installed Triton does not compile
            print(f"{name:30s} not run: {str(exc).strip().splitlines()[-1]}", flush=True)
            continue
        out["rows"].append({"variant": name, "us": us})
        print(f"{name:30s} {us:7.2f} us  {100 * floor / us:4.0f}% of copy")
    fz.DIAG = 0
    from bench_w4_b1 import compiled

    for kern in compiled(fz._fused_moe_kernel).values():
        kern._init_handles()
        print(f"compiled: regs {kern.n_regs} spills {kern.n_spills} shared {kern.metadata.shared}")
        out.setdefault("compiled", []).append({"regs": kern.n_regs, "spills": kern.n_spills,
                                               "shared": kern.metadata.shared})  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
