"""The in-memory layouts of quantized weights, and their plain-PyTorch references.

Every checkpoint format (AWQ, GPTQ, compressed-tensors, DeepSeek FP8, MXFP4, NVFP4, W8A8 INT8) is
converted at load time into one of five kernel layouts held in a `QuantizedWeight`. The Triton
kernels (`triton_w4a16`, `triton_fp8_gemm`, `triton_int8_gemm`, `triton_fused_moe_w4`,
`triton_fused_moe_w8`) read exactly these layouts, and the functions here are both the CPU path and
the reference the kernels are tested against. No Triton import here: the CPU engine needs none.

Shapes: N = out_features, K = in_features; MoE experts add a leading expert dim E to every tensor
except `perm`.

  fmt         qweight                        scales                          extra
  "int4"      int32 [N, K//8]  uint4 codes   float (any) [N, K//G]          zeros uint8 [N, K//G] | None
  "mxfp4"     int32 [N, K//8]  E2M1 codes    uint8 E8M0 [N, K//32]
  "nvfp4"     int32 [N, K//8]  E2M1 codes    float8_e4m3fn [N, K//16]        global_scale float32 [N]
  "fp8_block" float8_e4m3fn [N, K]           float32 [ceil(N/BN), ceil(K/BK)]  block (BN, BK) = (128, 128)
  "int8"      int8 [N, K]                    float32 [N]

4-bit packing: code (n, k) = (qweight[n, k // 8] >> (4 * (k % 8))) & 0xF, low nibble first along K
(compressed-tensors' order; a little-endian view of FP4's uint8 [N, K//2] pairs is the same layout).

Dequantization (w[n, k] in float32):
  int4       (code - zero) * scale[n, k // G], zero = zeros[n, k // G] or 8 when zeros is None
  mxfp4      e2m1(code) * 2 ** (scale[n, k // 32] - 127)
  nvfp4      e2m1(code) * float(scale[n, k // 16]) * global_scale[n]
  fp8_block  float(q) * scale[n // BN, k // BK]
  int8       q * scale[n]

Activations: 4-bit formats are weight-only (x stays in its dtype; kernels dequantize weight tiles in
registers and use 16-bit dots). "fp8_block" quantizes x per token and per BK-column group to E4M3
(scale = amax / 448); "int8" quantizes x per token to INT8 (scale = amax / 127). The references
below do the same quantization so kernels and references agree to accumulation order.

`perm` (GPTQ act-order, dense only): the columns of `qweight`/`scales` are stored in the order `perm`
(int64 [K]), and the layer computes y = x[:, perm] @ W^T.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FORMATS = ("int4", "mxfp4", "nvfp4", "fp8_block", "int8")
FOUR_BIT_FORMATS = ("int4", "mxfp4", "nvfp4")
FP8_MAX = 448.0
INT8_MAX = 127.0
# E2M1 value of each 4-bit code: bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [N, K] weight (or [E, N, K] stacked experts) in one kernel layout (module docstring)."""

    fmt: str
    qweight: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group_size: int  # K elements per scale: int4 G, mxfp4 32, nvfp4 16, fp8_block BK, int8 K
    zeros: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    block_n: int = 128  # fp8_block only: rows per scale
    # int4 [N, K] with 16-bit scales: the one-row GEMV's copy of scales and zeros, int32 [ceil(N / 4), K // G, 4]
    # of scale bits | zero << 16 (scale_zero_copy); None: the kernels read `scales` and `zeros`
    scale_zero: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized weight format {self.fmt!r}; valid: {', '.join(FORMATS)}")

    @property
    def num_experts(self) -> int | None:
        return self.qweight.shape[0] if self.qweight.dim() == 3 else None

    def expert(self, e: int) -> QuantizedWeight:
        """The 2-D weight of expert e of a stacked [E, ...] weight."""
        return replace(
            self,
            qweight=self.qweight[e],
            scales=self.scales[e],
            zeros=None if self.zeros is None else self.zeros[e],
            global_scale=None if self.global_scale is None else self.global_scale[e],
        )

    def nbytes(self) -> int:
        """Bytes a kernel streams to read the whole weight."""
        tensors = (self.qweight, self.scales, self.zeros, self.global_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


SCALE_ZERO_ROWS = 4  # rows of a scale_zero block: one 16-byte load


def scale_zero_copy(qw: QuantizedWeight) -> torch.Tensor | None:
    """QuantizedWeight.scale_zero for a 2-D int4 weight with fp16 / bf16 scales (zero 8 where it has no
    zeros); None for any other weight. Element [n // 4, g, n % 4] holds row n's group g: each group's 4 rows
    are 16 contiguous bytes, and a block of 4 rows' groups is contiguous (a GEMV program's scales are one
    span of memory, as in `scales`). Four bytes a group and row, beside the scales and zeros the other
    kernels read; padded rows past N hold zeros."""
    if qw.fmt != "int4" or qw.qweight.dim() != 2 or qw.scales.dtype not in (torch.float16, torch.bfloat16):
        return None
    n, groups = qw.scales.shape
    bits = qw.scales.view(torch.int16).to(torch.int32) & 0xFFFF  # [N, K // G]
    zeros = torch.full_like(bits, 8) if qw.zeros is None else qw.zeros.to(torch.int32)
    r = SCALE_ZERO_ROWS
    out = torch.zeros(-(-n // r) * r, groups, dtype=torch.int32, device=bits.device)
    out[:n] = bits | (zeros << 16)
    return out.view(-1, r, groups).transpose(1, 2).contiguous()  # [ceil(N / 4), K // G, 4]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] integers in 0..15 -> int32 [..., K//8], low nibble first."""
    k = codes.shape[-1]
    if k % 8:
        raise ValueError(f"pack_int4: last dim {k} is not a multiple of 8")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    packed = (c << shifts).sum(dim=-1)  # [..., K//8] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K//8] -> uint8 codes [..., K]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., K//8, 8]
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.uint8)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer dtype, 0..15) -> float32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to the nearest E2M1 code -> uint8 0..15.
    Ties go to the even mantissa, as in the OCP MX spec; |x| > 6 saturates to 6."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    a = x.float().abs().clamp(max=6.0)
    dist = (a.unsqueeze(-1) - mags).abs()  # [..., 8]
    # Among equally near codes prefer the even one (mantissa bit 0): subtract a tiny bias from even codes.
    even = (torch.arange(8, device=x.device) % 2 == 0).float() * 1e-6
    code = torch.argmin(dist - even, dim=-1)
    sign = (x < 0) & (code > 0)
    return (code + 8 * sign.long()).to(torch.uint8)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] (or [E, N, K]) a QuantizedWeight stands for, columns in stored order."""
    f, g = qw.fmt, qw.group_size
    if f in FOUR_BIT_FORMATS:
        codes = unpack_int4(qw.qweight)  # [..., N, K]
        if f == "int4":
            zeros = 8.0 if qw.zeros is None else qw.zeros.float().repeat_interleave(g, dim=-1)
            return (codes.float() - zeros) * qw.scales.float().repeat_interleave(g, dim=-1)
        vals = e2m1_to_float(codes)
        if f == "mxfp4":
            scale = torch.exp2(qw.scales.float() - 127.0)
            return vals * scale.repeat_interleave(g, dim=-1)
        assert qw.global_scale is not None, "nvfp4 needs global_scale"
        scale = qw.scales.float() * qw.global_scale.float().unsqueeze(-1)
        return vals * scale.repeat_interleave(g, dim=-1)
    if f == "fp8_block":
        n, k = qw.qweight.shape[-2:]
        s = qw.scales.float().repeat_interleave(qw.block_n, dim=-2).repeat_interleave(g, dim=-1)
        return qw.qweight.float() * s[..., :n, :k]
    return qw.qweight.float() * qw.scales.float().unsqueeze(-1)  # int8


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b correctly rounded on every device (CUDA divides by a Python scalar through its reciprocal,
    one ulp off the IEEE quotient the kernels compute)."""
    return a / torch.full_like(a, b)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 values in [-448, 448] -> the nearest E4M3 value (ties to even), still float32. Done in
    exact float arithmetic because torch's own float32 -> float8 cast is not correctly rounded on CUDA
    for every input (it disagreed with the CPU on ~0.2% of activations on an H100)."""
    _, exp = torch.frexp(v.abs().clamp_min(2.0**-6))  # |v| = m * 2^exp, m in [0.5, 1); subnormals: 2^-6
    step = torch.exp2((exp - 4).to(torch.float32))  # 3 mantissa bits below the leading one
    return torch.round(v / step) * step  # the quotient is exact (step is a power of two)


def quantize_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M, 1]): symmetric per token."""
    xf = x.float()
    scale = _div(xf.abs().amax(dim=-1, keepdim=True), INT8_MAX).clamp_min(1e-10)
    return torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_act_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scale [M, ceil(K/group)]): per token and K-group."""
    m, k = x.shape
    ng = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, ng * group - k)).view(m, ng, group)
    scale = _div(xf.abs().amax(dim=-1), FP8_MAX).clamp_min(1e-10)  # [M, ng]
    q = round_to_e4m3((xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    return q.view(m, ng * group)[:, :k].contiguous(), scale


def _fake_quant_act(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [M, K] as the kernels see it (float32): activation-quantized for fp8_block / int8, else as is."""
    if qw.fmt == "int8":
        q, s = quantize_act_int8(x)
        return q.float() * s
    if qw.fmt == "fp8_block":
        q, s = quantize_act_fp8(x, qw.group_size)
        return q.float() * s.repeat_interleave(qw.group_size, dim=-1)[:, : x.shape[1]]
    return x.float()


def quant_linear_ref(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [M, K] -> [M, N] in x.dtype, float32 accumulation."""
    if qw.perm is not None:
        x = x[:, qw.perm]
    y = _fake_quant_act(x, qw) @ dequantize(qw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quant_moe_ref(
    hidden: torch.Tensor,  # [T, D]
    w13: QuantizedWeight,  # [E, 2I, D]: rows [gate | up]
    w2: QuantizedWeight,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, D] hidden.dtype
    """Experts one at a time, each dequantized once. The SiLU(gate) * up intermediate is rounded to
    hidden.dtype before the down projection, as in the fused kernels."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids.reshape(-1)).tolist():
        token_idx, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        x = hidden.index_select(0, token_idx)  # [n, D]
        gate_up = quant_linear_ref(x, w13.expert(expert)).float()  # [n, 2I]
        inter = gate_up.shape[-1] // 2
        act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(hidden.dtype)
        y = quant_linear_ref(act, w2.expert(expert)).float()  # [n, D]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot].unsqueeze(-1).float())
    return out.to(hidden.dtype)
