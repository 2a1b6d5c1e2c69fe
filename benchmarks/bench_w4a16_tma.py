"""The dense int4 product with its words streamed by TMA (kernels/gluon_w4a16_tma.py) at 1-16 rows, beside the path
the engine takes today (`w4a16_linear`: the mma.sync or wgmma kernels by their rules) and cuBLAS bf16, in the same
process, on the issue's dense shapes (int4 g128, asymmetric as AWQ).

Same measurement as benchmarks/bench_w4a16.py: bytes = qweight + scales + zeros + x + y; floor = bytes / the copy
bandwidth measured in this run; each time is the median of a CUDA graph of products over enough weight copies to
exceed L2 four times. Every timed config is first checked against quant_linear_ref (||y - ref|| / ||ref|| < 1e-2).
`--configs T:S:P:X:H,..` are the TMA configs timed: T 64-row tiles a program, S ring stages, P the K split
(0: gluon_w4a16_tma.default_config's, -2: twice it, -4: four times), X chunks of x loaded ahead, H = 1 for
each half of a chunk on its own accumulator. Kernels are compiled first in a process pool.

    PYTHONPATH=$PWD python benchmarks/bench_w4a16_tma.py --out $OUT/w4a16_tma_h200.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_w4a16 import DEV, DT, L2_BYTES, SHAPES, make_weight, rel_err, run_pool, time_per_call
from ceilings import copy_bandwidth

from ftransformers.kernels import gluon_w4a16_tma as tm
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_linear_ref
from ftransformers.kernels.triton_w4a16 import w4a16_linear

VARIANT = "int4-asym"
DEFAULT_CONFIGS = "2:4:0:1:0,2:4:0:1:1,1:4:0:1:1,2:3:0:1:1,1:4:-2:1:1,2:4:-2:1:1,2:4:0:2:1,2:4:-2:1:0"
Job = tuple[int, int, int, tm.TmaLinearConfig | None]


def resolve(spec: str, m: int, n: int, k: int, group: int) -> tm.TmaLinearConfig | None:
    """T:S:P:X:H -> the config at M rows of this weight, or None where it does not fit."""
    tiles, stages, split, x_ahead, halves = (int(v) for v in spec.split(":"))
    cfg = replace(tm.default_config(m, n, k, group, tiles, stages), x_ahead=x_ahead, halves=bool(halves))
    if split > 0:
        cfg = replace(cfg, split=split)
    elif split < 0:
        cfg = replace(cfg, split=cfg.split * -split)
    return cfg if tm.fits(m, n, k, group, cfg) else None


def run_tma(x: torch.Tensor, qw: QuantizedWeight, cfg: tm.TmaLinearConfig) -> torch.Tensor:
    return tm.w4a16_tma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, None, cfg)


def _compile_job(job: Job) -> str:
    n, k, m, cfg = job
    try:
        gen = torch.Generator(device=DEV).manual_seed(0)
        qw = make_weight(VARIANT, n, k, gen)
        x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
        run_tma(x, qw, cfg) if cfg else w4a16_linear(x, qw)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing pass
        return f"{n}x{k} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def checked(x: torch.Tensor, qws: list[QuantizedWeight], fn: Any) -> float | str:
    """ms per product of fn(x, qw), after checking it on qws[0]; a string says why it was not timed."""
    try:
        err = rel_err(fn(x, qws[0]), quant_linear_ref(x, qws[0]))
        if not err < 1e-2:
            return f"rel err {err:.3g}"
        return time_per_call(lambda i: fn(x, qws[i]), len(qws))
    except Exception as e:  # noqa: BLE001 - a config that does not run is reported
        return f"{type(e).__name__}: {str(e)[:160]}"


def pct(nbytes: int, t: float | str, bw: float) -> str:
    return f"{t * 1e3:6.1f} us ({100 * nbytes / t / 1e6 / bw:3.0f}%)" if not isinstance(t, str) else f"{t[:40]:>17s}"


def cname(c: tm.TmaLinearConfig) -> str:
    return f"t{c.tiles} st{c.stages} s{c.split} x{c.x_ahead}" + (" h" if c.halves else "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, metavar="T:S:P:X:H,..")
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()
    shapes = args.shapes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    specs = args.configs.split(",")
    plan: dict[tuple[str, int], list[tm.TmaLinearConfig]] = {}
    for s in shapes:
        n, k = SHAPES[s]
        for m in rows:
            cfgs = [resolve(c, m, n, k, 128) for c in specs]
            plan[s, m] = list(dict.fromkeys(c for c in cfgs if c))  # distinct, in order
    jobs = [(*SHAPES[s], m, c) for (s, m), cfgs in plan.items() for c in [None, *cfgs]]
    run_pool(_compile_job, jobs, args.workers)

    bw = copy_bandwidth()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": now, "command": " ".join(sys.argv),
                           "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": bw,
                           "rows": []}  # fmt: skip
    print(f"{out['device']}  copy {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name in shapes:
        n, k = SHAPES[name]
        w16 = [torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k**0.5
               for _ in range(max(2, -(-4 * L2_BYTES // (2 * n * k))))]  # fmt: skip
        probe = make_weight(VARIANT, n, k, gen)
        copies = max(2, -(-4 * L2_BYTES // probe.nbytes()))
        qws = [probe] + [make_weight(VARIANT, n, k, gen) for _ in range(copies - 1)]
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
            nbytes, b16 = probe.nbytes() + 2 * m * (k + n), 2 * n * k + 2 * m * (k + n)
            t_engine = checked(x, qws, lambda x, qw: w4a16_linear(x, qw))
            t_cublas = time_per_call(lambda i, x=x, w=w16: F.linear(x, w[i]), len(w16))
            tma = [(c, checked(x, qws, lambda x, qw, c=c: run_tma(x, qw, c))) for c in plan[name, m]]
            row = {"shape": name, "N": n, "K": k, "M": m, "fmt": VARIANT, "bytes": nbytes,
                   "floor_ms": nbytes / bw / 1e6, "engine_ms": t_engine, "cublas_bf16_ms": t_cublas,
                   "cublas_bf16_bytes": b16, "tma": [{"config": asdict(c), "ms": t} for c, t in tma]}  # fmt: skip
            out["rows"].append(row)
            ok = sorted(((t, c) for c, t in tma if not isinstance(t, str)), key=lambda r: r[0])
            bad = [f"{cname(c)}: {t[:80]}" for c, t in tma if isinstance(t, str)]
            print(f"{name:20s} M={m:<3d} floor {nbytes / bw / 1e3:6.1f} us  engine {pct(nbytes, t_engine, bw)}  "
                  f"cublas bf16 {pct(b16, t_cublas, bw)}  tma: " + "  ".join(f"{cname(c)} {pct(nbytes, t, bw)}"
                  for t, c in ok) + (f"  FAILED {bad}" if bad else ""), flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
