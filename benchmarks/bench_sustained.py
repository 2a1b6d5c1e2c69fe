"""A decode step's CUDA graph replayed back to back for `--seconds`: each replay's time in order, beside the GPU's SM
clock, power draw and clock-event reasons sampled by nvidia-smi while it runs.

Why: bench_decode times a graph replay over a few tens of replays, while each of its engine rows serves 64 steps
twice. On an H200, Qwen3-8B at B=128 replayed in 7.87 ms while its engine steps took 8.56 ms, drifting from 8.1 to
8.8 ms over the run, and nvidia-smi showed the GPU at its software power cap at 1.4-1.7 GHz (session 51,
benchmarks/results/decode_8b_s51_h200.*, smi_s51d.csv). Here the same graph runs for seconds with no scheduler or
host work in between, so whatever the clock does under a power cap shows in the replay times alone:
- `burst_ms`: the median of `--burst` replays after the GPU idled `--idle` seconds (bench_decode's way);
- `tenths_ms`: the median replay in each tenth of the sustained run, in order;
- `smi`: the samples taken during the sustained run (SM MHz, W, deg C, clock-event reasons; bit 0x4 is the
  software power cap), summarised in `smi_summary`.

    PYTHONPATH=$PWD python benchmarks/bench_sustained.py --out $OUT/r/sustained_8b_h200.json --model qwen3-8b:36 --batch 128

Each figure is printed beside the step's floor (bench_decode's bytes over the copy bandwidth measured now).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
from ceilings import Report

SMI_FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
POWER_CAP_BIT = 0x4  # nvidia-smi's clocks_event_reasons: SW power cap


def start_smi(period_ms: int) -> subprocess.Popen[str] | None:
    """nvidia-smi sampling SMI_FIELDS every `period_ms` to a pipe, or None where there is no nvidia-smi."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits", f"-lms={period_ms}"]
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def stop_smi(proc: subprocess.Popen[str] | None) -> list[dict[str, Any]]:
    if proc is None:
        return []
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    return parse_smi(out)


def parse_smi(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --format=csv,noheader,nounits` over SMI_FIELDS -> dicts (unparsable rows skipped)."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(SMI_FIELDS):
            continue
        try:
            rows.append({"time": parts[0], "sm_mhz": float(parts[1]), "watts": float(parts[2]),
                         "celsius": float(parts[3]), "reasons": int(parts[4], 16)})  # fmt: skip
        except ValueError:
            continue
    return rows


def summarise_smi(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and lowest SM clock, median power, and the share of samples at the power cap, by halves of the run."""
    if not rows:
        return {}
    half = len(rows) // 2

    def part(rs: list[dict[str, Any]]) -> dict[str, float]:
        return {"samples": len(rs), "sm_mhz_median": statistics.median(r["sm_mhz"] for r in rs),
                "sm_mhz_min": min(r["sm_mhz"] for r in rs), "watts_median": statistics.median(r["watts"] for r in rs),
                "power_capped_share": sum(bool(r["reasons"] & POWER_CAP_BIT) for r in rs) / len(rs)}  # fmt: skip

    return {"first_half": part(rows[: max(1, half)]), "second_half": part(rows[half:] or rows)}


def replay_times(replay: Any, n: int) -> list[float]:
    """ms of each of `n` back-to-back replays (CUDA events around each; nothing else enqueued between them)."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    marks[0].record()
    for i in range(n):
        replay()
        marks[i + 1].record()
    torch.cuda.synchronize()
    return [marks[i].elapsed_time(marks[i + 1]) for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bd.add_step_args(p)
    p.add_argument("--seconds", type=float, default=3.0, help="length of the sustained run")
    p.add_argument("--burst", type=int, default=20, help="replays of the burst median (bench_decode's iters: 10)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds the GPU idles before the burst")
    p.add_argument("--smi-ms", type=int, default=100, help="nvidia-smi's sampling period")
    p.add_argument("--mem-fraction", type=float, default=0.85)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sustained: needs a CUDA GPU (it replays a captured decode graph)")
    if args.seconds <= 0 or args.burst < 1 or args.idle < 0:
        raise SystemExit("bench_sustained: --seconds must be positive, --burst at least 1, --idle not negative")
    bd.DEV = "cuda"
    rep = Report("cuda", model=args.model, batch=args.batch, context=args.context)
    runner, cfg, acc = bd.step_model(args, max(2048, args.context + 64))
    floor = bd.decode_bytes(acc, args.batch, args.context) / (rep.copy_gbs * 1e9) * 1e3
    step = bd.decode_batch(runner, cfg["vocab_size"], args.batch, args.context)
    runner.forward_step(step)  # fills the graph's buffers with this batch
    graphs = runner.graph_runner
    if graphs is None or args.batch not in graphs.graphs:
        raise SystemExit(f"bench_sustained: no CUDA graph at batch {args.batch} (graphs off, or not a captured size)")
    replay = graphs.graph_for(args.batch, args.context + 1).replay
    replay_times(replay, 3)  # warm
    time.sleep(args.idle)
    burst = statistics.median(replay_times(replay, args.burst))
    n = max(10, int(args.seconds * 1e3 / burst))
    smi = start_smi(args.smi_ms)
    times = replay_times(replay, n)
    samples = stop_smi(smi)
    tenth = max(1, n // 10)
    tenths = [statistics.median(times[i : i + tenth]) for i in range(0, tenth * 10, tenth)]
    rep.out.update(floor_ms=floor, burst_ms=burst, replays=n, tenths_ms=tenths, replays_ms=[round(t, 4) for t in times],
                   smi=samples, smi_summary=summarise_smi(samples))  # fmt: skip
    rep.log(f"{args.model} B={args.batch} ctx {args.context}  floor {floor:.3f} ms")
    rep.log(f"burst (median of {args.burst} after {args.idle:.0f} s idle): {burst:.3f} ms (x{burst / floor:.2f})")
    rep.log(
        f"sustained, {n} replays back to back, median of each tenth: "
        + " ".join(f"{t:.3f}" for t in tenths)
        + f"  (x{tenths[0] / floor:.2f} -> x{tenths[-1] / floor:.2f})"
    )
    for half, s in rep.out["smi_summary"].items():
        rep.log(f"  nvidia-smi {half}: SM {s['sm_mhz_median']:.0f} MHz (min {s['sm_mhz_min']:.0f}), "
                f"{s['watts_median']:.0f} W, at the power cap in {100 * s['power_capped_share']:.0f}% of "
                f"{s['samples']} samples")  # fmt: skip
    if not samples:
        rep.log("  (no nvidia-smi samples)")
    rep.save(str(args.out))


if __name__ == "__main__":
    main()
