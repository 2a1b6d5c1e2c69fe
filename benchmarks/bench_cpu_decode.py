"""Decode on the CPU (the demo model through the offline engine, torch_native attention): time a token at a short
and a long context, beside its floor, for the reference backend's one-query path and SDPA
(`torch_native.CPU_ONE_QUERY`) in the same process. The floor is the larger of the bytes the step reads (the weights
and the KV cache) over the copy bandwidth of a 512 MiB copy (past the caches; ceilings' 32 MiB CPU copy is not) and
the step's FLOPs (2 a weight, 4 a head and key) over the matmul rate (ceilings.matmul_rate: on the CPU the faster of
bf16 and float32), both measured in the same run.

A token's time is (the time of a request generating 2 + N tokens - the time of one generating 2) / N, on a prompt
whose prefix is already cached, median of `--repeats`.

    PYTHONPATH=$PWD python benchmarks/bench_cpu_decode.py --out benchmarks/results/cpu_decode_demo.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import Report, best_rate, matmul_rate

from ftransformers.attention import torch_native
from ftransformers.config.sampling_params import SamplingParams
from ftransformers.entrypoints.demo_model import ensure_demo_model
from ftransformers.entrypoints.llm import LLM
from ftransformers.models.llama import head_dim_of

VARIANTS = {"one_query": True, "sdpa": False}


def request_s(llm: LLM, ids: list[int], tokens: int) -> float:
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=sp)
    assert len(out.outputs[0].token_ids) == tokens
    return time.perf_counter() - t0


def dram_copy_gbs() -> float:
    """GB/s (read + written) of a 512 MiB bf16 copy: the weights' 269 MB stream from DRAM, not from the caches."""
    src = torch.rand(1 << 28, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return best_rate(2 * src.numel() * 2 / 1e6, lambda: dst.copy_(src), "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="32,2048", help="prompt lengths in tokens")
    ap.add_argument("--tokens", type=int, default=32, help="tokens timed a request (N)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        ap.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")

    report = Report("cpu", command=" ".join(sys.argv), threads=torch.get_num_threads(), rows=[])
    dram_gbs = report.out["dram_copy_gbs"] = dram_copy_gbs()
    tflops = report.out["matmul_tflops"] = matmul_rate("cpu")
    report.log(f"512 MiB copy {dram_gbs:.1f} GB/s, matmul (the faster of bf16, float32) {tflops * 1e3:.0f} GFLOP/s")
    llm = LLM(str(ensure_demo_model()), device="cpu")
    model, pool = llm.runner.model, llm.runner.kv_pool
    weight_bytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    kv_token_bytes = sum(k[0].numel() * k.element_size() * 2 for k in pool.k_buffers)  # K and V, every layer
    cfg = llm.model_config.hf_config
    head_flops = 4 * cfg.num_attention_heads * head_dim_of(cfg)
    weight_flops = 2 * weight_bytes / next(model.parameters()).element_size()
    report.log(f"demo model, {llm.runner.dtype}, {torch.get_num_threads()} threads: weights {weight_bytes / 1e6:.1f} MB,"
               f" KV {kv_token_bytes / 1e3:.1f} KB a token")
    gen = torch.Generator().manual_seed(0)
    for context in map(int, args.contexts.split(",")):
        ids = torch.randint(100, cfg.vocab_size, (context,), generator=gen).tolist()
        keys = context + args.tokens // 2  # the timed tokens' mean context
        bytes_ms = (weight_bytes + keys * kv_token_bytes) / (dram_gbs * 1e6)
        flops_ms = (weight_flops + keys * head_flops * cfg.num_hidden_layers) / (tflops * 1e9)
        floor_ms = max(bytes_ms, flops_ms)
        report.log(f"context {context}: floor {floor_ms:.2f} ms (bytes {bytes_ms:.2f}, FLOPs {flops_ms:.2f})")
        request_s(llm, ids, 2)  # caches the prompt's prefix
        for name in variants:
            torch_native.CPU_ONE_QUERY = VARIANTS[name]
            per_token = []
            for _ in range(args.repeats):
                per_token.append((request_s(llm, ids, 2 + args.tokens) - request_s(llm, ids, 2)) / args.tokens * 1e3)
            ms = statistics.median(per_token)
            report.out["rows"].append({"context": context, "variant": name, "token_ms": ms, "floor_ms": floor_ms,
                                       "bytes_floor_ms": bytes_ms, "flops_floor_ms": flops_ms, "all_ms": per_token})
            report.log(f"context {context:5d}  {name:9s}  {ms:7.2f} ms a token ({1e3 / ms:5.1f} tok/s), "
                       f"floor {floor_ms:.2f} ms: {ms / floor_ms:.2f}x")
    torch_native.CPU_ONE_QUERY = True
    report.save(args.out)


if __name__ == "__main__":
    main()
