"""Why an engine decode step can take longer than the same batch's graph replay: host time, GPU time, routing
and the KV the step attends to, measured apart.

bench_quant_decode.py times two things for one batch: `graph_ms`, one decode step replayed on random input
tokens, and `engine_ms`, steady decode through the Scheduler (greedy tokens the model itself generated). In
session 31 Qwen3-30B-A3B W4A16 at batch 32 read 10.5 ms against 12.2. This script found why: the host was not
the bound (launch_step 0.86 ms of host time a step, the GPU busy 12.2 ms of each 12.3); the replay's KV was a
uniform(-1, 1) fill, and attending to it the MoE inputs grew about four times larger (largest magnitude 0.0036
against 0.00086) and the 32 tokens went to 81 distinct experts a layer instead of the 112 of uniform routing. bench_decode.decode_batch now prefills the
timed sequences for real. The parts (the replay-only ones still register their KV the old way, on purpose):

1. `engine`: the Scheduler loop as bench_decode.engine_step_ms runs it, with CUDA events around each launch:
   median wall ms and median GPU ms of the steady full-batch decode steps.
2. `--modes`: one random-token step replayed waited for one by one, and queued back to back.
3. `--layouts`: queued replays of the engine's own saved step, of random tokens over the KV slots the engine's
   prompts wrote, and over slots scattered across the pool (random fill), each with one eager pass's routing
   spread and hidden-state magnitude.
4. `--cpu`: host ms inside launch_step, and cProfile's top functions over 20 engine steps.
5. `--kernels`: per kernel name, GPU microseconds per step in ten steady engine steps against ten graph
   replays (torch.profiler; CUPTI serialises the PDL overlap, so both read alike there), and idle time.
6. `routing` and `moe` (MoE models): the engine's requests served again with graphs off, recording each steady
   step's expert ids; then the MoE layer alone on that routing beside uniform random routing.

    PYTHONPATH=$PWD python benchmarks/probe_engine_routing.py --out $OUT/probe_routing.json \
        --model qwen3-30b-a3b:48 --format w4a16 --batch 32 --layouts
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

import bench_decode as bd
import bench_quant_decode as bq


def serve(runner: Any, prompts: list[list[int]], new_tokens: int, on_launch: Any) -> None:
    """Greedy requests through a fresh Scheduler (overlap on); on_launch(step_batch, launch) wraps every launch."""
    from ftransformers.config.sampling_params import SamplingParams
    from ftransformers.scheduler.io_struct import GenerateReq
    from ftransformers.scheduler.scheduler import Scheduler

    launch = runner.launch_step
    runner.launch_step = lambda b: on_launch(b, launch)  # instance attribute: shadows the method for this run
    try:
        sched = Scheduler(runner, runner.server_args, [], overlap=True)
        sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            sched.add_request(GenerateReq(rid=f"p{i}", input_ids=p, sampling_params=sp))
        while sched.has_work():
            sched.step()
    finally:
        del runner.launch_step


def engine_times(
    runner: Any, prompts: list[list[int]], new_tokens: int, saved: list[Any] | None = None
) -> dict[str, Any]:
    """Median wall and GPU ms of steady full-batch decode steps (the 8th decode on: warm, no prefill beside).
    `saved` receives the 20th full decode's StepBatch of the timed run."""
    batch = len(prompts)
    marks: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []

    def on_launch(b: Any, launch: Any) -> Any:
        full = len(b.seqs) == batch and b.num_tokens == batch
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = launch(b)
        e1.record()
        if full:
            marks.append((time.perf_counter(), e0, e1))
            if saved is not None and len(marks) == 20:
                saved.append(b)
        return out

    serve(runner, prompts, new_tokens, lambda b, launch: on_launch(b, launch))  # warm-up run
    marks.clear()
    serve(runner, prompts, new_tokens, on_launch)
    torch.cuda.synchronize()
    steady = marks[8:]
    wall = [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(steady)]  # launch to launch
    gpu = [a[1].elapsed_time(a[2]) for a in steady]
    return {"steps": len(steady), "wall_ms": statistics.median(wall), "gpu_ms": statistics.median(gpu),
            "gpu_ms_min": min(gpu), "gpu_ms_max": max(gpu)}  # fmt: skip


