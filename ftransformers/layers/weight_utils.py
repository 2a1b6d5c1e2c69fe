"""Weight-loading errors and helpers shared by layers, models and the loader.

Every parameter may carry a `weight_loader(param, loaded_weight, *shard)` (vLLM convention) and a
`weight_shards` set naming the shards it must receive (fused QKV, gate/up, stacked experts); the
model's `load_weights` uses `LoadTracker` to report weights the model needed but never received.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch
from torch import nn


class WeightLoadError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


class MissingWeightFilesError(WeightLoadError):
    pass


class UnexpectedWeightError(WeightLoadError):
    pass


class WeightShapeError(WeightLoadError):
    pass


class MissingWeightsError(WeightLoadError):
    pass


def check_shape(dst: torch.Tensor, src: torch.Tensor, what: str = "") -> None:
    if tuple(dst.shape) != tuple(src.shape):
        where = f" ({what})" if what else ""
        raise WeightShapeError(f"shape mismatch{where}: expected {tuple(dst.shape)}, got {tuple(src.shape)}")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


class LoadTracker:
    """Records which (parameter, shard) pairs were written, then names what is still missing."""

    def __init__(self, module: nn.Module) -> None:
        self.params = dict(module.named_parameters())
        self.loaded: dict[str, set[Hashable]] = {}

    def load(self, param_name: str, tensor_name: str, loaded_weight: torch.Tensor, *shard: Hashable) -> None:
        param = self.params.get(param_name)
        if param is None:
            raise UnexpectedWeightError(f"checkpoint tensor {tensor_name!r} does not belong to this model")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, loaded_weight, *shard)
        except WeightShapeError as e:
            raise WeightShapeError(f"checkpoint tensor {tensor_name!r}: {e}") from None
        key: Hashable = shard[0] if len(shard) == 1 else (tuple(shard) if shard else None)
        self.loaded.setdefault(param_name, set()).add(key)

    def check_complete(self) -> None:
        missing: list[str] = []
        for name, param in self.params.items():
            got = self.loaded.get(name, set())
            needed: set[Hashable] | None = getattr(param, "weight_shards", None)
            if needed is None:
                if not got:
                    missing.append(name)
            elif not needed <= got:
                missing.append(f"{name} (shards {sorted(map(str, needed - got))[:4]})")
        if missing:
            shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
            raise MissingWeightsError(f"weights the model needs but the checkpoint lacks: {shown}")


def load_with_mapping(
    tracker: LoadTracker,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: Iterable[tuple[str, str, Hashable]] = (),
    skip_substrings: Iterable[str] = ("rotary_emb.inv_freq",),
) -> None:
    """Route checkpoint tensors to parameters; (param_suffix, weight_suffix, shard_id) entries map
    e.g. `.q_proj` onto shard 'q' of the fused `.qkv_proj`."""
    mapping = list(stacked_params_mapping)
    skips = tuple(skip_substrings)
    for name, tensor in weights:
        if any(s in name for s in skips):
            continue
        for param_part, weight_part, shard_id in mapping:
            if weight_part in name:
                tracker.load(name.replace(weight_part, param_part), name, tensor, shard_id)
                break
        else:
            tracker.load(name, name, tensor)
