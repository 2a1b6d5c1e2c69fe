"""The dense int4 product with the weights decoded as wgmma's register operand (kernels/gluon_w4a16_rs.py) at 1-128
rows, beside the kernel `w4a16_linear` takes, the one it takes with this kernel's rule off, and cuBLAS on a bf16 copy
of the weight, in the same process.

Same measurement as benchmarks/bench_w4a16.py: bytes = qweight + scales + zeros + x + y; floor = bytes / the copy
bandwidth measured in this run; each time is the median of a CUDA graph of products over enough weight copies to
exceed L2 several times. Every timed config is first checked against quant_linear_ref (||y - ref|| / ||ref|| < 1e-2).
`--rs W:BK:STAGES:SPLIT[:IN_FLIGHT[:REGS[:AFTER]]],..` names the configs (SPLIT 0: default_config's split; STAGES 0: its
stages); the default, the engine's two forms (`engine_config`: 3 stages and three programs an SM to 64 rows, two at
128). Kernels are compiled first in a process pool.

    PYTHONPATH=$PWD python benchmarks/bench_w4a16_rs.py --out $OUT/w4a16_rs.json --rows 1,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_w4a16 import DEV, DT, L2_BYTES, SHAPES, make_weight, run_pool, time_per_call
from bench_w4a16_mma import checked
from ceilings import copy_bandwidth

from ftransformers.kernels import gluon_w4a16_rs as rs
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.kernels.triton_w4a16 import w4a16_linear

Job = tuple[str, int, int, int, rs.RsConfig]


def parse_rs(spec: str) -> rs.RsConfig:
    """W:BK:STAGES:SPLIT[:IN_FLIGHT[:REGS[:AFTER]]] as a config (0 = default_config's stages or split, resolved per
    shape; IN_FLIGHT 0 unless given, REGS 2 with one warpgroup and 1 with two; AFTER 1 = scale_after)."""
    f = [int(v) for v in spec.split(":")]
    if not 4 <= len(f) <= 7:
        raise ValueError(f"--rs {spec!r}: want W:BK:STAGES:SPLIT[:IN_FLIGHT[:REGS[:AFTER]]]")
    return rs.RsConfig(*f[:4], *(f[4:5] or [0]), *(f[5:6] or [2 if f[0] == 4 else 1]), bool((f[6:7] or [0])[0]))


def resolved(cfg: rs.RsConfig, m: int, n: int, k: int, group: int) -> rs.RsConfig:
    auto = rs.default_config(m, n, k, group, cfg.warps, cfg.bk)
    return replace(cfg, stages=cfg.stages or auto.stages, split=cfg.split or auto.split)


def run_rs(x: torch.Tensor, qw: QuantizedWeight, cfg: rs.RsConfig) -> torch.Tensor:
    return rs.w4a16_rs(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, None, cfg)


def before(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """w4a16_linear with this kernel's rule off: the kernel it took before."""
    rows = rs.ENGINE_MIN_ROWS
    rs.ENGINE_MIN_ROWS = 0
    try:
        return w4a16_linear(x, qw)
    finally:
        rs.ENGINE_MIN_ROWS = rows


def _compile_job(job: Job) -> str:
    v, n, k, m, cfg = job
    try:
        gen = torch.Generator(device=DEV).manual_seed(0)
        qw = make_weight(v, n, k, gen)
        cfg = resolved(cfg, m, n, k, qw.group_size)
        if rs.fits(m, n, k, qw.group_size, cfg):
            run_rs(torch.randn(m, k, device=DEV, dtype=DT, generator=gen), qw, cfg)
            torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported, then timed as an error string
        return f"{v} {n}x{k} M={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def cell(nbytes: int, t: float | str, bw: float) -> str:
    return f"{t:.4f} ms ({nbytes / bw / 1e6 / t:4.0%})" if isinstance(t, float) else f"[{t}]"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default="int4-asym")
    p.add_argument("--rows", default="1,8,16,32,64,128")
    p.add_argument(
        "--rs", default="4:128:3:0:0:3:1,4:128:0:0:0:2:1", metavar="W:BK:STAGES:SPLIT[:IN_FLIGHT[:REGS[:AFTER]]],.."
    )
    p.add_argument("--workers", type=int, default=14)
    args = p.parse_args()
    try:
        configs = [parse_rs(c) for c in args.rs.split(",") if c]
    except ValueError as e:
        p.error(str(e))
    shapes, variants, rows = args.shapes.split(","), args.variants.split(","), [int(m) for m in args.rows.split(",")]
    jobs: list[Job] = [(v, *SHAPES[s], m, c) for s in shapes for v in variants for m in rows for c in configs]
    run_pool(_compile_job, jobs, args.workers)

    bw = copy_bandwidth()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": now,
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GBps": bw,
        "rows": [],
    }
    print(f"{out['device']}  copy {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name in shapes:
        n, k = SHAPES[name]
        w16 = [torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k**0.5
               for _ in range(max(2, -(-4 * L2_BYTES // (2 * n * k))))]  # fmt: skip
        for v in variants:
            probe = make_weight(v, n, k, gen)
            qws = [probe] + [make_weight(v, n, k, gen) for _ in range(max(2, -(-4 * L2_BYTES // probe.nbytes())) - 1)]
            for m in rows:
                x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
                nbytes = probe.nbytes() + 2 * m * (k + n)
                t_cublas = time_per_call(lambda i, x=x, w=w16: F.linear(x, w[i]), len(w16))
                t_engine = checked(x, qws, lambda x, qw: w4a16_linear(x, qw))
                t_before = checked(x, qws, before)
                row = {"shape": name, "N": n, "K": k, "M": m, "fmt": v, "bytes": nbytes, "floor_ms": nbytes / bw / 1e6,
                       "cublas_bf16_ms": t_cublas, "engine_ms": t_engine, "before_ms": t_before, "rs": []}  # fmt: skip
                line = (
                    f"{name:20s} {v:9s} M={m:<4d} floor {nbytes / bw / 1e6:.4f}  cuBLAS bf16 {t_cublas:.4f}  "
                    f"engine {cell(nbytes, t_engine, bw)}  without rs {cell(nbytes, t_before, bw)}"
                )
                for c in configs:
                    c = resolved(c, m, n, k, probe.group_size)
                    t = (
                        checked(x, qws, lambda x, qw, c=c: run_rs(x, qw, c))
                        if rs.fits(m, n, k, probe.group_size, c)
                        else "does not fit"
                    )
                    row["rs"].append({"config": asdict(c), "ms": t})
                    line += (
                        f"  | rs w{c.warps} bk{c.bk} s{c.stages} p{c.split} f{c.in_flight} r{c.regs} "
                        f"a{int(c.scale_after)} "
                        f"{cell(nbytes, t, bw)}"
                    )
                out["rows"].append(row)
                print(line, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
