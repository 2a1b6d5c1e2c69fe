"""The absorbed MLA's per-head products at decode rows (kernels/triton_mla_bmm.py) against torch.bmm (cuBLAS) in the
same process, on DeepSeek-V3's shapes (W_UK [H, 128, 512] on the query, W_UV [H, 128, 512] transposed on the latent
output), bf16, for tile variants of the kernel's module constants.

Achieved GB/s = weight bytes (+ a, c) / median time, beside the device-to-device copy bandwidth measured in the same
run. Each timed call runs the product over enough weight copies to exceed L2 several times, inside a CUDA graph, and
reports the median per product. Every variant is checked against the float32 reference before it is timed.

    PYTHONPATH=$PWD python benchmarks/bench_mla_bmm.py --out $OUT/mla_bmm.json --heads 128,16 --rows 1,4 \
        --variants 4096:4:3,16384:4:3
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceilings import copy_bandwidth

from ftransformers.kernels import triton_mla_bmm as mb

DEV = torch.device("cuda")
DT = torch.bfloat16
N_NOPE, L, V = 128, 512, 128  # DeepSeek-V3: qk_nope_head_dim, kv_lora_rank, v_head_dim
L2_BYTES = 50 << 20


def time_per_call(fn_for: Any, copies: int) -> float:
    """Median ms of one product, from a graph of `copies` products over distinct weights."""
    return do_bench_cudagraph(lambda: [fn_for(i) for i in range(copies)], rep=20) / copies


def set_variant(spec: str) -> None:
    tile, warps, stages = (int(v) for v in spec.split(":"))  # TILE_ELEMS:WARPS:STAGES
    mb.TILE_ELEMS, mb.WARPS, mb.STAGES = tile, warps, stages


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--heads", default="128,16")
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--variants", default="4096:4:3")
    args = p.parse_args()
    bw = copy_bandwidth()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "copy_GBps": bw, "rows": [],
    }  # fmt: skip
    print(f"{out['device']}  copy {bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for H in [int(h) for h in args.heads.split(",")]:
        wbytes = H * (N_NOPE + V) * L * 2  # a layer's kv_b_proj; each product reads half of it
        copies = max(2, -(-4 * L2_BYTES // (wbytes // 2)))
        kv_b = [torch.randn(H, N_NOPE + V, L, device=DEV, dtype=DT, generator=gen) / L**0.5 for _ in range(copies)]
        forms = {
            "w_uk": [w[:, :N_NOPE] for w in kv_b],  # [H, N, L]
            "w_uv^T": [w[:, N_NOPE:].transpose(1, 2) for w in kv_b],  # [H, L, V]
        }
        for M in [int(m) for m in args.rows.split(",")]:
            for form, ws in forms.items():
                K, N = ws[0].shape[1:]
                a = torch.randn(M, H, K, device=DEV, dtype=DT, generator=gen).transpose(0, 1)  # [H, M, K] view
                c = torch.empty(M, H, N, device=DEV, dtype=DT).transpose(0, 1)
                nbytes = H * K * N * 2 + 2 * H * M * (K + N)
                ref = mb.mla_bmm_ref(a, ws[0])
                t_bmm = time_per_call(lambda i, a=a, ws=ws: torch.bmm(a, ws[i]), copies)
                row: dict[str, Any] = {
                    "heads": H, "rows": M, "form": form, "K": K, "N": N,
                    "floor_us": nbytes / bw / 1e3, "bmm_us": t_bmm * 1e3, "variants": {},
                }  # fmt: skip
                line = (f"H={H:<4d} M={M} {form:7s} floor {row['floor_us']:6.2f} us  torch.bmm {t_bmm * 1e3:6.2f} us "
                        f"({100 * nbytes / t_bmm / 1e6 / bw:3.0f}%)")  # fmt: skip
                for spec in args.variants.split(","):
                    set_variant(spec)
                    got = mb.mla_bmm(a, ws[0], out=c)
                    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
                    if not err < 1e-2:
                        row["variants"][spec] = {"error": f"rel err {err:.3g}"}
                        line += f"  {spec} ERR {err:.3g}"
                        continue
                    t = time_per_call(lambda i, a=a, ws=ws, c=c: mb.mla_bmm(a, ws[i], out=c), copies)
                    row["variants"][spec] = {"us": t * 1e3, "GBps": nbytes / t / 1e6}
                    line += f"  {spec} {t * 1e3:6.2f} us ({100 * nbytes / t / 1e6 / bw:3.0f}%)"
                out["rows"].append(row)
                print(line, flush=True)
                Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
