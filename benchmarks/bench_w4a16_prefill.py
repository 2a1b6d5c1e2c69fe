"""int4 weights at many rows: the dense product (kernels/triton_w4a16.py) from 64 rows to prefill and the MoE's
aligned path (kernels/triton_fused_moe_w4.py) at prefill token counts, beside bf16 on the same shapes in the same
process (cuBLAS `F.linear` on the dequantized weight; the bf16 fused MoE), each beside its FLOP floor (2 M N K over
the bf16 matmul rate measured here) and its byte floor (the int4 weight, x and y over the copy rate measured here).

Why: a W4A16 server answered fewer tokens a second than bf16 at 64-160 requests, and its prompts prefilled at
0.56-0.71x bf16 (docs/performance.md, session 75). Variants: the engine's own choice (`engine`), the dequantizing
GEMM's tiles with K split to fill the SMs, and the codes kernel's decoded form in row tiles (`dense_configs`); for the
MoE (Qwen3-30B-A3B's experts, `--experts` adds DeepSeek-V3's), the engine without the codes kernel's decoded form
(session 75's), raw codes at 128-row blocks, and the decoded form on three tilings. Every variant is checked against
`quant_linear_ref` / `quant_moe_ref` before it is timed. `--moe-sweep` times the MoE's two decoded GEMMs apart over
tiles instead (`moe_sweep`).

    PYTHONPATH=$PWD python benchmarks/bench_w4a16_prefill.py --out $OUT/w4a16_prefill_h200.json
    PYTHONPATH=$PWD python benchmarks/bench_w4a16_prefill.py --out $OUT/moe_sweep.json --rows "" --shapes "" --experts qwen3-30b-a3b,deepseek-v3 --moe-sweep
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_w4 import random_qw, routings
from ceilings import Report, graph_ms, matmul_rate, module_values

from ftransformers.kernels import gluon_w4a16_ws as ws
from ftransformers.kernels import triton_fused_moe as tfm
from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.launch import cdiv
from ftransformers.kernels.quant_formats import QuantizedWeight, dequantize, quant_linear_ref, quant_moe_ref
from ftransformers.kernels.triton_fused_moe_codes import moe_gemm_codes
from ftransformers.kernels.triton_w4a16 import w4a16_linear
from ftransformers.kernels.triton_w4a16_codes import rows_split

DENSE = {  # (N, K) of the int4 linears
    "qwen3-8b qkv": (6144, 4096), "qwen3-8b o": (4096, 4096), "qwen3-8b gate_up": (24576, 4096),
    "qwen3-8b down": (4096, 12288), "qwen3-30b-a3b qkv": (5120, 2048), "qwen3-30b-a3b o": (2048, 4096),
}  # fmt: skip
EXPERTS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}  # D, I, E, top-k
WS_CONFIGS = "256x128x64:4,128x128x64:4,256x128x64:4:x_tma=0"  # --ws's default
L2_BYTES = 256 << 20  # weight copies a timed graph cycles through, so that no call finds its weight in L2


def parse_ws_config(text: str) -> ws.WsConfig:
    """'BMxBNxBK:stages[:key=value..]' (WsConfig's fields), e.g. 128x256x64:3:producer_regs=152:diag=1."""
    tile, stages, *extra = text.split(":")
    bm, bn, bk = (int(v) for v in tile.split("x"))
    cfg = ws.WsConfig(bm, bn, bk, int(stages))
    return replace(cfg, **{k: int(v) for k, v in (e.split("=") for e in extra)})


def dense_configs(m: int, n: int, k: int, sms: int, ws_configs: list[ws.WsConfig]) -> dict[str, dict[str, int]]:
    """Candidate tiles of the dequantizing GEMM, (BM, BN, BK, warps, stages), K split to two programs an SM where the
    tiles are fewer (to 256 rows); then the codes kernel's decoded form (kernels/triton_w4a16_codes.py, `DEQUANT`:
    the weight tile decoded in PTX as the wgmma's A operand) over row tiles of 64-256, which the engine runs past 64
    rows since session 75 (`rows_config`). (Session 75's third device call also ran each dequantizing tile with the
    weight as the dot's first operand, an A/B taken out again: 572fd70's `--w-as-a`.)"""
    if m <= 256:
        tiles = [(64, 128, 128, 4, 3), (128, 64, 128, 4, 3), (128, 128, 64, 8, 4), (64, 64, 128, 4, 4)]
    else:
        tiles = [(256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3)]
    out = {}
    for bm, bn, bk, warps, stages in tiles:
        split = rows_split(cdiv(m, bm), cdiv(n, bn), cdiv(k, bk), 2 * sms) if m <= 256 else 1
        out[f"{bm}x{bn}x{bk} w{warps} s{stages} split{split}"] = {
            "GEMV": 0, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "GROUP_M": 8,
            "num_warps": warps, "num_stages": stages,
        }  # fmt: skip
    for bm in (64, 128, 256):
        for bn, warps, stages in ((64, 4, 3), (128, 8, 3), (128, 4, 3), (128, 8, 4)):
            if bm > max(64, 2 * m) or (bm == 256 and bn == 128 and warps == 4):
                continue
            split = rows_split(cdiv(m, bm), cdiv(n, bn), cdiv(k, 128), 2 * sms)
            cfg = {"CODES": 1, "DEQUANT": 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": split,
                   "GROUP_M": 8, "num_warps": warps, "num_stages": stages}  # fmt: skip
            out[f"decoded {bm}x{bn}x128 w{warps} s{stages} split{split}"] = cfg
    if m > 64:  # the warp-specialised kernel (kernels/gluon_w4a16_ws.py): the decode beside the wgmmas
        for cfg in ws_configs:
            label = f"ws {cfg.bm}x{cfg.bn}x{cfg.bk} s{cfg.stages}{'' if cfg.x_tma else ' cp.async'}"
            label += f" split{cfg.split}" if cfg.split > 1 else ""
            label += f" words{cfg.words_ahead}" if cfg.words_ahead else ""
            label += f" p{cfg.producer_warps}" if cfg.producer_warps != ws.PRODUCER_WARPS else ""
            out[label] = ws.as_dict(cfg)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def dense(
    rep: Report, rows: list[int], rate: float, shapes: list[str], ws_configs: list[ws.WsConfig]
) -> list[dict[str, Any]]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name in shapes:
        n, k = DENSE[name]
        one = random_qw("int4", 128, True, 1, n, k)
        copies = max(1, min(8, L2_BYTES // one.nbytes()))
        qws = [QuantizedWeight("int4", q.qweight[0], q.scales[0], n, k, 128, zeros=q.zeros[0])
               for q in [one] + [random_qw("int4", 128, True, 1, n, k) for _ in range(copies - 1)]]  # fmt: skip
        bf = [dequantize(q).to(torch.bfloat16) for q in qws]
        for m in rows:
            copies = 1 if m >= 1024 else len(qws)  # there a call is compute-bound and its x and y fill L2 anyway
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            ref = quant_linear_ref(xs[0], qws[0])
            flop_ms = 2 * m * n * k / rate * 1e3
            byte_ms = (qws[0].nbytes() + 2 * m * (n + k)) / rep.copy_gbs / 1e6
            row: dict[str, Any] = {"shape": name, "N": n, "K": k, "rows": m, "flop_floor_ms": flop_ms,
                                   "byte_floor_ms": byte_ms, "ms": {}, "errors": {}}  # fmt: skip

            def cublas(
                i: int, xs: list[torch.Tensor] = xs, ws: list[torch.Tensor] = bf, c: int = copies
            ) -> torch.Tensor:
                return F.linear(xs[i % c], ws[i % c])

            def ours(i: int, cfg: dict[str, int] | None, xs: list[torch.Tensor] = xs,
                     qs: list[QuantizedWeight] = qws, c: int = copies) -> torch.Tensor:  # fmt: skip
                return w4a16_linear(xs[i % c], qs[i % c], config=cfg)

            row["ms"]["cublas bf16"] = graph_ms(cublas, copies)
            variants: dict[str, dict[str, int] | None] = {"engine": None, **dense_configs(m, n, k, sms, ws_configs)}
            for label, cfg in variants.items():
                try:
                    err = rel_err(w4a16_linear(xs[0], qws[0], config=cfg), ref)
                    row["errors"][label] = err
                    if err > 1e-2:
                        row["ms"][label] = None
                        continue
                    row["ms"][label] = graph_ms(lambda i, c=cfg: ours(i, c), copies)
                except Exception as e:  # noqa: BLE001 - a config a shape cannot take
                    row["errors"][label] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(row)
            timed = {lb: t for lb, t in row["ms"].items() if t}
            best = min((lb for lb in timed if lb not in ("engine", "cublas bf16")), key=timed.get, default=None)
            rep.log(f"{name:<20} M={m:<5} floors flop {flop_ms * 1e3:8.1f} us, bytes {byte_ms * 1e3:7.1f} us | "
                    f"cuBLAS bf16 {timed['cublas bf16'] * 1e3:8.1f} | engine {_us(timed.get('engine'))} | "
                    f"best {best}: {_us(timed.get(best))}")  # fmt: skip
            for lb, t in sorted(timed.items(), key=lambda kv: kv[1]):
                err = row["errors"].get(lb, 0)
                rep.log(f"    {t * 1e3:9.1f} us  {flop_ms / t:5.0%} of matmul  {lb}  (err {err:.1e})")
    return results


def _us(t: float | None) -> str:
    return f"{t * 1e3:8.1f}" if t else "    -   "


def int4_experts(name: str) -> tuple[int, int, int, int, QuantizedWeight, QuantizedWeight]:
    """EXPERTS[name]'s (D, I, E, top-k) and random asymmetric int4 g128 w13 [E, 2I, D] and w2 [E, D, I]."""
    d, inter, e, top_k = EXPERTS[name]
    return d, inter, e, top_k, random_qw("int4", 128, True, e, 2 * inter, d), random_qw("int4", 128, True, e, d, inter)


def moe(rep: Report, tokens: list[int], rate: float, experts: list[str]) -> list[dict[str, Any]]:
    results = []
    for name in experts:
        d, inter, e, top_k, w13, w2 = int4_experts(name)
        # one expert at a time: DeepSeek-V3's whole float32 w13 alone is 30 GB
        b13, b2 = (torch.stack([dequantize(w.expert(i)).to(torch.bfloat16) for i in range(e)]) for w in (w13, w2))
        for t in tokens:
            h = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
            tw, ids = routings(t, e, top_k, 1)[0]
            ref = quant_moe_ref(h, w13, w2, tw, ids)
            flop_ms = 2 * t * top_k * 3 * d * inter / rate * 1e3
            row: dict[str, Any] = {"experts": name, "tokens": t, "flop_floor_ms": flop_ms, "ms": {}, "errors": {}}

            def w4_moe(settings: list[tuple[str, int]], cfg: Any, a: tuple = (h, w13, w2, tw, ids)) -> torch.Tensor:
                with module_values(w4, settings):  # launch-time knobs of triton_fused_moe_w4
                    return w4.fused_moe_w4(*a, config=cfg)

            bm = tfm.default_config(t, e, top_k).block_m
            off = [("DECODED_FROM_BLOCK_M", 1 << 30)]  # no decoded form
            variants = {
                "engine": ([], None),
                # session 75's engine: raw codes to 64-row blocks, the dequantizing kernel on 128-row ones
                "no decoded form": (off, None),
                "raw codes to block 128": (off + [("CODES_MAX_BLOCK_M", 128)], None),
                # the decoded form (DECODED_FROM_BLOCK_M) on three tilings
                "decoded up 64 / down 128 cols, 4 warps": (
                    [("DECODED_FROM_BLOCK_M", 1)], tfm.MoEConfig(bm, 64, 128, 128, 128, 8, 4, 3)),
                "decoded up 128 / down 128 cols, 8 warps": (
                    [("DECODED_FROM_BLOCK_M", 1)], tfm.MoEConfig(bm, 128, 128, 128, 128, 8, 8, 3)),
                "decoded up 128 / down 256 cols, 8 warps": (
                    [("DECODED_FROM_BLOCK_M", 1)], tfm.MoEConfig(bm, 128, 128, 256, 128, 8, 8, 3)),
            }  # fmt: skip
            runs = {"bf16 fused_moe": partial(tfm.fused_moe, h, b13, b2, tw, ids)}
            runs |= {label: partial(w4_moe, settings, cfg) for label, (settings, cfg) in variants.items()}
            for label, fn in runs.items():
                err = rel_err(fn(), ref)
                row["errors"][label] = err
                # CUDA events, not a graph: the aligned path's sort need not be capturable, and at these sizes a
                # launch is a small part of a call
                row["ms"][label] = do_bench(fn, warmup=25, rep=100, return_mode="median") if err < 2e-2 else None
            results.append(row)
            parts = "  ".join(f"{lb} {_us(ms)} us ({flop_ms / ms:.0%})" for lb, ms in row["ms"].items() if ms)
            rep.log(f"MoE {name} T={t:<5} flop floor {flop_ms * 1e3:8.1f} us | {parts}")
    return results


# (BLOCK_N, warps, stages) of the decoded form's gate-up (two accumulators: SiLU(gate) * up) and down GEMMs
UP_TILES = ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4))
DOWN_TILES = ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3))