def per_kernel(prof: Any, steps: int) -> dict[str, Any]:
    """From a finished torch.profiler run over `steps` steps, per step: GPU us by kernel (and copy) name, the
    span from first start to last end, the time no kernel ran, and that idle time by the kernel it preceded."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = sorted((e["ts"], e["ts"] + e["dur"], e["name"][:90]) for e in trace["traceEvents"]
                    if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))  # fmt: skip
    per: dict[str, float] = {}
    idle_before: dict[str, float] = {}
    latest = events[0][0] if events else 0.0
    for start, end, name in events:
        per[name] = per.get(name, 0.0) + (end - start) / steps
        if start > latest:
            idle_before[name] = idle_before.get(name, 0.0) + (start - latest) / steps
        latest = max(latest, end)
    idle = sorted(idle_before.items(), key=lambda kv: -kv[1])
    return {"by_name": per, "span_us": (latest - events[0][0]) / steps if events else 0.0,
            "idle_us": sum(idle_before.values()), "idle_before": [[k, round(v, 1)] for k, v in idle[:8]]}  # fmt: skip


def kernels_engine_vs_replay(
    runner: Any, prompts: list[list[int]], new_tokens: int, ctx: int, vocab: int
) -> dict[str, Any]:
    """Per-kernel GPU us per step: steps 10-19 of an engine run against ten graph replays on random tokens."""
    from torch.profiler import ProfilerActivity, profile

    batch, steps = len(prompts), 10
    state = {"full": 0}
    prof = profile(activities=[ProfilerActivity.CUDA])

    def on_launch(b: Any, launch: Any) -> Any:
        if len(b.seqs) == batch and b.num_tokens == batch:
            state["full"] += 1
            if state["full"] == 10:
                torch.cuda.synchronize()
                prof.start()
            if state["full"] == 10 + steps:
                torch.cuda.synchronize()
                prof.stop()
        return launch(b)

    serve(runner, prompts, max(new_tokens, 24), on_launch)
    engine = per_kernel(prof, steps)
    n = ctx + 1
    timed = registered_step(runner, vocab, ctx, torch.arange(1, 1 + batch * n).view(batch, n).tolist())
    runner.forward_step(timed)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as replay_prof:
        for _ in range(steps):
            runner.forward_step(timed)
        torch.cuda.synchronize()
    replay = per_kernel(replay_prof, steps)
    e, r = engine.pop("by_name"), replay.pop("by_name")
    names = sorted(set(e) | set(r), key=lambda k: -abs(e.get(k, 0.0) - r.get(k, 0.0)))
    rows = [{"kernel": k, "engine_us": round(e.get(k, 0.0), 1), "replay_us": round(r.get(k, 0.0), 1)} for k in names]
    return {"engine": engine, "replay": replay, "engine_total_us": sum(e.values()), "replay_total_us": sum(r.values()),
            "rows": rows[:25]}  # fmt: skip


def cpu_profile(runner: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Host side of steady engine steps 10-29: ms a step inside launch_step, and cProfile's top functions."""
    import cProfile
    import io
    import pstats

    batch = len(prompts)
    state: dict[str, Any] = {"full": 0, "launch_ms": []}
    cp = cProfile.Profile()

    def on_launch(b: Any, launch: Any) -> Any:
        full = len(b.seqs) == batch and b.num_tokens == batch
        state["full"] += int(full)
        if state["full"] == 10 and full:
            cp.enable()
        t0 = time.perf_counter()
        out = launch(b)
        if full and 10 <= state["full"] < 30:
            state["launch_ms"].append((time.perf_counter() - t0) * 1e3)
        if state["full"] == 30 and full:
            cp.disable()
        return out

    serve(runner, prompts, max(new_tokens, 40), on_launch)
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(25)
    return {"launch_ms_median": statistics.median(state["launch_ms"]), "cprofile_top": buf.getvalue()}


