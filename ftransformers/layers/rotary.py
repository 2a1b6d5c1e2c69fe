"""Rotary position embeddings (vLLM layout: a [max_position, rotary_dim] cos|sin cache).

Subclasses change the frequencies by overriding `_compute_inv_freq` and/or
`_compute_cos_sin_cache` (YaRN lives in rotary_yarn.py). The cache stays float32; q and k are
rotated in float32 and cast back to their dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.max_position_embeddings, self.base = max_position_embeddings, base
        self.is_neox_style = is_neox_style
        cache = self._compute_cos_sin_cache()
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [P, rotary_dim] float32

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        # [rotary_dim / 2]
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (base**exponent)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim / 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, rotary_dim] float32; cos/sin: [T, 1, rotary_dim / 2]
        if self.is_neox_style:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:  # type: ignore[override]
        # .to(dtype)/.half() must not round the float32 cache; device moves still apply.
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)
        return self

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; query: [T, H*D] or [T, H, D]; key: [T, H_kv*D] or [T, H_kv, D]
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2] each
        return self._apply_rotary(query, cos, sin), self._apply_rotary(key, cos, sin)

    def _apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_size)  # [T, H, D]
        rot = self._rotate(x[..., : self.rotary_dim].float(), cos, sin).to(x.dtype)
        if self.rotary_dim < self.head_size:
            rot = torch.cat((rot, x[..., self.rotary_dim :]), dim=-1)
        return rot.reshape(shape)


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    def __init__(self, *args: Any, scaling_factor: float, **kwargs: Any) -> None:
        self.scaling_factor = scaling_factor
        super().__init__(*args, **kwargs)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        return super()._compute_inv_freq(base) / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        *args: Any,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        orig_max_position: int,
        **kwargs: Any,
    ) -> None:
        self.scaling_factor, self.low_freq_factor = scaling_factor, low_freq_factor
        self.high_freq_factor, self.orig_max_position = high_freq_factor, orig_max_position
        super().__init__(*args, **kwargs)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq(base)
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are scaled down by the factor, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.scaling_factor, inv_freq)
        smooth = (self.orig_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.scaling_factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)


def rope_type_of(rope_parameters: dict[str, Any] | None) -> str:
    if not rope_parameters:
        return "default"
    return str(rope_parameters.get("rope_type", rope_parameters.get("type", "default")))


def get_rope(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    rope_parameters: dict[str, Any] | None,
    is_neox_style: bool = True,
    base: float | None = None,
) -> RotaryEmbedding:
    """Build the rotary embedding a config's `rope_parameters` (or legacy `rope_scaling`) asks for.

    The base comes from `base` when given, else `rope_parameters['rope_theta']`, else 10000.
    """
    params = dict(rope_parameters or {})
    theta = float(base if base is not None else params.get("rope_theta", 10000.0))
    rope_type = rope_type_of(params)
    common = (head_dim, rotary_dim, max_position, theta, is_neox_style)
    if rope_type == "default":
        return RotaryEmbedding(*common)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*common, scaling_factor=float(params["factor"]))
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            *common,
            scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            orig_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"unsupported rope type {rope_type!r}; supported here: default, linear, llama3 "
        "(YaRN: ftransformers.layers.rotary_yarn)"
    )


def share_rotary_caches(modules: Iterable[nn.Module]) -> int:
    """Point every `rotary_emb` among `modules` (the decoder layers' attentions) at the first one of the same
    class, head size, rotary dim and style whose float32 cos|sin cache is equal, so a model holds one cache
    instead of one a layer (Qwen3-30B-A3B: 48 x 21 MB). Caches on the meta device are left alone. Returns the
    bytes freed."""
    kept: list[RotaryEmbedding] = []
    freed = 0
    for m in modules:
        rope = getattr(m, "rotary_emb", None)
        if not isinstance(rope, RotaryEmbedding) or rope.cos_sin_cache.is_meta:  # meta (a quantize skeleton): no values
            continue
        for k in kept:
            same = (type(k), k.head_size, k.rotary_dim, k.is_neox_style) == (
                type(rope), rope.head_size, rope.rotary_dim, rope.is_neox_style)  # fmt: skip
            if same and k.cos_sin_cache.shape == rope.cos_sin_cache.shape and torch.equal(k.cos_sin_cache, rope.cos_sin_cache):
                freed += rope.cos_sin_cache.numel() * rope.cos_sin_cache.element_size()
                m.rotary_emb = k
                break
        else:
            kept.append(rope)
    return freed


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """A config's rope settings as one dict with `rope_type` and `rope_theta`, whichever spelling
    the config uses (transformers>=5 `rope_parameters`, or older `rope_theta` + `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    params = dict(params) if params else dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = rope_type_of(params)
    return params
