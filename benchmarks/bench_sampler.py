"""What a decode step's sampling costs on the GPU: `Sampler.sample` on [S, V] logits per sampling setting,
for each `--backends` entry in one process (triton: the sort-free kernel; torch_native: the sorting path).

A step that needs the sampler (any row with temperature, top-k/p, min-p, penalties, bans or logprobs)
runs it between two decode graphs, so its kernels sit on the step's critical path. For each setting
and S this prints the wall time per call (host launch included, synchronised, median of ITERS) and
the GPU kernel time per call by kernel (torch.profiler), beside the floor of reading the bf16 logits
once (S * V * 2 bytes over the copy bandwidth) and the in-graph greedy kernel (`greedy_tokens`), which
is what a plain greedy step costs now. Before timing, every backend's tokens are checked against the
kept set of the sorting reference (`top_k_top_p_min_p_mask`). `--variants` times the kernel alone at
other tile sizes and warp counts (BLOCKxWARPS).

    PYTHONPATH=. python benchmarks/bench_sampler.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
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
from ftransformers.kernels.triton_sampling import sample_tokens
from ftransformers.runtime.sampler import Sampler, apply_penalties, top_k_top_p_min_p_mask
from ftransformers.runtime.step_io import SeqStep

ITERS = 30
SETTINGS = {
    "greedy (sampler)": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
    "Qwen3 defaults: T 0.6, top_k 20, top_p 0.95": {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
    "T 1.0, min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "T 0.7, top_p 0.9, top_k 50, repetition 1.1": {"temperature": 0.7, "top_p": 0.9, "top_k": 50,
                                                   "repetition_penalty": 1.1},
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


def check_kept(sampler: Sampler, logits: torch.Tensor, seqs: list[SeqStep]) -> int:
    """Tokens of one call outside the sorting reference's kept set (greedy rows: not the argmax)."""
    sp = seqs[0].sampling
    toks = torch.tensor([r.token_id for r in sampler(logits, seqs)], device=logits.device)
    x = apply_penalties(logits.float(), seqs)
    if sp.greedy:
        return int((toks != x.argmax(-1)).sum())
    S, V = x.shape

    def full(v: float) -> torch.Tensor:
        return torch.full((S,), v, device=x.device)

    keep = top_k_top_p_min_p_mask(
        x / sp.temperature,
        full(sp.top_k).long() if 0 < sp.top_k < V else None,
        full(sp.top_p).float() if sp.top_p < 1 else None,
        full(sp.min_p).float() if sp.min_p > 0 else None,
    )
    return int((~keep[torch.arange(S, device=x.device), toks]).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="sampler_h100.json")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--backends", default="torch_native,triton")
    parser.add_argument("--variants", default="512x4,1024x4,1024x8,2048x8,4096x16,2048x8x1",
                        help="BLOCKxWARPS[xPROGRAMS a row] of the triton kernel timed alone (top_p 0.9 and "
                             "Qwen3 defaults; programs a row default to sample_split)")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth()
    rows: list[dict] = []
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s, V={args.vocab}")
    for S in (int(s) for s in args.rows.split(",")):
        logits = torch.randn(S, args.vocab, device="cuda", dtype=torch.bfloat16) * 4  # the graph's buffer
        floor = S * args.vocab * 2 / copy_gbs / 1e3
        gpu, _ = kernels_us(lambda: greedy_tokens(logits))  # noqa: B023 - called here
        print(f"S={S}: floor {floor:.2f} us; in-graph greedy_tokens {gpu:.2f} us of GPU")
        for name, params in SETTINGS.items():
            seqs = steps(S, params)
            for backend in args.backends.split(","):
                sampler = Sampler("cuda", seed=0, backend=backend)
                bad = sum(check_kept(sampler, logits, seqs) for _ in range(4))
                fn = lambda: sampler.sample(logits, seqs).results()  # noqa: B023 - called in this iteration
                wall = wall_us(fn)
                gpu, top = kernels_us(fn)
                rows.append({"S": S, "setting": name, "backend": backend, "wall_us": wall, "gpu_us": gpu,
                             "floor_us": floor, "outside_kept_set": bad, "kernels": top})  # fmt: skip
                print(f"  {name:44s} {backend:12s} wall {wall:8.1f} us  GPU {gpu:8.1f} us  outside kept {bad}  "
                      + ", ".join(f"{k['kernel'][:30]} {k['us']:.1f}" for k in top[:3]))  # fmt: skip
        dev = logits.device
        for setting, (t, k, p) in {"top_p 0.9": (0.7, 0, 0.9), "Qwen3 defaults": (0.6, 20, 0.95)}.items():
            vec = [torch.full((S,), v, device=dev) for v in (t, p, 0.0)]
            top_k = torch.full((S,), k, dtype=torch.int32, device=dev)
            seeds = torch.arange(S, dtype=torch.int64, device=dev) + 1
            for variant in args.variants.split(","):
                block, warps, *split = (int(v) for v in variant.split("x"))
                gpu, _ = kernels_us(functools.partial(sample_tokens, logits, vec[0], top_k, vec[1], vec[2], seeds,
                                                      block=block, num_warps=warps,
                                                      split=split[0] if split else None))  # fmt: skip
                rows.append({"S": S, "setting": f"kernel alone, {setting}", "variant": variant, "gpu_us": gpu,
                             "floor_us": floor})  # fmt: skip
                print(f"  kernel alone, {setting:16s} {variant:10s} (BLOCKxWARPS[xPROGRAMS]): GPU {gpu:8.1f} us")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs,
                                             "vocab": args.vocab, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
