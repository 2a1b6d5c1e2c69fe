"""The one linear method and the one MoE method every format shares.

Both create a module's parameters from its `Scheme`'s `TensorSpec`s, in the checkpoint's layout and
under its names (a linear: `qweight`, `scales`, ...; experts: `w13_qweight` [E, ...] / `w2_qweight`),
with the attributes `layers.linear.shard_view` reads to place fused parts. After loading,
`process_weights_after_loading` hands the tensors to `Scheme.to_kernel`, keeps the `QuantizedWeight`
(`layer.qw`, or `moe.w13_qw` / `moe.w2_qw`) and frees the checkpoint-layout tensors; int8 and
fp8_block layers keep their kernel `qweight` visible as `weight`.

Forward: on CUDA the Triton kernels (imported on first use, so the CPU engine needs no triton); on
any other device the plain-PyTorch references of kernels/quant_formats.py. GPTQ act-order's column
permutation is applied to x here, so kernels only ever see `perm=None`.

`keep_float` (DeepSeek's kv_b_proj, which some checkpoints store quantized): the float `weight` and
the scheme's tensors are all optional; whichever arrived wins, a quantized one is dequantized into
`weight`, and the layer runs unquantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ftransformers.kernels.quant_formats import FOUR_BIT_FORMATS, QuantizedWeight, dequantize, quant_linear_ref
from ftransformers.quant.base import LinearQuantMethod, QuantError, Scheme, Shard, TensorSpec

if TYPE_CHECKING:
    from ftransformers.layers.linear import LinearBase
    from ftransformers.layers.moe.experts import FusedMoE

_CHUNK = 1 << 26  # elements per step when filling big dummy tensors through temporaries


def quant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype through the kernel of qw's format (CUDA) or its reference."""
    if not x.is_cuda:
        return quant_linear_ref(x, qw, bias)
    if qw.fmt in FOUR_BIT_FORMATS:  # GPTQ act order's `perm` (4-bit only) is applied by w4a16_linear
        from ftransformers.kernels.triton_w4a16 import w4a16_linear

        return w4a16_linear(x, qw, bias)
    from ftransformers.kernels import triton_w8_row

    if qw.perm is None and triton_w8_row.takes(x, qw):  # one row, all of K in one load
        return triton_w8_row.w8_row(x.contiguous(), qw, bias, x.new_empty(1, qw.out_features))
    if qw.fmt == "fp8_block":
        from ftransformers.kernels.triton_fp8_gemm import fp8_block_linear

        return fp8_block_linear(x, qw, bias)
    from ftransformers.kernels.triton_int8_gemm import int8_linear

    return int8_linear(x, qw, bias)


def quant_reads_ahead(qw: QuantizedWeight, rows: int) -> bool:
    """Whether quant_linear on `rows` rows of qw reads the weight ahead of its PDL wait (kernels/pdl.py)."""
    if not qw.qweight.is_cuda:
        return False
    if qw.fmt in ("int8", "fp8_block"):
        from ftransformers.kernels import triton_w8_row

        return triton_w8_row.reads_ahead(qw, rows)
    if qw.fmt not in FOUR_BIT_FORMATS:
        return False
    from ftransformers.kernels.triton_w4a16 import w4a16_reads_ahead

    return w4a16_reads_ahead(qw, rows)


