"""Where an engine decode step goes beyond its kernels: the GPU's idle gaps between steps and what the host did then.

`bench_decode.py`'s engine rows (the `Scheduler` loop, overlap scheduling on) can run slower than the same batch's
graph replay: Qwen3-8B at B=128 on an H200 took 8.47 ms a step against a 7.87 ms replay (docs/performance.md,
session 50). This serves a batch through the `Scheduler` as those rows do (random prompts of `--context` tokens,
greedy, ignore_eos), lets it reach steady decode, then records `--steps` steps with torch.profiler (CPU and CUDA)
and prints, per step:
- its wall time (and the median beside the floor bench_decode divides its engine rows by, bytes over the copy
  bandwidth measured now), the GPU's busy time (the union of its kernels and copies) and the GPU's idle time;
- every idle gap of at least `--gap-us`, with the kernels on each side and the scheduler phases the host was in
  (`Scheduler.step`'s phases and the worker's launch, wrapped in record_function ranges for this run only).

    PYTHONPATH=$PWD python benchmarks/profile_engine.py --out $OUT/r/profile_engine_8b_h200.json --model qwen3-8b:36 --batch 128

`--dry-run`: the CPU smoke run on a shrunken model (torch_native kernels; only the host ranges mean anything).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
from ceilings import Report

# Scheduler methods and worker calls timed as host ranges (name in the trace: "host:<name>")
HOST_PHASES = ("step", "_schedule", "_launch", "_read", "_build_seq")


def wrap_phases(stack: ExitStack, sched: Any, runner: Any) -> None:
    """Wrap the scheduler's phases and the runner's launch in record_function ranges, undone by `stack`."""

    def wrapped(obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def ranged(*a: Any, **k: Any) -> Any:
            with record_function(f"host:{name}"):
                return fn(*a, **k)

        setattr(obj, name, ranged)
        stack.callback(delattr, obj, name)  # instance attributes shadow the methods

    for name in HOST_PHASES:
        wrapped(sched, name)
    wrapped(runner, "launch_step")


def gpu_intervals(events: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel and memcpy/memset the GPU ran, by start."""
    out = []
    for e in events:
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return sorted(out)


def host_ranges(events: Any) -> list[tuple[float, float, str]]:
    return sorted(
        (float(e.time_range.start), float(e.time_range.end), e.name[5:])
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("host:")
    )


def analyse(events: Any, gap_us: float) -> list[dict[str, Any]]:
    """Per recorded `Scheduler.step`: wall, GPU busy and idle us within it, and its idle gaps >= gap_us."""
    gpu = gpu_intervals(events)
    host = host_ranges(events)
    steps = [h for h in host if h[2] == "step"]
    rows = []
    for s0, s1, _ in steps:
        inside = [(max(a, s0), min(b, s1), n) for a, b, n in gpu if b > s0 and a < s1]
        busy, end, gaps = 0.0, s0, []
        prev = "(step start)"
        for a, b, n in inside:
            if a > end:
                if a - end >= gap_us:
                    during = sorted({h[2] for h in host if h[2] != "step" and h[0] < a and h[1] > end})
                    gaps.append({"us": round(a - end, 1), "after": prev[:60], "before": n[:60], "host": during})
                busy += b - a
            else:
                busy += max(0.0, b - end)
            end = max(end, b)
            prev = n
        if s1 - end >= gap_us:
            during = sorted({h[2] for h in host if h[2] != "step" and h[0] < s1 and h[1] > end})
            gaps.append({"us": round(s1 - end, 1), "after": prev[:60], "before": "(step end)", "host": during})
        rows.append({"wall_us": round(s1 - s0, 1), "gpu_busy_us": round(busy, 1),
                     "gpu_idle_us": round(s1 - s0 - busy, 1), "gaps": gaps})  # fmt: skip
    return rows


def run(args: argparse.Namespace, rep: Report) -> None:
    """Serve the batch twice (the first warms up), record `--steps` steady steps of the second into rep.out."""
    from ftransformers.config.sampling_params import SamplingParams
    from ftransformers.scheduler.io_struct import GenerateReq
    from ftransformers.scheduler.scheduler import Scheduler

    runner, cfg, acc = bd.step_model(args, max(2048, args.context + args.new_tokens + 64))
    # bench_decode's floor of a step at `context` (its engine rows' divisor): bytes read / copy bandwidth now
    rep.out["floor_us"] = bd.decode_bytes(acc, args.batch, args.context) / (rep.copy_gbs * 1e9) * 1e6
    prompts = torch.randint(0, cfg["vocab_size"], (args.batch, args.context)).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    out = rep.out
    for attempt in range(2):  # the first serves the batch once to compile and warm everything
        sched = Scheduler(runner, runner.server_args, [], overlap=not args.sync)
        for i, p in enumerate(prompts):
            sched.add_request(GenerateReq(rid=f"p{attempt}-{i}", input_ids=p, sampling_params=sp))
        walls: list[float] = []
        while sched.has_work() and (attempt == 0 or len(walls) < args.warm_steps):
            t0 = time.perf_counter()
            sched.step()
            walls.append((time.perf_counter() - t0) * 1e6)
        if attempt == 0:
            continue
        out["unprofiled_wall_us"] = round(statistics.median(walls[-max(1, args.warm_steps // 3) :]), 1)
        with ExitStack() as stack:
            wrap_phases(stack, sched, runner)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    sched.step()
                bd.sync()
        out["steps"] = analyse(prof.events(), args.gap_us)
        while sched.has_work():
            sched.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bd.add_step_args(p)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens a request; steps past the recorded ones finish")
    p.add_argument("--warm-steps", type=int, default=30,
                   help="steps before the recorded ones (the prompts' chunked prefill among them)")  # fmt: skip
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--gap-us", type=float, default=20.0)
    p.add_argument("--sync", action="store_true", help="overlap scheduling off")
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke run on a shrunken model")
    args = p.parse_args()
    if args.steps + args.warm_steps + 2 > args.new_tokens:
        raise SystemExit("profile_engine: --new-tokens must exceed --warm-steps + --steps + 2 (steady decode steps)")
    bd.DEV = "cpu" if args.dry_run else "cuda"
    rep = Report(bd.DEV, model=args.model, batch=args.batch, context=args.context, overlap=not args.sync)
    run(args, rep)
    res, floor = rep.out, rep.out["floor_us"]
    steps = res["steps"]
    recorded = statistics.median(s["wall_us"] for s in steps[1:]) if len(steps) > 1 else float("nan")
    unprofiled = res["unprofiled_wall_us"]
    rep.log(f"{args.model}  B={args.batch} ctx {args.context}  overlap {not args.sync}  floor {floor:.1f} us")
    rep.log(f"step {unprofiled:.1f} us (x{unprofiled / floor:.2f}) unprofiled, the median of the last warm steps; "
            f"{recorded:.1f} (x{recorded / floor:.2f}) profiled, the median past the first")  # fmt: skip
    for i, s in enumerate(steps):
        rep.log(f"step {i}: wall {s['wall_us']:8.1f} us  GPU busy {s['gpu_busy_us']:8.1f}  "
                f"idle {s['gpu_idle_us']:7.1f}")  # fmt: skip
        for g in s["gaps"]:
            rep.log(f"    idle {g['us']:7.1f} us  after {g['after']!r}  before {g['before']!r}  host in {g['host']}")
    rep.save(str(args.out))


if __name__ == "__main__":
    main()