def replay_modes(runner: Any, batch: int, ctx: int, vocab: int, n: int = 40) -> dict[str, Any]:
    """One random-token decode step replayed n times three ways: each waited for (wall ms, as graph_ms), each
    waited for (GPU ms between events around the launch), and n launches queued back to back (GPU ms / n,
    as in the engine, where the next step is queued while this one runs). Unix times bracket each mode."""
    timed = bd.decode_step(vocab, batch, ctx)
    runner.forward_step(timed)
    out: dict[str, Any] = {}
    t0 = time.time()
    walls, gpus = [], []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        w0 = time.perf_counter()
        e0.record()
        pending = runner.launch_step(timed)
        e1.record()
        pending.result()
        walls.append((time.perf_counter() - w0) * 1e3)
        gpus.append(e0.elapsed_time(e1))
    out["waited"] = {"wall_ms": statistics.median(walls), "gpu_ms": statistics.median(gpus), "unix": [t0, time.time()]}
    t0 = time.time()
    out["queued"] = {"gpu_ms": queued_ms(runner, timed, n), "unix": [t0, time.time()]}
    return out


def queued_ms(runner: Any, step: Any, n: int = 40) -> float:
    """GPU ms a replay of `step` with n launches queued back to back."""
    runner.forward_step(step)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    pendings = [runner.launch_step(step) for _ in range(n)]
    e1.record()
    pendings[-1].result()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def slot_layout(runner: Any, step: Any) -> dict[str, Any]:
    """Where a step's sequences keep their KV: the slots' range and how often a position's slot is the previous + 1."""
    rows = []
    for s in step.seqs:
        n = s.prefix_len + len(s.input_ids)
        rows.append(runner.req_to_token[s.req_pool_idx, :n].long().cpu())
    allslots = torch.cat(rows)
    runs = sum(int((r[1:] - r[:-1] == 1).sum()) for r in rows) / sum(len(r) - 1 for r in rows)
    return {"min": int(allslots.min()), "max": int(allslots.max()), "consecutive": runs,
            "seq0_head": rows[0][:4].tolist(), "seq0_tail": rows[0][-4:].tolist()}  # fmt: skip


def eager_view(runner: Any, step: Any, experts: int) -> dict[str, Any]:
    """One eager forward of `step` (graphs off): per MoE layer input, the routing spread, the hidden state's
    largest magnitude and its non-finite count (mean over layers, the first and last layer's)."""
    rows: list[dict[str, float]] = []

    def pre(_m: Any, a: tuple[torch.Tensor, ...]) -> None:
        h = a[0].float()
        rows.append({**spread(a[2], experts), "absmax": float(h.abs().nan_to_num(0.0).max()),
                     "nonfinite": int((~h.isfinite()).sum())})  # fmt: skip

    bd.eager_with_moe_hook(runner, step, pre)
    if not rows:
        return {}
    keys = ("distinct", "max_per_expert", "absmax", "nonfinite")
    return {"mean": {k: statistics.mean(r[k] for r in rows) for k in keys},
            "first_layer": rows[0], "last_layer": rows[-1], "max_absmax": max(r["absmax"] for r in rows)}  # fmt: skip


def registered_step(runner: Any, vocab: int, ctx: int, slots: list[list[int]]) -> Any:
    """Random tokens at position `ctx`, sequence i's KV in slots[i] (ctx + 1 of them): the first ctx registered
    in req_to_token by one decode step, holding whatever the pool holds there (no prefill)."""
    from ftransformers.runtime.step_io import StepBatch

    toks = torch.randint(0, vocab, (len(slots),)).tolist()
    runner.forward_step(StepBatch([bd.seq_step(i, [t], ctx, 0, slots[i]) for i, t in enumerate(toks)]))
    return StepBatch([bd.seq_step(i, [t], ctx, ctx, [slots[i][-1]]) for i, t in enumerate(toks)])


