"""In-process A/B of decode-step variants: one model, one KV pool, CUDA graphs re-captured per variant,
variants timed in interleaved rounds, so that a peer runs in the same process and drift between runs
(the same code's B=1 graph replay read 3.327 and 3.346 ms in two processes of session 8) cannot pose
as a difference.

Variants (comma-separated `--variants`):
  base                  the engine as configured
  separate-rope         decode q/k norm + rope + K/V store as their own launch (triton_rope_store), not
                        inside the attention's first stage
  router=PATH           the fused router (`fused_router_topk`) of another checkout's
                        ftransformers/kernels/triton_router.py, e.g. the previous commit's
  no-pdl                programmatic dependent launch off (kernels/pdl.py)
  no-prefetch           PDL on, but no L2 prefetch ahead of the wait (kernels/pdl.py, l2_prefetch)
  prefetch=F/G          L2 prefetch for the kernel families F, G only (pdl.PREFETCH_FAMILIES); the families
                        measured and dropped in session 9 (gemv, moe_down, ...) are in commit 119bf58
  set=MOD.NAME=V        the module-level toggle ftransformers.kernels.MOD.NAME set to V (an integer; a decimal
                        for a float value), e.g. set=triton_w4a16.PRELOAD_FIRST_TILE=0; a dotted MOD names a
                        module under ftransformers instead (set=attention.triton_backend.GQA_BLOCK_N=32)
  A+B                   both, e.g. separate-rope+router=PATH (the previous commit's decode step)

`--timeline` adds, per variant and batch, a CUPTI trace of a few replays (torch.profiler) read as the
step's critical path: each kernel is charged the time by which it moved the stream's latest end (with PDL
a kernel starts before its predecessor ends, so its own duration overstates what it costs the step),
summed by kernel name per step.

`--stamps` adds, per variant, decode attention stage 1 phase by phase at the first batch size: one more graph,
captured with every stage-1 launch writing its programs' timestamps (kernels/stamps.py), each phase timed from the
layer's first program past its PDL wait, and the gap from a layer's last stamp to the next layer's first wait.

Per variant and batch: median graph-replay ms over `--iters` replays, per round; the table gives the
median over rounds and each round's figure, beside the step's byte floor (bench_decode's accounting and
the shared copy ceiling). `--format` builds the model with quantized weights as bench_quant_decode does
(its accounting gives the floor then).

    PYTHONPATH=$PWD python benchmarks/ab_decode.py --out $OUT/ab.json --model qwen3-30b-a3b:48 \
        --batches 1,8 --variants base,separate-rope,router=prev/ftransformers/kernels/triton_router.py
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
import bench_quant_decode as bq
from ceilings import module_settings, set_module_values


def _router_from(path: str) -> Callable[[], Callable[[], None]]:
    spec = importlib.util.spec_from_file_location("ab_peer_router", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"ab_decode: cannot load a router module from {path}")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)

    def apply() -> Callable[[], None]:
        from ftransformers.kernels import triton_router

        mine = triton_router.fused_router_topk
        triton_router.fused_router_topk = peer.fused_router_topk  # layers/moe/topk.py looks it up per call
        return lambda: setattr(triton_router, "fused_router_topk", mine)

    return apply


def _separate_rope() -> Callable[[], None]:
    from ftransformers.attention.triton_backend import TritonAttentionBackend

    TritonAttentionBackend.fuse_decode_rope = False
    return lambda: setattr(TritonAttentionBackend, "fuse_decode_rope", True)


def _no_pdl() -> Callable[[], None]:
    from ftransformers.kernels.pdl import pdl_enabled, set_pdl_enabled

    was = pdl_enabled()
    set_pdl_enabled(False)
    return lambda: set_pdl_enabled(was)


def _prefetch(spec: str) -> Callable[[], Callable[[], None]]:
    # spec: "" (none) or "fam/fam"
    def apply() -> Callable[[], None]:
        from ftransformers.kernels.pdl import pdl_prefetch_families, set_pdl_prefetch

        was = pdl_prefetch_families()
        set_pdl_prefetch(frozenset(f for f in spec.split("/") if f))
        return lambda: set_pdl_prefetch(was)

    return apply


def _set(spec: str) -> Callable[[], Callable[[], None]]:
    # spec: "module.NAME=value" under ftransformers.kernels, or "package.module.NAME=value" under ftransformers
    target, _, value = spec.partition("=")
    mod_name, _, attr = target.rpartition(".")
    path = f"ftransformers.{mod_name}" if "." in mod_name else f"ftransformers.kernels.{mod_name}"

    def apply() -> Callable[[], None]:
        mod = importlib.import_module(path)
        try:
            kept = set_module_values(mod, module_settings(f"{attr}={value}", mod))
        except ValueError as e:
            raise SystemExit(f"ab_decode: set={spec}: {e}") from None
        return lambda: setattr(mod, attr, kept[attr])

    return apply


NAME_CHARS = 80  # a kernel's name in the timeline: its first characters (template arguments make some very long)


def timeline(replay: Callable[[], None], reps: int = 4) -> dict[str, Any]:
    """Critical-path time per kernel name of `reps` graph replays (module docstring), per step."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events)
    shapes = {e["name"][:NAME_CHARS]: launch_shape(e.get("args", {})) for e in events}
    per_name: dict[str, list[float]] = {}
    latest = kernels[0][0] if kernels else 0.0
    for start, end, name in kernels:
        row = per_name.setdefault(name[:NAME_CHARS], [0.0, 0.0, 0.0])
        row[0] += max(0.0, end - max(latest, start)) / reps  # critical-path share
        row[1] += (end - start) / reps  # own duration
        row[2] += 1 / reps
        latest = max(latest, end)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {"kernels_per_step": len(kernels) / reps,
            "critical_us": sum(v[0] for v in per_name.values()),
            "top": [{"kernel": k, "critical_us": round(v[0], 1), "own_us": round(v[1], 1), "per_step": round(v[2], 1),
                     "launch": shapes.get(k)} for k, v in top[:16]]}  # fmt: skip


