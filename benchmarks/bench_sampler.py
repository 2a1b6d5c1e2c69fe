"""What a decode step's sampling costs on the GPU: `Sampler.sample` on [S, V] logits per sampling setting.

A step that needs the sampler (any row with temperature, top-k/p, min-p, penalties, bans or logprobs)
runs it between two decode graphs, so its kernels sit on the step's critical path. For each setting
and S this prints the wall time per call (host launch included, synchronised, median of ITERS) and
the GPU kernel time per call by kernel (torch.profiler), beside the floor of reading the bf16 logits
once (S * V * 2 bytes over the copy bandwidth) and the in-graph greedy kernel (`greedy_tokens`), which
is what a plain greedy step costs now.

    PYTHONPATH=. python benchmarks/bench_sampler.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import copy_bandwidth

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.kernels.triton_greedy import greedy_tokens
from ftransformers.runtime.sampler import Sampler
from ftransformers.runtime.step_io import SeqStep

ITERS = 30
SETTINGS = {
    "greedy (sampler)": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
    "greedy, logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "greedy, repetition 1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
}


def steps(S: int, params: dict) -> list[SeqStep]:
    sp = SamplingParams(max_tokens=64, **params)
    prompt = list(range(100, 612))  # 512 prompt tokens, 32 generated
    return [SeqStep(rid=f"r{i}", req_pool_idx=i, input_ids=[1], prefix_len=543, slots_start=543, slots=[1],
                    sample=True, sampling=sp, prompt_ids=prompt, output_ids=list(range(700, 732)))
            for i in range(S)]  # fmt: skip


def wall_us(fn) -> float:
    times = []
    for _ in range(ITERS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times[3:])


def kernels_us(fn, reps: int = 10) -> tuple[float, list[dict]]:
    """GPU time per call, total and by kernel name (top 8)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = by.setdefault(e.name[:70], [0.0, 0.0])
            k[0] += e.device_time / reps
            k[1] += 1 / reps
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:8]
    total = sum(v[0] for v in by.values())
    return total, [{"kernel": k, "us": round(v[0], 2), "per_call": round(v[1], 1)} for k, v in top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="sampler_h100.json")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,32")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth()
    sampler = Sampler("cuda", seed=0)
    rows: list[dict] = []
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s, V={args.vocab}")
    for S in (int(s) for s in args.rows.split(",")):
        logits = torch.randn(S, args.vocab, device="cuda", dtype=torch.bfloat16) * 4  # the graph's buffer
        floor = S * args.vocab * 2 / copy_gbs / 1e3
        gpu, _ = kernels_us(lambda: greedy_tokens(logits))  # noqa: B023 - called here
        print(f"S={S}: floor {floor:.2f} us; in-graph greedy_tokens {gpu:.2f} us of GPU")
        for name, params in SETTINGS.items():
            seqs = steps(S, params)
            fn = lambda: sampler.sample(logits, seqs).results()  # noqa: B023 - called in this iteration
            wall = wall_us(fn)
            gpu, top = kernels_us(fn)
            rows.append({"S": S, "setting": name, "wall_us": wall, "gpu_us": gpu, "floor_us": floor, "kernels": top})
            print(f"  {name:28s} wall {wall:8.1f} us  GPU {gpu:8.1f} us  ({len(top)} kernel kinds; top: "
                  + ", ".join(f"{k['kernel'][:40]} {k['us']:.1f}" for k in top[:3]) + ")")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs,
                                             "vocab": args.vocab, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