def layouts(runner: Any, saved: Any, batch: int, ctx: int, vocab: int, capacity: int, experts: int) -> dict[str, Any]:
    """Queued replays of the engine's own saved step (its tokens, its KV slots), of random tokens in contiguous
    slots (graph_ms's layout), and of random tokens in slots scattered over the whole pool."""
    out: dict[str, Any] = {"engine_layout": slot_layout(runner, saved)}
    out["engine_step_queued_ms"] = queued_ms(runner, saved)
    out["engine_step_eager"] = eager_view(runner, saved, experts)
    n = ctx + 1
    for name, order in (
        ("contiguous", torch.arange(1, 1 + batch * n)),
        ("scattered", 1 + torch.randperm(capacity - 1)[: batch * n]),
    ):
        step = registered_step(runner, vocab, ctx, order.view(batch, n).tolist())
        out[f"{name}_layout"] = slot_layout(runner, step)
        out[f"{name}_queued_ms"] = queued_ms(runner, step)
        out[f"{name}_eager"] = eager_view(runner, step, experts)
    return out


def moe_layers(runner: Any) -> list[Any]:
    from ftransformers.layers.moe.experts import FusedMoE

    return [m for m in runner.model.modules() if isinstance(m, FusedMoE)]


def spread(ids: torch.Tensor, experts: int) -> dict[str, float]:
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    return {"distinct": int((counts > 0).sum()), "max_per_expert": int(counts.max()),
            "experts_over_16": int((counts > 16).sum())}  # fmt: skip


def routing(
    runner: Any, prompts: list[list[int]], new_tokens: int, experts: int, keep_layers: set[int]
) -> dict[str, Any]:
    """Expert ids of the engine's steady decode steps, graphs off; the hidden states of `keep_layers` kept."""
    from ftransformers.attention.forward_batch import get_forward_batch

    batch = len(prompts)
    layers = moe_layers(runner)
    state = {"record": False, "step": 0}
    per_layer: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(layers))}
    kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]] = {}

    def hook(i: int) -> Any:
        def pre(_m: Any, a: tuple[torch.Tensor, ...]) -> None:
            if state["record"]:
                per_layer[i].append(spread(a[2], experts))
                if i in keep_layers:
                    kept[i] = (a[0].clone(), a[1].clone(), a[2].clone(), get_forward_batch().moe_backend)

        return pre

    hooks = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(layers)]

    def on_launch(b: Any, launch: Any) -> Any:
        full = len(b.seqs) == batch and b.num_tokens == batch
        state["record"] = full and state["step"] >= 8
        state["step"] += int(full)
        return launch(b)

    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        serve(runner, prompts, new_tokens, on_launch)
    finally:
        runner.graph_runner = graphs
        for h in hooks:
            h.remove()

    def summary(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.mean(r[k] for r in rows) for k in rows[0]} if rows else {}

    return {"per_layer": {i: summary(r) for i, r in per_layer.items()},
            "all_layers": summary([r for rs in per_layer.values() for r in rs]), "kept": kept}  # fmt: skip


def random_step_routing(runner: Any, batch: int, ctx: int, vocab: int, experts: int) -> dict[str, float]:
    """Spread of one decode step on random tokens over the KV slots graph_ms's step uses (whatever they hold now)."""
    return eager_view(runner, bd.decode_step(vocab, batch, ctx), experts)["mean"]


