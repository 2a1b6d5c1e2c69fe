"""What the dense int4 mma kernel (kernels/gluon_w4a16_mma.py) costs without its loads of x, or without its
loads of the weights: upper bounds on what a better x (or weight) access pattern could save. Results of the
ablated kernels are wrong by design and never checked; the unablated kernel is checked against
quant_linear_ref first.

The ablated kernels are the module's own source with one line replaced (the next chunk's x, or words, reuse
the first chunk's registers instead of loading), imported as a separate module, so the rest of the kernel
(layouts, config, mma chain, scales, cross-warp sum) is unchanged. Each product is timed as in
bench_w4a16_mma.py (CUDA graph over enough weight copies to exceed L2), default config, int4 g128 asym, in
one process; floor = bytes (words + scales + zeros + x + y) / the copy bandwidth measured in this run.

    PYTHONPATH=$PWD python benchmarks/ablate_w4a16_mma.py --out $OUT/ablate_w4a16_mma_h100.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_w4a16 import DEV, DT, L2_BYTES, SHAPES, make_weight, rel_err, time_per_call
from ceilings import Report

from ftransformers.kernels import gluon_w4a16_mma as mma
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_linear_ref

NEXT_X = "x = gl.load(x_ptrs + gl.minimum(c + 1, CHUNKS - 1) * KC)"
NEXT_Q = "q = gl.load(q_ptrs + gl.minimum(c + 1, CHUNKS - 1) * (KC // 8))"
ABLATIONS = {"no-x-loads": (NEXT_X, "x = x_c"), "no-weight-loads": (NEXT_Q, "q = q_c")}


def ablated(
    name: str, old: str, new: str, tmp: Path, module: ModuleType = mma, more: tuple[tuple[str, str], ...] = ()
) -> ModuleType:
    """`module`'s source with `old` replaced by `new` (and each pair of `more`), imported as a module of its own."""
    src = Path(module.__file__ or "").read_text()
    for a, b in ((old, new), *more):
        assert src.count(a) == 1, f"{name}: the line to replace is not in the kernel once: {a}"
        src = src.replace(a, b)
    path = tmp / f"{Path(module.__file__ or '').stem}_{name.replace('-', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def timed(mod: ModuleType, x: torch.Tensor, qws: list[QuantizedWeight]) -> float:
    """µs of one product by `mod`'s w4a16_mma (default config) over the weight copies."""
    return time_per_call(lambda i: mod.w4a16_mma(x, qws[i].qweight, qws[i].scales, qws[i].zeros, 128), len(qws)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="dsv3 o,qwen3-8b gate_up,qwen3-8b down,qwen3-8b qkv")
    p.add_argument("--rows", default="1,4,8,16")
    args = p.parse_args()
    report = Report(rows=[])
    bw, out, log = report.copy_gbs, report.out, report.log
    tmp = Path(tempfile.mkdtemp())
    mods = {"kernel": mma, **{k: ablated(k, *v, tmp) for k, v in ABLATIONS.items()}}
    gen = torch.Generator(device=DEV).manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        base = make_weight("int4-asym", n, k, gen)
        copies = max(2, -(-2 * L2_BYTES // base.nbytes()))
        qws = [base] + [make_weight("int4-asym", n, k, gen) for _ in range(copies - 1)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=DT, generator=gen)
            cfg = mma.default_config(m, n, k)
            if not mma.supported(x, base.qweight, base.group_size, cfg):
                log(f"{shape:20s} M={m:2d} not supported by {cfg}")
                continue
            err = rel_err(mma.w4a16_mma(x, base.qweight, base.scales, base.zeros, 128), quant_linear_ref(x, base))
            nbytes = base.nbytes() + 2 * m * (k + n)
            floor = nbytes / bw / 1e3
            times = {label: timed(mod, x, qws) for label, mod in mods.items()}
            out["rows"].append({"shape": shape, "M": m, "config": cfg.__dict__, "bytes": nbytes, "floor_us": floor,
                                "rel_err": err, "us": times})  # fmt: skip
            log(f"{shape:20s} M={m:2d} floor {floor:5.1f} us  " + "  ".join(
                f"{lab} {t:6.1f} ({100 * floor / t:3.0f}%)" for lab, t in times.items()) + f"  err {err:.1e}")  # fmt: skip
    report.save(args.out)


if __name__ == "__main__":
    main()
