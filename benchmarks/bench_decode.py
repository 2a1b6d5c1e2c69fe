"""Decode and prefill step times of `ModelRunner.forward_step` on real model shapes (dummy bf16
weights), each beside its floor, with Hugging Face transformers at batch 1 as the peer.

Floors, from ceilings measured in the same run: decode = bytes the step must read (non-expert
weights, the expected distinct experts E*(1-(1-K/E)^B) per MoE layer under uniform routing, the KV
of every sequence) / device-to-device copy bandwidth (read + write bytes); prefill = model FLOPs
(2 per weight per token, causal attention with the model's own head dims, MLA counted
non-absorbed) / bf16 matmul rate (8192^3). Decode KV is the model's own: each sequence's random prompt of
`context` tokens is prefilled for real once (`decode_batch`), then timed steps re-decode position `context`
(slots_start = context). Until session 31 the KV was a uniform(-1, 1) fill instead, which skewed MoE routing
for quantized dummy weights (see `decode_batch`).

Prefill rows also give the step's summed kernel time and launch count from one profiled eager step
(`kernel_ms`, `launches`): where the step takes much longer than its kernels, the host's launches bound it
(Qwen3-30B-A3B at 1K tokens on an H200: 28 ms of kernels in 30-74 ms steps, docs/performance.md).

Engine rows (`engine_overlap_ms`, `engine_sync_ms`): the same batch served through the `Scheduler`
loop (requests of `context` prompt tokens, greedy or `--engine-sampling`, ignore_eos, 64 new tokens), with overlap
scheduling on and off: the median wall time of the `Scheduler.step()` calls that launch a decode of
all B sequences right after another one (steady decode; prefill steps excluded). This is the step
time a server or `LLM.generate` user sees, host scheduling included. `engine_*_steps_ms` lists those steps in
order: a drift over the run is the GPU's clock, not the host (Qwen3-8B at B=128 on an H200 held its 700 W power cap
at 1.4-1.7 GHz and its steps went from 8.1 to 8.8 ms: benchmarks/results/decode_8b_s51_h200.*, smi_s51d.csv;
benchmarks/bench_sustained.py replays a graph for seconds). The steps decode positions `context` to
`context` + 63, so `engine_*_own_ratio` divides them by the floor of the middle one (`engine_floor_ms`: the KV
of `context` + 32 tokens a sequence); `engine_*_ratio` by the row's floor at `context`, as before session 51.

    PYTHONPATH=$PWD python benchmarks/bench_decode.py --out $OUT/decode_h100.json \
        --models qwen3-30b-a3b:48,qwen3-8b:36,deepseek-v3:3
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from ceilings import ceilings as shared_ceilings
from model_shapes import FULL_DENSE, FULL_DEPTH, SHAPES, model_spec, write_config  # noqa: F401 (bd.SHAPES and others)

RUN_CONTEXT = 9216  # positions a runner is sized for: the default contexts and the engine's new tokens
DEV = "cuda"
ENGINE_SAMPLING: dict[str, float | int] = {}  # SamplingParams of the engine rows beyond greedy (--engine-sampling)
ENGINE_NEW_TOKENS = 64  # tokens each request of an engine row generates


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Any, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    return shared_ceilings(DEV)  # benchmarks/ceilings.py


# Model accounting -------------------------------------------------------------------------------
def accounting(model: torch.nn.Module, cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    from ftransformers.layers.moe.experts import FusedMoE

    expert_ids = {id(p) for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters()}
    moe_layers = sum(isinstance(m, FusedMoE) for m in model.modules())
    named = dict(model.named_parameters())
    embed = named["model.embed_tokens.weight"].numel()
    lm_head = cfg["vocab_size"] * cfg["hidden_size"]
    non_expert = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids) - embed
    E = cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    K = cfg.get("num_experts_per_tok", 0)
    expert = 3 * cfg["hidden_size"] * cfg.get("moe_intermediate_size", 0)
    if "kv_lora_rank" in cfg:
        kv_tok = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
        H, dqk, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    else:
        kv_tok = layers * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 2
        H, dqk, dv = cfg["num_attention_heads"], cfg["head_dim"], cfg["head_dim"]
    per_layer = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        per_layer.append(sum(p.numel() for p in layer.parameters() if id(p) not in expert_ids))
    last_is_moe = any(isinstance(m, FusedMoE) for m in model.model.layers[-1].modules())  # type: ignore[index]
    return {
        "layer_non_expert": per_layer, "last_is_moe": last_is_moe, "layers": layers, "moe_layers": moe_layers,
        "experts": E, "top_k": K, "expert_params": expert, "non_expert_params": non_expert, "lm_head_params": lm_head,
        "kv_bytes_per_token": kv_tok, "attn_heads": H, "d_qk": dqk, "d_v": dv, "hidden": cfg["hidden_size"],
    }  # fmt: skip


def decode_bytes(acc: dict[str, Any], batch: int, context: int) -> float:
    E, K = acc["experts"], acc["top_k"]
    distinct = E * (1 - (1 - K / E) ** batch) if E else 0.0
    weights = acc["non_expert_params"] + acc["moe_layers"] * distinct * acc["expert_params"]
    return 2 * weights + 2 * batch * acc["hidden"] + batch * (context + 1) * acc["kv_bytes_per_token"]


def prefill_flops(acc: dict[str, Any], tokens: int) -> float:
    per_token = (
        acc["non_expert_params"] - acc["lm_head_params"] + acc["moe_layers"] * acc["top_k"] * acc["expert_params"]
    )
    attn = acc["layers"] * 2 * acc["attn_heads"] * (acc["d_qk"] + acc["d_v"]) * tokens * (tokens + 1) / 2
    return 2 * per_token * tokens + attn + 2 * acc["lm_head_params"]


# Our engine -----------------------------------------------------------------------------------
def make_runner(path: Path, max_bs: int, args: argparse.Namespace, context_length: int = RUN_CONTEXT) -> Any:
    """The engine on the dummy checkpoint at `path`, with DeepSeek-V3's routing correction bias zeroed (below)."""
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.config.server_args import ServerArgs
    from ftransformers.runtime.model_runner import ModelRunner

    kernels = "triton" if DEV == "cuda" else "torch_native"
    sa = ServerArgs(model_path=str(path), load_format="dummy", dtype="bfloat16", device=DEV,
                    attention_backend=kernels, moe_backend=kernels, max_running_requests=max_bs,
                    cuda_graph_max_bs=max_bs, mem_fraction_static=args.mem_fraction, context_length=context_length,
                    disable_pdl=getattr(args, "disable_pdl", False),
                    sampling_backend=getattr(args, "sampling_backend", "auto"))  # fmt: skip
    runner = ModelRunner(sa, ModelConfig.from_server_args(sa))
    for pname, param in runner.model.named_parameters():
        if pname.endswith("e_score_correction_bias"):  # as HF initialises it: a dummy +-1e-3 bias would outweigh
            param.data.zero_()  # the ~1e-5 score spread and send every DeepSeek-V3 token to the same ~9 experts
    return runner


