"""Fused MoE over 4-bit experts (kernels/triton_fused_moe_w4.py) vs quant_moe_ref, fresh random inputs.

Formats int4 (group 32 and 128, zeros absent and present, bf16 / fp16 / fp32 scales), mxfp4, nvfp4;
hidden bf16 and fp16; T in {1, 2, 5, 33}, top-k 2 and 8 (pair path at T*K <= W4_PAIR_MAX_PAIRS, else
aligned), both paths also forced with small tiles. Expert ids: random, repeated across tokens, never all
one expert. CPU: TRITON_INTERPRET=1, tiny shapes (D=128, I=128: one int4 group of 128; E 8..16) and a
covering subset of the matrix. CUDA: E=128, D=2048, I=768, the full matrix, and a CUDA-graph replay on
refilled inputs.
Tolerance: ||out - ref|| / ||ref|| <= 1e-2 for bf16 and fp16 hidden (the kernels dequantize exactly
the reference's float32 weights; the differences are summation order, the 16-bit B tiles of the
aligned path's tensor-core dots, and the 16-bit rounding of intermediates).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels.quant_formats import QuantizedWeight, quant_moe_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def random_qw(
    fmt: str, e: int, n: int, k: int, gen: torch.Generator, group: int = 128, zeros: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> QuantizedWeight:  # fmt: skip
    """Random words (8 random codes each) and scales sized so that x @ W^T keeps unit scale, made on
    DEV with gen (a generator on DEV)."""
    g = {"int4": group, "mxfp4": 32, "nvfp4": 16}[fmt]
    kw = {"generator": gen, "device": DEV}
    qweight = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, **kw)
    z = gs = None
    if fmt == "int4":
        scales = ((torch.rand(e, n, k // g, **kw) + 0.5) * 0.5 / k**0.5).to(scale_dtype)
        if zeros:
            z = torch.randint(4, 12, (e, n, k // g), dtype=torch.uint8, **kw)
    elif fmt == "mxfp4":  # 2^(s-127) ~ 0.25 / sqrt(k) .. 1 / sqrt(k)
        base = 127 - int(torch.log2(torch.tensor(float(k))).item() / 2)
        scales = torch.randint(base - 2, base + 1, (e, n, k // g), dtype=torch.uint8, **kw)
    else:
        scales = (torch.rand(e, n, k // g, **kw) * 300 + 20).to(torch.float8_e4m3fn)
        gs = (torch.rand(e, n, **kw) + 0.5) / (200 * k**0.5)
    return QuantizedWeight(fmt, qweight, scales, n, k, g, zeros=z, global_scale=gs)


def make_routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate-free top-k ids [T, K] drawn from about half the experts (so tokens repeat experts, but
    never all the same one), and weights [T, K] float32."""
    allowed = torch.randperm(e, generator=gen, device=DEV)[: max(k + 1, e // 2)]
    pick = torch.rand(t, allowed.numel(), generator=gen, device=DEV).topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=gen, device=DEV) + 0.1
    return weights / weights.sum(-1, keepdim=True), allowed[pick]


def run_case(fmt: str, t: int, e: int, k: int, d: int, inter: int, dtype: torch.dtype, seed: int,
             config=None, codes: bool = True, **qkw) -> float:  # fmt: skip
    gen = torch.Generator(DEV).manual_seed(seed)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(dtype)
    w13 = random_qw(fmt, e, 2 * inter, d, gen, **qkw)
    w2 = random_qw(fmt, e, d, inter, gen, **qkw)
    weights, ids = make_routing(t, e, k, gen)
    assert ids.unique().numel() > 1
    out = w4.fused_moe_w4(hidden, w13, w2, weights, ids, config, codes=codes)
    assert out.shape == hidden.shape and out.dtype == dtype
    return rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids))


SHAPE = (2048, 768) if CUDA else (128, 128)  # (D, I): I >= the 128 group
TOKENS = [1, 2, 5, 33]
# (fmt, quantization kwargs): int4 g128 sym / asym, int4 g32 sym / asym, mxfp4, nvfp4
FORMATS = [
    ("int4", {"group": 128}),
    ("int4", {"group": 128, "zeros": True}),
    ("int4", {"group": 32}),
    ("int4", {"group": 32, "zeros": True, "scale_dtype": torch.float16}),
    ("mxfp4", {}),
    ("nvfp4", {}),
]


