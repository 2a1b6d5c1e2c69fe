"""Quantization configs and how they attach to a model's linear layers and MoE experts.

A checkpoint's `quantization_config` (or `--quantization`) becomes a `QuantConfig`: the method name,
the `Scheme` of each quantized module (one for all, or chosen per module by compressed-tensors'
`config_groups`), and the modules that stay in the model dtype (`ignore`: Hugging Face module names,
or `re:`-prefixed regexes as in compressed-tensors). Before the weights are read,
`apply_quant_config` walks the model: every `LinearBase` and `FusedMoE` that is not ignored, and not
marked `skip_quant` by its model (an MoE router read as a plain weight), gets a method
(quant/kernel_method.py) that replaces its float weight by the scheme's tensors under the checkpoint's
own names and layout; the layers' weight loaders place each shard (fused qkv / gate_up, stacked
experts). After loading, `finish_quantized_load` converts them into kernel-layout `QuantizedWeight`s.
A module marked `accept_quantized` (DeepSeek's `kv_b_proj`, absorbed into the attention) is stored
quantized by some checkpoints and in the model dtype by others: it is read either way and kept float.

A float checkpoint with `--quantization fp8 | w8a8_int8 | int4 | mxfp4 | nvfp4` is quantized at load
time (quant/online.py), layer by layer after its float weights arrive; `--quantization-ignore` names
the modules that stay in the model dtype then.

A fused module (our `qkv_proj` is the checkpoint's q/k/v_proj) is ignored when any of its parts is:
the parts must agree, as in vLLM.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ftransformers.kernels.quant_formats import QuantizedWeight

if TYPE_CHECKING:
    from ftransformers.layers.linear import LinearBase

Shard = tuple[int, int]  # (offset, size) of one checkpoint module in a layer's output features
ONLINE_METHODS = ("fp8", "w8a8_int8", "int4", "mxfp4", "nvfp4")  # load-time quantization of a float checkpoint


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

    def reads_ahead_of_wait(self, layer: LinearBase, rows: int) -> bool:
        """Whether `apply` on `rows` rows runs a kernel that reads its weight ahead of its PDL wait
        (kernels/pdl.py), so that the kernel before it gains by triggering early (default: no)."""
        return False


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a quantized module. `shape` is per module (per expert), with None at
    the output-feature dim; "per_shard" tensors have no None (one per fused part: scalars, g_idx)."""

    suffix: str
    dtype: torch.dtype
    shape: tuple[int | None, ...]
    packed_factor: int = 1  # output features per element along the None dim
    layout: str = "rows"  # rows | blocks | per_shard (layers/linear.py shard_view)
    block_n: int = 0  # "blocks": output rows per scale row
    allowed: tuple[torch.dtype, ...] | None = None  # checkpoint dtypes accepted (None: dtype, or any float)
    dummy: tuple[Any, ...] = ("float", 1e-3)  # how load_format=dummy fills it (kernel_method._dummy_filler)
    optional: bool = False  # a checkpoint may lack it (e.g. NVFP4's input_global_scale, unused weight-only)

    @property
    def output_dim(self) -> int | None:
        return self.shape.index(None) if None in self.shape else None


class Scheme(ABC):
    """A checkpoint format for one module: its tensors and their conversion to a `QuantizedWeight`."""

    name: str  # for messages: "awq", "compressed-tensors pack-quantized", ...
    fmt: str  # kernel layout (kernels/quant_formats.py)

    def describe(self) -> str:
        return self.name

    @abstractmethod
    def specs(self, k: int, dtype: torch.dtype) -> list[TensorSpec]:
        """The tensors of a module with in_features k (dtype: the model's, for formats that follow it)."""

    def check(self, n: int, k: int, shards: Sequence[Shard], where: str) -> None:
        """Raise QuantError when a module of this shape cannot be held (default: anything goes)."""

    @abstractmethod
    def to_kernel(self, t: dict[str, torch.Tensor], n: int, k: int, shards: Sequence[Shard], where: str) -> QuantizedWeight:
        """Checkpoint-layout tensors (suffix -> [E?, ...]) -> the kernel layout; `where` names the module."""


