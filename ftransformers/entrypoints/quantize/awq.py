"""AWQ (Lin et al. 2023; our own code after AutoAWQ's search_best_scale / auto_clip): per-input-channel
scales that protect the channels with large activations before 4-bit asymmetric rounding.

For each `ScaleGroup` of a decoder layer (q/k/v after the input norm; gate/up after the post-attention
norm, all experts, shared experts and the router together for an MoE block; down after up; o after v
when heads == kv heads; MLA's q_a/kv_a after the input norm and q_b after q_a_layernorm):
  s(α) = mean|x|^α per input channel, normalised by sqrt(max(s) · min(s)), α in {0, 0.05, .., 0.95}
  loss(α) = Σ_members ‖x Q(W·s)ᵀ/s − x Wᵀ‖² / elements, over ≤ 2048 calibration tokens per member
and the best α wins (α = 0 is plain round-to-nearest, so the loss never rises). The group's columns
are multiplied by s, its producer's output channels (norm weight, or up/v rows and bias) divided by
it, and routers (kept in float) multiplied too, so the float model computes the same function.
Then each quantized linear except query/key producers gets a clipping search: per output row and
group, max|w| shrunk by 0..45% (10 steps), keeping the clip that minimises the group's output error on
512 tokens. The next layer is fed this layer's float outputs after scaling and clipping (not its
quantized outputs), as AutoAWQ does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ftransformers.entrypoints.quantize.calibration import LayerCalib, LinearRef, ScaleGroup, calibrate_layers

N_GRID = 20
LOSS_TOKENS = 2048
CLIP_TOKENS = 512
CLIP_STEPS = 10  # shrink max|w| by 0, 5, .., 45%
NO_CLIP = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # errors pass through softmax


def fake_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] rounded on AWQ's grid and dequantized, float32: the formula of quantizers.quantize_int4
    (asymmetric, fp16 scales) without packing (the searches call it ~200 times a layer; a test pins
    it to dequantize(quantize_int4(..)))."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(dim=-1, keepdim=True).clamp(max=0), wg.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-10).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(wg / scale) + zero).clamp(0, 15)
    return ((q - zero) * scale).reshape(n, k)


def _sample(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n).long()]


def search_scale(x_mean: torch.Tensor, members: list[tuple[torch.Tensor, torch.Tensor]], group: int,
                 grid: int = N_GRID) -> tuple[torch.Tensor, float, float]:  # fmt: skip
    """x_mean [K] mean|x| per channel; members: (W [N, K], x [T, K]) -> (s [K], best loss, loss at α=0)."""
    cases = [(w.float(), xs, xs @ w.float().t()) for w, x in members if x.shape[0] for xs in [_sample(x.float(), LOSS_TOKENS)]]
    best_s, best, rtn = torch.ones_like(x_mean), float("inf"), float("nan")
    if not cases:
        return best_s, 0.0, 0.0
    for i in range(grid):
        s = x_mean.float().pow(i / grid).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err, count = 0.0, 0
        for w, xs, y in cases:
            wq = fake_int4(w * s, group) / s
            err += float((xs @ wq.t() - y).pow(2).sum())
            count += y.numel()
        loss = err / count
        if i == 0:
            rtn = loss
        if loss < best:
            best, best_s = loss, s
    return best_s, best, rtn


def search_clip(w: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K], x [T, K] -> max|w| per (row, group) [N, K/G, 1] minimising that group's output error."""
    n, k = w.shape
    xs = _sample(x.float(), CLIP_TOKENS).reshape(-1, k // group, group)  # [T, ng, G]
    wg = w.float().reshape(n, k // group, group)
    ref = torch.einsum("tgj,ngj->ntg", xs, wg)
    org_max = wg.abs().amax(dim=-1, keepdim=True)  # [N, ng, 1]
    best_err = torch.full(org_max.shape[:2], float("inf"))
    best = org_max.clone()
    for i in range(CLIP_STEPS):
        mx = org_max * (1 - i / (2 * CLIP_STEPS))
        q = fake_int4(torch.maximum(torch.minimum(wg, mx), -mx).reshape(n, k), group).reshape(n, k // group, group)
        err = (torch.einsum("tgj,ngj->ntg", xs, q) - ref).pow(2).mean(dim=1)  # [N, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), mx, best)
    return best


def _apply_scale(g: ScaleGroup, s: torch.Tensor, touched: dict[str, torch.Tensor]) -> None:
    for name, t in g.producers:
        t.div_(s.view(-1, *([1] * (t.dim() - 1))))
        touched[name] = t
    for m in g.members:
        m.weight.mul_(s[None, :])
        m.x = m.x / s  # a new tensor: members may share one recorded input
        touched[f"{m.name}.weight"] = m.weight
    for name, t in g.passengers:
        t.mul_(s[None, :])
        touched[name] = t


def awq_layer(calib: LayerCalib, group: int, clip: bool, touched: dict[str, torch.Tensor], stats: dict[str, float]) -> None:
    """Search, then apply, every group's scales; then clip (module docstring)."""
    chosen: list[tuple[ScaleGroup, torch.Tensor]] = []
    for g in calib.groups:
        quantized = [m for m in g.members if m.quantized]
        if not quantized:
            continue
        inputs = {m.input_key: m.x for m in g.members}
        x_all = torch.cat(list(inputs.values()))
        if x_all.shape[0] == 0:
            continue
        s, best, rtn = search_scale(x_all.abs().mean(dim=0), [(m.weight, m.x) for m in quantized], group)
        stats["rtn_loss"] = stats.get("rtn_loss", 0.0) + rtn
        stats["awq_loss"] = stats.get("awq_loss", 0.0) + best
        stats["groups"] = stats.get("groups", 0) + 1
        chosen.append((g, s))
    for g, s in chosen:
        _apply_scale(g, s, touched)
    if not clip:
        return
    refs: list[LinearRef] = [r for r in calib.refs.values() if r.quantized and r.x.shape[0]
                             and r.name.rsplit(".", 1)[-1] not in NO_CLIP]  # fmt: skip
    for r in refs:
        mx = search_clip(r.weight, r.x, group)
        n, k = r.weight.shape
        wg = r.weight.view(n, k // group, group)
        wg.copy_(torch.maximum(torch.minimum(wg, mx), -mx))
        touched[f"{r.name}.weight"] = r.weight


def awq_calibrate(model_path: Path, calib_ids: list[int], targets: set[str], group: int, clip: bool = True,
                  progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:  # fmt: skip
    """-> (float32 tensors to write in place of the checkpoint's, by checkpoint name; search statistics)."""
    touched: dict[str, torch.Tensor] = {}  # views into the calibration model, which they keep alive
    stats: dict[str, float] = {}
    calibrate_layers(model_path, calib_ids, targets, lambda c: awq_layer(c, group, clip, touched, stats), progress)
    return touched, stats

