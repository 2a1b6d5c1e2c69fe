"""compressed-tensors checkpoints (llm-compressor; Kimi-K2's INT4, RedHat's W8A8 / FP8 / FP4 models).

`quantization_config = {"quant_method": "compressed-tensors", "format": F, "config_groups": {name:
{"targets": [...], "weights": {...}, "input_activations": {...} | null, "format": optional}},
"ignore": [...]}`. Each module takes the scheme of the group whose targets match it (an exact module
name before a `re:` regex before the class name "Linear"); unmatched or ignored modules stay in the
model dtype, so one checkpoint may mix schemes (e.g. attention W8A8, experts INT4). Schemes:
  pack-quantized        INT4 weights (W4A16), strategy group or channel, symmetric or not:
                        weight_packed int32 [N, K/8] (signed value + 8, low nibble first), weight_scale
                        [N, K/G], weight_shape [2], asymmetric weight_zero_point int32 [N/8, K/G]
                        (zero + 8 packed along N)  -> "int4" (the same packing)
  int-quantized         W8A8 INT8: channel weights, dynamic per-token activations -> "int8"
  float-quantized       FP8 weights, block [bn, bk] or channel, dynamic activations -> "fp8_block"
  nvfp4-pack-quantized  NVFP4 (fp4.py), run weight-only
  mxfp4-pack-quantized  MXFP4 (fp4.py)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.kernels.quant_formats import QuantizedWeight, unpack_int4
from ftransformers.quant.awq import INT4_DUMMY_SCALE
from ftransformers.quant.base import QuantConfig, QuantError, Scheme, Shard, TensorSpec, register_quant_method
from ftransformers.quant.fp4 import Fp4Scheme
from ftransformers.quant.fp8 import Fp8BlockScheme, ignore_list
from ftransformers.quant.kernel_method import int4_weight
from ftransformers.quant.w8a8_int8 import Int8ChannelScheme

CT = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "nvfp4-pack-quantized",
           "mxfp4-pack-quantized", "mixed-precision")  # fmt: skip


@dataclass(frozen=True)
class PackedInt4Scheme(Scheme):
    group_size: int = 128  # 0: channel (one group per row)
    symmetric: bool = True
    name: str = f"{CT} pack-quantized"
    fmt: str = "int4"

    def describe(self) -> str:
        return f"{self.name} group_size {self.group_size or 'K'}"

    def _g(self, k: int) -> int:
        return self.group_size or k

    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        ng = k // self._g(k)
        specs = [
            TensorSpec("weight_packed", torch.int32, (None, k // 8), dummy=("bits",)),
            TensorSpec("weight_scale", dtype, (None, ng), dummy=("scale", INT4_DUMMY_SCALE)),
            TensorSpec("weight_shape", torch.int64, (2,), layout="per_shard", allowed=(torch.int32, torch.int64),
                       dummy=("shape",)),
        ]  # fmt: skip
        if not self.symmetric:
            specs.append(TensorSpec("weight_zero_point", torch.int32, (None, ng), packed_factor=8, dummy=("bits",)))
        return specs

    def check(self, n: int, k: int, shards: Sequence[Shard], where: str) -> None:
        if k % 8 or k % self._g(k):
            raise QuantError(f"{self.describe()}: {where} has {k} input features, not a multiple of 8 and of the group")

    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        want = torch.tensor([[size, k] for _, size in shards], device=t["weight_shape"].device)
        if not bool((t["weight_shape"] == want).all()):
            got = t["weight_shape"].reshape(-1, 2)[: len(shards)].tolist()
            raise QuantError(f"{self.describe()}: {where}.weight_shape is {got}, expected {want.tolist()}")
        zeros = None
        if not self.symmetric:  # [.., N/8, K/G] packed along N -> [.., N, K/G]
            zeros = unpack_int4(t["weight_zero_point"].transpose(-1, -2)).transpose(-1, -2)
        return int4_weight(t["weight_packed"], t["weight_scale"], zeros, n, k, self._g(k))


def _field(args: dict[str, Any], key: str, default: Any = None) -> Any:
    value = args.get(key, default)
    return value.lower() if isinstance(value, str) else value


def scheme_of(group: str, spec: dict[str, Any], default_format: str | None) -> Scheme:
    """The Scheme of one config group (raises QuantError naming the unsupported field)."""
    w = spec.get("weights")
    if not isinstance(w, dict):
        raise QuantError(f"{CT}: config_groups.{group}.weights is missing (weight-less schemes are not supported)")
    acts = spec.get("input_activations")
    if spec.get("output_activations"):
        raise QuantError(f"{CT}: config_groups.{group}.output_activations is not supported")
    fmt = _field(spec, "format") or default_format
    bits, kind, strategy = w.get("num_bits"), _field(w, "type", "int"), _field(w, "strategy")
    group_size, sym = w.get("group_size"), bool(w.get("symmetric", True))
    where = f"{CT}: config_groups.{group}"

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise QuantError(f"{where}: {what} is not supported")

    if _field(w, "actorder") == "group":
        need(False, "weights actorder 'group' (g_idx)")
    if acts is not None:
        need(bool(acts.get("dynamic", False)), "static input_activations (input_scale)")
    if kind == "int" and bits == 4:
        need(fmt in (None, "pack-quantized", "mixed-precision"), f"format {fmt!r} for int4 weights")
        need(acts is None, "int4 weights with quantized input_activations (W4A8)")
        need(strategy in ("group", "channel"), f"int4 weights strategy {strategy!r}")
        g = int(group_size) if strategy == "group" else 0
        need(strategy == "channel" or (g > 0 and g % 8 == 0), f"int4 weights group_size {group_size!r}")
        return PackedInt4Scheme(group_size=g, symmetric=sym)
    if kind == "int" and bits == 8:
        need(fmt in (None, "int-quantized", "naive-quantized", "mixed-precision"), f"format {fmt!r} for int8 weights")
        need(strategy == "channel" and sym, f"int8 weights strategy {strategy!r} symmetric {sym} (want channel, symmetric)")
        need(acts is not None and _field(acts, "type", "int") == "int" and acts.get("num_bits") == 8
             and _field(acts, "strategy") == "token" and bool(acts.get("symmetric", True)),
             "int8 weights without dynamic per-token symmetric int8 input_activations")  # fmt: skip
        return Int8ChannelScheme(name=f"{CT} int-quantized")
    if kind == "float" and bits == 8:
        need(fmt in (None, "float-quantized", "naive-quantized", "mixed-precision"), f"format {fmt!r} for fp8 weights")
        need(acts is None or (_field(acts, "type") == "float" and acts.get("num_bits") == 8),
             "fp8 weights with non-fp8 input_activations")  # fmt: skip
        if strategy == "block":
            block = w.get("block_structure")
            need(isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
                 f"fp8 weights block_structure {block!r}")  # fmt: skip
            return Fp8BlockScheme(name=f"{CT} float-quantized", block_n=block[0], block_k=block[1], scale_suffix="weight_scale")
        need(strategy == "channel", f"fp8 weights strategy {strategy!r} (supported: block, channel)")
        return Fp8BlockScheme(name=f"{CT} float-quantized", block_n=1, block_k=0, scale_suffix="weight_scale")
    if kind == "float" and bits == 4:
        need(sym, "asymmetric fp4 weights")
        if group_size == 16 and strategy == "tensor_group":
            need(fmt in (None, "nvfp4-pack-quantized", "mixed-precision"), f"format {fmt!r} for nvfp4 weights")
            return Fp4Scheme("nvfp4", f"{CT} nvfp4-pack-quantized")
        if group_size == 32 and strategy == "group":
            need(fmt in (None, "mxfp4-pack-quantized", "mixed-precision"), f"format {fmt!r} for mxfp4 weights")
            return Fp4Scheme("mxfp4", f"{CT} mxfp4-pack-quantized")
        need(False, f"fp4 weights strategy {strategy!r} group_size {group_size!r} (nvfp4: tensor_group 16, mxfp4: group 32)")
    need(False, f"weights num_bits {bits!r} type {kind!r}")
    raise AssertionError  # unreachable: need(False) raised


@dataclass(frozen=True)
class _Target:
    exact: frozenset[str]
    regexes: tuple[re.Pattern[str], ...]
    any_linear: bool

    def rank(self, name: str) -> int:
        """0 exact, 1 regex, 2 class "Linear", 3 no match (compressed-tensors' precedence)."""
        if name in self.exact:
            return 0
        if any(r.fullmatch(name) for r in self.regexes):
            return 1
        return 2 if self.any_linear else 3


def _target(group: str, targets: Any) -> _Target:
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise QuantError(f"{CT}: config_groups.{group}.targets must be a non-empty list of module names")
    exact = frozenset(t for t in targets if not t.startswith("re:") and "." in t)
    regexes = tuple(re.compile(t[3:]) for t in targets if t.startswith("re:"))
    return _Target(exact, regexes, any(t in ("Linear", "nn.Linear", "torch.nn.Linear") for t in targets))


@register_quant_method(CT)
def _parse(raw: dict[str, Any]) -> QuantConfig:
    fmt = _field(raw, "format")
    if fmt is not None and fmt not in FORMATS:
        raise QuantError(f"{CT}: format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    sparsity = raw.get("sparsity_config") or {}
    if sparsity and _field(sparsity, "format", "dense") != "dense":
        raise QuantError(f"{CT}: sparsity_config format {sparsity.get('format')!r} is not supported; supported: dense")
    if raw.get("transform_config"):
        raise QuantError(f"{CT}: transform_config (rotations) is not supported")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantError(f"{CT}: quantization_config config_groups is missing or empty")
    parsed = [(_target(name, g.get("targets")), scheme_of(name, g, fmt)) for name, g in groups.items()]

    def scheme_of_name(name: str) -> Scheme | None:
        best = min(parsed, key=lambda p: p[0].rank(name))
        return best[1] if best[0].rank(name) < 3 else None

    def select(names: Sequence[str]) -> Scheme | None:
        found = [scheme_of_name(n) for n in names]
        if any(s != found[0] for s in found):
            shown = ", ".join(f"{n}: {s.describe() if s else 'unquantized'}" for n, s in zip(names, found))
            raise QuantError(f"{CT}: parts of one fused module use different schemes ({shown})")
        return found[0]

    return QuantConfig(CT, None, ignore_list(raw, CT, ("ignore",)), select=select)
