"""DeepSeek-V3 prefill with MLA in the absorbed form (before) and the MHA form (after), one runner.

Step level: `ModelRunner.forward_step` of one fresh N-token sequence on the DeepSeek-V3 shape of
`bench_decode.py` (full width, 3 layers: 1 dense + 2 MoE, dummy bf16 weights, Triton attention and
MoE), with `DeepseekV3Attention.prefill_form` forced to each form and, for the MHA form, both
kernels of the Triton backend ("triton": the extend kernel over dense K/V; "sdpa": torch flash per
sequence). Floor = model FLOPs (MLA counted non-absorbed) / bf16 matmul rate, as in bench_decode.
Layer level: one layer's attention alone at 8K tokens (no prefix, and 4K new over a 4K prefix).

    PYTHONPATH=$PWD python benchmarks/bench_mla_prefill.py --out $OUT/mla_prefill_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd

from ftransformers.kernels.triton_mla_attention import mla_extend_fwd
from ftransformers.kernels.triton_mla_prefill import mla_prefill_fwd, mla_prefill_ref, mla_prefill_sdpa
from ftransformers.models.deepseek_v3 import DeepseekV3Attention
from ftransformers.runtime.step_io import StepBatch

H, L, R, N, V = 128, 512, 64, 128, 128
VARIANTS = [("absorbed", "triton"), ("mha", "triton"), ("mha", "sdpa")]


def layer_attention(pre: int, ext: int, rate: float) -> list[dict[str, Any]]:
    dev, dt = "cuda", torch.bfloat16
    P, T, scale = pre, ext, (N + R) ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dt)
    q_nope, q_rope, kv, k_rope = rn(T, H, N), rn(T, H, R), rn(P + T, H, N + V), rn(P + T, R)
    latent = rn(P + T, L + R)
    w = rn(H * (N + V), L) * L**-0.5
    t = lambda x: torch.tensor(x, device=dev)
    pre_t, ext_t, zero = t([P]), t([T]), t([0])
    r2t = torch.arange(P + T, device=dev)[None]
    out_v, out_l = torch.empty(T, H, V, device=dev, dtype=dt), torch.empty(T, H, L, device=dev, dtype=dt)
    ident = torch.arange(max(P, 1), device=dev)
    pairs = T * P + T * (T + 1) / 2
    q_lat = rn(T, H, L)
    runs = {
        "absorbed_triton": lambda: mla_extend_fwd(q_lat, q_rope, latent[P:], out_l, latent,
                                                  r2t, zero, pre_t, ext_t, zero, T, scale),
        "mha_triton": lambda: mla_prefill_fwd(q_nope, q_rope, kv, k_rope, out_v, ident, zero, pre_t, ext_t, zero, T, scale),
        "mha_sdpa": lambda: mla_prefill_sdpa(q_nope, q_rope, kv, k_rope, out_v, [P], [T], scale),
        "expand_kv_b_proj": lambda: latent[:, :L] @ w.t(),
    }  # fmt: skip
    ref = mla_prefill_ref(q_nope[:256], q_rope[:256], torch.cat([kv[:P], kv[P : P + 256]]), torch.cat([k_rope[:P], k_rope[P : P + 256]]), [P], [256], scale) if P == 0 else None  # fmt: skip
    per_pair = {
        "absorbed_triton": 2 * H * (2 * L + R),
        "mha_triton": 2 * H * (N + R + V),
        "mha_sdpa": 2 * H * (N + R + V),
    }
    res = []
    for name, fn in runs.items():
        ms = do_bench(fn, warmup=5, rep=50, return_mode="median")
        flops = pairs * per_pair[name] if name in per_pair else 2 * (P + T) * L * H * (N + V)
        row = {"kernel": name, "prefix": P, "tokens": T, "ms": ms, "TFLOPs": flops / ms / 1e9,
               "matmul_share": flops / ms / 1e9 / rate}  # fmt: skip
        if ref is not None and name.startswith("mha"):
            fn()
            row["rel_err_first256"] = ((out_v[:256].float() - ref).norm() / ref.norm()).item()
        res.append(row)
        print(row, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--mem-fraction", type=float, default=0.92)
    args = ap.parse_args()
    bd.DEV = "cuda"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "torch": torch.__version__, "command": " ".join(sys.argv)}  # fmt: skip
    out["ceilings"] = bd.ceilings()
    rate = out["ceilings"]["matmul_TFLOPs"] * 1e12
    print(out["ceilings"], flush=True)
    out["layer_attention"] = layer_attention(0, 8192, rate / 1e12) + layer_attention(4096, 4096, rate / 1e12)
    bd.free()
    root = Path(tempfile.mkdtemp()) / "deepseek-v3-3"
    cfg = bd.write_config("deepseek-v3", 3, root, False)
    runner = bd.make_runner(root, 1, args)
    acc = bd.accounting(runner.model, cfg, 3)
    acc["vocab"] = cfg["vocab_size"]
    out["prefill"] = []
    for form, kernel in VARIANTS:
        DeepseekV3Attention.prefill_form = form
        runner.attn_backend.mla_prefill_kernel = kernel
        for tokens in (int(x) for x in args.prefill.split(",")):
            row = bd.bench_prefill(runner, acc, rate, tokens)
            row.update(form=form, kernel=kernel)
            out["prefill"].append(row)
            print(row, flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    DeepseekV3Attention.prefill_form, runner.attn_backend.mla_prefill_kernel = "auto", "auto"
    ids = torch.randint(0, cfg["vocab_size"], (8192,)).tolist()
    step = StepBatch([bd.seq_step(0, ids, 0, 0, list(range(1, 8193)))])
    out["profile_8k_auto"] = bd.profile_step(runner, step, "prefill 8192, auto form")
    print(out["profile_8k_auto"], flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
