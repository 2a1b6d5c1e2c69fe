"""Triton 8-bit GEMMs (FP8 block-scaled, W8A8 INT8) and their fused MoE vs `quant_linear_ref` /
`quant_moe_ref` (kernels/quant_formats.py) on fresh random inputs.

Weights are realistic quantizations of randn weights: fp8 = (w / s) cast to E4M3 with s the
128x128 block's amax / 448; int8 = round(w / s) with s the row's amax / 127.

Tolerance: ||out - ref|| / ||ref|| <= 2e-2 for bfloat16 and float16. Activation quantization is
identical on both sides (checked bit for bit by the act-quant tests, ties included), so what remains
is (a) float32 summation order (tensor-core or CUDA-core partial sums per K group vs the reference's
float32 matmul; int8 products are summed exactly in int32, then scaled), a few float32 ulps, and
(b) rounding of the output to 16 bits, up to 2^-8 relative per element for bfloat16. In the MoE a
one-ulp difference in the rounded intermediate can move an element across an 8-bit rounding
boundary, which costs at most one quantization step (2^-4 relative for E4M3) on that element; a
few such elements stay far below 2e-2 in norm. Measured: on CPU (interpreter) the kernels match
the reference bit for bit in most cases; on an H100 int8 is within 5e-4, but fp8 sits at 2-5e-3
(dense) and 1.4-2.5e-2 (MoE, Qwen3-30B-A3B shape) against the reference run on CUDA, a gap not
explained yet (benchmarks/bench_w8.py --sections diag compares the CUDA and CPU references).

CPU: TRITON_INTERPRET=1, tiny shapes (N=160 and 37, K=256 and 300: partial 128-groups and scale
blocks). Triton 3.6's interpreter truncates float32 -> bfloat16 (GPUs round to nearest even), so
this module makes the interpreter's cast round to nearest even while it runs. CUDA: K=7168,
N in {576, 160, 2112}, Qwen3-30B-A3B-shaped experts, and CUDA-graph replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.quant_formats import (
    QuantizedWeight,
    quant_linear_ref,
    quant_moe_ref,
    quantize_act_fp8,
    quantize_act_int8,
)
from ftransformers.kernels.triton_fp8_gemm import Fp8GemmConfig, Fp8GemvConfig, fp8_block_linear, quant_act_fp8
from ftransformers.kernels.triton_fused_moe import MoEConfig
from ftransformers.kernels.triton_fused_moe_w8 import W8PairConfig, fused_moe_w8
from ftransformers.kernels.triton_int8_gemm import Int8GemmConfig, Int8GemvConfig, int8_linear, quant_act_int8
from ftransformers.kernels.triton_moe_w8_token import TokenW8Config, moe_w8_token, takes
from ftransformers.kernels.triton_w8_row import w8_row

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 2e-2
DTYPES = [torch.bfloat16, torch.float16]
# (N, K) of dense weights: odd N (DeepSeek's kv_a 576, 160), K not a multiple of 128 on CPU.
SHAPES = [(576, 7168), (160, 7168), (2112, 7168)] if CUDA else [(160, 256), (37, 300)]


@pytest.fixture(autouse=True, scope="module")
def _interpreter_bf16_rounds_to_nearest() -> Iterator[None]:
    if CUDA:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    yield
    interpreter.InterpreterBuilder.cast_impl = original


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> QuantizedWeight:
    """w [..., N, K] float -> fp8_block weight with per-(block x block) amax / 448 scales."""
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wp = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    wp = wp.view(*lead, nb, block, kb, block)
    s = (wp.abs().amax(dim=(-3, -1)) / 448.0).clamp_min(1e-10)  # [..., NB, KB]
    q = (wp / s[..., :, None, :, None]).to(torch.float8_e4m3fn).view(*lead, nb * block, kb * block)
    return QuantizedWeight("fp8_block", q[..., :n, :k].contiguous(), s, n, k, block)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """w [..., N, K] float -> int8 weight with per-row amax / 127 scales."""
    s = (w.float().abs().amax(dim=-1) / 127.0).clamp_min(1e-10)
    q = torch.round(w.float() / s[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, s, w.shape[-2], w.shape[-1], w.shape[-1])


def make_weight(fmt: str, shape: tuple[int, ...], gen: torch.Generator) -> QuantizedWeight:
    w = (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(DEV)
    return quantize_fp8_block(w) if fmt == "fp8_block" else quantize_int8(w)


LINEARS = {"fp8_block": fp8_block_linear, "int8": int8_linear}


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_quant_is_bit_identical(dtype: torch.dtype) -> None:
    # Against the reference on CPU: torch on CUDA divides by a Python scalar as a multiplication by
    # its reciprocal, so there amax / 448 can be one ulp off the IEEE quotient the kernels compute.
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 300, generator=gen) * 3).to(DEV, dtype)
    x[1] = 0  # an all-zero row: scale clamps to 1e-10
    x[2, :7] = torch.tensor([1e-3, -2e-3, 3e-4, 0.0, 5e-5, -1e-6, 7.0], dtype=dtype)  # fp8 subnormals
    q, s = quant_act_fp8(x)
    rq, rs = quantize_act_fp8(x.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
    q, s = quant_act_int8(x)
    rq, rs = quantize_act_int8(x.cpu())
    assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs[:, 0])


def test_act_quant_ties_round_to_even() -> None:
    # int8: amax 15.875 -> scale 0.125 exactly, so x / scale hits k + 0.5 exactly.
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.0])
    x = torch.cat([torch.tensor([15.875]), halves * 0.125]).view(1, -1).to(DEV)
    assert torch.equal(quant_act_int8(x)[0].cpu(), quantize_act_int8(x.cpu())[0])
    # fp8: amax 448 -> scale 1, midpoints between E4M3 neighbours (normal and subnormal).
    mids = torch.tensor([1.0625, 1.1875, -1.0625, 2.125, 2.375, 3 * 2.0**-10, 5 * 2.0**-10, 232.0, 15.5])
    x = torch.cat([torch.tensor([448.0]), mids]).view(1, -1).to(DEV)
    q, _ = quant_act_fp8(x)
    assert torch.equal(q.cpu().view(torch.uint8), quantize_act_fp8(x.cpu())[0].view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8_block", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 4, 16, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(fmt: str, dtype: torch.dtype, M: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(M * 10 + bias)
    shapes = SHAPES if CUDA else SHAPES[bias : bias + 1]  # CPU: one shape per bias setting
    for n, k in shapes:
        qw = make_weight(fmt, (n, k), gen)
        x = torch.randn(M, k, generator=gen).to(DEV, dtype)
        b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
        out = LINEARS[fmt](x, qw, b)
        assert out.dtype == dtype
        assert rel_err(out, quant_linear_ref(x, qw, b)) <= TOL, (n, k)


@pytest.mark.parametrize(
    "fmt,cfg,M",
    [
        ("fp8_block", Fp8GemvConfig(4, 8, 64, late_sum=False, num_stages=2), 3),
        ("fp8_block", Fp8GemvConfig(2, 16, 128, late_sum=True), 2),
        ("fp8_block", Fp8GemmConfig(16, 32, 1, 4, 2), 9),
        ("fp8_block", Fp8GemmConfig(16, 32, 2, 4, 2), 40),
        ("int8", Int8GemvConfig(1, 8, 128, dot=False, prequant=False, late_sum=True), 1),
        ("int8", Int8GemvConfig(4, 8, 64, dot=False, prequant=True), 3),
        ("int8", Int8GemvConfig(4, 8, 64, dot=False, prequant=False, late_sum=True), 4),
        ("int8", Int8GemvConfig(16, 16, 64, dot=True, prequant=False), 9),
        ("int8", Int8GemmConfig(16, 32, 32, 2, 4, 2), 40),
    ],
)
def test_linear_every_kernel_variant(fmt: str, cfg: object, M: int) -> None:
    """Each kernel with small tiles (several programs and K steps), and x a row slice of a wider buffer."""
    gen = torch.Generator().manual_seed(17)
    qw = make_weight(fmt, (160, 300), gen)
    x = torch.randn(M, 400, generator=gen).to(DEV, torch.bfloat16)[:, 50:350]
    out = LINEARS[fmt](x, qw, None, cfg)
    assert rel_err(out, quant_linear_ref(x, qw)) <= TOL


@pytest.mark.parametrize("fmt", ["fp8_block", "int8"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tiles", [(None, None), (4, 16), (2, 512)])  # (warps, weight elements a thread)
def test_w8_row_matches_reference(fmt: str, bias: bool, tiles: tuple[int | None, int | None]) -> None:
    shapes = [(5120, 2048), (2048, 4096), (160, 300)] if CUDA else [(160, 256), (37, 300)]
    for i, (n, k) in enumerate(shapes):
        gen = torch.Generator().manual_seed(17 + i)
        qw = make_weight(fmt, (n, k), gen)
        dtype = DTYPES[i % 2]
        x = torch.randn(1, k, generator=gen).to(DEV, dtype)
        b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
        out = w8_row(x, qw, b, torch.empty(1, n, device=DEV, dtype=dtype), *tiles)
        assert rel_err(out, quant_linear_ref(x, qw, b)) <= TOL, (fmt, n, k, dtype)


@pytest.mark.skipif(not CUDA, reason="quant_linear takes the kernels on CUDA only")
@pytest.mark.parametrize("fmt", ["fp8_block", "int8"])
def test_quant_linear_takes_the_row_kernel_for_one_row(fmt: str) -> None:
    from ftransformers.kernels import triton_w8_row
    from ftransformers.quant.kernel_method import quant_linear, quant_reads_ahead

    gen = torch.Generator().manual_seed(5)
    qw = make_weight(fmt, (2048, 4096), gen)
    x = torch.randn(1, 4096, generator=gen).to(DEV, torch.bfloat16)
    assert triton_w8_row.takes(x, qw) and quant_reads_ahead(qw, 1) and not quant_reads_ahead(qw, 2)
    assert rel_err(quant_linear(x, qw), quant_linear_ref(x, qw)) <= TOL


def test_linear_rejects_other_formats() -> None:
    gen = torch.Generator().manual_seed(1)
    qw = make_weight("int8", (16, 64), gen)
    with pytest.raises(ValueError):
        fp8_block_linear(torch.randn(1, 64, device=DEV), qw)
    assert int8_linear(torch.randn(0, 64, device=DEV), qw).shape == (0, 16)


def make_routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, K] distinct per token
    weights = torch.rand(t, k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(DEV), ids.to(DEV)


def make_moe(fmt: str, t: int, d: int, inter: int, e: int, dtype: torch.dtype, gen: torch.Generator):
    hidden = torch.randn(t, d, generator=gen).to(DEV, dtype)
    return hidden, make_weight(fmt, (e, 2 * inter, d), gen), make_weight(fmt, (e, d, inter), gen)


# (T, E, K, config): CPU D=160, I=96 (the 2I=192 gate|up rows straddle a 128-row scale block).
MOE_CASES = (
    [
        (1, 8, 8, None),
        (8, 128, 8, None),
        (64, 128, 8, None),
        (300, 128, 8, None),
        (5, 4, 3, W8PairConfig()),
        (1, 128, 8, W8PairConfig(late_sum=True)),
    ]
    if CUDA
    else [
        (1, 8, 2, W8PairConfig(up_n=32, up_k=256, down_n=32, down_k=128, late_sum=True)),
        (5, 4, 3, W8PairConfig(up_n=32, up_k=128, down_n=16, down_k=64, late_sum=False)),
        (20, 8, 2, None),
        (9, 4, 3, MoEConfig(16, 32, 64, 32, 32, 2, 4, 2)),
    ]
)


@pytest.mark.parametrize("fmt", ["fp8_block", "int8"])
@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_fused_moe_w8_matches_reference(fmt: str, case: int) -> None:
    t, e, k, cfg = MOE_CASES[case]
    d, inter = (2048, 768) if CUDA else (160, 96)
    for dtype in DTYPES if CUDA else DTYPES[case % 2 : case % 2 + 1]:
        gen = torch.Generator().manual_seed(case * 31 + t)
        hidden, w13, w2 = make_moe(fmt, t, d, inter, e, dtype, gen)
        weights, ids = make_routing(t, e, k, gen)
        out = fused_moe_w8(hidden, w13, w2, weights, ids, cfg)
        assert out.shape == hidden.shape and out.dtype == dtype
        assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL, (t, e, k, dtype)


def test_fused_moe_w8_one_token_default() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden, w13, w2 = make_moe("int8", 1, 160, 96, 4, torch.bfloat16, gen)
    weights, ids = make_routing(1, 4, 2, gen)
    assert rel_err(fused_moe_w8(hidden, w13, w2, weights, ids), quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL


# One token's path (kernels/triton_moe_w8_token.py): (D, I, E, top-k, config). CPU: K not a power of two (masked
# past it), I = 96 so the up rows start inside a 128-row fp8 scale block, top-k 3 padded to 4 slots.
TOKEN_CASES = (
    [(2048, 768, 128, 8, None), (4096, 1536, 64, 6, None), (2048, 768, 128, 8, TokenW8Config(2, 4, 8, 4))]
    if CUDA
    else [
        (160, 96, 8, 2, None),
        (160, 96, 4, 3, TokenW8Config(8, 2, 2, 4)),
        (300, 200, 6, 4, TokenW8Config(1, 4, 1, 2)),
    ]
)


@pytest.mark.parametrize("fmt", ["fp8_block", "int8"])
@pytest.mark.parametrize("case", range(len(TOKEN_CASES)))
def test_token_path_matches_reference(fmt: str, case: int) -> None:
    d, inter, e, k, cfg = TOKEN_CASES[case]
    for dtype in DTYPES if CUDA else DTYPES[case % 2 : case % 2 + 1]:
        gen = torch.Generator().manual_seed(case * 7 + k)
        hidden, w13, w2 = make_moe(fmt, 1, d, inter, e, dtype, gen)
        weights, ids = make_routing(1, e, k, gen)
        assert takes(hidden, w13, w2) == (fmt == "int8")  # fp8 keeps the pair path (takes' docstring)
        out = moe_w8_token(hidden, w13, w2, weights.reshape(-1).float().contiguous(), ids, cfg)
        assert out.shape == hidden.shape and out.dtype == dtype
        assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL, (case, dtype)


def test_token_path_takes_one_token_of_int8_experts_up_to_max_k() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden, w13, w2 = make_moe("int8", 2, 160, 96, 4, torch.bfloat16, gen)
    assert takes(hidden[:1], w13, w2) and not takes(hidden, w13, w2)
    assert not takes(*make_moe("fp8_block", 1, 160, 96, 4, torch.bfloat16, gen))
    wide, w13w, w2w = make_moe("int8", 1, 4104, 96, 2, torch.bfloat16, gen)  # D past MAX_K
    assert not takes(wide, w13w, w2w)


def test_fp8_one_token_takes_the_pair_gate_up_then_the_token_down() -> None:
    from ftransformers.kernels.triton_moe_w8_token import takes_down

    gen = torch.Generator().manual_seed(4)
    hidden, w13, w2 = make_moe("fp8_block", 1, 160, 96, 8, torch.bfloat16, gen)
    weights, ids = make_routing(1, 8, 3, gen)
    assert takes_down(hidden, w13, w2) and not takes(hidden, w13, w2)
    out = fused_moe_w8(hidden, w13, w2, weights, ids)
    assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL


def _graph_replays_match(fn, inputs: list[torch.Tensor], refill) -> None:  # type: ignore[no-untyped-def]
    fn(*inputs)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    for _ in range(3):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(*inputs))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", ["fp8_block", "int8"])
def test_cuda_graph_replay(fmt: str) -> None:
    gen = torch.Generator().manual_seed(9)
    qw = make_weight(fmt, (2112, 7168), gen)
    for m in (1, 8):
        x = torch.randn(m, 7168, device=DEV, dtype=torch.bfloat16)
        _graph_replays_match(lambda x: LINEARS[fmt](x, qw), [x], partial(_refill_randn, x))
    for t in (1, 8):
        hidden, w13, w2 = make_moe(fmt, t, 2048, 768, 128, torch.bfloat16, gen)
        weights, ids = make_routing(t, 128, 8, gen)
        _graph_replays_match(
            fused_moe_w8, [hidden, w13, w2, weights, ids], partial(_refill_moe, hidden, weights, ids, gen)
        )


def _refill_randn(x: torch.Tensor) -> None:
    x.copy_(torch.randn_like(x))


def _refill_moe(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gen: torch.Generator) -> None:
    new_w, new_ids = make_routing(hidden.shape[0], 128, ids.shape[1], gen)
    hidden.copy_(torch.randn_like(hidden)), weights.copy_(new_w), ids.copy_(new_ids)
