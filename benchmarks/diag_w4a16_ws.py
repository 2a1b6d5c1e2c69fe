"""Where the warp-specialised int4 GEMM (kernels/gluon_w4a16_ws.py) spends its time: each config beside its halves
(`diag` 1: the consumer and x's copies with no decode; 2: the producer with no wgmma) and beside the engine's pick and
cuBLAS on the dequantized bf16 weight, in one process. Diagnostic configs compute wrong results and are not checked;
the others are checked against quant_linear_ref first. Each figure is printed beside the FLOP floor (2 M N K over the
bf16 matmul rate measured here).

    PYTHONPATH=$PWD python benchmarks/diag_w4a16_ws.py --out $OUT/diag_ws.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_w4 import random_qw
from bench_w4a16_prefill import DENSE, rel_err
from bench_w4a16_prefill import parse_ws_config as parse_config
from ceilings import Report, graph_ms, matmul_rate

from ftransformers.kernels import gluon_w4a16_ws as ws
from ftransformers.kernels.quant_formats import QuantizedWeight, dequantize, quant_linear_ref
from ftransformers.kernels.triton_w4a16 import w4a16_linear


def run_case(rep: Report, name: str, m: int, rate: float, configs: list[str]) -> dict:
    n, k = DENSE[name]
    one = random_qw("int4", 128, True, 1, n, k)
    qw = QuantizedWeight("int4", one.qweight[0], one.scales[0], n, k, 128, zeros=one.zeros[0])
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bf = dequantize(qw).to(torch.bfloat16)
    ref = quant_linear_ref(x, qw)
    flop_ms = 2 * m * n * k / rate * 1e3
    row: dict = {"shape": name, "rows": m, "flop_floor_ms": flop_ms, "ms": {}, "errors": {}}
    row["ms"]["cublas bf16"] = graph_ms(lambda i: F.linear(x, bf), 1)
    row["ms"]["engine"] = graph_ms(lambda i: w4a16_linear(x, qw), 1)
    for text in configs:
        cfg = parse_config(text)
        try:
            if not cfg.diag:
                row["errors"][text] = err = rel_err(w4a16_linear(x, qw, config=ws.as_dict(cfg)), ref)
                if err > 1e-2:
                    row["ms"][text] = None
                    continue
            row["ms"][text] = graph_ms(
                lambda i, c=cfg: ws.w4a16_ws(x, qw.qweight, qw.scales, qw.zeros, 128, None, c), 1
            )
        except Exception as e:  # noqa: BLE001 - a config that does not fit
            row["errors"][text] = f"{type(e).__name__}: {str(e)[:160]}"
    rep.log(f"{name} M={m}: FLOP floor {flop_ms * 1e3:.1f} us")
    for label, t in row["ms"].items():
        rep.log(f"    {label:<44} " + (f"{t * 1e3:9.1f} us  {flop_ms / t:5.0%} of matmul" if t else "failed")
                + (f"  ({row['errors'][label]})" if isinstance(row["errors"].get(label), str) else ""))  # fmt: skip
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="qwen3-8b gate_up:8192,qwen3-8b gate_up:1024,qwen3-8b o:8192")
    p.add_argument("--configs", default="128x256x64:3,128x256x64:3:diag=1,128x256x64:3:diag=2,"
                   "128x256x64:3:in_flight=0,256x128x64:3:producer_regs=128")  # fmt: skip
    args = p.parse_args()
    rep = Report("cuda", command=" ".join(sys.argv))
    rate = matmul_rate("cuda") * 1e12
    rep.log(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    rep.out["matmul_tflops"] = rate / 1e12
    rep.out["cases"] = []
    for case in args.cases.split(","):
        name, m = case.rsplit(":", 1)
        rep.out["cases"].append(run_case(rep, name, int(m), rate, args.configs.split(",")))
        rep.save(args.out)


if __name__ == "__main__":
    main()
