"""Where MLA decode's microseconds go at few heads a GPU, phase by phase: stage 1 (kernels/gluon_mla_few_heads.py)
and stage 2 (triton_decode_attention.decode_combine) with their programs' timestamps (kernels/stamps.py).

Each case builds bench_attention.py's MLA case (DeepSeek-V3's 512 + 64 latent, contiguous slots, enough layers of
KV cache to exceed L2 several times, the backend's splits and head blocks) and runs its layers in a CUDA graph in
these orders (`--orders`):
  chain  stage 1 and stage 2 of each layer back to back (bench_attention.py's timing: a layer's stage 1 launches
         under PDL behind the previous layer's stage 2);
  alone  a torch copy before each layer's stage 1, as in a decode step, where the absorbing bmm and the latent
         store precede the attention and PDL cannot overlap them (the copy's own time is taken off);
  again  alone, with stage 2 run a second time on the partials the first has just read ("stage2 again");
  bmm    the absorbing W_UK product before each layer's stage 1 as models/deepseek_v3.per_head_product runs it
         (kernels/triton_mla_bmm.py where it takes the shape: a PDL kernel, which stage 1 can overlap; else
         torch.bmm), the decode step's order with the latent's store in the rope kernel (its own time taken off).
`--variants` applies ab_decode.py's `set=MOD.NAME=V` module toggles to every case. It times each order's replay
with and without the stamps (their cost), checks the output against the float32 reference, and prints, for a
middle layer, each stamp's min / median / max over the programs in microseconds from the layer's first stage-1
program's entry (%globaltimer), the median in-program durations (%clock64), and the step from the layer's last
stage-2 store to the next layer's first entry.

    PYTHONPATH=$PWD python benchmarks/diag_mla_phases.py --out $OUT/diag_mla_phases.json \
        --cases 16:1:32768,16:1:4096,8:1:32768,16:4:32768
    ncu --clock-control none --kernel-name regex:'few_heads|stage2' --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
        python benchmarks/diag_mla_phases.py --out /dev/null --cases 16:1:32768 --calls 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_decode import variant_setup
from bench_attention import L2_MULT, MLA_SCALE, MLA_SHAPE, contiguous_table, rel_err
from ceilings import copy_bandwidth

from ftransformers.attention.triton_backend import mla_block_h, mla_max_kv_splits, mla_num_kv_splits, peak_gbps_per_sm
from ftransformers.kernels import gluon_mla_few_heads as few
from ftransformers.kernels import triton_decode_attention as tda
from ftransformers.kernels import triton_mla_bmm
from ftransformers.kernels.launch import cdiv
from ftransformers.kernels.stamps import stamp_buffer
from ftransformers.kernels.triton_decode_attention import COMBINE_STAMP_SLOTS, decode_scratch
from ftransformers.kernels.triton_mla_attention import mla_attention_ref
from ftransformers.models.deepseek_v3 import per_head_product

DEV = torch.device("cuda")
DT = torch.bfloat16
S1 = ["entry", "after wait", "tile 0 issued", "q in smem", "tile 0 landed", "last product", "stored"]
S2 = ["entry", "after wait", "stored"]
NOPE = 128  # DeepSeek-V3's qk_nope_head_dim: the absorbing product's K


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def analyse(s1: torch.Tensor, s2: torch.Tensor, next_entry: float | None) -> dict:
    """s1 [P1, 7, 2], s2 [P2, 3, 2] int64 of one layer (ns, cycles); next_entry: the next layer's first entry, ns."""
    a, b = s1.cpu().tolist(), s2.cpu().tolist()
    t0 = min(p[0][0] for p in a)
    us = lambda ns: (ns - t0) / 1e3
    out: dict = {"stage1": {}, "stage2": {}, "programs": [len(a), len(b)]}
    for k, name in enumerate(S1):
        got = [us(p[k][0]) for p in a if p[k][0] >= 0]
        out["stage1"][name] = spread(got) if got else None
    for k, name in enumerate(S2):
        got = [us(p[k][0]) for p in b if p[k][0] >= 0]
        out["stage2"][name] = spread(got) if got else None
    # in-program durations from entry, by the SM's clock (cycles -> us at each program's own ns / cycle ratio)
    ratio = statistics.median((p[6][0] - p[0][0]) / max(1, p[6][1] - p[0][1]) for p in a if p[6][0] >= 0)
    out["ns_per_cycle"] = ratio
    out["stage1_from_entry_us"] = {
        name: statistics.median((p[k][1] - p[0][1]) * ratio / 1e3 for p in a if p[k][0] >= 0)
        for k, name in enumerate(S1)
    }
    out["span_us"] = us(max(p[2][0] for p in b)) if b else us(max(p[6][0] for p in a))
    if next_entry is not None:
        out["to_next_layer_us"] = (next_entry - t0) / 1e3 - out["span_us"]
    steps = sorted({p[k][0] for p in a for k in range(7) if p[k][0] >= 0})
    out["globaltimer_step_ns"] = min((y - x for x, y in itertools.pairwise(steps) if y > x), default=0)
    return out


