"""Microbenchmark of the ends of a decode step (`kernels/triton_greedy.py`) against the torch ops they replace.

  greedy: `greedy_tokens` on [S, V] logits (bf16 as the graph now keeps them) against what the step ran
          before: torch.argmax of the float32 logits, and the `.float()` + copy into the graph's float32
          buffer that preceded it; floor = the logits bytes read over the copy bandwidth.
  inputs: `decode_inputs` (placeholders resolved, req_to_token written) against the torch ops of the
          eager path (resolve_future's where/index, the req_to_token index_put).
Every figure is a CUDA-graph replay of REPS calls (median µs per call), next to an empty kernel's node.
Each variant is checked against torch.argmax / the torch ops before it is timed.

    PYTHONPATH=. python benchmarks/bench_greedy.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router
from ceilings import copy_bandwidth

from ftransformers.kernels.triton_greedy import decode_inputs, greedy_split, greedy_tokens
from ftransformers.runtime.cuda_graph_runner import FIELDS
from ftransformers.runtime.sampler import resolve_future

REPS = 20


def per_call_us(fn) -> float:
    """µs per call of fn(), from a CUDA graph of REPS calls (bench_router's timing)."""
    return bench_router.per_call_us(lambda _i: fn(), REPS)


def bench_greedy(S: int, V: int, copy_gbs: float) -> dict:
    bf16 = torch.randn(S, V, device="cuda", dtype=torch.bfloat16) * 4
    f32_buf = torch.empty(S, V, device="cuda")
    tokens = torch.empty(S, dtype=torch.int64, device="cuda")
    future = torch.zeros(2 * S + 2, dtype=torch.int64, device="cuda")
    slots = torch.arange(S, device="cuda")
    assert torch.equal(greedy_tokens(bf16, out=tokens, future=future, slots=slots), bf16.argmax(-1))
    assert torch.equal(future[:S], bf16.argmax(-1))
    return {
        "S": S, "V": V, "split": greedy_split(S, V),
        "greedy_bf16_us": per_call_us(lambda: greedy_tokens(bf16, out=tokens, future=future, slots=slots)),
        "torch_argmax_f32_us": per_call_us(lambda: f32_buf.argmax(-1)),
        "torch_float_copy_us": per_call_us(lambda: f32_buf.copy_(bf16.float())),
        "floor_bf16_us": S * V * 2 / copy_gbs / 1e3, "floor_f32_us": S * V * 4 / copy_gbs / 1e3,
    }  # fmt: skip


def bench_inputs(S: int, V: int) -> dict:
    ctx, i = 4096, FIELDS.index
    r2t = torch.zeros(S + 1, ctx, dtype=torch.int64, device="cuda")
    inputs = torch.zeros(len(FIELDS), S, dtype=torch.int64, device="cuda")
    inputs[i("input_ids")] = -torch.arange(1, S + 1, device="cuda")  # every row a placeholder
    inputs[i("positions")] = torch.randint(0, ctx, (S,), device="cuda")
    inputs[i("out_cache_loc")] = torch.randint(1, 10**6, (S,), device="cuda")
    inputs[i("req_pool_indices")] = torch.arange(S, device="cuda")
    fut = torch.randint(0, V, (2 * S + 2,), device="cuda")
    ids = inputs[i("input_ids")].clone()

    def torch_inputs() -> None:
        resolve_future(ids, fut)
        r2t[inputs[i("req_pool_indices")], inputs[i("positions")]] = inputs[i("out_cache_loc")]

    work = inputs.clone()
    decode_inputs(work, FIELDS, fut, r2t)
    assert torch.equal(work[i("input_ids")], resolve_future(ids, fut))
    clone = per_call_us(lambda: inputs.clone())  # the timed kernel runs on a copy that keeps the placeholders
    return {
        "decode_inputs_us": per_call_us(lambda: decode_inputs(inputs.clone(), FIELDS, fut, r2t)) - clone,
        "clone_us": clone, "torch_inputs_us": per_call_us(torch_inputs),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="greedy_h100.json")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,8,32,128")
    args = parser.parse_args()
    dummy = torch.empty(1, device="cuda")
    copy_gbs = copy_bandwidth()
    empty = per_call_us(lambda: bench_router._empty_kernel[(1,)](dummy))
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s, empty kernel node {empty:.2f} µs")
    rows: list[dict] = []
    for S in (int(s) for s in args.rows.split(",")):
        row = {**bench_greedy(S, args.vocab, copy_gbs), **bench_inputs(S, args.vocab), "empty_kernel_us": empty}
        rows.append(row)
        print(f"S={S:4d} V={args.vocab} split {row['split']:3d}: greedy (bf16) {row['greedy_bf16_us']:7.2f} µs "
              f"(floor {row['floor_bf16_us']:6.2f}) | before: argmax (f32) {row['torch_argmax_f32_us']:7.2f} µs "
              f"(floor {row['floor_f32_us']:6.2f}) + float/copy {row['torch_float_copy_us']:7.2f} µs\n"
              f"          inputs: decode_inputs {row['decode_inputs_us']:6.2f} µs | torch ops {row['torch_inputs_us']:6.2f} µs")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs,
                                             "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