@dataclass(frozen=True)
class QuantConfig:
    method: str
    scheme: Scheme | None = None  # the scheme of every quantized module (unless `select` is given)
    ignore: tuple[str, ...] = ()
    # per-module scheme after `ignore`; given every part of a fused module (or expert stack), it raises
    # QuantError when they disagree
    select: Callable[[Sequence[str]], Scheme | None] | None = None
    online: bool = False  # quantize a float checkpoint at load time

    def is_ignored(self, hf_names: Iterable[str]) -> bool:
        for name in hf_names:
            for pattern in self.ignore:
                if pattern.startswith("re:"):
                    if re.fullmatch(pattern[3:], name):
                        return True
                elif name == pattern or name.endswith("." + pattern):
                    return True
        return False

    def scheme_for(self, hf_names: Sequence[str]) -> Scheme | None:
        if self.is_ignored(hf_names):
            return None
        return self.select(hf_names) if self.select is not None else self.scheme


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
    from ftransformers.quant import awq, compressed_tensors, fp8, gptq, w8a8_int8  # noqa: F401 - register themselves


def quant_config_for(hf_config: Any, override: str = "auto", ignore: Sequence[str] = ()) -> QuantConfig | None:
    """The QuantConfig of a checkpoint's `quantization_config`. `override`: 'auto' takes it as it is,
    'none' refuses a quantized checkpoint, a method name must match the checkpoint's, or, on a float
    checkpoint, names a load-time method (ONLINE_METHODS); `ignore` (--quantization-ignore) only
    applies to load-time quantization."""
    _import_methods()
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    found = str(raw.get("quant_method", "")).lower() if raw else None
    if found and ignore:
        raise QuantError(f"--quantization-ignore applies to load-time quantization; the checkpoint is already "
                         f"quantized with {found!r} (its quantization_config says which modules stay unquantized)")  # fmt: skip
    if override == "none":
        if found:
            raise QuantError(f"--quantization none, but the checkpoint is quantized with {found!r}")
        return None
    if override == "auto":
        if ignore:
            raise QuantError(f"--quantization-ignore needs a load-time --quantization method ({', '.join(ONLINE_METHODS)})")
        if not found:
            return None
        name = found
    elif not found:
        if override in ONLINE_METHODS:
            from ftransformers.quant.online import online_quant_config

            return online_quant_config(override, tuple(ignore))
        raise QuantError(f"--quantization {override}: the checkpoint has no quantization_config and {override} "
                         f"cannot quantize at load time (load-time methods: {', '.join(ONLINE_METHODS)}); "
                         "write a quantized copy with `ftransformers quantize`")  # fmt: skip
    elif found != override:
        raise QuantError(f"--quantization {override} does not match the checkpoint's quant_method {found!r}")
    else:
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


def expert_module_names(module_name: str) -> list[str]:
    """Checkpoint names standing for a FusedMoE's experts (expert 0's; every expert shares a scheme)."""
    return [f"{module_name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


def apply_quant_config(model: nn.Module, qconfig: QuantConfig) -> list[str]:
    """Give every quantizable linear layer and MoE expert stack its method; returns the names of the
    quantized modules (FusedMoE modules by their own name, e.g. `model.layers.1.mlp.experts`)."""
    from ftransformers.layers.linear import LinearBase
    from ftransformers.layers.moe.experts import FusedMoE
    from ftransformers.quant.kernel_method import KernelLinearMethod, KernelMoEMethod

    stacked = getattr(model, "stacked_params_mapping", ())
    done: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            scheme = qconfig.scheme_for(expert_module_names(name))
            if scheme is not None:
                KernelMoEMethod(scheme).attach(module, name)
                done.append(name)
            continue
        if not isinstance(module, LinearBase):
            continue
        scheme = qconfig.scheme_for(checkpoint_module_names(name, stacked))
        if getattr(module, "skip_quant", False):
            if scheme is not None and getattr(module, "accept_quantized", False) and not qconfig.online:
                KernelLinearMethod(scheme, keep_float=True).attach(module, name)
            continue
        if scheme is not None:
            KernelLinearMethod(scheme).attach(module, name)
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
    shards = getattr(layer, "shard_offsets", None)
    if shards is not None:
        param.weight_shards = set(shards)  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(param, key, value)
    layer.register_parameter(name, param)
    return param
