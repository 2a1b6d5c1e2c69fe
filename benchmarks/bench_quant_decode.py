"""Decode step time of whole models with quantized weights (W4A16, W8A8, FP8, FP4) beside bf16, in one
process, each beside its bandwidth floor.

Models are built from dummy weights of real shapes with a `quantization_config` in their config (the
loader fills valid quantized tensors), so every linear and every MoE expert runs the format's kernels.
Floor = bytes one decode step must read / device-to-device copy bandwidth measured in the same run:
the model's own tensor bytes (quantized weights with their scales and zeros; embeddings excluded),
with MoE experts counted for the expected distinct experts E*(1-(1-K/E)^B) per layer under uniform
routing, plus the KV of every sequence (prefilled for real: bench_decode.decode_batch). Rows: `graph_ms`
(one `forward_step` replaying the decode CUDA graph), `distinct_experts` (of that step, a layer's mean) and
`engine_ms` (steady decode through the Scheduler loop with overlap on, as a user sees it; bench_decode.py's
method).

    PYTHONPATH=$PWD python benchmarks/bench_quant_decode.py --out $OUT/quant_decode_h100.json \
        --models qwen3-30b-a3b:48 --formats bf16,w4a16,w8a8,fp8,mxfp4,nvfp4 --batches 1,8,32
    # DeepSeek-V3 full-width layers in W4A16: as many as fit; per-layer time from two depths
    PYTHONPATH=$PWD python benchmarks/bench_quant_decode.py --out $OUT/quant_dsv3_h100.json \
        --models deepseek-v3:4,deepseek-v3:12 --formats w4a16 --batches 1,8,32
    # prefill of 1K and 8K-token prompts per format (one eager step), beside the bf16 matmul floor
    PYTHONPATH=$PWD python benchmarks/bench_quant_decode.py --out $OUT/quant_prefill_h100.json \
        --models qwen3-30b-a3b:48 --formats bf16,w4a16 --batches 1,64,128 --prefill 1024,8192

`--prefill`: bench_decode's prefill rows (one prompt's eager step, its kernels' summed time and launches), whose
FLOP floor counts the model's logical weights (the bf16 model's parameters, built on the meta device), so every
format's row divides the same FLOPs by the bf16 matmul rate measured here.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
from ceilings import module_settings, set_module_values

IGNORE = ["lm_head"]  # kept in bf16, as the public quantized checkpoints do
FORMATS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    # AutoAWQ GEMM layout, the public DeepSeek-R1 AWQ checkpoints' format
    "w4a16": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": IGNORE},
    # compressed-tensors pack-quantized int4, symmetric, group 32: Kimi-K2-Thinking's experts' format
    "w4a16-g32-sym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": IGNORE,
                      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                "strategy": "group", "group_size": 32}}}},
    # the same at group 128: the kernels' layout of a symmetric GPTQ checkpoint (GPTQ's default; its dummy weights
    # here would draw random zero points, so asymmetric ones)
    "w4a16-g128-sym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": IGNORE,
                       "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                     "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                 "strategy": "group", "group_size": 128}}}},
    "w8a8": {"quant_method": "w8a8_int8", "ignore": IGNORE},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "ignored_layers": IGNORE},
    "mxfp4": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": IGNORE,
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                            "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                        "strategy": "group", "group_size": 32}}}},
    "nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": IGNORE,
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                            "weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                        "strategy": "tensor_group", "group_size": 16}}}},
}  # fmt: skip


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor a module holds directly: parameters, buffers, and tensors inside attributes
    (a quantized layer's kernel-layout `QuantizedWeight`)."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        elif hasattr(t, "__dataclass_fields__"):
            for f in t.__dataclass_fields__:
                add(getattr(t, f))

    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()) + list(vars(m).values()):
            add(t)
    return total


def accounting(model: torch.nn.Module, cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    from ftransformers.layers.moe.experts import FusedMoE

    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_bytes = sum(module_bytes(m) for m in moe)
    embed = model.model.embed_tokens  # type: ignore[union-attr]
    # a step reads one row of the embedding and of the rotary cos|sin caches (float32 [max positions, rotary dim];
    # before 50a2870 one a layer, 1.0 GB in Qwen3-30B-A3B, which the floors before 759e8d4 counted as read)
    caches = {id(t): t for m in model.modules() if isinstance(t := getattr(m, "cos_sin_cache", None), torch.Tensor)}
    rope_bytes = sum(t.numel() * t.element_size() for t in caches.values())
    non_expert = module_bytes(model) - expert_bytes - module_bytes(embed) - rope_bytes
    E = cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if "kv_lora_rank" in cfg:
        kv_tok = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    else:
        kv_tok = layers * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 2
    return {"non_expert_bytes": non_expert, "moe_layers": len(moe), "experts": E,
            "top_k": cfg.get("num_experts_per_tok", 0), "bytes_per_expert": expert_bytes / max(1, len(moe) * E),
            "kv_bytes_per_token": kv_tok, "hidden": cfg["hidden_size"], "vocab": cfg["vocab_size"],
            "model_GB": module_bytes(model) / 1e9}  # fmt: skip


def decode_bytes(acc: dict[str, Any], batch: int, context: int) -> float:
    E, K = acc["experts"], acc["top_k"]
    distinct = E * (1 - (1 - K / E) ** batch) if E else 0.0
    return (acc["non_expert_bytes"] + acc["moe_layers"] * distinct * acc["bytes_per_expert"]
            + 4 * batch * acc["hidden"] + batch * (context + 1) * acc["kv_bytes_per_token"])  # fmt: skip


def write_config(name: str, layers: int, root: Path, fmt: str, dry_run: bool) -> dict[str, Any]:
    """bench_decode's config of `name` with the `quantization_config` of `fmt` (none for bf16)."""
    cfg = bd.write_config(name, layers, root, dry_run)
    if FORMATS[fmt] is not None:
        cfg["quantization_config"] = FORMATS[fmt]
        (root / "config.json").write_text(json.dumps(cfg))
    return cfg