def launch_text(ls: dict[str, Any] | None) -> str:
    """launch_shape's dict as the timeline line's bracket ("" without one)."""
    if not ls:
        return ""
    by = ", ".join(f"{n} {c}" for n, c in ls["per_sm"].items())
    return (f" [{ls['programs']} x {ls['threads']} thr, {ls['regs']} regs, {ls['smem'] / 1024:.0f} KB; an SM holds "
            f"{min(ls['per_sm'].values())}, by {by}; left {ls['left']['regs'] // 1024}K regs, "
            f"{ls['left']['smem'] // 1024} KB]")  # fmt: skip


def launch_shape(args: dict[str, Any]) -> dict[str, Any] | None:
    """A kernel event's launch (CUPTI, through torch.profiler's trace): programs, threads, registers a thread and shared
    memory a program, and how many of its programs an SM holds by each of registers, shared memory and threads (a
    Hopper SM: 64K registers, allocated 256 to a warp at a time, 227 KB of shared memory, 2048 threads), the least of
    which bounds what else can run beside it."""
    grid, block, regs = args.get("grid"), args.get("block"), args.get("registers per thread")
    if not (grid and block and regs):
        return None
    programs, threads = math.prod(grid), math.prod(block)
    smem = int(args.get("shared memory", 0))
    program_regs = math.ceil(threads / 32) * math.ceil(regs * 32 / 256) * 256
    by = {"regs": 65536 // program_regs, "threads": 2048 // threads, "smem": 227 * 1024 // smem if smem else 32}
    n = min(by.values())  # what is left of a full SM's registers and shared memory for other kernels' programs
    left = {"regs": 65536 - n * program_regs, "smem": 227 * 1024 - n * smem}
    return {"programs": programs, "threads": threads, "regs": regs, "smem": smem, "per_sm": by, "left": left}


def stage1_stamps(runner: Any, setup: Callable[[], Callable[[], None]], step: Any, batches: list[int], ctx: int,
                  dummy_req_row: int) -> dict[str, Any]:
    """Decode attention stage 1, phase by phase, in a graph of batches[0] captured with every launch's timestamps
    (triton_decode_attention.STAGE1_STAMP_SINK): for each phase of STAGE1_PHASES, us from the layer's first
    program past its PDL wait (about when the kernel before it completed), the median over the layers of the
    programs' median and latest; and the layer's end (its last stamp) to the next layer's first wait."""
    from ftransformers.kernels import triton_decode_attention as tda
    from ftransformers.kernels.stamps import StampSink
    from ftransformers.runtime.cuda_graph_runner import CudaGraphRunner

    undo = setup()
    try:
        sink = tda.STAGE1_STAMP_SINK = StampSink(1 << 20, int(tda.STAGE1_STAMP_SLOTS), torch.device("cuda"))
        graphs = CudaGraphRunner(runner, max(batches), dummy_req_row)
        graphs.capture()
        runner.graph_runner = graphs
        runner.forward_step(step)
        graph = graphs.graph_for(batches[0], ctx + 1)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        sink.buf.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        layers = [w.cpu() for w in sink.views if bool((w[:, 0, 0] >= 0).any())]  # the replayed graph's launches
    finally:
        tda.STAGE1_STAMP_SINK = None
        undo()
    waits = [float(w[:, 1, 0][w[:, 1, 0] >= 0].min()) for w in layers]
    per_phase: dict[str, dict[str, float]] = {}
    for s, phase in enumerate(tda.STAGE1_PHASES):
        med, late = [], []
        for w, t0 in zip(layers, waits):
            t = w[:, s, 0][w[:, s, 0] >= 0].double()
            if t.numel():
                med.append((float(t.median()) - t0) / 1e3)
                late.append((float(t.max()) - t0) / 1e3)
        if med:
            per_phase[phase] = {"median_us": statistics.median(med), "latest_us": statistics.median(late)}
    ends = [float(w[..., 0].max()) for w in layers]
    gaps = [(waits[i + 1] - ends[i]) / 1e3 for i in range(len(layers) - 1)]
    return {"layers": len(layers), "programs": int(layers[0].shape[0]) if layers else 0, "phases": per_phase,
            "end_to_next_wait_us": statistics.median(gaps) if gaps else None}  # fmt: skip


def print_phases(ph: dict[str, Any]) -> None:
    print(f"  stage 1 phases ({ph['layers']} layers x {ph['programs']} programs; us from the first program past "
          f"its wait, median over layers of the programs' median / latest):")  # fmt: skip
    for phase, t in ph["phases"].items():
        print(f"    {phase:18s} {t['median_us']:7.2f} / {t['latest_us']:7.2f}")
    if ph["end_to_next_wait_us"] is not None:
        print(f"    last stamp to the next layer's first wait: {ph['end_to_next_wait_us']:.2f} us")


def variant_setup(name: str) -> Callable[[], Callable[[], None]]:
    """name (parts joined by '+') -> a function that applies the variant and returns its undo."""
    if "+" in name:
        parts = [variant_setup(part) for part in name.split("+")]

        def apply_all() -> Callable[[], None]:
            undos = [apply() for apply in parts]
            return lambda: [undo() for undo in reversed(undos)] and None

        return apply_all
    if name == "base":
        return lambda: lambda: None
    if name == "separate-rope":
        return _separate_rope
    if name == "no-pdl":
        return _no_pdl
    if name == "no-prefetch":
        return _prefetch("")
    if name.startswith("prefetch="):
        return _prefetch(name.partition("=")[2])
    if name.startswith("router="):
        return _router_from(name.partition("=")[2])
    if name.startswith("set="):
        return _set(name.partition("=")[2])
    raise SystemExit(
        f"ab_decode: unknown variant {name!r} (base, separate-rope, no-pdl, no-prefetch, prefetch=F/G, router=PATH, "
        "set=MOD.NAME=V)"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-30b-a3b:48")
    p.add_argument("--format", default="bf16", choices=sorted(bq.FORMATS))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--variants", default="base,separate-rope")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--mem-fraction", type=float, default=0.92)
    p.add_argument("--timeline", action="store_true", help="critical path by kernel name (last round)")
    p.add_argument("--stamps", action="store_true",
                   help="after the rounds, each variant's decode attention stage 1 phase by phase (its programs' "
                        "timestamps, kernels/stamps.py) in one more graph of the first batch size")  # fmt: skip
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.variants.split(",")
    setups = {n: variant_setup(n) for n in names}
    bd.DEV = "cuda"
    bd.logging_setup()
    from ftransformers.runtime.cuda_graph_runner import CudaGraphRunner

    ceil = bd.ceilings()
    name, depth = bd.model_spec(args.model)
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name) / f"{name}-{depth}"
    cfg = bq.write_config(name, depth, root, args.format, False)
    runner = bd.make_runner(root, max(batches), args, max(bd.RUN_CONTEXT, args.context + 1024))
    quant = bq.FORMATS[args.format] is not None
    acc = bq.accounting(runner.model, cfg, depth) if quant else bd.accounting(runner.model, cfg, depth)
    acc["vocab"] = cfg["vocab_size"]
    decode_bytes = bq.decode_bytes if quant else bd.decode_bytes
    for buf in getattr(runner.kv_pool, "k_buffers", []) + getattr(runner.kv_pool, "v_buffers", []):
        buf.uniform_(-1.0, 1.0)  # finite where no sequence writes; decode_batch prefills the timed ones
    ctx = args.context
    steps = {b: bd.decode_batch(runner, acc["vocab"], b, ctx) for b in batches}
    assert isinstance(runner.graph_runner, CudaGraphRunner), "ab_decode needs CUDA graphs"
    dummy_req_row = runner._max_req_slots  # as ModelRunner passes it to make_cuda_graph_runner
    times: dict[str, dict[int, list[float]]] = {v: {b: [] for b in batches} for v in names}
    lines: dict[str, dict[int, dict[str, Any]]] = {v: {} for v in names}
    for r in range(args.rounds):
        for v in names:
            undo = setups[v]()
            try:
                graphs = CudaGraphRunner(runner, max(batches), dummy_req_row)
                graphs.capture()
                runner.graph_runner = graphs
                for b in batches:
                    runner.forward_step(steps[b])  # fills the graph's buffers with this batch
                    times[v][b].append(bd.median_ms(graphs.graph_for(b, ctx + 1).replay, args.iters))
                    print(f"round {r} {v:40s} B={b:3d} replay {times[v][b][-1]:.3f} ms", flush=True)
                    if args.timeline and r == args.rounds - 1:
                        lines[v][b] = timeline(graphs.graph_for(b, ctx + 1).replay)
            finally:
                undo()
    phases = {v: stage1_stamps(runner, setups[v], steps[batches[0]], batches, ctx, dummy_req_row) for v in names} \
        if args.stamps else {}
    rows: list[dict[str, Any]] = []
    for v in names:
        for b in batches:
            floor = decode_bytes(acc, b, ctx) / (ceil["copy_GBps"] * 1e9) * 1e3
            med = statistics.median(times[v][b])
            rows.append({"variant": v, "batch": b, "context": ctx, "floor_ms": floor, "replay_ms": med,
                         "ratio": med / floor, "rounds_ms": times[v][b], "timeline": lines[v].get(b),
                         "stage1_phases": phases.get(v) if b == batches[0] else None})  # fmt: skip
    out = {"device": torch.cuda.get_device_name(), "args": vars(args), "ceilings": ceil, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{out['device']}  copy {ceil['copy_GBps']:.0f} GB/s   {args.model} {args.format} ctx {ctx}")
    for row in rows:
        rounds = " ".join(f"{t:.3f}" for t in row["rounds_ms"])
        print(f"{row['variant']:40s} B={row['batch']:3d} replay {row['replay_ms']:.3f} ms "
              f"(x{row['ratio']:.2f} of floor {row['floor_ms']:.3f}; rounds {rounds})")  # fmt: skip
        if row["stage1_phases"]:
            print_phases(row["stage1_phases"])
        if row["timeline"]:
            tl = row["timeline"]
            print(f"  timeline: {tl['kernels_per_step']:.0f} kernels, critical path {tl['critical_us']:.1f} us a step")
            for k in tl["top"]:
                us = f"{k['critical_us']:8.1f} us critical {k['own_us']:8.1f} us own"
                print(f"    {us} {k['per_step']:5.0f}x  {k['kernel'][:60]}{launch_text(k.get('launch'))}")


if __name__ == "__main__":
    main()
