"""The dense int4 product on mma.sync (kernels/gluon_w4a16_mma.py) at 1-16 rows, beside the path
`w4a16_linear` took before it (its `w4a16_config` kernels) and the bf16 peers (Triton GEMV, cuBLAS), in
the same process.

Same measurement as benchmarks/bench_w4a16.py: bytes = qweight + scales + zeros + x + y; floor = bytes /
the copy bandwidth measured in this run; each time is the median of a CUDA graph of products over enough
weight copies to exceed L2 several times. Every timed config is first checked against quant_linear_ref
(||y - ref|| / ||ref|| < 1e-2). `--sweep M,..` also times every config of gluon_w4a16_mma.SWEEP on the
int4-asym weights at those row counts (`--sweep-split`: only those whose warps split N); `--ab NAME=V`
times each row's default config again with a module toggle of gluon_w4a16_mma set (e.g. SPAN_MASKED_X=0);
`--caps R,..` times it again with each register cap R (the launch's `maxnreg`; 0: ptxas's own choice) that
fits its warps in the register file, and prints each capped kernel's registers, spills and programs an SM as
this device's ptxas built it. `--wgmma T:KC:S[:A[:D]],..` also times the wgmma kernel
(kernels/gluon_w4a16_wgmma.py) with T 64-row tiles a program, chunks of at most KC, K split S ways (0:
wg.default_config's split), A = 1 for scales loaded a chunk ahead and D chunks of words requested ahead (1-3,
default 1), at every row count where it fits (Hopper).
Kernels are compiled first in a process pool.

    PYTHONPATH=$PWD python benchmarks/bench_w4a16_mma.py --out $OUT/w4a16_mma_h100.json [--sweep 1,4,8,16]
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
from bench_w4_b1 import compiled, occupancy
from bench_w4a16 import DEV, DT, L2_BYTES, SHAPES, make_weight, rel_err, run_pool, time_per_call
from ceilings import copy_bandwidth, module_settings, module_values, set_module_values

from ftransformers.kernels import gluon_w4a16_mma as mma
from ftransformers.kernels import gluon_w4a16_wgmma as wg
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_linear_ref
from ftransformers.kernels.triton_gemv import GEMV_MAX_M, gemv
from ftransformers.kernels.triton_w4a16 import w4a16_config, w4a16_linear

Job = tuple[str, int, int, int, mma.MmaLinearConfig | wg.WgmmaLinearConfig | None]


def run_mma(x: torch.Tensor, qw: QuantizedWeight, cfg: mma.MmaLinearConfig | None) -> torch.Tensor:
    return mma.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, None, cfg)


def run_wgmma(x: torch.Tensor, qw: QuantizedWeight, cfg: wg.WgmmaLinearConfig) -> torch.Tensor:
    return wg.w4a16_wgmma(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, None, cfg)


def resolved(cfg: wg.WgmmaLinearConfig, m: int, qw: QuantizedWeight) -> wg.WgmmaLinearConfig:
    """cfg, its split 0 replaced by wg.default_config's for these tiles and chunk."""
    if cfg.split:
        return cfg
    auto = wg.default_config(m, qw.out_features, qw.in_features, qw.group_size, cfg.tiles, cfg.kc)
    return replace(auto, scales_ahead=cfg.scales_ahead, words_ahead=cfg.words_ahead)