def bf16_accounting(root: Path, cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """bench_decode's accounting (parameter counts, for prefill FLOPs) of the model without its quantization: the
    model class built on the meta device from the config, so that a packed weight counts its logical elements."""
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.registry import get_model_class

    hf = ModelConfig.from_pretrained(root).hf_config
    with torch.device("meta"):
        model = get_model_class(hf.architectures)(hf)
    return bd.accounting(model, cfg, layers)


def run_format(name: str, layers: int, fmt: str, pdl: bool, args: argparse.Namespace, bw: float,
               rate: float = 0.0) -> dict[str, Any]:  # fmt: skip
    root = Path(tempfile.mkdtemp()) / f"{name}-{layers}-{fmt}"
    args.disable_pdl = not pdl
    cfg = write_config(name, layers, root, fmt, args.dry_run)
    t0 = time.perf_counter()
    runner = bd.make_runner(root, max(args.batches), args)
    res: dict[str, Any] = {"model": name, "layers": layers, "format": fmt, "pdl": pdl, "init_s": time.perf_counter() - t0}
    pool = runner.kv_pool
    for buf in getattr(pool, "k_buffers", []) + getattr(pool, "v_buffers", []) + getattr(pool, "latent_buffers", []):
        buf.uniform_(-1.0, 1.0)  # finite data where no sequence writes; timed steps prefill theirs (bd.decode_batch)
    acc = accounting(runner.model, cfg, layers)
    res["accounting"] = acc
    if args.prefill:
        flops_acc = bf16_accounting(root, cfg, layers)
        res["prefill"] = []
        for n in args.prefill:
            row = bd.bench_prefill(runner, {**flops_acc, "vocab": acc["vocab"]}, rate, bw, n)
            row["byte_floor_ms"] = decode_bytes(acc, n, 0) / bw * 1e3  # this format's bytes, not bf16's
            res["prefill"].append(row)
        print(f"  {name}:{layers} {fmt} prefill {res['prefill']}", flush=True)
    res["decode"] = []
    for batch in args.batches:
        res["decode"].append(decode_row(runner, acc, bw, batch, args))
        print(f"  {name}:{layers} {fmt} pdl={pdl} {res['decode'][-1]}", flush=True)
    if args.profile and pdl:
        res["profile"] = [profile(runner, acc, b, args.context) for b in args.batches if b <= 8]
    del runner, pool
    bd.free()
    return res


def profile(runner: Any, acc: dict[str, Any], batch: int, ctx: int) -> dict[str, Any]:
    """Eager kernel time of one decode step by kernel name (bench_decode.profile_step)."""
    from ftransformers.runtime.step_io import StepBatch

    n = ctx + 1
    step = StepBatch([bd.seq_step(i, [i + 3], ctx, ctx, [(i + 1) * n]) for i in range(batch)])
    prof = bd.profile_step(runner, step, f"decode B={batch} ctx={ctx} (eager)")
    print(f"  profile {prof['label']}: {prof['kernel_ms']:.3f} ms of kernels, {prof['kernels_per_step']:.0f} kernels")
    for k in prof["top"]:
        print(f"    {k['us']:9.1f} us  x{k['per_step']:<6} {k['kernel']}")
    return prof


def decode_row(runner: Any, acc: dict[str, Any], bw: float, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = args.context
    floor = decode_bytes(acc, batch, ctx) / bw * 1e3
    row: dict[str, Any] = {"batch": batch, "context": ctx, "floor_ms": floor, "bytes_GB": decode_bytes(acc, batch, ctx) / 1e9}
    if batch * (ctx + 1) > runner.kv_capacity:
        row["skipped"] = f"KV of {batch}x{ctx + 1} tokens > pool {runner.kv_capacity}"
        return row
    timed = bd.decode_batch(runner, acc["vocab"], batch, ctx)
    if acc.get("experts"):
        row["distinct_experts"] = bd.distinct_experts(runner, timed)
    t = bd.median_ms(lambda: runner.forward_step(timed), args.iters)
    row.update(graph_ms=t, graph_ratio=t / floor, tok_per_s=batch / t * 1e3)
    if not args.no_engine:
        ms = bd.engine_step_ms(runner, acc["vocab"], batch, ctx, overlap=True)
        if ms is not None:
            row.update(engine_ms=ms, engine_ratio=ms / floor)
    return row


def print_prefill(out: dict[str, Any]) -> None:
    rows = [(m, r) for m in out["models"] if "error" not in m for r in m.get("prefill", []) if "ms" in r]
    if not rows:
        return
    print(f"\nprefill, one prompt (bf16 matmul {out.get('matmul_TFLOPs', 0):.0f} TFLOP/s)")
    print(f"{'model':<18} {'format':<7} tokens  floor_ms  byte_ms      ms  of matmul  kernel_ms  vs bf16")
    base = {(m["model"], m["layers"], r["tokens"]): r["ms"] for m, r in rows if m["format"] == "bf16"}
    for m, r in rows:
        b = base.get((m["model"], m["layers"], r["tokens"]))
        speed = f"{b / r['ms']:5.2f}x" if b else "  -"
        print(f"{m['model'] + ':' + str(m['layers']):<18} {m['format']:<7} {r['tokens']:<6} {r['floor_ms']:9.3f} "
              f"{r['byte_floor_ms']:8.3f} {r['ms']:7.3f} {r['matmul_share']:9.0%} {r.get('kernel_ms', 0):10.3f}  "
              f"{speed}")  # fmt: skip


def print_table(out: dict[str, Any]) -> None:
    print(f"\n{out['device']}  copy {out['copy_GBps']:.0f} GB/s  context {out['args']['context']}")
    base: dict[tuple[str, int, int, bool], float] = {}
    print(f"{'model':<18} {'format':<7} pdl {'GB':>6}  B    floor_ms  graph_ms  ratio  engine_ms  ratio  vs bf16")
    for m in out["models"]:
        if "error" in m:
            print(f"{m['model']}:{m['layers']} {m['format']} ERROR {m['error'][:300]}")
            continue
        for r in m["decode"]:
            if "skipped" in r:
                continue
            key = (m["model"], m["layers"], r["batch"], m.get("pdl", True))
            t = r.get("engine_ms", r["graph_ms"])
            if m["format"] == "bf16":
                base[key] = t
            speed = f"{base[key] / t:5.2f}x" if key in base else "  -"
            print(f"{m['model'] + ':' + str(m['layers']):<18} {m['format']:<7} {'on ' if m.get('pdl', True) else 'off'} "
                  f"{m['accounting']['model_GB']:6.1f}  "
                  f"{r['batch']:<4} {r['floor_ms']:8.3f} {r['graph_ms']:9.3f} {r['graph_ratio']:6.2f} "
                  f"{r.get('engine_ms', 0):10.3f} {r.get('engine_ratio', 0):6.2f}  {speed}")  # fmt: skip
    print_prefill(out)
    # Per-layer time from two depths of the same model and format: (t_deep - t_shallow) / extra layers.
    rows = {(m["model"], m["format"], m.get("pdl", True), m["layers"]): m for m in out["models"] if "decode" in m}
    for (model, fmt, pdl, layers), m in sorted(rows.items()):
        deeper = sorted(ly for (mo, f, pd, ly) in rows if mo == model and f == fmt and pd == pdl and ly > layers)
        if not deeper:
            continue
        d = rows[(model, fmt, pdl, deeper[-1])]
        for r, rd in zip(m["decode"], d["decode"], strict=True):
            if "graph_ms" in r and "graph_ms" in rd:
                per = (rd["graph_ms"] - r["graph_ms"]) / (deeper[-1] - layers)
                print(f"  {model} {fmt} pdl={pdl} B={r['batch']}: {per:.3f} ms per layer "
                      f"(graph step at {deeper[-1]} minus at {layers} layers)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="qwen3-30b-a3b:48")
    p.add_argument("--formats", default="bf16,w4a16,w8a8,fp8,mxfp4,nvfp4")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--mem-fraction", type=float, default=0.92)
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--prefill", default="", help="prompt lengths for prefill rows, e.g. 1024,8192 ('' = none)")
    p.add_argument("--profile", action="store_true", help="eager kernel profile at batches <= 8 (PDL runs)")
    p.add_argument("--pdl", default="on", help="'on', 'off' or 'on,off': programmatic dependent launch per run")
    p.add_argument("--dry-run", action="store_true", help="CPU smoke test: shapes shrunk 16x, torch_native")
    p.add_argument("--set", default="", help="MODULE.NAME=V[+..]: module-level values of ftransformers.kernels.* for "
                   "the whole run (an A/B across runs), e.g. gluon_w4a16_ws.ENGINE_MIN_ROWS=0")  # fmt: skip
    args = p.parse_args()
    for item in filter(None, args.set.split("+")):
        mod_name, _, setting = item.partition(".")
        try:
            mod = importlib.import_module(f"ftransformers.kernels.{mod_name}")
            set_module_values(mod, module_settings(setting, mod))
        except (ImportError, ValueError) as e:
            raise SystemExit(f"bench_quant_decode: --set takes MODULE.NAME=V of ftransformers.kernels; {item!r}: {e}")
    bd.DEV = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.no_engine = True
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",") if x.strip()]
    if any(n <= 0 for n in args.batches + args.prefill):
        raise SystemExit("bench_quant_decode: --batches and --prefill take positive sizes")
    bd.logging_setup()
    device = torch.cuda.get_device_name() if bd.DEV == "cuda" else "cpu (dry run)"
    out: dict[str, Any] = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "torch": torch.__version__, "args": dict(vars(args)), "command": " ".join(sys.argv),
                           "models": []}  # fmt: skip
    ceil = bd.ceilings()
    out["copy_GBps"] = ceil["copy_GBps"]
    out["matmul_TFLOPs"] = ceil.get("matmul_TFLOPs", 0.0)
    for spec in args.models.split(","):
        name, _, layers = spec.partition(":")
        for fmt, pdl in [(f, p == "on") for f in args.formats.split(",") for p in args.pdl.split(",")]:
            try:
                depth = int(layers or bd.FULL_DEPTH[name])
                out["models"].append(run_format(name, depth, fmt, pdl, args, out["copy_GBps"] * 1e9,
                                                      out["matmul_TFLOPs"] * 1e12))  # fmt: skip
            except Exception as e:  # noqa: BLE001 - keep the other formats' results
                import traceback

                traceback.print_exc()
                out["models"].append({"model": name, "layers": layers, "format": fmt, "pdl": pdl,
                                      "error": f"{type(e).__name__}: {e}"[:800]})  # fmt: skip
                bd.free()
            Path(args.out).write_text(json.dumps(out, indent=1))
    print_table(out)


if __name__ == "__main__":
    main()