def run_case(heads: int, batch: int, ctx: int, sms: int, copy_gbps: float, orders: list[str], calls: int = 0) -> dict:
    _, L, R = MLA_SHAPE
    r2t, rows, n_slots = contiguous_table([ctx] * batch)
    kv_bytes = batch * ctx * (L + R) * 2
    layers = max(3, min(32, math.ceil(L2_MULT / kv_bytes)))
    bufs = [torch.randn(n_slots, L + R, device=DEV, dtype=DT) for _ in range(layers)]
    q_nope = torch.randn(batch, heads, L, device=DEV, dtype=DT)
    q_rope = torch.randn(batch, heads, R, device=DEV, dtype=DT)
    seq_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int64)
    block_h = mla_block_h(heads, batch, "gluon_few")
    hn = few.heads_block(heads) if block_h is None or block_h >= heads else few.heads_block(block_h)
    gbps = peak_gbps_per_sm(torch.cuda.get_device_properties(DEV))
    splits = mla_num_kv_splits(batch, cdiv(heads, hn), sms, mla_max_kv_splits(heads, "gluon_few", gbps))
    mid_o, mid_lse = decode_scratch(batch, heads, L, splits, DEV)
    outs = [torch.empty_like(q_nope) for _ in range(layers)]
    p1 = cdiv(heads, hn) * splits * batch
    p2 = math.prod(tda.combine_launch(batch, heads, L, splits)[0])
    stamps = [
        (stamp_buffer(p1, few.STAMP_SLOTS, DEV), stamp_buffer(p2, COMBINE_STAMP_SLOTS, DEV)) for _ in range(layers)
    ]
    seconds = [stamp_buffer(p2, COMBINE_STAMP_SLOTS, DEV) for _ in range(layers)]  # the "again" order's 2nd stage 2
    before = torch.empty(batch * heads * L, device=DEV, dtype=DT)  # the "alone" order's predecessor: a torch copy
    before_src = torch.randn_like(before)  # of q_nope's size (the absorbing bmm's output)
    # the "bmm" order's predecessor: the model's own W_UK product, [B, H, 128] x [H, 128, L], into a [B, H, L] tensor
    # the attention does not read
    q_tokens = torch.randn(batch, heads, NOPE, device=DEV, dtype=DT)
    w_uk = torch.randn(heads, NOPE, L, device=DEV, dtype=DT) * NOPE**-0.5

    def absorb() -> None:
        per_head_product(q_tokens, w_uk)

    def step(order: str, stamped: bool) -> None:
        for i, buf in enumerate(bufs):
            if order == "bmm":
                absorb()
            elif order != "chain":
                before.copy_(before_src)
            few.mla_decode_few_heads(q_nope, q_rope, buf, outs[i], r2t, rows, seq_lens, mid_o, mid_lse, splits,
                                     MLA_SCALE, 0, block_h, stamps[i] if stamped else None)  # fmt: skip
            if order == "again":  # stage 2 once more, on the partials the first has just read
                tda.decode_combine(mid_o, mid_lse, outs[i], seq_lens, splits, few.BLOCK_N, few.BLOCK_N,
                                   stamps=seconds[i] if stamped else None)  # fmt: skip

    if calls:  # for Nsight Compute: the two stages, eagerly, over the layers in turn
        for i in range(calls):
            few.mla_decode_few_heads(q_nope, q_rope, bufs[i % layers], outs[0], r2t, rows, seq_lens, mid_o, mid_lse,
                                     splits, MLA_SCALE, 0, block_h)  # fmt: skip
        torch.cuda.synchronize()
        return {}
    ref = mla_attention_ref(q_nope[:1], q_rope[:1], bufs[0], r2t, rows[:1], [ctx - 1], [1], MLA_SCALE)
    res: dict = {
        "heads": heads,
        "batch": batch,
        "context": ctx,
        "splits": splits,
        "heads_a_program": hn,
        "layers": layers,
        "programs": [p1, p2],
        "bytes": kv_bytes,
        "floor_us": kv_bytes / copy_gbps / 1e3,
    }
    copies_ms = do_bench_cudagraph(lambda: [before.copy_(before_src) for _ in bufs], rep=60, return_mode="median")
    res["copy_alone_us"] = copies_ms * 1e3 / layers  # taken off the "alone" order's time below
    bmm_ms = do_bench_cudagraph(lambda: [absorb() for _ in bufs], rep=60, return_mode="median")
    res["bmm_alone_us"] = bmm_ms * 1e3 / layers  # taken off the "bmm" order's
    res["bmm_kernel"] = "mla_bmm" if triton_mla_bmm.takes(q_tokens.transpose(0, 1), w_uk) else "torch.bmm"
    for order in orders:
        for stamped in (False, True):
            for o in outs:
                o.fill_(float("nan"))
            step(order, stamped)
            torch.cuda.synchronize()
            err = rel_err(outs[0][:1], ref)
            res[f"{order}_err"] = err
            assert err < 1e-2 or few.DIAG, (order, stamped, err)  # DIAG: a timing experiment, wrong by design
            ms = do_bench_cudagraph(lambda o=order, s=stamped: step(o, s), rep=60, return_mode="median") / layers
            ms -= {"chain": 0.0, "bmm": res["bmm_alone_us"]}.get(order, res["copy_alone_us"]) / 1e3
            key = f"{order}{'_stamped' if stamped else ''}"
            res[f"{key}_us"] = ms * 1e3
            res[f"{key}_pct_copy"] = kv_bytes / ms / 1e6 / copy_gbps
        # the stamps of the last replay: a middle layer, with the next layer's first entry
        mid = layers // 2
        nxt = stamps[mid + 1][0][:, 0, 0].min().item()
        res[f"{order}_phases"] = analyse(stamps[mid][0], stamps[mid][1], nxt)
        if order == "again":
            res["again_phases"]["stage2 again"] = analyse(stamps[mid][0], seconds[mid], None)["stage2"]
        for s in stamps:
            s[0].fill_(-1)
            s[1].fill_(-1)
    return res