def seq_step(i: int, ids: list[int], prefix: int, start: int, slots: list[int]) -> Any:
    from ftransformers.config.sampling_params import SamplingParams
    from ftransformers.runtime.step_io import SeqStep

    return SeqStep(
        rid=f"r{i}", req_pool_idx=i, input_ids=ids, prefix_len=prefix, slots_start=start, slots=slots, sample=True,
        sampling=SamplingParams(temperature=0.0), prompt_ids=ids[:1], output_ids=[],
    )  # fmt: skip


PREFILL_TOKENS = 16384  # most prompt tokens one prefill step of decode_batch carries


def decode_batch(runner: Any, vocab: int, batch: int, ctx: int) -> Any:
    """The timed decode step: `batch` sequences (request slots 0..batch-1, KV slots 1 + i*(ctx+1) on, in order)
    each decoding position `ctx` of a random prompt that is first prefilled for real, so the KV is the model's
    own and attention outputs, hence MoE routing, have the scale the engine sees. A uniform(-1, 1) KV fill
    instead sent Qwen3-30B-A3B W4A16's 32 tokens to 81 distinct experts a layer, not the 111.8 of uniform
    routing the floor counts, and its replay ran 2.2 ms faster than the engine (session 31,
    probe_engine_routing.py)."""
    from ftransformers.runtime.step_io import StepBatch

    n = ctx + 1
    group = max(1, PREFILL_TOKENS // max(ctx, 1))
    for g0 in range(0, batch, group):
        runner.forward_step(StepBatch([seq_step(i, torch.randint(0, vocab, (ctx,)).tolist(), 0, 0,
                                                list(range(1 + i * n, 1 + i * n + ctx)))
                                       for i in range(g0, min(batch, g0 + group))]))  # fmt: skip
    return decode_step(vocab, batch, ctx)


def decode_step(vocab: int, batch: int, ctx: int) -> Any:
    """Random tokens of `batch` sequences at position `ctx`, sequence i's KV in slots 1 + i*(ctx+1) on (the slots
    `decode_batch` prefills; this writes none of the first `ctx`)."""
    from ftransformers.runtime.step_io import StepBatch

    n = ctx + 1
    toks = torch.randint(0, vocab, (batch,)).tolist()  # distinct inputs: routing spreads like real traffic
    return StepBatch([seq_step(i, [toks[i]], ctx, ctx, [(i + 1) * n]) for i in range(batch)])


def bench_decode(runner: Any, acc: dict[str, Any], bw: float, batch: int, ctx: int, iters: int,
                 engine: bool = True) -> dict[str, Any]:
    row: dict[str, Any] = {"batch": batch, "context": ctx}
    floor = decode_bytes(acc, batch, ctx) / bw * 1e3
    E, K = acc["experts"], acc["top_k"]
    row.update(floor_ms=floor, bytes_GB=decode_bytes(acc, batch, ctx) / 1e9,
               uniform_distinct_experts=E * (1 - (1 - K / E) ** batch) if E else None)  # fmt: skip
    if batch * (ctx + 1) > runner.kv_capacity:
        row["skipped"] = f"KV of {batch}x{ctx + 1} tokens > pool {runner.kv_capacity} tokens at this depth"
        return row
    timed = decode_batch(runner, acc["vocab"], batch, ctx)
    graphs = runner.graph_runner
    row["distinct_experts"] = distinct_experts(runner, timed)
    for mode in ("graph", "eager"):
        runner.graph_runner = graphs if mode == "graph" else None
        if mode == "graph" and graphs is None:
            continue
        t = median_ms(lambda: runner.forward_step(timed), iters if mode == "graph" else max(3, iters // 2))
        row[f"{mode}_ms"], row[f"{mode}_ratio"] = t, t / floor
    runner.graph_runner = graphs
    if graphs is not None and batch in graphs.graphs:
        g = graphs.graph_for(batch, ctx + 1)  # the graph the timed step replayed (its sequences hold ctx + 1)
        row["replay_ms"] = median_ms(g.replay, iters)  # the graph alone, buffers as the timed step left them
        row["tok_per_s"] = batch / row["graph_ms"] * 1e3
    # the engine's steady steps decode positions ctx .. ctx + ENGINE_NEW_TOKENS - 1: the middle one reads the KV
    # of ctx + ENGINE_NEW_TOKENS / 2 tokens a sequence (the `_own_ratio`s' floor; the `_ratio`s keep the row's)
    engine_floor = decode_bytes(acc, batch, ctx + ENGINE_NEW_TOKENS // 2) / bw * 1e3
    for overlap in (True, False) if engine else ():  # last: the engine runs refill the graph buffers
        steps = engine_steps_ms(runner, acc["vocab"], batch, ctx, overlap)
        if steps is not None:
            key, ms = "overlap" if overlap else "sync", statistics.median(steps)
            row[f"engine_{key}_ms"], row[f"engine_{key}_ratio"] = ms, ms / floor
            row["engine_floor_ms"], row[f"engine_{key}_own_ratio"] = engine_floor, ms / engine_floor
            row[f"engine_{key}_steps_ms"] = [round(t, 4) for t in steps]  # in step order
    return row


def engine_step_ms(
    runner: Any, vocab: int, batch: int, ctx: int, overlap: bool, new_tokens: int = ENGINE_NEW_TOKENS
) -> float | None:
    """Median wall time of steady decode steps through the Scheduler loop (see the module doc)."""
    steps = engine_steps_ms(runner, vocab, batch, ctx, overlap, new_tokens)
    return statistics.median(steps) if steps is not None else None


def engine_steps_ms(
    runner: Any, vocab: int, batch: int, ctx: int, overlap: bool, new_tokens: int = ENGINE_NEW_TOKENS
) -> list[float] | None:
    """Wall ms of each steady decode step through the Scheduler loop, in order (None: the batch does not fit, or
    fewer than 8 steady steps)."""
    from ftransformers.config.sampling_params import SamplingParams
    from ftransformers.scheduler.io_struct import GenerateReq
    from ftransformers.scheduler.scheduler import Scheduler

    if batch * (ctx + new_tokens + 1) > runner.kv_capacity or ctx + new_tokens > runner.max_context_len:
        return None
    prompts = torch.randint(0, vocab, (batch, ctx)).tolist()
    launched: list[bool] = []  # per launch: a decode of all `batch` sequences
    launch = runner.launch_step

    def recording_launch(step_batch: Any) -> Any:
        launched.append(len(step_batch.seqs) == batch and step_batch.num_tokens == batch)
        return launch(step_batch)

    runner.launch_step = recording_launch  # instance attribute: shadows the method for this run
    try:
        times: list[float] = []
        for _ in range(2):  # the first run warms up
            sched = Scheduler(runner, runner.server_args, [], overlap=overlap)  # fresh: no prefix-cache hits
            sp = SamplingParams(**{"temperature": 0.0, **ENGINE_SAMPLING}, max_tokens=new_tokens, ignore_eos=True)
            for i, p in enumerate(prompts):
                sched.add_request(GenerateReq(rid=f"e{i}", input_ids=p, sampling_params=sp))
            launched.clear()
            times.clear()
            sync()
            while sched.has_work():
                n = len(launched)
                t0 = time.perf_counter()
                sched.step()
                # steady: this call launched a full decode, and so did the one before (whose step it read)
                if len(launched) == n + 1 and n >= 1 and launched[n] and launched[n - 1]:
                    times.append(time.perf_counter() - t0)
    finally:
        del runner.launch_step
    return [t * 1e3 for t in times] if len(times) >= 8 else None


def eager_with_moe_hook(runner: Any, step: Any, pre: Any) -> None:
    """One eager `forward_step` of `step` (graphs off) with `pre(module, args)` as a forward pre-hook on every
    MoE layer (args: hidden [T, D], topk_weights, topk_ids [T, K])."""
    from ftransformers.layers.moe.experts import FusedMoE

    hooks = [m.register_forward_pre_hook(pre) for m in runner.model.modules() if isinstance(m, FusedMoE)]
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        runner.forward_step(step)
    finally:
        runner.graph_runner = graphs
        for h in hooks:
            h.remove()


def distinct_experts(runner: Any, step: Any) -> float | None:
    """Mean number of distinct experts the step's tokens route to per MoE layer (one eager step)."""
    counts: list[int] = []
    eager_with_moe_hook(runner, step, lambda _m, a: counts.append(int(a[2].unique().numel())))
    return sum(counts) / len(counts) if counts else None


def bench_prefill(runner: Any, acc: dict[str, Any], rate: float, bw: float, tokens: int) -> dict[str, Any]:
    from ftransformers.runtime.step_io import StepBatch

    flops = prefill_flops(acc, tokens)
    # An MoE prompt of T tokens also reads every expert it hits at least once: at 1K tokens that
    # byte floor can exceed the FLOP floor.
    byte_floor = decode_bytes(acc, tokens, 0) / bw * 1e3
    row: dict[str, Any] = {"tokens": tokens, "TFLOP": flops / 1e12, "floor_ms": flops / rate * 1e3,
                           "byte_floor_ms": byte_floor}  # fmt: skip
    if tokens > runner.kv_capacity or tokens > runner.max_context_len:
        row["skipped"] = f"pool {runner.kv_capacity} / context {runner.max_context_len} too small"
        return row
    ids = torch.randint(0, acc["vocab"], (tokens,)).tolist()
    step = StepBatch([seq_step(0, ids, 0, 0, list(range(1, tokens + 1)))])
    t = median_ms(lambda: runner.forward_step(step), 5, 2)  # 1K-token wall times varied 2x across runs at 3, 1
    row.update(ms=t, ratio=t / row["floor_ms"], matmul_share=row["floor_ms"] / t)
    # the step's summed kernel time and launches (profiled): a step well above its kernels' time waits on the host
    prof = profile_step(runner, step, f"prefill {tokens}")
    row.update(kernel_ms=prof["kernel_ms"], launches=prof["kernels_per_step"], top=prof["top"],
               kernel_matmul_share=row["floor_ms"] / prof["kernel_ms"] if prof["kernel_ms"] else 0.0)  # fmt: skip
    return row


def profile_step(runner: Any, step: Any, label: str) -> dict[str, Any]:
    """Kernel time of one eager step by kernel name (top 12) and the step's summed kernel time."""
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graph_runner = runner.graph_runner, None
    runner.forward_step(step)
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            runner.forward_step(step)
        sync()
    runner.graph_runner = graphs
    kern: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kern.setdefault(e.name[:90], [0.0, 0])
            k[0] += e.device_time / 2
            k[1] += 1 / 2
    total = sum(v[0] for v in kern.values())
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "label": label, "kernel_ms": total / 1e3, "kernels_per_step": sum(v[1] for v in kern.values()),
        "top": [{"kernel": k, "us": round(v[0], 1), "per_step": round(v[1], 1)} for k, v in top],
    }  # fmt: skip


def profile_cpu(runner: Any, step: Any, label: str) -> dict[str, Any]:
    """Host time of graph-mode decode steps by top-level torch op (self CPU time, per step)."""
    from torch.profiler import ProfilerActivity, profile

    runner.forward_step(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            runner.forward_step(step)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    wall = median_ms(lambda: runner.forward_step(step), 10)
    top = [{"op": e.key[:80], "us": round(e.self_cpu_time_total / 5, 1), "per_step": e.count / 5} for e in ops]
    return {"label": label, "step_ms": wall, "top_cpu": top}


def profiles(runner: Any, vocab: int, ctx: int, batches: list[int], prefill: list[int]) -> list[dict[str, Any]]:
    from ftransformers.runtime.step_io import StepBatch

    out, n = [], ctx + 1
    for b in [b for b in (1, 32) if b in batches and b * n <= runner.kv_capacity]:
        step = StepBatch([seq_step(i, [i + 3], ctx, ctx, [(i + 1) * n]) for i in range(b)])
        out.append(profile_step(runner, step, f"decode B={b} ctx={ctx} (eager)"))
    if 1 in batches and runner.graph_runner is not None:
        step = StepBatch([seq_step(0, [3], ctx, ctx, [n])])
        out.append(profile_cpu(runner, step, f"decode B=1 ctx={ctx} (graph): host side"))
    if prefill and max(prefill) <= min(runner.kv_capacity, runner.max_context_len):
        p = max(prefill)
        ids = torch.randint(0, vocab, (p,)).tolist()
        out.append(profile_step(runner, StepBatch([seq_step(0, ids, 0, 0, list(range(1, p + 1)))]), f"prefill {p}"))
    return out


# Hugging Face peer ----------------------------------------------------------------------------
def hf_peer(path: Path, vocab: int, ctx: int, prefill: int, iters: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    t0 = time.perf_counter()
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    out: dict[str, Any] = {"init_s": time.perf_counter() - t0, "context": ctx}
    with torch.inference_mode():
        pf = torch.randint(0, vocab, (1, prefill), device=DEV)
        out["prefill_tokens"] = prefill
        out["prefill_ms"] = median_ms(lambda: model(pf, use_cache=False, logits_to_keep=1), 2, 1)
        res = model(torch.randint(0, vocab, (1, ctx), device=DEV), use_cache=True, logits_to_keep=1)
        state = {"pkv": res.past_key_values, "tok": res.logits[:, -1:].argmax(-1)}

        def step() -> None:
            r = model(state["tok"], past_key_values=state["pkv"], use_cache=True)
            state["tok"] = r.logits[:, -1:].argmax(-1)

        out["decode_ms"] = median_ms(step, iters, 2)
    return out


def free() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def run_model(
    name: str, layers: int, contexts: list[int], args: argparse.Namespace, ceil: dict[str, float], hf: bool
) -> dict[str, Any]:
    """One model at one depth: decode at `contexts` x batches; prefill, profile and HF when it is the
    model's main entry (contexts == all of them)."""
    main_entry = contexts == args.contexts
    prefill = args.prefill if main_entry else []
    root = Path(tempfile.mkdtemp()) / f"{name}-{layers}"
    cfg = write_config(name, layers, root, args.dry_run)
    t0 = time.perf_counter()
    runner = make_runner(root, max(args.batches), args, max(RUN_CONTEXT, max(contexts) + 1024))  # + new tokens
    res: dict[str, Any] = {"model": name, "layers": layers, "full_depth": FULL_DEPTH[name]}
    res["init_s"] = time.perf_counter() - t0
    gr = runner.graph_runner
    res["graph_capture_s"] = getattr(gr, "capture_seconds", None)
    res["graph_batch_sizes"] = gr.batch_sizes if gr is not None else []
    acc = accounting(runner.model, cfg, layers)
    acc["vocab"] = cfg["vocab_size"]
    res.update(accounting=acc, kv_pool_tokens=runner.kv_capacity)
    pool = runner.kv_pool
    for buf in getattr(pool, "k_buffers", []) + getattr(pool, "v_buffers", []) + getattr(pool, "latent_buffers", []):
        buf.uniform_(-1.0, 1.0)  # finite data where no sequence writes (slot 0, read by graph padding rows)
    bw, rate = ceil["copy_GBps"] * 1e9, ceil["matmul_TFLOPs"] * 1e12
    res["decode"] = [bench_decode(runner, acc, bw, b, c, args.iters, engine=c == contexts[0])
                     for c in contexts for b in args.batches]  # fmt: skip
    for r in res["decode"]:
        print(f"  {name}:{layers} decode {r}", flush=True)
    res["prefill"] = [bench_prefill(runner, acc, rate, bw, p) for p in prefill]
    print(f"  {name}:{layers} prefill {res['prefill']}", flush=True)
    if not args.no_profile and prefill:
        res["profile"] = profiles(runner, cfg["vocab_size"], contexts[0], args.batches, prefill)
    del runner, gr, pool
    free()
    if hf and main_entry:
        try:
            res["hf"] = hf_peer(root, cfg["vocab_size"], contexts[0], min(args.prefill, default=1024), args.iters)
            d = next(r for r in res["decode"] if r["batch"] == 1 and r["context"] == contexts[0])
            res["hf"]["our_speedup_b1"] = res["hf"]["decode_ms"] / d.get("graph_ms", d.get("eager_ms", float("nan")))
            # the most any step of ours could show against this peer: its step over our floor (the peer's eager step
            # is bound by its host's Python and launches, so this bound moves with the host, not with our kernels)
            res["hf"]["floor_speedup_b1"] = res["hf"]["decode_ms"] / d["floor_ms"]
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            res["hf"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        free()
    if layers < FULL_DEPTH[name]:
        res["extrapolation"] = extrapolate(res, acc, FULL_DEPTH[name], FULL_DENSE.get(name), bw, rate)
    return res


def extrapolate(
    res: dict[str, Any], acc: dict[str, Any], depth: int, dense: int | None, bw: float, rate: float
) -> dict[str, Any]:
    """Full-depth floors (first layer repeated up to `dense` dense layers, last layer for the rest)
    and the time at the measured ratio to floor, for every measured point."""
    have_dense = acc["layers"] - acc["moe_layers"]
    extra_dense = max(0, (dense or have_dense) - have_dense) if acc["last_is_moe"] else depth - acc["layers"]
    extra_last = depth - acc["layers"] - extra_dense if acc["last_is_moe"] else 0
    first, last = acc["layer_non_expert"][0], acc["layer_non_expert"][-1]
    full = dict(acc, layers=depth, non_expert_params=acc["non_expert_params"] + extra_dense * first + extra_last * last,
                moe_layers=acc["moe_layers"] + extra_last,
                kv_bytes_per_token=acc["kv_bytes_per_token"] * depth / acc["layers"])  # fmt: skip
    dec, pre = [], []
    for r in res["decode"]:
        mode = "graph" if "graph_ms" in r else "eager"
        if f"{mode}_ms" in r:
            f = decode_bytes(full, r["batch"], r["context"]) / bw * 1e3
            dec.append({"batch": r["batch"], "context": r["context"], "floor_ms": f, "est_ms": f * r[f"{mode}_ratio"],
                        "per_layer_ms": r[f"{mode}_ms"] / acc["layers"], "mode": mode})  # fmt: skip
    for r in res["prefill"]:
        if "ms" in r:
            f = prefill_flops(full, r["tokens"]) / rate * 1e3
            pre.append({"tokens": r["tokens"], "floor_ms": f, "est_ms": f * r["ratio"],
                        "per_layer_ms": r["ms"] / acc["layers"]})  # fmt: skip
    return {"depth": depth, "assumption": "same ratio to floor as measured", "decode": dec, "prefill": pre}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument(
        "--models", default="qwen3-30b-a3b:48,qwen3-8b:36,deepseek-v3:3,qwen3-30b-a3b:12@4096,qwen3-8b:12@4096"
    )
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--prefill", default="1024,8192")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--mem-fraction", type=float, default=0.92)
    p.add_argument("--hf", default="first", help="'first': HF peer for each model's first entry; 'none'")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU smoke test: shapes shrunk 16x, torch_native")
    p.add_argument("--engine-sampling", default="",
                   help="sampling parameters of the engine rows, e.g. 'temperature=0.7,top_p=0.9' (default greedy)")
    p.add_argument("--sampling-backend", default="auto", choices=("auto", "torch_native", "triton"),
                   help="the engine's sampler for --engine-sampling rows (auto: triton on CUDA)")
    p.add_argument("--separate-decode-rope", action="store_true",
                   help="decode q/k norm + rope + K/V store as their own launch (the pre-fusion path), for A/B")  # fmt: skip
    args = p.parse_args()
    if args.separate_decode_rope:
        from ftransformers.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.fuse_decode_rope = False
    global DEV
    DEV = "cpu" if args.dry_run else "cuda"
    for item in filter(None, args.engine_sampling.split(",")):
        key, _, value = item.partition("=")
        ENGINE_SAMPLING[key.strip()] = int(value) if key.strip() == "top_k" else float(value)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",") if x.strip()]  # "" = no prefill rows
    if any(n <= 0 for n in args.batches + args.contexts + args.prefill):
        raise SystemExit("bench_decode: --batches, --contexts and --prefill take positive sizes")
    logging_setup()
    import transformers
    import triton

    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"
    out: dict[str, Any] = {
        "device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__, "args": dict(vars(args)), "models": [],
    }  # fmt: skip
    out["ceilings"] = ceilings()
    print("ceilings", out["ceilings"], flush=True)
    seen: set[str] = set()
    for spec in args.models.split(","):  # name[:layers][@ctx+ctx...]: extra entries at other depths
        spec, _, only = spec.partition("@")
        name, _, layers = spec.partition(":")
        contexts = [int(c) for c in only.split("+")] if only else args.contexts
        hf = args.hf == "first" and name not in seen
        seen.add(name)
        try:
            out["models"].append(run_model(name, int(layers or FULL_DEPTH[name]), contexts, args, out["ceilings"], hf))
        except Exception as e:  # noqa: BLE001 - keep the other models' results
            import traceback

            traceback.print_exc()
            out["models"].append({"model": name, "layers": layers, "error": f"{type(e).__name__}: {e}"[:800]})
            free()
        Path(args.out).write_text(json.dumps(out, indent=1))
    print_table(out)


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The arguments of the scripts that study one decode step shape: --out, --model (NAME:LAYERS), --batch, --context."""
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="qwen3-8b:36", help="NAME:LAYERS of bench_decode's shapes")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=512)


def step_model(args: argparse.Namespace, context_length: int) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The runner of add_step_args' --model (NAME[:LAYERS], dummy weights) for --batch rows, with its config and its
    byte accounting (`decode_bytes`'s input); `args.dry_run`, where present, shrinks it for the CPU."""
    name, depth = model_spec(args.model)
    root = Path(tempfile.mkdtemp()) / f"{name}-{depth}"
    cfg = write_config(name, depth, root, getattr(args, "dry_run", False))
    runner = make_runner(root, args.batch, args, context_length)
    return runner, cfg, accounting(runner.model, cfg, depth)


def logging_setup() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def print_table(out: dict[str, Any]) -> None:
    c = out["ceilings"]
    print(f"\n{out['device']}  copy {c['copy_GBps']:.0f} GB/s  bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    for m in out["models"]:
        if "error" in m:
            print(f"{m['model']}:{m['layers']} ERROR {m['error'][:200]}")
            continue
        print(f"{m['model']} ({m['layers']} layers; capture {m.get('graph_capture_s') or 0:.1f} s)")
        print("  decode  B    ctx  floor_ms  graph_ms  ratio  eager_ms  ratio  replay_ms  tok/s"
              "  engine_overlap  ratio  own_kv  engine_sync  ratio")
        for r in m["decode"]:
            if "skipped" in r:
                print(f"         {r['batch']:<4} {r['context']:<5} {r['floor_ms']:8.3f}  skipped: {r['skipped']}")
                continue
            print(f"         {r['batch']:<4} {r['context']:<5} {r['floor_ms']:8.3f} {r.get('graph_ms', 0):9.3f} "
                  f"{r.get('graph_ratio', 0):6.2f} {r['eager_ms']:9.3f} {r['eager_ratio']:6.2f} "
                  f"{r.get('replay_ms', 0):9.3f} {r.get('tok_per_s', 0):7.0f} "
                  f"{r.get('engine_overlap_ms', 0):14.3f} {r.get('engine_overlap_ratio', 0):6.2f} "
                  f"{r.get('engine_overlap_own_ratio', 0):7.2f} "
                  f"{r.get('engine_sync_ms', 0):12.3f} {r.get('engine_sync_ratio', 0):6.2f}")  # fmt: skip
        for r in m["prefill"]:
            if "skipped" not in r:
                print(f"  prefill {r['tokens']:<6} floor {r['floor_ms']:.1f} ms (bytes {r['byte_floor_ms']:.1f} ms)  "
                      f"{r['ms']:.1f} ms  {100 * r['matmul_share']:.0f}% of matmul rate; its kernels "
                      f"{r.get('kernel_ms', 0):.1f} ms in {r.get('launches', 0):.0f} launches "
                      f"({100 * r.get('kernel_matmul_share', 0):.0f}%)")  # fmt: skip
        if "hf" in m:
            print(f"  HF peer: {m['hf']}")


if __name__ == "__main__":
    main()
