"""The kernel layouts of kernels/quant_formats.py: packing, FP4 codes, dequantization and the
activation-quantized references, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from ftransformers.kernels.quant_formats import (
    E2M1_VALUES,
    QuantizedWeight,
    dequantize,
    e2m1_to_float,
    float_to_e2m1,
    pack_int4,
    quant_linear_ref,
    quant_moe_ref,
    quantize_act_fp8,
    quantize_act_int8,
    scale_zero_copy,
    unpack_int4,
)


def test_pack_int4_round_trip_and_nibble_order() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 3, 64), generator=g).to(torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 3, 8) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed), codes)
    # element k of a word sits at bits 4*(k%8): element 0 in the low nibble, element 7 in the top one
    assert int(pack_int4(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]]))) == 1
    assert int(pack_int4(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]]))) == -(2**28)  # 0xF0000000 as int32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("zeros", [True, False])
def test_scale_zero_copy_holds_each_group_scale_and_zero(dtype: torch.dtype, zeros: bool) -> None:
    g = torch.Generator().manual_seed(5)
    n, k, group = 7, 256, 64
    scales = (torch.rand(n, k // group, generator=g) * 0.02 - 0.01).to(dtype)  # both signs
    z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8) if zeros else None
    qw = QuantizedWeight("int4", pack_int4(torch.randint(0, 16, (n, k), generator=g)), scales, n, k, group, zeros=z)
    sz = scale_zero_copy(qw)
    assert sz is not None and sz.shape == (2, k // group, 4) and sz.dtype == torch.int32 and sz.is_contiguous()
    rows = sz.transpose(1, 2).reshape(8, k // group)  # [N padded to 8, K // G]
    assert torch.equal(rows[n:], torch.zeros(1, k // group, dtype=torch.int32).expand(8 - n, -1))
    assert torch.equal((rows[:n] & 0xFFFF).to(torch.int16).view(dtype), scales)
    assert torch.equal(rows[:n] >> 16, z.to(torch.int32) if z is not None else torch.full((n, k // group), 8))
    fp32 = QuantizedWeight("int4", qw.qweight, scales.float(), n, k, group)
    fp4 = QuantizedWeight("mxfp4", qw.qweight, torch.full((n, k // 32), 127, dtype=torch.uint8), n, k, 32)
    stacked = QuantizedWeight("int4", qw.qweight[None], scales[None], n, k, group)
    assert scale_zero_copy(fp32) is None and scale_zero_copy(fp4) is None and scale_zero_copy(stacked) is None


def test_pack_int4_is_the_little_endian_view_of_fp4_byte_pairs() -> None:
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (4, 32), generator=g).to(torch.uint8)
    as_bytes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # uint8 [N, K//2], low nibble first
    assert torch.equal(as_bytes.view(torch.int32), pack_int4(codes))


def test_e2m1_round_trip_and_rounding() -> None:
    codes = torch.arange(16)
    vals = e2m1_to_float(codes)
    back = float_to_e2m1(vals)
    assert torch.equal(e2m1_to_float(back), vals)
    assert e2m1_to_float(float_to_e2m1(torch.tensor([0.74, 0.76, 2.5, 5.1, 9.0, -0.26]))).tolist() == [
        0.5, 1.0, 2.0, 6.0, 6.0, -0.5]  # fmt: skip
    assert e2m1_to_float(float_to_e2m1(torch.tensor([0.25, 1.25, 5.0]))).tolist() == [0.0, 1.0, 4.0]  # ties to even
    assert len(E2M1_VALUES) == 16


def _random_qw(fmt: str, n: int, k: int, g: torch.Generator, experts: int | None = None) -> QuantizedWeight:
    lead = () if experts is None else (experts,)
    group = {"int4": 32, "mxfp4": 32, "nvfp4": 16, "fp8_block": 128, "int8": k}[fmt]
    if fmt in ("int4", "mxfp4", "nvfp4"):
        qweight = pack_int4(torch.randint(0, 16, (*lead, n, k), generator=g))
    elif fmt == "fp8_block":
        qweight = (torch.randn(*lead, n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        qweight = torch.randint(-127, 128, (*lead, n, k), generator=g).to(torch.int8)
    zeros = global_scale = None
    if fmt == "int4":
        scales = torch.rand(*lead, n, k // group, generator=g) * 0.02 + 0.001
        zeros = torch.randint(0, 16, (*lead, n, k // group), generator=g).to(torch.uint8)
    elif fmt == "mxfp4":
        scales = torch.randint(118, 124, (*lead, n, k // group), generator=g).to(torch.uint8)
    elif fmt == "nvfp4":
        scales = (torch.rand(*lead, n, k // group, generator=g) * 400 + 1).to(torch.float8_e4m3fn)
        global_scale = torch.rand(*lead, n, generator=g) * 1e-4 + 1e-5
    elif fmt == "fp8_block":
        scales = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 1e-4 + 1e-5
    else:
        scales = torch.rand(*lead, n, generator=g) * 1e-3 + 1e-4
    return QuantizedWeight(fmt, qweight, scales, n, k, group, zeros=zeros, global_scale=global_scale)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4", "fp8_block", "int8"])
def test_dequantize_matches_the_elementwise_definition(fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    n, k = 160, 256  # n not a multiple of the FP8 block: the last block row is partial
    qw = _random_qw(fmt, n, k, g)
    w = dequantize(qw)
    assert w.shape == (n, k)
    rows, cols = torch.randint(0, n, (50,), generator=g), torch.randint(0, k, (50,), generator=g)
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        if fmt in ("int4", "mxfp4", "nvfp4"):
            code = (int(qw.qweight[r, c // 8]) >> (4 * (c % 8))) & 0xF
            gi = c // qw.group_size
            if fmt == "int4":
                want = (code - int(qw.zeros[r, gi])) * float(qw.scales[r, gi])
            elif fmt == "mxfp4":
                want = E2M1_VALUES[code] * 2.0 ** (int(qw.scales[r, gi]) - 127)
            else:
                want = E2M1_VALUES[code] * float(qw.scales[r, gi].float()) * float(qw.global_scale[r])
        elif fmt == "fp8_block":
            want = float(qw.qweight[r, c].float()) * float(qw.scales[r // 128, c // 128])
        else:
            want = int(qw.qweight[r, c]) * float(qw.scales[r])
        assert float(w[r, c]) == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_activation_quantizers_bound_their_error() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 300, generator=g) * 3
    q8, s8 = quantize_act_int8(x)
    assert q8.dtype == torch.int8 and s8.shape == (7, 1)
    assert ((q8.float() * s8 - x).abs() <= s8 / 2 + 1e-6).all()
    qf, sf = quantize_act_fp8(x, 128)
    assert qf.shape == x.shape and sf.shape == (7, 3)
    back = qf.float() * sf.repeat_interleave(128, dim=1)[:, :300]
    assert ((back - x).abs() <= x.abs() * 2**-4 + sf.repeat_interleave(128, dim=1)[:, :300] * 2**-9).all()


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4", "fp8_block", "int8"])
def test_linear_and_moe_references_agree_with_dense_math(fmt: str) -> None:
    g = torch.Generator().manual_seed(5)
    e, d, inter, t, top = 4, 256, 128, 6, 2
    w13, w2 = _random_qw(fmt, 2 * inter, d, g, e), _random_qw(fmt, d, inter, g, e)
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(t)])
    wts = torch.rand(t, top, generator=g)
    out = quant_moe_ref(x, w13, w2, wts, ids)
    for i in range(t):
        want = torch.zeros(d)
        for j in range(top):
            ex = int(ids[i, j])
            gu = quant_linear_ref(x[i : i + 1], w13.expert(ex))[0]
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            want += float(wts[i, j]) * quant_linear_ref(act[None], w2.expert(ex))[0]
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
    if fmt not in ("fp8_block", "int8"):  # weight-only: the linear is x @ dequantize(W)^T exactly
        xi = torch.randn(3, inter, generator=g)
        torch.testing.assert_close(quant_linear_ref(xi, w2.expert(0)), xi @ dequantize(w2.expert(0)).t())