def show(r: dict) -> list[str]:
    head = (f"{r['variant']}: H={r['heads']} B={r['batch']} ctx={r['context']} splits={r['splits']} "
            f"programs {r['programs']} floor {r['floor_us']:.1f} us")  # fmt: skip
    lines = [head + f"; taken off: the alone order's copy alone {r['copy_alone_us']:.2f} us a layer, the bmm order's "
             f"{r['bmm_kernel']} alone {r['bmm_alone_us']:.2f}"]  # fmt: skip
    for order in [o for o in ("chain", "alone", "again", "bmm") if f"{o}_us" in r]:
        lines.append(f"  {order}: {r[f'{order}_us']:.2f} us ({r[f'{order}_pct_copy']:.0%} of copy), stamped "
                     f"{r[f'{order}_stamped_us']:.2f} us")  # fmt: skip
        ph = r[f"{order}_phases"]
        for stage, names in (("stage1", S1), ("stage2", S2), ("stage2 again", S2)):
            if stage not in ph:
                continue
            for name in names:
                v = ph[stage][name]
                if v:
                    lines.append(f"    {stage} {name:14s} {v['min']:7.2f} {v['median']:7.2f} {v['max']:7.2f} us")
        lines.append("    stage1 medians from entry (clock64): " + ", ".join(
            f"{k} {v:.2f}" for k, v in ph["stage1_from_entry_us"].items()))  # fmt: skip
        lines.append(f"    span {ph['span_us']:.2f} us, to the next layer's entry "
                     f"{ph.get('to_next_layer_us', 0):.2f} us, globaltimer step {ph['globaltimer_step_ns']} ns, "
                     f"{ph['ns_per_cycle']:.3f} ns a cycle")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="a JSON file")
    ap.add_argument("--cases", default="16:1:32768,16:1:4096,8:1:32768,16:4:32768", help="HEADS:BATCH:CONTEXT,...")
    ap.add_argument(
        "--variants",
        default="base",
        help="comma-separated: base, or ab_decode.py's set=MOD.NAME=V (joined by '+'), applied to each case",
    )
    ap.add_argument("--orders", default="chain,alone", help="chain, alone, again (alone + stage 2 run twice), bmm")
    ap.add_argument("--calls", type=int, default=0, help="only launch each case's two stages this many times (ncu)")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    copy_gbps = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs; copy {copy_gbps:.0f} GB/s", flush=True)
    results = []
    for case in args.cases.split(","):
        h, b, c = (int(x) for x in case.split(":"))
        for variant in args.variants.split(","):
            undo = variant_setup(variant)()
            try:
                r = run_case(h, b, c, props.multi_processor_count, copy_gbps, args.orders.split(","), args.calls)
            finally:
                undo()
            if not r:
                continue
            r["variant"] = variant
            results.append(r)
            print("\n".join(show(r)), flush=True)
    command = "PYTHONPATH=$PWD python benchmarks/diag_mla_phases.py " + " ".join(sys.argv[1:])
    doc = {
        "device": props.name,
        "date": time.strftime("%Y-%m-%d"),
        "copy_gbps": copy_gbps,
        "command": command,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