# Every (format, T, top-k) on CUDA; on CPU (interpreter) a covering subset: each format on both paths,
# each T and top-k at least twice. The index picks the FORMATS entry.
CPU_CASES = [(0, 1, 8), (0, 65, 2), (1, 2, 8), (1, 33, 8), (2, 5, 2), (2, 65, 2), (3, 2, 2), (3, 33, 8),
             (4, 1, 8), (4, 33, 8), (5, 5, 2), (5, 65, 2)]  # fmt: skip
CUDA_CASES = [(f, t, k) for f in range(len(FORMATS)) for t in TOKENS for k in (2, 8)]


@pytest.mark.parametrize("case", CUDA_CASES if CUDA else CPU_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if CUDA else [None])
def test_fused_moe_w4_matches_reference(case: tuple[int, int, int], dtype: torch.dtype | None) -> None:
    f, t, k = case
    fmt, qkw = FORMATS[f]
    e = 128 if CUDA else (8 if k == 2 else 16)
    dtype = dtype or (torch.bfloat16 if (t + k) % 2 else torch.float16)
    err = run_case(fmt, t, e, k, *SHAPE, dtype, seed=31 * t + k + f, **qkw)
    assert err <= TOL, (fmt, qkw, t, k, dtype, err)


@pytest.mark.parametrize("f,dtype", [(1, torch.bfloat16), (4, torch.float16), (5, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("path", ["pair", "aligned"])
def test_both_paths_small_tiles(f: int, dtype: torch.dtype, path: str) -> None:
    # Each path forced, with tiles smaller than D and I (several N and K steps) and D, I not multiples
    # of the K tile (masked groups): D=160, I=96, groups of 32 (16 for nvfp4); 5 tokens of top-3.
    fmt, qkw = FORMATS[f]
    cfg = (
        w4.W4PairConfig(up_n=64, up_k=64, down_n=64, down_k=64) if path == "pair" else w4.MoEConfig(16, 64, 64, 64, 64)
    )
    err = run_case(fmt, 5, 8, 3, 160, 96, dtype, seed=3 + f, config=cfg, **{**qkw, "group": 32})
    assert err <= TOL, (fmt, path, err)


@pytest.mark.parametrize("codes", [True, False], ids=["codes", "dequant"])
@pytest.mark.parametrize("f,group", [(0, 128), (1, 64), (3, 32)], ids=str)
def test_aligned_int4_codes_and_dequant(f: int, group: int, codes: bool) -> None:
    # The aligned path's int4 GEMMs on raw codes (triton_fused_moe_codes) and the dequantizing kernel
    # they replace, several N and K tiles per expert block: 9 tokens of top-4 over 8 experts.
    fmt, qkw = FORMATS[f]
    d, inter = (256, 384) if not CUDA else (2048, 768)
    cfg = w4.MoEConfig(16, 32, max(64, group), 64, max(64, group), 2, 4, 2)
    err = run_case(fmt, 9, 8, 4, d, inter, torch.bfloat16 if f != 3 else torch.float16, seed=40 + f,
                   config=cfg, codes=codes, **{**qkw, "group": group})  # fmt: skip
    assert err <= TOL, (fmt, group, codes, err)


@pytest.mark.parametrize("f,group", [(0, 128), (1, 64), (1, 128)], ids=str)
def test_aligned_int4_decoded(f: int, group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The codes kernel's decoded form (DECODED_FROM_BLOCK_M: each tile decoded with its scale and zero before one
    # dot), gate-up with SiLU-mul and the weighted down, zero points and none, K tiles of 128 and 64, several N and
    # K tiles per expert block and partial blocks: 9 tokens of top-4 over 8 experts.
    from ftransformers.kernels import triton_fused_moe_codes as codes_mod

    monkeypatch.setattr(w4, "DECODED_FROM_BLOCK_M", 16)
    calls = []
    real = codes_mod.moe_gemm_codes
    monkeypatch.setattr(w4, "moe_gemm_codes", lambda *a, **kw: calls.append(kw["decoded"]) or real(*a, **kw))
    fmt, qkw = FORMATS[f]
    d, inter = (256, 384) if not CUDA else (2048, 768)
    cfg = w4.MoEConfig(16, 32, group, 64, group, 2, 4, 2)
    err = run_case(fmt, 9, 8, 4, d, inter, torch.bfloat16, seed=60 + f + group, config=cfg,
                   **{**qkw, "group": group})  # fmt: skip
    assert err <= TOL and calls == [True, True], (fmt, group, err, calls)


@pytest.mark.parametrize("split", [2, 4, 8])
def test_pair_down_split_over_slots(split: int) -> None:
    # The down kernel split over slot groups (programs per token and D block, the last one out adding
    # the partials): same function, and every ticket counter is back at zero afterwards (the next launch
    # and a graph replay rely on it). Asym int4 and nvfp4, 2 tokens of top-8, 3 D blocks of 64.
    from ftransformers.kernels.tickets import ticket_counters

    cfg = w4.W4PairConfig(up_n=64, up_k=64, down_n=64, down_k=64, down_split=split)
    for f in (1, 5):
        fmt, qkw = FORMATS[f]
        err = run_case(fmt, 2, 16, 8, 192, 96, torch.bfloat16, seed=7 * split + f, config=cfg, **{**qkw, "group": 32})
        assert err <= TOL, (fmt, split, err)
    assert not ticket_counters(torch.device(DEV), "moe_w4_down", 2 * 3).any()


def test_rejects_bad_layouts() -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    w13 = random_qw("int4", 4, 128, 64, gen, group=32)
    w2 = random_qw("int4", 4, 64, 64, gen, group=32)
    hidden = torch.randn(1, 64).to(DEV, torch.bfloat16)
    weights, ids = torch.full((1, 2), 0.5, device=DEV), torch.tensor([[0, 1]], device=DEV)
    int8 = QuantizedWeight("int8", torch.ones(4, 64, 64, dtype=torch.int8, device=DEV), torch.ones(4, 64), 64, 64, 64)
    with pytest.raises(ValueError, match="w2 has format 'int8'"):
        w4.fused_moe_w4(hidden, w13, int8, weights, ids)
    with pytest.raises(ValueError, match="w13 qweight"):
        w4.fused_moe_w4(hidden, w2, w2, weights, ids)
    with pytest.raises(ValueError, match="hidden must be"):
        w4.fused_moe_w4(hidden.float(), w13, w2, weights, ids)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 16])
def test_cuda_graph_replay(t: int) -> None:
    gen = torch.Generator(DEV).manual_seed(t)
    e, k, (d, inter) = 128, 8, SHAPE
    w13, w2 = random_qw("int4", e, 2 * inter, d, gen, zeros=True), random_qw("int4", e, d, inter, gen, zeros=True)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
    weights, ids = make_routing(t, e, k, gen)
    w4.fused_moe_w4(hidden, w13, w2, weights, ids)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w4.fused_moe_w4(hidden, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4.fused_moe_w4(hidden, w13, w2, weights, ids)
    for _ in range(3):
        hidden.copy_(torch.randn(t, d, generator=gen, device=DEV))
        new_weights, new_ids = make_routing(t, e, k, gen)
        weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, w4.fused_moe_w4(hidden, w13, w2, weights, ids))
        assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL


def test_codes_tiles_for_int4_blocks() -> None:
    # int4 blocks of up to 64 rows (decode-shaped 16, and 17-128 pairs an expert) get the codes kernel's 64 /
    # 128-column tiles, 128-row blocks its decoded form's 128 / 128; other formats keep the bf16 tiles
    for t in (32, 1024):  # 2 and 64 pairs an expert
        codes = w4.default_w4_config(t, 128, 8, 128, codes=True)
        plain = w4.default_w4_config(t, 128, 8, 128)
        assert (codes.up_n, codes.down_n) == (64, 128) and codes.block_m == plain.block_m <= w4.CODES_MAX_BLOCK_M
        assert w4._codes_ok(random_qw("int4", 2, 64, 128, torch.Generator(DEV).manual_seed(0)), codes)
    assert (w4.default_w4_config(32, 128, 8, 128).up_n, w4.default_w4_config(1024, 128, 8, 128).block_m) == (32, 64)
    prefill, plain = w4.default_w4_config(4096, 128, 8, 128, codes=True), w4.default_w4_config(4096, 128, 8, 128)
    assert prefill.block_m == plain.block_m > w4.CODES_MAX_BLOCK_M and (prefill.up_n, prefill.down_n) == (128, 128)
    assert (plain.up_n, plain.down_n) == (128, 256)
    assert w4._decoded_ok(random_qw("int4", 2, 64, 128, torch.Generator(DEV).manual_seed(0)), prefill, 128)
