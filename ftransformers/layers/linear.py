"""Linear layers with vLLM names and per-parameter `weight_loader`s.

Tensor parallel size is 1 for now: every layer holds the whole weight, but the names (and the
shard arguments of the loaders) are those of vLLM so that sharding can arrive without renames.
Weights are [out, in] as in `nn.Linear`.

Quantized checkpoints replace `weight` by tensors in their own layout (quant/), which the same loaders
fill shard by shard. A parameter says where a shard lands through attributes (`shard_view`):
  output_dim      the dim holding output features (default 0; AWQ/GPTQ tensors use 1)
  packed_factor   output features per element along output_dim (AWQ qweight/qzeros pack 8 per int32)
  shard_layout    "rows" (default: rows offset/pf .. (offset+size)/pf), "blocks" (block scales: each
                  shard holds ceil(size/block_n) rows after the blocks of the shards before it), or
                  "per_shard" (dim 0 indexes the shard: per-module scalars, g_idx, weight_shape)
Every loader sets `param.ft_loaded = True` once a tensor reached it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ftransformers.layers.weight_utils import WeightShapeError, check_shape, new_weight

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def one_row_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x [..., K] @ w [N, K]^T goes to kernels.triton_gemv: one row (batch-1 decode) on CUDA in 16-bit, where
    the weight-streaming kernel beats cuBLAS (benchmarks/results/gemv_sweep_h100.json, gemv_lm_head_h100.json)."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in _GEMV_DTYPES and w.dtype == x.dtype
            and x.stride(-1) == 1 and w.stride(-1) == 1)  # fmt: skip


def norm_then_linear(
    norm: nn.Module, linear: LinearBase, x: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """linear(norm(x + residual)) and x + residual in one launch (kernels.triton_gemv.gemv_rmsnorm) where the
    product is a one-row GEMV of an unquantized weight and the norm an RMSNorm (`weight`, `variance_epsilon`) of
    the weight's dtype over at most GEMV_WHOLE_ROW_K features; None where it does not take the call."""
    if linear.quant_method is not None:  # its own kernels (and no `weight`)
        return None
    w = linear.weight
    if not one_row_gemv(x, w) or residual.shape != x.shape:
        return None
    from ftransformers.kernels.triton_gemv import can_fold_norm, gemv_rmsnorm  # here: CPU needs no triton

    x2, r2 = x.reshape(1, -1), residual.reshape(1, -1)
    if not can_fold_norm(x2, r2, norm.weight, w):
        return None
    y, new_res = gemv_rmsnorm(x2, r2, norm.weight, norm.variance_epsilon, w, linear.bias)
    return y.view(*x.shape[:-1], w.shape[0]), new_res.view(x.shape)


Shard = tuple[int, int]  # (offset, size) in output features


def shard_view(param: nn.Parameter, data: torch.Tensor, shards: list[Shard], index: int, what: str = "") -> torch.Tensor:
    """The part of `data` (param's tensor, or one expert's slice of it) that shard `index` fills."""
    layout = getattr(param, "shard_layout", "rows")
    if layout == "per_shard":
        return data[index]
    dim = getattr(param, "output_dim", 0)
    offset, size = shards[index]
    if layout == "blocks":
        bn = int(param.block_n)  # type: ignore[attr-defined]
        start = sum(-(-s // bn) for _, s in shards[:index])
        return data.narrow(dim, start, -(-size // bn))
    pf = getattr(param, "packed_factor", 1)
    if offset % pf or size % pf:
        raise WeightShapeError(f"{what}: a shard of {size} rows at offset {offset} does not align with "
                               f"{pf} output features packed per element")  # fmt: skip
    return data.narrow(dim, offset // pf, size // pf)


def copy_checked(param: nn.Parameter, dst: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """Copy `loaded` into `dst` after checking its shape and, for quantized params (`quant_desc`), its dtype."""
    desc = getattr(param, "quant_desc", None)
    label = f"{desc}, {what}" if desc and what else (desc or what)
    check_shape(dst, loaded, label)
    allowed = getattr(param, "allowed_dtypes", None)
    if allowed is not None and loaded.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise WeightShapeError(f"dtype mismatch ({label}): expected {names}, got {str(loaded.dtype).removeprefix('torch.')}")
    dst.copy_(loaded)
    param.ft_loaded = True  # type: ignore[attr-defined]


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(new_weight(output_size, input_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        # Set by quant.apply_quant_config: a LinearQuantMethod that owns the weight tensors and the forward.
        self.quant_method: Any = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, *shard: Hashable) -> None:
        dst = param.data[0] if getattr(param, "shard_layout", "rows") == "per_shard" else param.data
        copy_checked(param, dst, loaded_weight, "")

    def output_shards(self) -> list[Shard]:
        """(offset, size) of each checkpoint module stacked in this layer's output (one for a plain layer)."""
        return [(0, self.output_size)]

    def reads_ahead_of_wait(self, rows: int) -> bool:
        """Whether this layer's kernel on `rows` rows reads its weight ahead of its PDL wait (kernels/pdl.py), so
        that the kernel just before it should trigger early (RMSNorm, decode attention's stage 2)."""
        return self.quant_method is not None and self.quant_method.reads_ahead_of_wait(self, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        w = self.weight
        if one_row_gemv(x, w):
            from ftransformers.kernels.triton_gemv import gemv  # here: CPU needs no triton

            y = gemv(x.reshape(1, -1), w, self.bias)
            return y.view(*x.shape[:-1], w.shape[0])
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    pass


class RowParallelLinear(LinearBase):
    pass


class _ShardedColumnLinear(LinearBase):
    """A column linear made of named output shards stacked along dim 0."""

    def __init__(self, input_size: int, shard_sizes: dict[Hashable, int], bias: bool) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[Hashable, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for p in self.parameters():
            p.weight_shards = set(shard_sizes)  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, *shard: Hashable) -> None:
        if not shard:
            copy_checked(param, param.data, loaded_weight, "")
            return
        if shard[0] not in self.shard_offsets:
            raise KeyError(f"unknown shard {shard[0]!r}; valid: {list(self.shard_offsets)}")
        index = list(self.shard_offsets).index(shard[0])
        what = f"shard {shard[0]!r}"
        copy_checked(param, shard_view(param, param.data, self.output_shards(), index, what), loaded_weight, what)

    def output_shards(self) -> list[Shard]:
        return list(self.shard_offsets.values())


class MergedColumnParallelLinear(_ShardedColumnLinear):
    """[gate | up] style fusion: shard i holds output_sizes[i] rows."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, dict(enumerate(output_sizes)), bias)


class QKVParallelLinear(_ShardedColumnLinear):
    """Fused q/k/v projection: rows [q: H*D | k: H_kv*D | v: H_kv*D_v]."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        v_head_size: int | None = None,
    ) -> None:
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.v_size = self.num_kv_heads * self.v_head_size
        super().__init__(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.v_size}, bias)
