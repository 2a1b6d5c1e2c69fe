"""Upper bound of a fusion before building it: the decode step with some per-layer kernels left out.

Runs benchmarks/bench_quant_decode.py with the Llama-family decoder layer (Llama, Qwen3, Qwen3-MoE)
patched to skip its input and / or post-attention RMSNorm (the hidden state passes through unnormed,
the residual is not added). The numbers the model computes are then wrong, and only the step time is
meaningful: it says how much a fusion that removes those launches could save at most, measured in the
same process as the unpatched step. Nothing here is used by the engine.

    PYTHONPATH=$PWD python benchmarks/ablate_decode.py --skip input_norm,post_norm -- \
        --out $OUT/ablate.json --models qwen3-30b-a3b:48 --formats bf16,w4a16 --batches 1,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_decode as bq

from ftransformers.models import llama

SKIPPABLE = ("input_norm", "post_norm")


def patch(skip: set[str]) -> None:
    def forward(
        self: llama.LlamaDecoderLayer, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        elif "input_norm" not in skip:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if "post_norm" not in skip:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    llama.LlamaDecoderLayer.forward = forward


def main() -> None:
    p = argparse.ArgumentParser(usage="ablate_decode.py --skip PARTS -- BENCH_QUANT_DECODE_ARGS")
    p.add_argument("--skip", required=True, help=f"comma-separated: {', '.join(SKIPPABLE)}")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    skip = set(filter(None, args.skip.split(",")))
    if not skip <= set(SKIPPABLE):
        p.error(f"--skip takes {', '.join(SKIPPABLE)}; got {', '.join(sorted(skip - set(SKIPPABLE)))}")
    patch(skip)
    print(f"ablation: decoder layers skip {sorted(skip)} (numerics invalid; time only)", flush=True)
    sys.argv = [sys.argv[0], *argv[split + 1 :]]
    bq.main()


if __name__ == "__main__":
    main()