def before(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The path w4a16_linear takes without this kernel (its CUDA-core GEMV or codes kernel)."""
    return w4a16_linear(x, qw, config=w4a16_config(x.shape[0], qw.out_features, qw.in_features, qw.fmt, qw.group_size))


def _compile_job(job: Job) -> str:
    variant, n, k, m, cfg = job
    try:
        gen = torch.Generator(device=DEV).manual_seed(0)
        qw = make_weight(variant, n, k, gen)
        x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
        if isinstance(cfg, wg.WgmmaLinearConfig):
            cfg = resolved(cfg, m, qw)
            if wg.supported(x, qw.qweight, qw.group_size, cfg):
                run_wgmma(x, qw, cfg)
        elif mma.supported(x, qw.qweight, qw.group_size, cfg or mma.default_config(m, n, k)):
            run_mma(x, qw, cfg)
        if cfg is None:
            before(x, qw)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - reported by the timing pass
        return f"{variant} {n}x{k} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}"


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


def cname(c: mma.MmaLinearConfig) -> str:
    return f"r{c.rows} w{c.warps} kc{c.kc}" + (f" s{c.split}" if c.split else "")


def wgmma_config(spec: str) -> wg.WgmmaLinearConfig:
    """T:KC:S[:A[:D]] -> tiles T, chunk KC, split S, scales ahead A (0 / 1), D chunks of words ahead."""
    f = [int(v) for v in spec.split(":")]
    return wg.WgmmaLinearConfig(f[0], f[1], f[2], bool(f[3]) if len(f) > 3 else False, f[4] if len(f) > 4 else 1)


def wname(c: wg.WgmmaLinearConfig) -> str:
    return (f"t{c.tiles} kc{c.kc} s{c.split}" + (" scales-ahead" if c.scales_ahead else "")
            + (f" w+{c.words_ahead}" if c.words_ahead != 1 else ""))  # fmt: skip


def kinfo(k: dict[str, Any] | None) -> str:
    return f" [{k['regs']}r {k['spills']}s {k['programs_per_sm']}/SM]" if k else ""


def capped(cfg: mma.MmaLinearConfig, caps: list[int]) -> list[mma.MmaLinearConfig]:
    """cfg with each other register cap whose program fits the register file (65536 a multiprocessor)."""
    return [replace(cfg, maxnreg=c) for c in caps if c != cfg.maxnreg and c * 32 * cfg.warps <= 65536]


def built(run: Any, kernel: Any = mma._w4a16_mma_kernel) -> tuple[Any, dict[str, Any] | None]:
    """run()'s result, and the registers, spills and programs an SM of the one kernel it compiled (None if it
    compiled none or several)."""
    seen = set(compiled(kernel))
    result = run()
    new = [k for key, k in compiled(kernel).items() if key not in seen]
    return result, occupancy(new[0], 0) if len(new) == 1 else None


def apply_settings(settings: list[tuple[str, int]]) -> None:
    """--set's values on gluon_w4a16_mma for the rest of the process (the compile pool's initializer too)."""
    set_module_values(mma, settings)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default="int4-sym,int4-asym")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--sweep", default="", help="row counts at which to time every SWEEP config (int4-asym)")
    p.add_argument("--sweep-split", action="store_true", help="sweep only the configs whose warps split N")
    p.add_argument(
        "--ab-warp-sum",
        action="store_true",
        help="--ab PADDED_WARP_SUM=0: each row's default config also with gl.sum's own cross-warp exchange",
    )
    p.add_argument(
        "--ab",
        default="",
        metavar="NAME=V[+NAME=V]",
        help="also time each row's default config with module values gluon_w4a16_mma.NAME set to int(V), "
        "e.g. SPAN_MASKED_X=0",
    )
    p.add_argument("--caps", default="", metavar="R,..",
                   help="also time each row's default config with each register cap R (0: none) that fits")
    p.add_argument("--wgmma", default="", metavar="T:KC:S[:A[:D]],..",
                   help="also time the wgmma kernel with T 64-row tiles a program, chunks of KC, K split S ways "
                   "(0: its default_config's split), A = 1: scales loaded a chunk ahead, D chunks of words ahead (1)")
    p.add_argument("--set", default="", metavar="NAME=V[+NAME=V]",
                   help="module values of gluon_w4a16_mma set to int(V) for the whole run (the compile pool too), "
                   "e.g. MAX_ROWS=32 to time its forms past 16 rows")  # fmt: skip
    p.add_argument("--workers", type=int, default=14)
    args = p.parse_args()
    if args.ab_warp_sum:
        if args.ab:
            p.error("--ab-warp-sum is --ab PADDED_WARP_SUM=0: give one of them")
        args.ab = "PADDED_WARP_SUM=0"
    parsed = {}
    for flag in ("set", "ab"):
        try:
            parsed[flag] = module_settings(getattr(args, flag), mma)
        except ValueError as e:
            p.error(f"--{flag}: {e}")
    settings, ab = parsed["set"], parsed["ab"]
    apply_settings(settings)
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    rows = [int(m) for m in args.rows.split(",")]
    sweep_rows = [int(m) for m in args.sweep.split(",") if m]
    jobs: list[Job] = [(v, *SHAPES[s], m, None) for s in shapes for v in variants for m in rows]
    caps = [int(c) for c in args.caps.split(",") if c]
    jobs += [(v, *SHAPES[s], m, c) for s in shapes for v in variants for m in rows
             for c in capped(mma.default_config(m, *SHAPES[s]), caps)]  # fmt: skip
    wgmma = [wgmma_config(c) for c in args.wgmma.split(",") if c]
    jobs += [(v, *SHAPES[s], m, c) for s in shapes for v in variants for m in rows for c in wgmma]
    sweep = [c for c in mma.SWEEP if c.split or not args.sweep_split]
    jobs += [("int4-asym", *SHAPES[s], m, c) for s in shapes for m in sweep_rows for c in sweep]
    run_pool(_compile_job, jobs, args.workers, apply_settings, (settings,))

    bw = copy_bandwidth()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": now, "settings": dict(settings),
                           "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
                           "copy_GBps": bw, "rows": [], "sweep": []}  # fmt: skip
    print(f"{out['device']}  copy {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name in shapes:
        n, k = SHAPES[name]
        w16 = [torch.randn(n, k, device=DEV, dtype=DT, generator=gen) / k**0.5
               for _ in range(max(2, -(-4 * L2_BYTES // (2 * n * k))))]  # fmt: skip
        peers: dict[int, tuple[float, float]] = {}
        for v in variants:
            probe = make_weight(v, n, k, gen)
            qws = [probe] + [make_weight(v, n, k, gen) for _ in range(max(2, -(-4 * L2_BYTES // probe.nbytes())) - 1)]
            for m in rows:
                x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
                nbytes, b16 = probe.nbytes() + 2 * m * (k + n), 2 * n * k + 2 * m * (k + n)
                if m not in peers:
                    peers[m] = (time_per_call(lambda i, x=x, w=w16: gemv(x, w[i]), len(w16))
                                if m <= GEMV_MAX_M else float("nan"),  # the bf16 GEMV's rows
                                time_per_call(lambda i, x=x, w=w16: F.linear(x, w[i]), len(w16)))  # fmt: skip
                cfg = mma.default_config(m, n, k)
                t_mma, own = ("not supported", None)
                if mma.supported(x, probe.qweight, probe.group_size, cfg):
                    t_mma, own = built(lambda x=x, qws=qws: checked(x, qws, lambda x, qw: run_mma(x, qw, None)))
                t_before = checked(x, qws, before)
                row = {"shape": name, "N": n, "K": k, "M": m, "fmt": v, "bytes": nbytes, "floor_ms": nbytes / bw / 1e6,
                       "mma_config": asdict(cfg), "mma_ms": t_mma, "before_ms": t_before, "gemv_bf16_ms": peers[m][0],
                       "cublas_bf16_ms": peers[m][1], "mma_kernel": own}  # fmt: skip
                t_ab = None
                if ab and not isinstance(t_mma, str):
                    with module_values(mma, ab):
                        t_ab = checked(x, qws, lambda x, qw: run_mma(x, qw, None))
                    row["mma_ab"] = {"toggle": args.ab, "ms": t_ab}
                by_cap: dict[int, tuple[float | str, dict[str, Any] | None]] = {}  # cap: (ms, its kernel)
                if caps and not isinstance(t_mma, str):
                    for c in capped(cfg, caps):
                        by_cap[c.maxnreg] = built(
                            lambda c=c, x=x, qws=qws: checked(x, qws, lambda x, qw: run_mma(x, qw, c)))  # fmt: skip
                    row["mma_caps"] = {str(r): {"ms": t, "kernel": k} for r, (t, k) in by_cap.items()}
                by_wgmma: dict[str, tuple[float | str, dict[str, Any] | None]] = {}  # config: (ms, its kernel)
                for c in (resolved(c, m, probe) for c in wgmma):
                    if wg.supported(x, probe.qweight, probe.group_size, c):
                        by_wgmma[wname(c)] = built(lambda c=c, x=x, qws=qws: checked(
                            x, qws, lambda x, qw: run_wgmma(x, qw, c)), wg._w4a16_wgmma_kernel)  # fmt: skip
                if by_wgmma:
                    row["wgmma"] = {name: {"ms": t, "kernel": k} for name, (t, k) in by_wgmma.items()}
                for key, t in (("mma", t_mma), ("before", t_before)):
                    if not isinstance(t, str):
                        row[f"{key}_pct_copy"] = 100 * nbytes / t / 1e6 / bw
                out["rows"].append(row)
                both = not isinstance(t_mma, str) and not isinstance(t_before, str)
                speed = f"x{t_before / t_mma:.2f}" if both else ""
                print(f"{name:20s} {v:9s} M={m:<3d} floor {nbytes / bw / 1e3:6.1f} us  "
                      f"mma {pct(nbytes, t_mma, bw)}{kinfo(own)}  "
                      f"before {pct(nbytes, t_before, bw)} {speed:6s} bf16 gemv {pct(b16, peers[m][0], bw)}  "
                      f"cublas {pct(b16, peers[m][1], bw)}"
                      + (f"  mma with {args.ab} {pct(nbytes, t_ab, bw)}" if t_ab is not None else "")
                      + "".join(f"  cap {r} {pct(nbytes, t, bw)}{kinfo(k)}" for r, (t, k) in by_cap.items())
                      + "".join(f"  wgmma {w} {pct(nbytes, t, bw)}{kinfo(k)}" for w, (t, k) in by_wgmma.items()),
                      flush=True)  # fmt: skip
                Path(args.out).write_text(json.dumps(out, indent=1))
            if v != "int4-asym":
                continue
            for m in sweep_rows:
                x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
                nbytes = probe.nbytes() + 2 * m * (k + n)
                res = []
                for c in sweep:
                    if mma.supported(x, probe.qweight, probe.group_size, c):
                        res.append((c, checked(x, qws, lambda x, qw, c=c: run_mma(x, qw, c))))
                out["sweep"].append({"shape": name, "M": m, "default": asdict(mma.default_config(m, n, k)),
                                     "results": [[asdict(c), t] for c, t in res]})  # fmt: skip
                ok = sorted(((t, c) for c, t in res if not isinstance(t, str)), key=lambda r: r[0])
                best = "  ".join(f"{cname(c)} {pct(nbytes, t, bw)}" for t, c in ok[:4])
                bad = [f"{cname(c)}: {t[:60]}" for c, t in res if isinstance(t, str)]
                print(f"  sweep {name:20s} M={m:<3d} {best}" + (f"  FAILED {bad}" if bad else ""), flush=True)
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