def moe_us(
    runner: Any, layer: int, kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor, str], experts: int
) -> dict[str, Any]:
    """The MoE layer alone in a CUDA graph: recorded routing against uniform random routing of the same shape."""
    from triton.testing import do_bench_cudagraph

    from ftransformers.layers.moe.experts import get_moe_backend, get_quant_moe_backend

    m = moe_layers(runner)[layer]
    hidden, weights, ids, name = kept
    T, K = ids.shape
    uniform = torch.stack([torch.randperm(experts, device=ids.device)[:K] for _ in range(T)]).to(ids.dtype)
    if m.w13_qw is not None:
        fn = get_quant_moe_backend(name)
        run = lambda i: fn(hidden, m.w13_qw, m.w2_qw, weights, i)
    else:
        fn = get_moe_backend(name)
        run = lambda i: fn(hidden, m.w13_weight, m.w2_weight, weights, i)
    res = {"layer": layer, "engine": spread(ids, experts), "uniform": spread(uniform, experts)}
    with torch.inference_mode():
        for key, i in (("engine_us", ids), ("uniform_us", uniform), ("engine_us_again", ids)):
            res[key] = do_bench_cudagraph(lambda i=i: run(i), rep=50) * 1e3
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-30b-a3b:48")
    p.add_argument("--format", default="w4a16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--mem-fraction", type=float, default=0.92)
    p.add_argument("--kernels", action="store_true", help="per-kernel GPU time, engine steps against replays")
    p.add_argument("--layouts", action="store_true", help="queued replays: the engine's own step, KV layouts")
    p.add_argument("--modes", action="store_true", help="replays waited for one by one against queued")
    p.add_argument("--cpu", action="store_true", help="host time of engine steps: launch_step and cProfile")
    args = p.parse_args()
    bd.logging_setup()
    name, layers = bd.model_spec(args.model)
    root = Path(tempfile.mkdtemp()) / f"{name}-{layers}-{args.format}"
    cfg = bq.write_config(name, layers, root, args.format, False)
    args.disable_pdl = False
    runner = bd.make_runner(root, args.batch, args)
    pool = runner.kv_pool
    for buf in getattr(pool, "k_buffers", []) + getattr(pool, "v_buffers", []):
        buf.uniform_(-1.0, 1.0)
    experts = cfg.get("num_experts", cfg.get("n_routed_experts", 0))
    vocab = cfg["vocab_size"]
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": " ".join(sys.argv), "args": vars(args)}  # fmt: skip
    acc = bq.accounting(runner.model, cfg, layers)
    bw = bd.ceilings()["copy_GBps"]
    args.iters, args.no_engine = 20, True
    out["graph"] = bq.decode_row(runner, acc, bw * 1e9, args.batch, args)
    print(f"graph replay on random tokens: {out['graph']['graph_ms']:.3f} ms", flush=True)
    if args.modes:
        out["modes"] = replay_modes(runner, args.batch, args.context, vocab)
        print(f"replays: {out['modes']}", flush=True)
    prompts = torch.randint(0, vocab, (args.batch, args.context)).tolist()
    t0 = time.time()
    saved: list[Any] = []
    out["engine"] = engine_times(runner, prompts, args.new_tokens, saved)
    out["engine"]["unix"] = [t0, time.time()]
    print(f"engine: {out['engine']}", flush=True)
    if args.layouts:
        out["layouts"] = layouts(runner, saved[0], args.batch, args.context, vocab, runner.kv_capacity, experts)
        print(f"layouts: {out['layouts']}", flush=True)
    if args.cpu:
        out["cpu"] = c = cpu_profile(runner, prompts, args.new_tokens)
        print(f"launch_step host ms a step: {c['launch_ms_median']:.3f}\n{c['cprofile_top']}", flush=True)
    if args.kernels:
        out["kernels"] = k = kernels_engine_vs_replay(runner, prompts, args.new_tokens, args.context, vocab)
        print(f"kernel us a step: engine {k['engine_total_us']:.0f}, replay {k['replay_total_us']:.0f}", flush=True)
        for key in ("engine", "replay"):
            print(f"  {key}: span {k[key]['span_us']:.0f} us a step, idle {k[key]['idle_us']:.0f} us, "
                  f"idle before {k[key]['idle_before']}", flush=True)  # fmt: skip
        for r in k["rows"]:
            print(f"  {r['engine_us']:9.1f} {r['replay_us']:9.1f}  {r['kernel']}", flush=True)
    if experts:
        mid = len(moe_layers(runner)) // 2
        keep = {0, mid, len(moe_layers(runner)) - 1}
        r = routing(runner, prompts, args.new_tokens, experts, keep)
        out["routing_engine"] = {"all_layers": r["all_layers"], "per_layer": r["per_layer"]}
        out["routing_random"] = random_step_routing(runner, args.batch, args.context, vocab, experts)
        print(f"routing, engine tokens: {r['all_layers']}\nrouting, random tokens: {out['routing_random']}", flush=True)
        out["moe"] = [moe_us(runner, i, r["kept"][i], experts) for i in sorted(r["kept"])]
        for row in out["moe"]:
            print(f"moe layer {row['layer']}: engine routing {row['engine']} {row['engine_us']:.1f} us "
                  f"({row['engine_us_again']:.1f}), uniform {row['uniform']} {row['uniform_us']:.1f} us", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
