"""Where the host's time goes in a step: Python functions (cProfile) and torch ops (self CPU time).

A 1K-token prefill of Qwen3-30B-A3B on an H200 ran 30-74 ms against 28 ms of kernels (592 launches), and an
eager batch-1 decode step 37 ms for 442 launches: the host, not the GPU, bounds those steps. This prints,
for each of a graph-mode decode step, an eager decode step and an eager prefill, the step's wall time
beside its summed kernel time, then the functions and torch ops that took the host's time (one profiled
run of `--reps` steps, per step). First, the same eager steps with kernels/launch.py's cached Triton launches
on and off, alternating in this process (`--rounds`). Also times the pinned host allocations a graph step makes
(`torch.tensor(list, pin_memory=True)`, `torch.empty(..., pin_memory=True)`) alone and with a
non-blocking copy in between, as the engine does.

    PYTHONPATH=$PWD python benchmarks/profile_host.py --out $OUT/r/profile_host_h200.json --model qwen3-30b-a3b:48
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd


def pinned_allocs(iters: int) -> dict[str, float]:
    """us a call of the pinned allocations a graph decode step makes (CUDA only)."""
    if bd.DEV != "cuda":
        return {}
    dev = torch.device("cuda")
    flat = list(range(7 * 8))
    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - t0) / iters * 1e6
        torch.cuda.synchronize()

    src = torch.arange(8, device=dev)
    timed("tensor(list) unpinned", lambda: torch.tensor(flat, dtype=torch.int64))
    timed("tensor(list, pin_memory)", lambda: torch.tensor(flat, dtype=torch.int64, pin_memory=True))
    timed("tensor(list, pin_memory) + H2D", lambda: torch.tensor(flat, dtype=torch.int64, pin_memory=True).to(dev, non_blocking=True))
    timed("empty(8, pin_memory)", lambda: torch.empty(8, dtype=torch.int64, pin_memory=True))
    timed("empty(8, pin_memory) + D2H", lambda: torch.empty(8, dtype=torch.int64, pin_memory=True).copy_(src, non_blocking=True))
    host = torch.empty(64, dtype=torch.int64, pin_memory=True)
    timed("persistent pinned: fill + H2D", lambda: host[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int64)).to(dev, non_blocking=True))
    return out


def top_functions(prof: cProfile.Profile, reps: int, n: int) -> dict[str, list[dict[str, Any]]]:
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_cc, calls, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({fn})" if line else fn
        rows.append({"fn": where[:100], "calls": calls / reps, "tottime_us": tt / reps * 1e6, "cumtime_us": ct / reps * 1e6})
    by_tot = sorted(rows, key=lambda r: -r["tottime_us"])[:n]
    by_cum = sorted(rows, key=lambda r: -r["cumtime_us"])[:n]
    return {"by_tottime": by_tot, "by_cumtime": by_cum}


def torch_ops(fn: Any, reps: int, n: int) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        bd.sync()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [{"op": e.key[:80], "self_us": e.self_cpu_time_total / reps, "calls": e.count / reps} for e in ops]


def examine(label: str, runner: Any, step: Any, graphs: bool, reps: int, n: int) -> dict[str, Any]:
    saved = runner.graph_runner
    runner.graph_runner = saved if graphs else None
    try:
        fn = lambda: runner.forward_step(step)
        res: dict[str, Any] = {"label": label, "wall_ms": bd.median_ms(fn, max(5, reps), 1)}
        if not graphs:  # (profile_step runs the step eagerly itself)
            kernels = bd.profile_step(runner, step, label)
            res["kernel_ms"], res["launches"] = kernels["kernel_ms"], kernels["kernels_per_step"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            fn()
        bd.sync()
        prof.disable()
        res.update(top_functions(prof, reps, n))
        res["torch_ops"] = torch_ops(fn, reps, n)
    finally:
        runner.graph_runner = saved
    return res


def ab_launch_cache(runner: Any, steps: dict[str, Any], rounds: int, iters: int) -> list[dict[str, Any]]:
    """Eager step wall times with kernels/launch.py's cached launches on and off, alternating in this process."""
    from ftransformers.kernels.launch import launch_cache_enabled, set_launch_cache

    if not launch_cache_enabled():
        return []
    saved, runner.graph_runner = runner.graph_runner, None
    rows: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            for on in (True, False):
                set_launch_cache(on)
                for label, step in steps.items():
                    ms = bd.median_ms(lambda: runner.forward_step(step), iters, 1)  # noqa: B023
                    rows.append({"round": r, "cache": on, "step": label, "wall_ms": ms})
                    print(f"round {r} cache {'on ' if on else 'off'} {label:32s} {ms:8.2f} ms", flush=True)
    finally:
        set_launch_cache(True)
        runner.graph_runner = saved
    return rows