def spec_tensor(spec: TensorSpec, n: int, k: int, shards: list[Shard], lead: tuple[int, ...],
                device: torch.device, where: str) -> torch.Tensor:  # fmt: skip
    if spec.layout == "per_shard":
        shape = (*lead, len(shards), *spec.shape)
    else:
        if spec.layout == "blocks":
            out = sum(-(-size // spec.block_n) for _, size in shards)
        else:
            for offset, size in shards:
                if offset % spec.packed_factor or size % spec.packed_factor:
                    raise QuantError(f"{where}.{spec.suffix}: a part of {size} output features at offset {offset} "
                                     f"does not align with the {spec.packed_factor} packed per element")  # fmt: skip
            out = n // spec.packed_factor
        shape = (*lead, *(out if d is None else d for d in spec.shape))
    return torch.empty(shape, dtype=spec.dtype, device=device)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _param_attrs(spec: TensorSpec, desc: str) -> dict[str, object]:
    allowed = spec.allowed
    if allowed is None:
        allowed = _FLOATS if spec.dtype in _FLOATS else (spec.dtype,)
    return {"output_dim": spec.output_dim if spec.output_dim is not None else 0, "packed_factor": spec.packed_factor,
            "shard_layout": spec.layout, "block_n": spec.block_n, "quant_desc": desc, "allowed_dtypes": allowed,
            "quant_spec": spec}  # fmt: skip


class KernelLinearMethod(LinearQuantMethod):
    def __init__(self, scheme: Scheme, keep_float: bool = False) -> None:
        self.scheme, self.keep_float = scheme, keep_float
        self.name = scheme.name

    def attach(self, layer: LinearBase, prefix: str) -> None:
        layer.quant_prefix = prefix  # type: ignore[assignment]
        if self.keep_float:
            try:
                self.scheme.check(layer.output_size, layer.input_size, layer.output_shards(), prefix)
            except QuantError:
                return  # this scheme cannot hold the module: the checkpoint must store it unquantized
        self.create_weights(layer)
        layer.quant_method = self

    def create_weights(self, layer: LinearBase) -> None:
        from ftransformers.quant.base import replace_parameter

        n, k, shards = layer.output_size, layer.input_size, layer.output_shards()
        where = getattr(layer, "quant_prefix", type(layer).__name__)
        self.scheme.check(n, k, shards, where)
        dtype, device = layer.weight.dtype, layer.weight.device
        if self.keep_float:
            layer.weight.weight_shards = set()  # type: ignore[attr-defined] - optional: float or quantized
        else:
            del layer._parameters["weight"]
        layer.quant_specs = self.scheme.specs(k, dtype)  # type: ignore[assignment]
        for spec in layer.quant_specs:
            if self.keep_float and spec.suffix == "weight":
                continue  # fp8 / int8 data lands in the float weight (exact), dequantized after loading
            t = spec_tensor(spec, n, k, shards, (), device, where)
            param = replace_parameter(layer, spec.suffix, t, **_param_attrs(spec, self.scheme.describe()))
            param.dummy_fill = _dummy_filler(spec, k, shards)  # type: ignore[attr-defined]
            if spec.optional:
                param.weight_shards = set()  # type: ignore[attr-defined]
            if self.keep_float:
                param.weight_shards = set()  # type: ignore[attr-defined]
                param.dummy_fill = lambda param, gen: None  # type: ignore[attr-defined] - dummy keeps the float weight

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        n, k, shards = layer.output_size, layer.input_size, layer.output_shards()
        where = getattr(layer, "quant_prefix", type(layer).__name__)
        specs: list[TensorSpec] = layer.quant_specs  # type: ignore[assignment]
        if self.keep_float:
            self._dequantize_into_weight(layer, specs, n, k, shards, where)
            return
        qw = dense_strides(self.scheme.to_kernel(_loaded(layer, "", specs), n, k, shards, where))
        if qw.qweight.is_cuda and qw.fmt == "int4":
            from ftransformers.kernels.triton_w4a16 import gemv_scale_zero

            qw = replace(qw, scale_zero=gemv_scale_zero(qw))
        for spec in specs:
            del layer._parameters[spec.suffix]
        del layer.quant_specs
        if qw.fmt in ("int8", "fp8_block"):
            layer.register_parameter("weight", nn.Parameter(qw.qweight, requires_grad=False))
        layer.qw = qw  # type: ignore[assignment]

    def _dequantize_into_weight(self, layer: LinearBase, specs: list[TensorSpec], n: int, k: int,
                                shards: list[Shard], where: str) -> None:  # fmt: skip
        extra = [s for s in specs if s.suffix != "weight" and not s.optional]
        got = [bool(getattr(getattr(layer, s.suffix), "ft_loaded", False)) for s in extra]
        weight_got = bool(getattr(layer.weight, "ft_loaded", False))
        if any(got) and not all(got):
            missing = [f"{where}.{s.suffix}" for s, g in zip(extra, got) if not g]
            raise QuantError(f"{self.scheme.describe()}: checkpoint lacks {', '.join(missing)}")
        if all(got) and extra:
            t = _loaded(layer, "", [s for s in specs if s.suffix != "weight"])
            for s in specs:
                if s.suffix == "weight":
                    t["weight"] = layer.weight.data.to(s.dtype)
            qw = self.scheme.to_kernel(t, n, k, shards, where)
            w = dequantize(qw)  # [N, K] in stored column order
            if qw.perm is not None:
                w = torch.empty_like(w).index_copy_(1, qw.perm, w)
            layer.weight.data.copy_(w)
        elif not weight_got:
            raise QuantError(f"{self.scheme.describe()}: checkpoint lacks {where}.weight (or its quantized tensors)")
        for spec in specs:
            if spec.suffix != "weight":
                del layer._parameters[spec.suffix]
        del layer.quant_specs
        layer.quant_method = None

    def reads_ahead_of_wait(self, layer: LinearBase, rows: int) -> bool:
        qw = getattr(layer, "qw", None)
        return qw is not None and quant_reads_ahead(qw, rows)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        y = quant_linear(x.reshape(-1, x.shape[-1]), layer.qw, layer.bias)  # type: ignore[arg-type]
        return y.view(*x.shape[:-1], y.shape[-1])


class KernelMoEMethod:
    """A FusedMoE's experts in one scheme: stacked checkpoint-layout tensors, then w13_qw / w2_qw."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.name = scheme.name

    def _stacks(self, moe: FusedMoE) -> list[tuple[str, int, int]]:
        D, I = moe.hidden_size, moe.intermediate_size
        return [("w13", 2 * I, D), ("w2", D, I)]

    def attach(self, moe: FusedMoE, prefix: str) -> None:
        moe.quant_prefix = prefix  # type: ignore[assignment]
        E = moe.num_experts
        for which, n, k in self._stacks(moe):
            shards = moe.expert_shards(which)
            where = f"{prefix}.{{e}}.{'gate_proj/up_proj' if which == 'w13' else 'down_proj'}"
            self.scheme.check(n, k, shards, where)
            old = moe._parameters.pop(f"{which}_weight")
            needed = {(e, s) for e in range(E) for s in (("w1", "w3") if which == "w13" else ("w2",))}
            specs = self.scheme.specs(k, old.dtype)
            setattr(moe, f"{which}_quant_specs", specs)
            for spec in specs:
                t = spec_tensor(spec, n, k, shards, (E,), old.device, where)
                param = nn.Parameter(t, requires_grad=False)
                for key, value in _param_attrs(spec, self.scheme.describe()).items():
                    setattr(param, key, value)
                param.weight_loader = moe.weight_loader  # type: ignore[attr-defined]
                param.weight_shards = set() if spec.optional else needed  # type: ignore[attr-defined]
                param.dummy_fill = _dummy_filler(spec, k, shards)  # type: ignore[attr-defined]
                moe.register_parameter(f"{which}_{spec.suffix}", param)
        moe.quant_method = self

    def process_weights_after_loading(self, moe: FusedMoE) -> None:
        prefix = getattr(moe, "quant_prefix", "experts")
        out: list[QuantizedWeight] = []
        for which, n, k in self._stacks(moe):
            specs: list[TensorSpec] = getattr(moe, f"{which}_quant_specs")
            t = _loaded(moe, f"{which}_", specs)
            where = f"{prefix}.{'w13 (gate_proj/up_proj)' if which == 'w13' else 'w2 (down_proj)'}"
            qw = self._convert_experts(t, n, k, moe.expert_shards(which), where)
            if qw.perm is not None:
                raise QuantError(f"{self.scheme.describe()}: {where}: act-order (desc_act / g_idx) experts are "
                                 "not supported; only dense layers take a column permutation")  # fmt: skip
            for spec in specs:
                del moe._parameters[f"{which}_{spec.suffix}"]
            delattr(moe, f"{which}_quant_specs")
            out.append(qw)
        moe.w13_qw, moe.w2_qw = out

    def _convert_experts(self, t: dict[str, torch.Tensor], n: int, k: int, shards: list[Shard], where: str) -> QuantizedWeight:
        """to_kernel one expert at a time into preallocated stacks: the conversion's temporaries (int4
        repacking goes through int64) stay the size of one expert, not of the whole [E, ...] stack."""
        E = next(iter(t.values())).shape[0]
        stacks: dict[str, torch.Tensor] = {}
        first: QuantizedWeight | None = None
        for e in range(E):
            qw = self.scheme.to_kernel({s: v[e] for s, v in t.items()}, n, k, shards, where)
            if qw.perm is not None:
                return qw  # the caller refuses act order for experts
            if first is None:
                first = qw
            if qw.zeros is None and (first.zeros is not None or "zeros" in stacks):
                qw = replace(qw, zeros=torch.full_like(first.scales, 8, dtype=torch.uint8))
            for f in ("qweight", "scales", "zeros", "global_scale"):
                value = getattr(qw, f)
                if value is None:
                    continue
                if f not in stacks:  # zeros may first appear at a later expert: earlier ones had all 8
                    stacks[f] = torch.empty((E, *value.shape), dtype=value.dtype, device=value.device)
                    if f == "zeros":
                        stacks[f][:e].fill_(8)
                stacks[f][e].copy_(value)
        assert first is not None
        return replace(first, **stacks)


def _loaded(module: nn.Module, prefix: str, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """suffix -> tensor of each spec the checkpoint provided (optional ones it lacked are left out)."""
    out = {}
    for s in specs:
        param = module._parameters[prefix + s.suffix]
        if not s.optional or getattr(param, "ft_loaded", False):
            out[s.suffix] = param.data
    return out


# load_format=dummy --------------------------------------------------------------------------------


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of t along dim 0 of at most ~_CHUNK elements each (whole t when it is small or 1-D)."""
    if t.dim() < 2 or t.numel() <= _CHUNK:
        return [t]
    step = max(1, _CHUNK // max(1, t[0].numel()))
    return [t[i : i + step] for i in range(0, t.shape[0], step)]


def _dummy_filler(spec: TensorSpec, k: int, shards: list[Shard]) -> Callable[[nn.Parameter, torch.Generator], None]:
    """A function (param, gen) -> None filling `param` with valid random values of its kind (spec.dummy):
    float (weights of a load-time method), bits (packed codes), int8, scale (positive), fp8 (finite
    E4M3 codes), e8m0 (biased exponents), g_idx, shape (ct's weight_shape)."""
    kind, *args = spec.dummy

    def fill(param: nn.Parameter, gen: torch.Generator) -> None:  # the parameter as it is when filled
        data = param.data
        for part in _chunks(data):
            if kind == "float":
                part.uniform_(-args[0], args[0], generator=gen)
            elif kind == "bits":
                if part.dtype == torch.int32:
                    part.random_(-(2**31), 2**31 - 1, generator=gen)
                else:
                    part.random_(0, 256, generator=gen)
            elif kind == "scale":
                tmp = torch.empty(part.shape, dtype=torch.float32, device=part.device).uniform_(0.5, 1.5, generator=gen)
                part.copy_(tmp * args[0])
            elif kind == "fp8":
                codes = part.view(torch.uint8)
                codes.random_(0, 254, generator=gen)  # 0x00..0xFD; 0x7F is E4M3's NaN
                codes.masked_fill_(codes == 0x7F, 0x7E)
            elif kind == "int8":
                part.random_(-127, 128, generator=gen)
            elif kind == "e8m0":
                part.random_(int(args[0]) - 1, int(args[0]) + 2, generator=gen)
        param.ft_loaded = True  # type: ignore[attr-defined]
        if kind == "g_idx":  # [.., S, K]: group of each input column, the same in every part
            group, permute = int(args[0]), bool(args[1]) and data.dim() == 2  # act order: dense layers only
            order = torch.arange(k, device=data.device) // group
            if permute:
                order = order[torch.randperm(k, generator=gen, device=data.device)]
            data.copy_(order.to(data.dtype).expand_as(data))
        elif kind == "shape":  # [.., S, 2]: (rows, in_features) of each part
            sizes = torch.tensor([[size, k] for _, size in shards], dtype=data.dtype, device=data.device)
            data.copy_(sizes.expand_as(data))

    return fill


# to_kernel helpers shared by the formats ------------------------------------------------------------


def dense_strides(qw: QuantizedWeight) -> QuantizedWeight:
    """qw with every tensor in row-major strides, size-1 dims included (`contiguous()` leaves a
    transposed [N, 1] as it is; the kernels assert unit strides along the last dim)."""
    out = {}
    for f in ("qweight", "scales", "zeros", "global_scale"):
        t = getattr(qw, f)
        if t is not None:
            want = torch.empty(t.shape, device="meta").stride()
            out[f] = t if t.stride() == want else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return replace(qw, **out)


def int4_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, n: int, k: int,
                group: int, perm: torch.Tensor | None = None) -> QuantizedWeight:  # fmt: skip
    """The "int4" layout from qweight int32 [.., N, K//8], scales [.., N, K//G], zeros uint8-valued
    [.., N, K//G] (dropped when every zero is 8, the symmetric grid)."""
    if zeros is not None:
        zeros = zeros.to(torch.uint8).contiguous()
        if bool((zeros == 8).all()):
            zeros = None
    return QuantizedWeight("int4", qweight.contiguous(), scales.contiguous(), n, k, group, zeros=zeros, perm=perm)


def rows_of_shards(values: torch.Tensor, shards: list[Shard]) -> torch.Tensor:
    """Per-part values [.., S] -> per-row [.., N] (each part's value repeated over its rows)."""
    sizes = torch.tensor([size for _, size in shards], device=values.device)
    return torch.repeat_interleave(values, sizes, dim=-1)


def block_scales(scales: torch.Tensor, shards: list[Shard], block_n: int) -> tuple[torch.Tensor, int]:
    """Block scales stored part by part ([.., sum_i ceil(size_i/bn), KB], layout "blocks") -> the
    kernel's [.., ceil(N/bn'), KB] and bn'. bn' = bn when every part starts on a block boundary (the
    usual case: parts are stacked as they are); otherwise the largest divisor of bn that every part
    offset is a multiple of, each scale repeated over the finer blocks it covers (exact)."""
    offsets = [offset for offset, _ in shards]
    fine = block_n
    for offset in offsets:
        fine = math.gcd(fine, offset)
    if fine == block_n:
        return scales.contiguous(), block_n
    parts, start = [], 0
    for _, size in shards:
        nb = -(-size // block_n)
        part = scales.narrow(-2, start, nb).repeat_interleave(block_n // fine, dim=-2)
        parts.append(part.narrow(-2, 0, -(-size // fine)))
        start += nb
    return torch.cat(parts, dim=-2).contiguous(), fine