def _tile_call(kernel: Any, group_m: int, tile: tuple[int, int, int]) -> None:
    block_n, warps, stages = tile
    kernel(block_n, group_m, warps, stages)


def _tile_label(tile: tuple[int, int, int]) -> str:
    return "n{} w{} s{}".format(*tile)


def moe_sweep(rep: Report, tokens: list[int], rate: float, experts: list[str]) -> list[dict[str, Any]]:
    """The int4 MoE's two GEMMs apart on the codes kernel's decoded form, at the engine's row blocks, over UP_TILES
    and DOWN_TILES: the engine's tiles' two GEMMs (summed over the slots) checked against quant_moe_ref, then each
    tile's output against the engine's."""
    results = []
    for name in experts:
        d, inter, e, top_k, w13, w2 = int4_experts(name)
        for t in tokens:
            h = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
            tw, ids = routings(t, e, top_k, 1)[0]
            weights = tw.reshape(-1).to(torch.float32).contiguous()
            cfg = w4.aligned_config(t, w13, w2, top_k)
            align = tfm.moe_align(ids, e, cfg.block_m)
            act = torch.empty(t * top_k, inter, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(t * top_k, d, device="cuda", dtype=torch.bfloat16)
            gemms = {  # name: (the kernel up to its tiles, the engine's tiles, tiles swept, FLOPs)
                "gate_up": (partial(moe_gemm_codes, h, w13.qweight, w13.scales, w13.zeros, 128, act, align, top_k,
                                    cfg.block_m, decoded=True),
                            (cfg.up_n, cfg.num_warps, cfg.num_stages), UP_TILES, 2 * t * top_k * 2 * inter * d),
                "down": (partial(moe_gemm_codes, act, w2.qweight, w2.scales, w2.zeros, 128, y, align, 1, cfg.block_m,
                                 weights=weights, decoded=True),
                         (cfg.down_n, cfg.num_warps, cfg.num_stages), DOWN_TILES, 2 * t * top_k * d * inter),
            }  # fmt: skip
            refs = []  # the engine's tiles' act and y, their sum over the slots checked against quant_moe_ref
            for kernel, engine, _, _ in gemms.values():
                _tile_call(kernel, cfg.group_m, engine)
                refs.append((act if not refs else y).clone())
            engine_err = rel_err(
                tfm.moe_sum(y.view(t, top_k, d), torch.empty_like(h)), quant_moe_ref(h, w13, w2, tw, ids)
            )
            for (gemm, (kernel, engine, tiles, flops)), ref in zip(gemms.items(), refs, strict=True):
                out = act if gemm == "gate_up" else y
                act.copy_(refs[0])  # the down's input, whatever the gate-up variants left there
                flop_ms = flops / rate * 1e3
                row: dict[str, Any] = {"experts": name, "tokens": t, "gemm": gemm, "block_m": cfg.block_m,
                                       "engine": list(engine), "engine_error": engine_err, "flop_floor_ms": flop_ms,
                                       "ms": {}, "errors": {}}  # fmt: skip
                if engine_err > 2e-2:
                    rep.log(
                        f"MoE {name} T={t} {gemm}: the engine's tiles off quant_moe_ref by {engine_err:.1e}; not timed"
                    )
                    results.append(row)
                    continue
                for tile in dict.fromkeys((engine, *tiles)):
                    label = _tile_label(tile)
                    call = partial(_tile_call, kernel, cfg.group_m, tile)
                    try:
                        out.zero_()
                        call()
                        err = rel_err(out, ref)
                        row["errors"][label] = err
                        row["ms"][label] = (
                            do_bench(call, warmup=25, rep=100, return_mode="median") if err < 1e-2 else None
                        )
                    except Exception as ex:  # noqa: BLE001 - a tile the GPU cannot hold (shared memory, registers)
                        row["errors"][label] = f"{type(ex).__name__}: {str(ex)[:160]}"
                results.append(row)
                timed = sorted(((ms, lb) for lb, ms in row["ms"].items() if ms), key=lambda x: x[0])
                parts = "  ".join(f"{lb} {_us(ms)} ({flop_ms / ms:.0%})" for ms, lb in timed)
                rep.log(f"MoE {name} T={t:<5} {gemm:<7} block_m {cfg.block_m}, engine {_tile_label(engine)}, flop floor "
                        f"{flop_ms * 1e3:7.1f} us | {parts}")  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="96,128,160,256,1024,8192")
    p.add_argument("--shapes", default=",".join(DENSE))
    p.add_argument("--moe-tokens", default="1024,8192")
    p.add_argument("--experts", default="qwen3-30b-a3b", help=f"comma-separated, of {', '.join(EXPERTS)}")
    p.add_argument(
        "--ws",
        default=WS_CONFIGS,
        help="the warp-specialised kernel's configs past 64 rows, comma-separated BMxBNxBK:stages[:field=value..]",
    )
    p.add_argument("--moe-sweep", action="store_true", help="the MoE's decoded GEMMs apart over tiles, not `moe`")
    args = p.parse_args()
    rep = Report("cuda", command=" ".join(sys.argv))
    rate = matmul_rate("cuda") * 1e12
    rep.log(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    rep.out["matmul_tflops"] = rate / 1e12
    rows = [int(x) for x in args.rows.split(",") if x]
    ws_configs = [parse_ws_config(c) for c in args.ws.split(",") if c]
    rep.out["dense"] = dense(rep, rows, rate, [s for s in args.shapes.split(",") if s], ws_configs)
    rep.save(args.out)
    tokens, experts = [int(x) for x in args.moe_tokens.split(",") if x], args.experts.split(",")
    rep.out["moe"] = (moe_sweep if args.moe_sweep else moe)(rep, tokens, rate, experts)
    rep.save(args.out)


if __name__ == "__main__":
    main()
