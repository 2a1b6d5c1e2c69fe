"""DeepSeek rotary embedding: plain RoPE or YaRN scaling, interleaved or half-split pair layout.

Numerics follow Hugging Face's DeepseekV3 exactly: `freqs = position * inv_freq` in float32,
`cos/sin * attention_factor` (YaRN's mscale on the rotary part), then cast to the activation dtype.
With `mscale_all_dim` set, YaRN also multiplies the softmax scale by `mscale(factor, mscale_all_dim)^2`
(`softmax_scale_multiplier`): the attention layer applies it, not this module.

Layouts (rotary dim R, pairs P = R/2):
- interleaved (DeepSeek's `rope_interleave`): pair p is (x[2p], x[2p+1]); the output is written
  half-split, [x_even*cos - x_odd*sin | x_odd*cos + x_even*sin], as HF does. Queries and keys both
  come out in that layout, so their dot product is the one of the interleaved rotation.
- half-split (NeoX): pair p is (x[p], x[p+P]).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# DeepseekRotaryEmbedding.rope_latent runs kernels/triton_mla_rope.py on CUDA
# (`set=layers.rotary_yarn.FUSED_MLA_ROPE=0` in benchmarks/ab_decode.py restores the PyTorch ops for an A/B).
FUSED_MLA_ROPE = True
# On the CPU the kernel runs only under Triton's interpreter and where a test asks for it: it is slow there.
MLA_ROPE_ON_CPU = False


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The rope dict of a config in either spelling (`rope_parameters`, or `rope_scaling` + `rope_theta`)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params["rope_type"] == "yarn":
        params.setdefault(
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings,
        )
    return params


def softmax_scale_multiplier(rope_params: Mapping[str, Any]) -> float:
    """What DeepSeek multiplies `qk_head_dim ** -0.5` by: mscale(factor, mscale_all_dim)^2 for YaRN."""
    if rope_params.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = rope_params.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(rope_params["factor"], mscale_all_dim)
    return m * m


def yarn_inv_freq(
    rotary_dim: int, base: float, params: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [R/2] and the cos/sin attention factor (HF `_compute_yarn_parameters`)."""
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class DeepseekRotaryEmbedding(nn.Module):
    def __init__(
        self,
        rotary_dim: int,
        rope_params: Mapping[str, Any],
        max_position_embeddings: int,
        interleaved: bool = True,
    ) -> None:
        super().__init__()
        self.rotary_dim, self.interleaved = rotary_dim, interleaved
        base = float(rope_params["rope_theta"])
        rope_type = rope_params.get("rope_type", "default")
        if rope_type == "yarn":
            inv_freq, self.attention_factor = yarn_inv_freq(rotary_dim, base, rope_params, max_position_embeddings)
        elif rope_type == "default":
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
            self.attention_factor = 1.0
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r} for DeepSeek; valid: default, yarn")
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [R/2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, R/2] in `dtype`
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions[:, None].float() * inv_freq
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, N, R]; cos, sin: [T, 1, R/2]
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, R]; k: [T, R] (MLA's one shared rope key) or [T, H_k, R]
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        k_3d = k if k.dim() == 3 else k[:, None, :]
        q_out = self._rotate(q, cos, sin)
        k_out = self._rotate(k_3d, cos, sin)
        return q_out, (k_out if k.dim() == 3 else k_out[:, 0, :])

    def rope_latent(
        self, positions: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
        pool: torch.Tensor | None = None, loc: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """MLA's rotary and latent row: q_pe [T, H, R] rotated, latent [T, L + R] = [c_kv | rotated k_pe]. On CUDA
        (and with MLA_ROPE_ON_CPU under Triton's interpreter, so that CPU tests can run the kernel inside whole
        models) one launch, kernels/triton_mla_rope.py; elsewhere, or with FUSED_MLA_ROPE off, this module and a
        concatenation. With `pool` (a layer's latent buffer [N, L + R]) and `loc` [T], the latent rows are also stored
        at pool[loc] in the pool's dtype, as MLAKVPool.set_latent stores them (by the kernel, in the same launch)."""
        on_cpu = MLA_ROPE_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"
        if FUSED_MLA_ROPE and (q_pe.is_cuda or on_cpu):  # imported here so CPU needs no triton
            from ftransformers.kernels.triton_mla_rope import mla_rope

            inv_freq = self.inv_freq.to(device=q_pe.device, dtype=torch.float32)
            return mla_rope(positions, inv_freq, self.attention_factor, q_pe, c_kv, k_pe, self.interleaved, pool, loc)
        q_pe, k_pe = self(positions, q_pe, k_pe)
        latent = torch.cat([c_kv, k_pe], dim=-1)
        if pool is not None and loc is not None:
            pool[loc] = latent.to(pool.dtype)
        return q_pe, latent


def get_deepseek_rope(config: Any) -> tuple[DeepseekRotaryEmbedding, float]:
    """The rope module for a DeepSeek-V3 style config and its softmax-scale multiplier."""
    params = rope_parameters_of(config)
    rope = DeepseekRotaryEmbedding(
        rotary_dim=config.qk_rope_head_dim,
        rope_params=params,
        max_position_embeddings=config.max_position_embeddings,
        interleaved=bool(getattr(config, "rope_interleave", True)),
    )
    return rope, softmax_scale_multiplier(params)
