"""`--cpu-weight-path DIR`: the routed MoE experts as INT4 per output channel, for the CPU-expert hybrid.

One safetensors file per MoE layer (`layer_{i:03d}.safetensors`) plus `manifest.json`:
  w13_qweight  uint8   [E, 2I, D/2]  rows [gate | up]; two codes per byte along D, low nibble first
  w13_scale    float32 [E, 2I]
  w2_qweight   uint8   [E, D, I/2]
  w2_scale     float32 [E, D]
Symmetric per row: scale = max|w| / 7.5, code = clamp(round(w / scale), -8, 7) + 8, w = (code - 8) * scale
(the kernels' "int4" rule with one group per row). The experts are taken from the same float weights
the main checkpoint is quantized from (after AWQ's or SmoothQuant's function-preserving rescaling), so
they pair with the norms written there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight, dequantize
from ftransformers.quant.base import QuantError
from ftransformers.quant.quantizers import quantize_int4

FORMAT = "ftransformers-cpu-experts-int4-per-channel"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (uint8 [N, K/2], float32 scale [N])."""
    qw = quantize_int4(w, group_size=w.shape[-1], symmetric=True, scale_dtype=torch.float32)
    return qw.qweight.contiguous().view(torch.uint8), qw.scales[..., 0].contiguous()


class CpuExpertWriter:
    """Collects each MoE layer's expert weights from the tensor stream and writes the layer once complete."""

    def __init__(self, root: Path, moe_layers: dict[str, int]) -> None:
        """moe_layers: checkpoint prefix of each layer's experts (model.layers.3.mlp.experts) -> E."""
        self.root, self.moe_layers = root, moe_layers
        self.pending: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.layers: dict[str, dict[str, object]] = {}
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            raise QuantError(f"--cpu-weight-path {root} is not empty")

    def add(self, name: str, weight: torch.Tensor) -> None:
        m = _EXPERT.match(name)
        if m is None or m.group(1) not in self.moe_layers:
            return
        if weight.shape[-1] % 8:
            raise QuantError(f"--cpu-weight-path: {name} needs in_features divisible by 8, got {weight.shape[-1]}")
        prefix = m.group(1)
        parts = self.pending.setdefault(prefix, {})
        parts[(int(m.group(2)), m.group(3))] = _quantize_rows(weight)  # each expert as it streams by
        if len(parts) == 3 * self.moe_layers[prefix]:
            self._write(prefix, self.pending.pop(prefix))

    def _write(self, prefix: str, parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        e = self.moe_layers[prefix]
        tensors = {}
        for w, rows in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
            tensors[f"{w}_qweight"] = torch.stack([torch.cat([parts[(i, r)][0] for r in rows]) for i in range(e)])
            tensors[f"{w}_scale"] = torch.stack([torch.cat([parts[(i, r)][1] for r in rows]) for i in range(e)])
        m = _LAYER.search(prefix + ".")
        layer = int(m.group(1)) if m else len(self.layers)
        fname = f"layer_{layer:03d}.safetensors"
        save_file(tensors, str(self.root / fname), metadata={"format": FORMAT})
        self.layers[str(layer)] = {"file": fname, "prefix": prefix, "num_experts": e,
                                   "hidden_size": 2 * int(tensors["w13_qweight"].shape[-1]),
                                   "intermediate_size": 2 * int(tensors["w2_qweight"].shape[-1])}  # fmt: skip

    def finish(self) -> int:
        """Write manifest.json; returns the number of layers written."""
        if self.pending:
            missing = ", ".join(sorted(self.pending))
            raise QuantError(f"--cpu-weight-path: the checkpoint lacks some expert weights of {missing}")
        manifest = {
            "format": FORMAT, "version": 1,
            "dequantize": "w = (code - 8) * scale[row]; code (row, k) = (qweight[row, k // 2] >> 4 * (k % 2)) & 0xF",
            "tensors": {"w13_qweight": "uint8 [E, 2I, D/2], rows [gate | up]", "w13_scale": "float32 [E, 2I]",
                        "w2_qweight": "uint8 [E, D, I/2]", "w2_scale": "float32 [E, D]"},
            "layers": dict(sorted(self.layers.items(), key=lambda kv: int(kv[0]))),
        }  # fmt: skip
        (self.root / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return len(self.layers)


def load_cpu_experts(root: str | Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized (w13 float32 [E, 2I, D], w2 float32 [E, D, I]) of MoE layer `layer` in a
    `--cpu-weight-path` folder."""
    from safetensors.torch import load_file

    root = Path(root)
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise QuantError(f"{root}: not a {FORMAT} folder")
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        raise QuantError(f"{root} has no MoE layer {layer}; layers: {', '.join(manifest['layers'])}")
    t = load_file(str(root / entry["file"]))
    out = []
    for w in ("w13", "w2"):
        q, s = t[f"{w}_qweight"], t[f"{w}_scale"]
        _e, n, half = q.shape
        qw = QuantizedWeight("int4", q.contiguous().view(torch.int32), s.unsqueeze(-1), n, 2 * half, 2 * half)
        out.append(dequantize(qw))
    return out[0], out[1]
