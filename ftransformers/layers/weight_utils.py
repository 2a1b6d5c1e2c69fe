"""Weight-loading errors and helpers shared by layers, models and the loader.

Every parameter may carry a `weight_loader(param, loaded_weight, *shard)` (vLLM convention) and a
`weight_shards` set naming the shards it must receive (fused QKV, gate/up, stacked experts); the
model's `load_weights` uses `LoadTracker` to report weights the model needed but never received.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator
from contextvars import ContextVar

import torch
from torch import nn

# While set, linear and expert weights are created on the meta device (`deferred_weights`).
_DEFER_WEIGHTS: ContextVar[bool] = ContextVar("defer_weights", default=False)


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


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Within it, `new_weight` allocates nothing (meta device): a quantized model is built without ever
    holding its float weights, which a quantization method then replaces before
    `materialize_meta_parameters` allocates what is left. A 4-bit DeepSeek-V3 layer is a quarter of its
    bf16 size; building the bf16 stack first would cap the layers that fit at the bf16 count."""
    token = _DEFER_WEIGHTS.set(True)
    try:
        yield
    finally:
        _DEFER_WEIGHTS.reset(token)


def new_weight(*shape: int) -> torch.Tensor:
    """An uninitialised weight in the default dtype, on the current device (meta under deferred_weights)."""
    return torch.empty(*shape, device="meta" if _DEFER_WEIGHTS.get() else None)


def materialize_meta_parameters(module: nn.Module, device: torch.device | str) -> None:
    """Replace every meta parameter by an uninitialised one on `device`, keeping its attributes
    (weight_loader, weight_shards, ...) and its sharing (a tied lm_head stays tied)."""
    done: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, param in list(m._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = done.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                done[id(param)] = new
            m._parameters[name] = new
