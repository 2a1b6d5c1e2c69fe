"""Build a model for a `ModelConfig` and fill its weights.

Weights stream from `*.safetensors` one tensor at a time (the index file, when present, lists the
shards), each copied straight into its parameter, so a checkpoint is never held twice in memory.
`load_format='dummy'` fills every parameter with seeded random values and reads no weight file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ftransformers.config.model_config import ModelConfig
from ftransformers.layers.weight_utils import (
    MissingWeightFilesError,
    deferred_weights,
    materialize_meta_parameters,
    MissingWeightsError,
    UnexpectedWeightError,
    WeightLoadError,
    WeightShapeError,
)
from ftransformers.models.registry import UnsupportedArchitectureError, get_model_class
from ftransformers.quant import apply_quant_config, finish_quantized_load, quant_config_for

__all__ = [
    "MissingWeightFilesError",
    "MissingWeightsError",
    "UnexpectedWeightError",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "WeightShapeError",
    "iterate_weights",
    "load_model",
    "weight_files",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(model_path: str | Path) -> list[Path]:
    """The safetensors shards of a checkpoint, checked to exist."""
    root = Path(model_path)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightLoadError(f"cannot read {index}: {e}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise MissingWeightFilesError(f"weight file {f} listed in {SAFETENSORS_INDEX} is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise MissingWeightFilesError(f"no *.safetensors weight files in {root}")
    return files


def iterate_weights(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor) one at a time over every shard."""
    from safetensors import SafetensorError, safe_open

    for path in weight_files(model_path):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightLoadError(f"cannot read weight file {path}: {e}") from None


def fill_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Seeded uniform values for every parameter (norm weights too), on the parameter's device.
    Quantized parameters carry a `dummy_fill(param, generator)` (quant/kernel_method.py) giving values valid
    for their format: packed codes, positive scales, finite FP8, a real g_idx; with dequantized
    weights of the same magnitude as the float ones."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        fill = getattr(param, "dummy_fill", None)
        if fill is not None:
            fill(param, gen)
        elif param.dtype.is_floating_point:
            param.data.uniform_(low, high, generator=gen)
            param.ft_loaded = True  # type: ignore[attr-defined]
        else:
            param.data.random_(-8, 8, generator=gen)
            param.ft_loaded = True  # type: ignore[attr-defined]


def load_model(
    model_config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "auto",
    quantization_ignore: tuple[str, ...] = (),
) -> nn.Module:
    """Build the registered model class on `device` in `dtype` and load its weights.

    `quantization` ('auto': the checkpoint's `quantization_config`; 'none'; a method name matching
    the checkpoint's; or, for a float checkpoint, a load-time method) swaps the quantized layers'
    weights for the method's tensors before loading and converts them to kernel layouts after
    (quant/base.py); `quantization_ignore` keeps modules float under load-time quantization.
    After loading, a model's optional `post_load_weights()` runs (e.g. MLA weight absorption).
    """
    model_cls = get_model_class(getattr(model_config.hf_config, "architectures", None) or [model_config.architecture])
    dtype = dtype or model_config.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), deferred_weights():
            model = model_cls(model_config.hf_config)
    finally:
        torch.set_default_dtype(previous)
    qconfig = quant_config_for(model_config.hf_config, quantization, quantization_ignore)
    zero_bias: set[str] = set()
    if qconfig is not None:
        quantized = apply_quant_config(model, qconfig)  # on the meta linear / expert weights: no allocation
        zero_bias = _biasless_checkpoint_modules(model, quantized)
    materialize_meta_parameters(model, device)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    elif load_format in ("auto", "safetensors"):
        weights = iterate_weights(model_config.model_path)
        model.load_weights(_drop_zero_biases(weights, zero_bias) if zero_bias else weights)
    else:
        raise ValueError(f"unknown load format {load_format!r}; valid: auto, safetensors, dummy")
    if qconfig is not None:
        finish_quantized_load(model)
    post = getattr(model, "post_load_weights", None)
    if callable(post):
        post()
    return model.eval()


def _biasless_checkpoint_modules(model: nn.Module, quantized: list[str]) -> set[str]:
    """Checkpoint names of quantized modules without a bias (AutoGPTQ writes an all-zero `bias` for
    every linear it packs, bias or not; such tensors are dropped, as vLLM does)."""
    from ftransformers.quant.base import checkpoint_module_names

    stacked = getattr(model, "stacked_params_mapping", ())
    modules = dict(model.named_modules())
    out: set[str] = set()
    for name in quantized:
        if getattr(modules[name], "bias", None) is None:
            out.update(checkpoint_module_names(name, stacked))
    return out


def _drop_zero_biases(weights: Iterator[tuple[str, torch.Tensor]], names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        module = name.removesuffix(".bias")
        if module != name and (module in names or module.rsplit(".", 2)[0] in names) and not tensor.any():
            continue
        yield name, tensor
