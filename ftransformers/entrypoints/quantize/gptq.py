"""GPTQ (Frantar et al. 2022, as AutoGPTQ runs it): 4-bit weights that compensate each column's
rounding error on the columns not yet quantized, weighted by the inverse Hessian of the layer's
calibration inputs.

For a linear W [N, K] with inputs X [T, K]: H = 2 XᵀX / T, dampened by 1% of its mean diagonal,
U = upper Cholesky factor of H⁻¹. Columns are quantized in blocks of 128; column j's error
e = (w_j - q_j) / U[j, j] is subtracted from the later columns of the block as e · U[j, j:], and the
block's errors from all later columns at the block's end. A group's scale and zero point are computed
from the group's columns as they stand (already updated) when its first column is reached. With
`desc_act` the columns are processed in order of decreasing diag(H); the result's `perm` records that
order and the writer turns it into g_idx (dense layers only: MoE experts keep their column order, and
their g_idx is the plain one, since the fused-MoE kernels take no per-expert permutation). Zero-input ("dead") columns get H[j, j] = 1 and keep their
weights (AutoGPTQ zeroes them; an expert that saw no calibration token would then be lost).
Asymmetric zero points are kept in 1..15 so GPTQ v1's stored `zero - 1` never wraps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ftransformers.entrypoints.quantize.calibration import LayerCalib, LinearRef, calibrate_layers
from ftransformers.kernels.quant_formats import QuantizedWeight, dequantize, pack_int4

BLOCK = 128
DAMP = 0.01
MIN_TOKENS = 16  # fewer calibration inputs than this (a rarely chosen expert): round to nearest instead


def group_params(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, G] -> (scale [N] as fp16 holds it, zero [N] in 0..15; 8 when symmetric)."""
    if symmetric:
        scale = (w.abs().amax(dim=1) / 7.5).clamp_min(1e-10).half().float()
        return scale, torch.full_like(scale, 8.0)
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-10).half().float()
    return scale, torch.round(-lo / scale).clamp(1, 15)


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, 15)


def _result(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, symmetric: bool,
            perm: torch.Tensor | None) -> QuantizedWeight:  # fmt: skip
    n, k = codes.shape
    return QuantizedWeight("int4", pack_int4(codes.to(torch.uint8)), scales.half(), n, k, group,
                           zeros=None if symmetric else zeros.to(torch.uint8), perm=perm)  # fmt: skip


def rtn_gptq(w: torch.Tensor, group: int, symmetric: bool) -> QuantizedWeight:
    """Round to nearest on GPTQ's grid (the fallback for a weight without calibration inputs)."""
    n, k = w.shape
    wg = w.float().reshape(n * (k // group), group)
    scale, zero = group_params(wg, symmetric)
    codes = _round(wg, scale[:, None], zero[:, None]).reshape(n, k)
    return _result(codes, scale.reshape(n, -1), zero.reshape(n, -1), group, symmetric, None)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> H [K, K] = 2 xᵀx / T (summed in float64, returned in float32 as GPTQ runs)."""
    xd = x.double()
    return (2.0 * xd.t() @ xd / max(1, x.shape[0])).float()


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group: int, symmetric: bool = True, desc_act: bool = False,
                  block: int = BLOCK, damp: float = DAMP) -> QuantizedWeight:  # fmt: skip
    """w [N, K] float, h [K, K] -> int4 QuantizedWeight (columns in `perm` order when desc_act)."""
    W = w.float().clone()
    H = h.float().clone()
    n, k = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    perm = None
    if desc_act:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    eye = torch.eye(k, dtype=H.dtype)
    mean_diag = torch.diag(H).mean()
    for attempt in range(6):  # raise the dampening until H is positive definite
        chol, info = torch.linalg.cholesky_ex(H + (damp * 10**attempt) * mean_diag * eye)
        if int(info) == 0:
            break
    else:
        raise ValueError("GPTQ: the calibration Hessian is not positive definite")
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)  # U: H^-1 = UᵀU
    codes = torch.zeros(n, k)
    scales = torch.zeros(n, k // group)
    zeros = torch.zeros(n, k // group)
    scale = zero = torch.zeros(n)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        err1 = torch.zeros_like(W1)
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:  # the group's columns as updated so far (part may lie in later blocks)
                cols = W1[:, i : i + group] if i + group <= i2 - i1 else torch.cat([W1[:, i:], W[:, i2 : col + group]], 1)
                scale, zero = group_params(cols, symmetric)
                scales[:, col // group], zeros[:, col // group] = scale, zero
            q = _round(W1[:, i], scale, zero)
            codes[:, col] = q
            e = (W1[:, i] - (q - zero) * scale) / h1[i, i]
            W1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return _result(codes, scales, zeros, group, symmetric, perm)


def _rows(qw: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    return replace(qw, qweight=qw.qweight[a:b].contiguous(), scales=qw.scales[a:b].contiguous(), out_features=b - a,
                   zeros=None if qw.zeros is None else qw.zeros[a:b].contiguous())  # fmt: skip


def gptq_layer(calib: LayerCalib, group_size: int, symmetric: bool, desc_act: bool,
               results: dict[str, QuantizedWeight]) -> None:  # fmt: skip
    """Quantize every quantized linear of the layer; linears fed the same input (q/k/v, gate/up) share
    one Hessian and run as one row-stacked weight (GPTQ treats rows independently). The model's
    weights become the dequantized ones, so the next layer sees this layer's quantized outputs."""
    shared: dict[tuple[int, ...], list[LinearRef]] = {}
    for r in calib.refs.values():
        if r.quantized:
            shared.setdefault(r.input_key, []).append(r)
    for refs in shared.values():
        x = refs[0].x
        w = torch.cat([r.weight for r in refs])  # [sum N, K]
        g = w.shape[1] if group_size == -1 else group_size
        if x.shape[0] < MIN_TOKENS:  # an expert (almost) no calibration token chose: nothing to fit
            qw = rtn_gptq(w, g, symmetric)
        else:  # act order on dense layers only: the kernels take no per-expert column permutation
            qw = gptq_quantize(w, hessian(x), g, symmetric, desc_act and ".experts." not in refs[0].name)
        deq = dequantize(qw)
        if qw.perm is not None:
            deq = deq[:, torch.argsort(qw.perm)]  # stored order -> input order
        row = 0
        for r in refs:
            n = r.weight.shape[0]
            results[r.name] = _rows(qw, row, row + n)
            r.weight.copy_(deq[row : row + n])
            row += n


def gptq_calibrate(model_path: Path, calib_ids: list[int], targets: set[str], group_size: int, symmetric: bool,
                   desc_act: bool, progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
                   ) -> dict[str, QuantizedWeight]:  # fmt: skip
    """-> QuantizedWeight (2-D, kernel layout, `perm` when desc_act) by checkpoint module name."""
    results: dict[str, QuantizedWeight] = {}
    calibrate_layers(model_path, calib_ids, targets,
                     lambda c: gptq_layer(c, group_size, symmetric, desc_act, results), progress)  # fmt: skip
    return results
