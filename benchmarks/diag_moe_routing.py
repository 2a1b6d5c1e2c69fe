"""The int4 MoE calls of a real decode step (bench_decode's model and step, dummy weights of real shapes): how many
distinct experts each layer's tokens route to, and the mma path's gate-up in pair form beside the grouped form on
exactly those inputs, both checked against each other.

One eager step per batch records every `fused_moe_w4` call's arguments; each call is then replayed alone as a CUDA
graph of one launch (bench_moe_w4.graph_ms), pair-form gate-up, grouped gate-up (with its grouping launch) and the
whole MoE both ways. Floor: the call's distinct experts' gate-up bytes over the copy bandwidth measured here.

    PYTHONPATH=$PWD python benchmarks/diag_moe_routing.py --out $OUT/diag_moe_routing.json --model deepseek-v3:3 --batches 8,16,32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_decode as bd
import bench_moe_w4 as bm
import bench_quant_decode as bq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="deepseek-v3:3")
    p.add_argument("--format", default="w4a16")
    p.add_argument("--batches", default="8,16,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--spans", type=int, default=2)
    p.add_argument("--mem-fraction", type=float, default=0.92)
    args = p.parse_args()
    bd.DEV = "cuda"
    bd.logging_setup()
    from ftransformers.kernels import gluon_moe_w4_mma as mma
    from ftransformers.kernels import triton_fused_moe_w4 as w4

    copy_gbs, _ = bm.ceilings()
    name, depth = bd.model_spec(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    root = Path(tempfile.mkdtemp())
    cfg = bq.write_config(name, depth, root, args.format, False)
    runner = bd.make_runner(root, max(batches), args, max(bd.RUN_CONTEXT, args.context + 1024))
    calls: list[tuple[Any, ...]] = []
    original = w4.fused_moe_w4

    def record(hidden, w13, w2, weights, ids, config=None):  # fused_moe_w4's signature
        calls.append((hidden.clone(), w13, w2, weights.clone(), ids.clone()))
        return original(hidden, w13, w2, weights, ids, config)

    rows: list[dict[str, Any]] = []
    lines = [f"{torch.cuda.get_device_name()} copy {copy_gbs:.0f} GB/s {args.model} {args.format} ctx {args.context}"]
    print(lines[0], flush=True)
    for b in batches:
        step = bd.decode_batch(runner, cfg["vocab_size"], b, args.context)
        calls.clear()
        spread: list[tuple[int, float]] = []

        def routed(_m: Any, a: tuple[torch.Tensor, ...], spread: list = spread) -> None:  # every MoE layer, any format
            h = a[0].float()
            # how far the tokens' MoE inputs are apart: token-to-token spread over the spread of all values
            spread.append((int(a[2].unique().numel()), (h.std(dim=0).norm() / h.std().clamp_min(1e-30)).item()
                           / h.shape[1] ** 0.5))  # fmt: skip

        w4.fused_moe_w4 = record
        try:
            bd.eager_with_moe_hook(runner, step, routed)
        finally:
            w4.fused_moe_w4 = original
        for layer, (distinct, rel) in enumerate(spread):
            line = f"B={b:3d} MoE layer {layer}: {distinct} distinct experts, token spread / value spread {rel:.3f}"
            print(line, flush=True)
            lines.append(line)
            rows.append({"kind": "routing", "batch": b, "layer": layer, "distinct_experts": distinct,
                         "token_spread": rel})  # fmt: skip
        for layer, (hidden, w13, w2, weights, ids) in enumerate(calls):
            t, d = hidden.shape
            e = w13.qweight.shape[0]
            ids_c = ids.contiguous()
            mc = mma.default_config(t, d)
            distinct = int(ids.unique().numel())
            per_expert = torch.bincount(ids.reshape(-1), minlength=e)
            row: dict[str, Any] = {"kind": "int4 call", "batch": b, "layer": layer, "distinct_experts": distinct,
                                   "uniform_distinct": e * (1 - (1 - ids.shape[1] / e) ** t),
                                   "most_pairs_an_expert": int(per_expert.max()),
                                   "gate_up_floor_us": distinct * w13.nbytes() / e / copy_gbs / 1e3}  # fmt: skip
            if mma.supported(hidden, w13, w2, ids.shape[1]) and mma.chunk_k(d // mc.up_warps, w13.group_size, mc.up_kc,
                                                                            args.spans):  # fmt: skip
                pair = mma.gate_up(hidden, w13, ids_c, mc)
                grouped = mma.gate_up_grouped(hidden, w13, ids_c, mc, args.spans)
                row["act_rel_diff"] = bm.rel_err(grouped, pair)
                call = (hidden, w13, ids_c, mc)
                row["pair_gate_up_us"] = bm.graph_ms(lambda _i, c=call: mma.gate_up(*c), 1) * 1e3
                row["grouped_gate_up_us"] = bm.graph_ms(lambda _i, c=call: mma.gate_up_grouped(*c, args.spans), 1) * 1e3
            rows.append(row)
            line = (f"B={b:3d} layer {layer} distinct experts {distinct:4d} (uniform {row['uniform_distinct']:6.1f}), "
                    f"most pairs an expert {row['most_pairs_an_expert']:3d}, gate-up floor {row['gate_up_floor_us']:7.2f} us")  # fmt: skip
            if "pair_gate_up_us" in row:
                line += (f" | pair {row['pair_gate_up_us']:7.2f} us, grouped {row['grouped_gate_up_us']:7.2f} us, "
                         f"act diff {row['act_rel_diff']:.1e}")  # fmt: skip
            print(line, flush=True)
            lines.append(line)
    out = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "copy_gbs": copy_gbs, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
