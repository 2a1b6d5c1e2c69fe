"""Quantization configs and how they attach to a model's linear layers.

A checkpoint's `quantization_config` (or `--quantization`) becomes a `QuantConfig`: the method name,
its parameters, and the modules that stay in the model dtype (`ignore`: Hugging Face module names,
or `re:`-prefixed regexes as in compressed-tensors). Before the weights are read,
`apply_quant_config` walks the model: every `LinearBase` that is not ignored, and not marked
`skip_quant` by its model (an MoE router read as a plain weight, MLA's `kv_b_proj` that is absorbed
into other weights), gets the method's `LinearQuantMethod`, which replaces the layer's `weight`
parameter by the method's tensors (e.g. `weight` int8 + `weight_scale`) under the checkpoint's own
names. The layer's `weight_loader` keeps working because every quantized tensor keeps the output
features on dim 0 (`output_dim` attribute), so fused layers (qkv, gate_up) narrow it per shard as
before. After loading, `finish_quantized_load` lets each method repack what it read.

A fused module (our `qkv_proj` is the checkpoint's q/k/v_proj) is ignored when any of its parts is:
the parts must agree, as in vLLM.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ftransformers.layers.linear import LinearBase


class QuantError(ValueError):
    """A quantization config or tensor that cannot be used; the message is one line for a user."""


class LinearQuantMethod(ABC):
    """How one quantization scheme stores and applies a linear layer's weight."""

    name: str

    @abstractmethod
    def create_weights(self, layer: LinearBase) -> None:
        """Replace `layer.weight` by this scheme's parameters (on the same device)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x.dtype, bias included."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:  # noqa: B027 - optional hook
        """Repack loaded tensors for the kernels (default: nothing)."""


@dataclass(frozen=True)
class QuantConfig:
    method: str
    linear_method: LinearQuantMethod
    ignore: tuple[str, ...] = ()

    def is_ignored(self, hf_names: Iterable[str]) -> bool:
        for name in hf_names:
            for pattern in self.ignore:
                if pattern.startswith("re:"):
                    if re.fullmatch(pattern[3:], name):
                        return True
                elif name == pattern or name.endswith("." + pattern):
                    return True
        return False


# method name in `quantization_config.quant_method` (or --quantization) -> config parser
_PARSERS: dict[str, Callable[[dict[str, Any]], QuantConfig]] = {}


def register_quant_method(name: str) -> Callable[[Callable[[dict[str, Any]], QuantConfig]], Callable[[dict[str, Any]], QuantConfig]]:
    def wrap(fn: Callable[[dict[str, Any]], QuantConfig]) -> Callable[[dict[str, Any]], QuantConfig]:
        _PARSERS[name] = fn
        return fn

    return wrap


def supported_methods() -> list[str]:
    _import_methods()
    return sorted(_PARSERS)


def _import_methods() -> None:
    from ftransformers.quant import w8a8_int8  # noqa: F401 - registers itself


def quant_config_for(hf_config: Any, override: str = "auto") -> QuantConfig | None:
    """The QuantConfig of a checkpoint's `quantization_config`. `override`: 'auto' takes it as it is,
    'none' refuses a quantized checkpoint, a method name must match the checkpoint's (weights are
    not quantized at load time)."""
    _import_methods()
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    found = str(raw.get("quant_method", "")).lower() if raw else None
    if override == "none":
        if found:
            raise QuantError(f"--quantization none, but the checkpoint is quantized with {found!r}")
        return None
    if override == "auto":
        if not found:
            return None
        name = found
    else:
        if not found:
            raise QuantError(f"--quantization {override}: the checkpoint has no quantization_config; "
                             "write a quantized copy with `ftransformers quantize`")
        if found != override:
            raise QuantError(f"--quantization {override} does not match the checkpoint's quant_method {found!r}")
        name = override
    parser = _PARSERS.get(name)
    if parser is None:
        raise QuantError(f"quantization method {name!r} is not supported; supported: {', '.join(supported_methods())}")
    return parser(dict(raw or {}))


def checkpoint_module_names(module_name: str, stacked: Iterable[tuple[str, str, Any]]) -> list[str]:
    """The checkpoint module names a module of ours stands for (the parts of a fused module)."""
    names = [module_name]
    for param_part, weight_part, _shard in stacked:
        key = param_part.rstrip(".")
        if module_name.endswith(key):
            names.append(module_name[: -len(key)] + weight_part.rstrip("."))
    return names if len(names) == 1 else names[1:]


def apply_quant_config(model: nn.Module, qconfig: QuantConfig) -> list[str]:
    """Give every quantizable linear layer its method; returns the names of the quantized modules."""
    from ftransformers.layers.linear import LinearBase

    stacked = getattr(model, "stacked_params_mapping", ())
    done: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or getattr(module, "skip_quant", False):
            continue
        if qconfig.is_ignored(checkpoint_module_names(name, stacked)):
            continue
        qconfig.linear_method.create_weights(module)
        module.quant_method = qconfig.linear_method
        done.append(name)
    if not done:
        raise QuantError(f"quantization {qconfig.method!r}: no linear layer of this model is quantized")
    return done


def finish_quantized_load(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def replace_parameter(layer: nn.Module, name: str, tensor: torch.Tensor, **attrs: Any) -> nn.Parameter:
    """Register `tensor` as parameter `name` (replacing any), with the layer's weight_loader and attrs."""
    if name in layer._parameters:
        del layer._parameters[name]
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(param, key, value)
    shards = getattr(layer, "shard_offsets", None)
    if shards is not None:
        param.weight_shards = set(shards)  # type: ignore[attr-defined]
    layer.register_parameter(name, param)
    return param