def show(res: dict[str, Any]) -> None:
    extra = f"  kernels {res['kernel_ms']:.2f} ms, {res['launches']:.0f} launches" if "kernel_ms" in res else ""
    print(f"\n== {res['label']}: wall {res['wall_ms']:.2f} ms{extra}")
    for key in ("by_tottime", "by_cumtime"):
        print(f"  -- functions {key} (us a step, calls a step)")
        for r in res[key]:
            print(f"    {r['tottime_us']:9.1f} tot {r['cumtime_us']:9.1f} cum {r['calls']:7.1f}x  {r['fn']}")
    print("  -- torch ops by self CPU time (us a step)")
    for r in res["torch_ops"]:
        print(f"    {r['self_us']:9.1f} {r['calls']:7.1f}x  {r['op']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="qwen3-30b-a3b:48", help="NAME:LAYERS of bench_decode's shapes")
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the launch cache on / off A/B")
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke run on a shrunken model")
    args = p.parse_args()
    if args.dry_run:
        bd.DEV = "cpu"
    name, layers = args.model.split(":")
    root = Path(tempfile.mkdtemp()) / name
    cfg = bd.write_config(name, int(layers), root, args.dry_run)
    runner = bd.make_runner(root, 1, args, bd.RUN_CONTEXT)
    vocab = cfg["vocab_size"]
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if bd.DEV == "cuda" else "cpu",
                           "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                           "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    out["pinned_us"] = pinned_allocs(200)
    for k, v in out["pinned_us"].items():
        print(f"pinned: {k:40s} {v:8.1f} us a call")
    dec = bd.decode_batch(runner, vocab, 1, args.context)
    ids = torch.randint(0, vocab, (args.prefill,)).tolist()
    from ftransformers.runtime.step_io import StepBatch

    pre = StepBatch([bd.seq_step(0, ids, 0, 0, list(range(1, args.prefill + 1)))])
    out["ab_launch_cache"] = ab_launch_cache(
        runner, {f"decode B=1 ctx={args.context} (eager)": dec, f"prefill {args.prefill} (eager)": pre}, args.rounds, 5
    )
    for label in dict.fromkeys(r["step"] for r in out["ab_launch_cache"]):
        on = {r["round"]: r["wall_ms"] for r in out["ab_launch_cache"] if r["step"] == label and r["cache"]}
        off = {r["round"]: r["wall_ms"] for r in out["ab_launch_cache"] if r["step"] == label and not r["cache"]}
        # the host's speed can shift mid-process: each round's on / off pair is the comparison that holds
        ratios = [on[k] / off[k] for k in on]
        print(f"launch cache on / off: {label:32s} {statistics.median(on.values()):8.2f} / "
              f"{statistics.median(off.values()):8.2f} ms; paired ratio {statistics.median(ratios):.3f}, "
              f"on faster in {sum(x < 1 for x in ratios)} of {len(ratios)} rounds")  # fmt: skip
    out["steps"] = []
    if runner.graph_runner is not None:
        out["steps"].append(examine(f"decode B=1 ctx={args.context} (graph)", runner, dec, True, args.reps, args.top))
    out["steps"].append(examine(f"decode B=1 ctx={args.context} (eager)", runner, dec, False, args.reps, args.top))
    out["steps"].append(examine(f"prefill {args.prefill} (eager)", runner, pre, False, args.reps, args.top))
    for r in out["steps"]:
        show(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
