"""`ftransformers quantize`: argument parsing and one-line errors (the work is in checkpoint.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ftransformers.entrypoints.quantize.writers import METHOD_SPECS
from ftransformers.quant.base import QuantError

DEFAULT_CALIB_TOKENS = 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftransformers quantize", description="Write a quantized checkpoint.")
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder (bf16/fp16/fp32)")
    p.add_argument("--output", required=True, help="new folder for the quantized checkpoint")
    p.add_argument("--method", required=True, choices=sorted(METHOD_SPECS),
                   help="awq, gptq (need --calib-data), rtn-int4 (compressed-tensors), mxfp4, nvfp4, fp8, w8a8-int8")
    p.add_argument("--group-size", type=int, default=None,
                   help="input channels per scale for awq / gptq / rtn-int4 (default 128; gptq: -1 = one group)")
    p.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric int4 (default: gptq yes, rtn-int4 no; awq always has zero points)")
    p.add_argument("--desc-act", action="store_true", help="gptq: act order (columns by decreasing Hessian diagonal)")
    p.add_argument("--calib-data", default=None, metavar="FILE",
                   help="calibration text: required by awq and gptq; w8a8-int8: SmoothQuant first")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS, help="calibration tokens used")
    p.add_argument("--smooth-alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    p.add_argument("--no-awq-clip", dest="awq_clip", action="store_false", help="awq: skip the clipping search")
    p.add_argument("--ignore", nargs="*", default=[], metavar="MODULE",
                   help="checkpoint module names (or re:regex) kept in full precision")
    p.add_argument("--cpu-weight-path", default=None, metavar="DIR",
                   help="also write the MoE experts as INT4 per channel for the CPU-expert hybrid")
    return p


def calibration_ids(model_path: str, path: str, tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    f = Path(path)
    if not f.is_file():
        raise QuantError(f"--calib-data {path}: no such file")
    if tokens < 16:
        raise QuantError(f"--calib-tokens must be at least 16, got {tokens}")
    ids = AutoTokenizer.from_pretrained(model_path)(f.read_text())["input_ids"]
    return list(ids)[:tokens]


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from ftransformers.entrypoints.quantize.checkpoint import quantize_checkpoint

    args = build_parser().parse_args(argv)
    try:
        calib = calibration_ids(args.model_path, args.calib_data, args.calib_tokens) if args.calib_data else None
        summary = quantize_checkpoint(
            args.model_path, args.output, args.method, args.ignore,
            progress=lambda it: tqdm(it, desc="layers" if isinstance(it, range) else "tensors", leave=False),
            calib_ids=calib, smooth_alpha=args.smooth_alpha, group_size=args.group_size, symmetric=args.symmetric,
            desc_act=args.desc_act, cpu_weight_path=args.cpu_weight_path, awq_clip=args.awq_clip,
        )  # fmt: skip
    except (QuantError, OSError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    extra = f", {summary['smoothed_groups']} groups smoothed" if summary["smoothed_groups"] else ""
    if "awq" in summary:
        a = summary["awq"]
        extra += f", AWQ search: output MSE {a['awq_loss']:.3g} vs round-to-nearest {a['rtn_loss']:.3g}"
    if "cpu_expert_layers" in summary:
        extra += f", {summary['cpu_expert_layers']} MoE layers written to {args.cpu_weight_path}"
    print(f"wrote {args.output}: {summary['quantized_tensors']} weights quantized ({args.method}{extra}), "
          f"{summary['bytes_in'] / 1e6:.1f} MB -> {summary['bytes_out'] / 1e6:.1f} MB")
    return 0
