"""Triton 4-bit-weight GEMM (int4 / mxfp4 / nvfp4, decode and prefill paths) vs `quant_linear_ref` on
fresh random inputs: int4 scales ~0.01 with and without zero points, FP4 scales of the same weight
magnitude, x ~ N(0, 1).

CPU: TRITON_INTERPRET=1 and small shapes (odd N, K a multiple of 128, one K not a multiple of the
K tile). Tolerances (||out - ref|| / ||ref||): float32 1e-5; bfloat16 / float16 1e-2 (the weight is
exact in float32; the tensor-core path rounds it to x.dtype, and the output is rounded once, which the
interpreter does by truncation)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels import triton_w4a16
from ftransformers.kernels.quant_formats import QuantizedWeight, pack_int4, quant_linear_ref, scale_zero_copy
from ftransformers.kernels.triton_w4a16 import w4a16_config, w4a16_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): N not a multiple of any BLOCK_N, K not a multiple of the default BLOCK_K, large-weight tiles
SHAPES = [(5120, 2048), (1029, 4096), (2051, 1408), (8192, 4096)] if DEV == "cuda" else [(37, 256), (20, 384)]
ROWS = [1, 3, 8, 16, 33] + ([300] if DEV == "cuda" else [])
# (fmt, group, zeros, scale dtype)
WEIGHTS = [
    ("int4", 32, False, torch.float16), ("int4", 64, True, torch.bfloat16), ("int4", 128, True, torch.float16),
    ("int4", 128, False, torch.bfloat16), ("mxfp4", 32, False, None), ("nvfp4", 16, False, None),
]  # fmt: skip


def random_weight(
    fmt: str, n: int, k: int, g: torch.Generator, group: int = 128, zeros: bool = False,
    scale_dtype: torch.dtype | None = torch.float16, perm: bool = False,
) -> QuantizedWeight:  # fmt: skip
    """Weights of magnitude ~0.01-0.1 in the given layout, on DEV."""
    qweight = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    z = gs = None
    if fmt == "int4":
        scales = (torch.rand(n, k // group, generator=g) * 0.01 + 0.005).to(scale_dtype or torch.float16)
        if zeros:
            z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
    elif fmt == "mxfp4":
        group = 32
        scales = torch.randint(119, 124, (n, k // group), generator=g).to(torch.uint8)  # 2^-8 .. 2^-4
    else:
        group = 16
        scales = (torch.rand(n, k // group, generator=g) * 440 + 1).to(torch.float8_e4m3fn)
        gs = torch.rand(n, generator=g) * 1e-5 + 5e-6
    p = torch.randperm(k, generator=g).to(DEV) if perm else None
    return QuantizedWeight(
        fmt, qweight.to(DEV), scales.to(DEV), n, k, group,
        zeros=None if z is None else z.to(DEV), global_scale=None if gs is None else gs.to(DEV), perm=p,
    )  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("weight", WEIGHTS, ids=lambda w: f"{w[0]}-g{w[1]}-{'z' if w[2] else 'sym'}")
def test_matches_reference(weight: tuple, M: int, dtype: torch.dtype) -> None:
    fmt, group, zeros, sdt = weight
    gen = torch.Generator().manual_seed(M * 31 + group)
    for N, K in SHAPES:
        qw = random_weight(fmt, N, K, gen, group, zeros, sdt)
        x = torch.randn(M, K, generator=gen).to(DEV, dtype)
        assert rel_err(w4a16_linear(x, qw), quant_linear_ref(x, qw)) < tol(dtype), (N, K)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 8, 33])
def test_perm_bias_and_leading_dims(fmt: str, M: int) -> None:
    gen = torch.Generator().manual_seed(7 + M)
    N, K = SHAPES[0]
    qw = random_weight(fmt, N, K, gen, zeros=fmt == "int4", perm=True)
    x = torch.randn(M, K, generator=gen).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=gen).to(DEV, torch.bfloat16)
    ref = quant_linear_ref(x, qw, b)
    assert rel_err(w4a16_linear(x, qw, b), ref) < 1e-2
    assert rel_err(w4a16_linear(x.view(1, M, K), qw, b).view(M, N), ref) < 1e-2
    xf = x.float()
    assert rel_err(w4a16_linear(xf, qw, b.float()), quant_linear_ref(xf, qw, b.float())) < 1e-5


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_every_tile_path(fmt: str, preload: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FMA and tensor-core tiles, several programs along N and M, masked K tails and split-K; the GEMV with its
    first tile of words loaded ahead of the PDL wait (the default) and without."""
    monkeypatch.setattr(triton_w4a16, "PRELOAD_FIRST_TILE", preload)
    gen = torch.Generator().manual_seed(3)
    qw = random_weight(fmt, 40, 384, gen, group=64, zeros=True)
    base = {"SPLIT_K": 1, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    cases = [
        (2, {"BLOCK_M": 2, "BLOCK_N": 4, "BLOCK_K": 128, "GEMV": 1}),
        (3, {"BLOCK_M": 4, "BLOCK_N": 8, "BLOCK_K": 256, "GEMV": 1, "SPLIT_K": 2}),
        (16, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256, "GEMV": 0}),
        (5, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GEMV": 0, "SPLIT_K": 3}),
        (40, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "GEMV": 0, "GROUP_M": 2}),
        (48, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GEMV": 0, "SPLIT_K": 2}),  # large int4 past 32 rows
    ]
    for M, cfg in cases:
        x = torch.randn(M, 384, generator=gen).to(DEV)
        b = torch.randn(40, generator=gen).to(DEV)
        out = w4a16_linear(x, qw, b, config={**base, **cfg})
        assert rel_err(out, quant_linear_ref(x, qw, b)) < 1e-5, cfg


@pytest.mark.parametrize("weight", [w for w in WEIGHTS if w[0] == "int4"], ids=lambda w: f"g{w[1]}-{'z' if w[2] else 'sym'}")
@pytest.mark.parametrize("preload_sz", [False, True])
def test_gemv_reads_the_scale_zero_copy(weight: tuple, preload_sz: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV on QuantizedWeight.scale_zero (one vector load of a thread's rows' scales and zeros) computes
    what it computes from the row-major scales and zeros (the same float32 scale and zero), including K tails
    and split K, and USE_SCALE_ZERO = False reads the row-major ones; the copy's first tile read ahead of the PDL
    wait (GEMV_PRELOAD_SZ) or not."""
    monkeypatch.setattr(triton_w4a16, "GEMV_PRELOAD_SZ", preload_sz)
    _, group, zeros, sdt = weight
    gen = torch.Generator().manual_seed(11 + group)
    qw = random_weight("int4", 40, 384, gen, group, zeros, sdt)
    packed = replace(qw, scale_zero=scale_zero_copy(qw))
    base = {"GEMV": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    cases = [
        (1, {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 128}),
        (2, {"BLOCK_M": 2, "BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 2}),
    ]
    for M, cfg in cases:
        x = torch.randn(M, 384, generator=gen).to(DEV)
        b = torch.randn(40, generator=gen).to(DEV)
        out = w4a16_linear(x, packed, b, config={**base, **cfg})
        assert rel_err(out, w4a16_linear(x, qw, b, config={**base, **cfg})) < 1e-6, cfg
        assert rel_err(out, quant_linear_ref(x, qw, b)) < 1e-5, cfg
        xb = x.to(torch.bfloat16)
        assert rel_err(w4a16_linear(xb, packed, config={**base, **cfg}), quant_linear_ref(xb, qw)) < 1e-2, cfg
    monkeypatch.setattr(triton_w4a16, "USE_SCALE_ZERO", False)
    broken = replace(packed, scale_zero=torch.zeros_like(packed.scale_zero))  # read it and the result is 0
    x = torch.randn(1, 384, generator=gen).to(DEV)
    assert rel_err(w4a16_linear(x, broken), quant_linear_ref(x, qw)) < 1e-5


@pytest.mark.parametrize(
    "group,zeros,packed", [(16, True, False), (32, False, True), (64, True, True), (128, True, False)]
)
@pytest.mark.parametrize("preload", [True, False, "sz"])
def test_gemv_two_words_a_thread(group: int, zeros: bool, packed: bool, preload: bool | str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The GEMV on the int64 view of the words (two words a thread and row, one scale for both) matches the
    reference: K tails, split K, one and two rows, with and without the scale_zero copy and the preload (of the
    words, or "sz": of the words and the scale_zero copy)."""
    monkeypatch.setattr(triton_w4a16, "PRELOAD_FIRST_TILE", bool(preload))
    monkeypatch.setattr(triton_w4a16, "GEMV_PRELOAD_SZ", preload == "sz")
    gen = torch.Generator().manual_seed(13 + group)
    qw = random_weight("int4", 40, 384, gen, group, zeros, torch.bfloat16)
    if packed:
        qw = replace(qw, scale_zero=scale_zero_copy(qw))
    check_two_words(qw, gen)


def check_two_words(qw: QuantizedWeight, gen: torch.Generator) -> None:
    """The GEMV on two words a thread against the reference for a [40, 384] weight: float32 x (1e-5) and bf16 x
    (1e-2), on three tiles: a K tail (384 = 256 + 128), split K at two rows, one tile most of it masked."""
    base = {"GEMV": 1, "SPLIT_K": 1, "WORDS": 2, "num_warps": 2, "num_stages": 2}
    cases = [
        (1, {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 256}),
        (2, {"BLOCK_M": 2, "BLOCK_N": 8, "BLOCK_K": 128, "SPLIT_K": 2}),
        (1, {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 1}),
    ]
    for M, cfg in cases:
        x = torch.randn(M, 384, generator=gen).to(DEV)
        b = torch.randn(40, generator=gen).to(DEV)
        assert rel_err(w4a16_linear(x, qw, b, config={**base, **cfg}), quant_linear_ref(x, qw, b)) < 1e-5, cfg
        xb = x.to(torch.bfloat16)
        assert rel_err(w4a16_linear(xb, qw, config={**base, **cfg}), quant_linear_ref(xb, qw)) < 1e-2, cfg


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("preload", [True, False])
def test_gemv_fp4_two_words_a_thread(fmt: str, preload: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP4 on the int64 view (two words a thread and row; the pair inside one group of 16 or 32) matches the
    reference on the int4 test's tiles: K tails, split K, one and two rows, one tile mostly masked."""
    monkeypatch.setattr(triton_w4a16, "PRELOAD_FIRST_TILE", preload)
    gen = torch.Generator().manual_seed(17 + preload)
    check_two_words(random_weight(fmt, 40, 384, gen), gen)


def test_gemv_words_where_the_layout_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two words a thread for groups and K tiles of whole 16-element pairs on contiguous, aligned words (FP4's
    # groups of 16 and 32 too); group 8 and a misaligned start read one word. GEMV_WORDS / FP4_GEMV_WORDS set the
    # default tiles' words and K tile.
    gen = torch.Generator().manual_seed(5)
    qw = random_weight("int4", 8, 256, gen, 32)
    q, words = triton_w4a16.gemv_words(qw, 2, 256)
    assert words == 2 and q.dtype == torch.int64 and q.shape == (8, 16)
    assert triton_w4a16.gemv_words(qw, 1, 256)[1] == 1 and triton_w4a16.gemv_words(qw, 2, 8)[1] == 1
    assert triton_w4a16.gemv_words(random_weight("int4", 8, 256, gen, 8), 2, 256)[1] == 1
    assert triton_w4a16.gemv_words(random_weight("mxfp4", 8, 256, gen), 2, 256)[1] == 2
    assert triton_w4a16.gemv_words(random_weight("nvfp4", 8, 256, gen), 2, 256)[1] == 2
    assert triton_w4a16.gemv_words(replace(qw, qweight=qw.qweight[:, 1:17]), 2, 256)[1] == 1
    monkeypatch.setattr(triton_w4a16, "GEMV_WORDS", 2)
    cfg = w4a16_config(1, 5120, 2048, "int4")
    assert (cfg["WORDS"], cfg["BLOCK_K"], cfg["num_warps"]) == (2, 2048, 4)
    assert (w4a16_config(1, 5120, 2048, "mxfp4")["WORDS"], w4a16_config(1, 5120, 2048, "nvfp4")["BLOCK_K"]) == (2, 2048)
    monkeypatch.setattr(triton_w4a16, "FP4_GEMV_WORDS", 1)
    assert (w4a16_config(1, 5120, 2048, "mxfp4")["WORDS"], w4a16_config(1, 5120, 2048, "nvfp4")["BLOCK_K"]) == (1, 1024)
    x = torch.randn(1, 384, generator=gen).to(DEV)
    w8 = random_weight("int4", 40, 384, gen, 8, True)  # asks for two words, reads one
    assert rel_err(w4a16_linear(x, w8), quant_linear_ref(x, w8)) < 1e-5


def test_gemv_rows_a_program_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    # GEMV_BLOCK_N 0 keeps the rule (8 rows a program on large weights, 4 on the others); set, it gives every GEMV
    # that many rows, and rows a program that split a scale_zero block of 4 (2) or cover two (8) still read it right
    assert (w4a16_config(1, 5120, 2048, "int4")["BLOCK_N"], w4a16_config(1, 8192, 16384, "int4")["BLOCK_N"]) == (4, 8)
    gen = torch.Generator().manual_seed(23)
    qw = random_weight("int4", 37, 256, gen, 64, zeros=True, scale_dtype=torch.bfloat16)
    qw = replace(qw, scale_zero=scale_zero_copy(qw))
    x = torch.randn(1, 256, generator=gen).to(DEV)
    for rows in (2, 8):
        monkeypatch.setattr(triton_w4a16, "GEMV_BLOCK_N", rows)
        assert w4a16_config(1, 5120, 2048, "int4")["BLOCK_N"] == rows
        assert rel_err(w4a16_linear(x, qw), quant_linear_ref(x, qw)) < 1e-5, rows


def test_gemv_scale_zero_only_where_the_gemv_runs() -> None:
    gen = torch.Generator().manual_seed(2)
    small = random_weight("int4", 64, 256, gen, 64, zeros=True)
    assert triton_w4a16.gemv_scale_zero(small) is not None
    q = torch.zeros(8192, 16384 // 8, dtype=torch.int32)  # DeepSeek-V3 o: the mma kernel's from one row with zeros
    s = torch.ones(8192, 128, dtype=torch.float16)
    large = QuantizedWeight("int4", q, s, 8192, 16384, 128, zeros=torch.full((8192, 128), 8, dtype=torch.uint8))
    assert triton_w4a16.gemv_scale_zero(large) is None
    assert triton_w4a16.gemv_scale_zero(replace(large, zeros=None)) is not None  # symmetric: the GEMV's at one row
    assert triton_w4a16.gemv_scale_zero(random_weight("mxfp4", 64, 256, gen)) is None


def test_config_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    assert w4a16_config(1, 5120, 2048, "int4")["GEMV"] == 1 and w4a16_config(2, 5120, 2048, "int4")["BLOCK_M"] == 2
    assert w4a16_config(4, 5120, 2048, "mxfp4")["GEMV"] == 1 and w4a16_config(4, 5120, 2048, "mxfp4")["BLOCK_M"] == 4
    # int4, 3-16 rows: the codes kernel, K split until 512 programs (80 column tiles -> 8 splits)
    assert w4a16_config(3, 5120, 2048, "int4") == {"CODES": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                                                   "SPLIT_K": 8, "num_warps": 4, "num_stages": 3}  # fmt: skip
    assert (
        w4a16_config(16, 24576, 4096, "int4", 32)["SPLIT_K"] == 2
        and w4a16_config(8, 24576, 4096, "int4", 32)["BLOCK_K"] == 32
    )
    assert "CODES" not in w4a16_config(8, 5120, 2048, "int4", 16)  # group 16: no K tile fits in a group
    assert w4a16_config(16, 5120, 2048, "nvfp4")["GEMV"] == 0 and w4a16_config(16, 5120, 2048, "nvfp4")["BLOCK_M"] == 16
    # int4, 17-64 rows, groups holding K tiles of 64: the codes kernel's decoded form, (BLOCK_M, BLOCK_N, BLOCK_K,
    # SPLIT_K, warps): wide large weights 128-row tiles split 2 to 32 rows, then 64-row tiles unsplit; deep large
    # weights 128-row tiles split 4; smaller ones 64-row tiles, K split until 256 programs
    def tiles(c: dict) -> tuple:
        assert c["CODES"] == 1 and c["DEQUANT"] == 1, c
        return c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"]

    assert tiles(w4a16_config(17, 24576, 4096, "int4")) == (32, 128, 128, 2, 8)
    assert tiles(w4a16_config(33, 24576, 4096, "int4")) == (64, 64, 128, 1, 4)
    assert tiles(w4a16_config(48, 7168, 16384, "int4", 64)) == (64, 128, 64, 4, 8)
    assert tiles(w4a16_config(32, 5120, 2048, "int4")) == (32, 64, 128, 4, 4)
    assert tiles(w4a16_config(64, 2048, 4096, "int4")) == (64, 64, 128, 4, 4)
    assert tiles(w4a16_config(64, 16384, 4096, "int4")) == (64, 64, 128, 1, 4)  # 256 tiles: unsplit
    # past 64 rows the decoded form in row tiles (rows_config): to 256 rows 64 x 64 tiles, 128 x 64 on deep or wide
    # weights, K split toward 264 programs; past 256 rows 256 x 128 tiles on 8 warps where they number 264, else
    # 128 x 64. The tiles the H200 measured best (session 75).
    assert tiles(w4a16_config(96, 6144, 4096, "int4")) == (64, 64, 128, 2, 4)  # Qwen3-8B qkv: 2 x 96 tiles
    assert tiles(w4a16_config(128, 4096, 12288, "int4")) == (128, 64, 128, 8, 4)  # Qwen3-8B down: 64 tiles
    assert tiles(w4a16_config(160, 24576, 4096, "int4")) == (128, 64, 128, 1, 4)  # Qwen3-8B gate_up: 768 tiles
    assert tiles(w4a16_config(256, 2048, 4096, "int4")) == (64, 64, 128, 4, 4)  # Qwen3-30B-A3B o: 4 x 32 tiles
    assert tiles(w4a16_config(1024, 24576, 4096, "int4")) == (256, 128, 128, 1, 8)
    assert tiles(w4a16_config(1024, 4096, 12288, "int4")) == (128, 64, 128, 1, 4)  # 4 x 32 tiles: too few
    assert tiles(w4a16_config(8192, 5120, 2048, "int4")) == (256, 128, 128, 1, 8)
    assert tiles(w4a16_config(300, 5120, 2048, "int4", 64)) == (128, 64, 64, 2, 4)  # 3 x 80 tiles
    assert "CODES" not in w4a16_config(300, 5120, 2048, "int4", 32)  # no K tile of 64 in a group
    assert "CODES" not in w4a16_config(300, 5120, 2048, "int4", codes=False)  # float32 x
    # without it (DECODED off): the codes form; large weights past CODES_MAX_ROWS_LARGE = 32 rows the decode-shaped
    # dequantizing tiles. Group 32 (no K tile of 64 in a group) keeps that rule.
    monkeypatch.setattr(triton_w4a16, "DECODED", False)
    mid = [w4a16_config(m, 5120, 2048, "int4") for m in (32, 64)]
    assert [(c["BLOCK_M"], c["SPLIT_K"], c.get("DEQUANT")) for c in mid] == [(32, 8, None), (64, 4, None)]
    assert w4a16_config(32, 24576, 4096, "int4")["CODES"] == 1 and w4a16_config(64, 5120, 2048, "int4")["CODES"] == 1
    for m, n, k, group, split in [(33, 24576, 4096, 128, 1), (64, 4096, 12288, 128, 4), (48, 7168, 16384, 128, 4),
                                  (48, 7168, 16384, 32, 4)]:  # fmt: skip
        if group == 32:
            monkeypatch.setattr(triton_w4a16, "DECODED", True)
        cfg = w4a16_config(m, n, k, "int4", group)
        assert "CODES" not in cfg and (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]) == (
            64, 64, 128, split), (m, n, k, cfg)  # fmt: skip
    # FP4, 17-64 rows: one decode-shaped row tile of max(16, M) rows
    assert w4a16_config(33, 5120, 2048, "mxfp4")["BLOCK_M"] == 64
    assert w4a16_config(24, 5120, 2048, "nvfp4")["GROUP_M"] == 1
    # FP4, 3-16 rows: K split only under 128 column tiles (deep, narrow weights), at least two K tiles per part
    shapes = ((5120, 2048), (2048, 4096), (4096, 12288), (7168, 16384), (24576, 4096), (256, 512), (1024, 2048))
    assert [w4a16_config(8, n, k, "mxfp4")["SPLIT_K"] for n, k in shapes] == [1, 1, 8, 8, 1, 1, 4]
    assert w4a16_config(2048, 5120, 2048, "mxfp4")["BLOCK_M"] >= 64


def test_rejects_unsupported() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=gen).to(DEV)
    int8 = QuantizedWeight("int8", torch.zeros(8, 256, dtype=torch.int8), torch.ones(8), 8, 256, 256)
    with pytest.raises(ValueError, match="not a 4-bit"):
        w4a16_linear(x, int8)
    qw = random_weight("int4", 8, 256, gen)
    stacked = QuantizedWeight("int4", qw.qweight[None], qw.scales[None], 8, 256, 128)
    with pytest.raises(ValueError, match="2-D"):
        w4a16_linear(x, stacked)
    bad_group = QuantizedWeight("int4", qw.qweight[:, :25], qw.scales, 8, 200, 128)
    with pytest.raises(ValueError, match="multiple"):
        w4a16_linear(x[:, :200], bad_group)
    with pytest.raises(ValueError, match="features"):
        w4a16_linear(x[:, :128], qw)


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("M", [1, 4, 16])
def test_cuda_graph_replay(M: int) -> None:
    gen = torch.Generator().manual_seed(M)
    qw = random_weight("nvfp4", 2048, 4096, gen)
    x = torch.randn(M, 4096, generator=gen).to(DEV, torch.bfloat16)
    w4a16_linear(x, qw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_linear(x, qw)
    x.copy_(torch.randn(M, 4096, generator=gen).to(DEV, torch.bfloat16))
    graph.replay()
    assert rel_err(out, quant_linear_ref(x, qw)) < 1e-2


CODES_BASE = {"CODES": 1, "BLOCK_M": 16, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_codes_kernel(dtype: torch.dtype) -> None:
    """The int4 codes kernel (scale after the dot): split K with tickets (last program out), zero points,
    bias, masked N and M, group 64 and 128, 2-64 rows."""
    gen = torch.Generator().manual_seed(11)
    n, k = (1029, 4096) if DEV == "cuda" else (40, 512)
    cases = [
        (128, True, 3, 64, 128, 1),
        (64, False, 16, 16, 64, 3),
        (128, True, 9, 128, 64, 4),
        (64, True, 2, 16, 64, 7),
        (128, False, 33, 64, 64, 2),
        (64, True, 64, 16, 64, 3),
    ]
    for group, zeros, M, bn, bk, split in cases:
        bn = bn if DEV == "cuda" else 16
        qw = random_weight("int4", n, k, gen, group, zeros, torch.bfloat16 if group == 64 else torch.float16)
        x = torch.randn(M, k, generator=gen).to(DEV, dtype)
        b = torch.randn(n, generator=gen).to(DEV, dtype)
        bm = max(16, 1 << (M - 1).bit_length())
        cfg = {**CODES_BASE, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}
        assert rel_err(w4a16_linear(x, qw, b, config=cfg), quant_linear_ref(x, qw, b)) < tol(dtype), cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_codes_kernel_decoded(dtype: torch.dtype) -> None:
    """The codes kernel's decoded form (DEQUANT: (code - zero) * scale rounded to x's dtype before one dot a tile):
    split K, zero points or none, bias, masked N and M, scales in x's dtype and in the other 16-bit one (rounded to
    x's), group 64 and 128, 3-64 rows."""
    gen = torch.Generator().manual_seed(12)
    n, k = (1029, 4096) if DEV == "cuda" else (40, 512)
    cases = [  # group, zeros, scale dtype is x's, M, BLOCK_N, BLOCK_K, split
        (128, True, False, 33, 64, 128, 1),
        (128, False, True, 64, 128, 64, 2),
        (64, True, True, 48, 64, 64, 4),
        (128, True, True, 3, 128, 128, 1),
        (128, True, True, 64, 128, 64, 4),
        # several row tiles (rows past the tile: 65-300 rows of mid-concurrency decode and prefill), banded
        (128, True, True, 70, 64, 128, 2, 32, 2),
        (64, False, False, 45, 128, 64, 1, 16, 4),
    ]
    for group, zeros, same, M, bn, bk, split, *tile in cases:
        bn = bn if DEV == "cuda" else 16
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        qw = random_weight("int4", n, k, gen, group, zeros, dtype if same else other)
        x = torch.randn(M, k, generator=gen).to(DEV, dtype)
        b = torch.randn(n, generator=gen).to(DEV, dtype)
        bm, group_m = tile or (max(16, 1 << (M - 1).bit_length()), 1)
        cfg = {**CODES_BASE, "DEQUANT": 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
               "GROUP_M": group_m}  # fmt: skip
        assert rel_err(w4a16_linear(x, qw, b, config=cfg), quant_linear_ref(x, qw, b)) < tol(dtype), cfg


@pytest.mark.skipif(DEV != "cuda", reason="the PTX decode (the interpreter runs the float32 form)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_codes_decoded_ptx_equals_float32_form(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoded form's PTX pairs give the float32 form's weights bit for bit (same tiles, same dot order), on
    tiles of 64 and 128 rows, 4 and 8 warps, K tiles of 64 and 128 and split K (where session 68's first form, which
    passed 16-bit operands two to an instance, paired words with other words' scales: 128 x 64 tiles, 8 warps)."""
    from ftransformers.kernels import triton_w4a16_codes

    gen = torch.Generator().manual_seed(13)
    qw = random_weight("int4", 1024, 4096, gen, 128, True, dtype)
    for m, bn, bk, split, warps, stages, bm in [(40, 64, 128, 1, 4, 3, 0), (64, 128, 64, 4, 8, 3, 0),
                                                (64, 128, 128, 2, 8, 4, 0), (17, 128, 64, 1, 4, 4, 0),
                                                (300, 128, 64, 2, 8, 3, 128), (160, 64, 128, 1, 4, 3, 256)]:  # fmt: skip
        x = torch.randn(m, 4096, generator=gen).to(DEV, dtype)
        cfg = {"CODES": 1, "DEQUANT": 1, "BLOCK_M": bm or max(16, 1 << (m - 1).bit_length()), "BLOCK_N": bn,
               "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "num_stages": stages, "GROUP_M": 8}  # fmt: skip
        monkeypatch.setattr(triton_w4a16_codes, "DQ_ASM", True)
        ptx = w4a16_linear(x, qw, config=cfg)
        assert rel_err(ptx, quant_linear_ref(x, qw)) < tol(dtype), cfg
        monkeypatch.setattr(triton_w4a16_codes, "DQ_ASM", False)
        assert torch.equal(ptx, w4a16_linear(x, qw, config=cfg)), cfg


def test_codes_split_without_tickets(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no ticket counters (a graph capture before the pool exists) a split product runs unsplit."""
    from ftransformers.kernels import tickets

    monkeypatch.setattr(tickets, "ticket_counters", lambda *a: None)
    gen = torch.Generator().manual_seed(5)
    qw = random_weight("int4", 40, 512, gen, 128, True)
    x = torch.randn(5, 512, generator=gen).to(DEV, torch.bfloat16)
    b = torch.randn(40, generator=gen).to(DEV, torch.bfloat16)
    cfg = {**CODES_BASE, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4}
    assert rel_err(w4a16_linear(x, qw, b, config=cfg), quant_linear_ref(x, qw, b)) < 1e-2


def test_codes_rejects_what_it_cannot_take() -> None:
    """Only int4 with 16-bit x, <= 64 rows and K tiles inside a group; float32 x (whose 1e-5 tolerance the
    offset codes' rounding would exceed) gets the dequantizing kernels by default."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 512, generator=gen).to(DEV, torch.bfloat16)
    cfg = {**CODES_BASE, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1}
    with pytest.raises(ValueError, match="codes kernel"):
        w4a16_linear(x, random_weight("nvfp4", 40, 512, gen), config=cfg)
    with pytest.raises(ValueError, match="codes kernel"):  # a K tile longer than the group
        w4a16_linear(x, random_weight("int4", 40, 512, gen, group=64), config=cfg)
    with pytest.raises(ValueError, match="codes kernel"):
        w4a16_linear(
            torch.randn(65, 512, generator=gen).to(DEV, torch.bfloat16),
            random_weight("int4", 40, 512, gen),
            config={**cfg, "BLOCK_M": 128},
        )
    qw, x32 = random_weight("int4", 40, 512, gen), x.float()
    with pytest.raises(ValueError, match="codes kernel"):
        w4a16_linear(x32, qw, config=cfg)
    assert "CODES" not in w4a16_config(4, 40, 512, "int4", codes=False)
    assert rel_err(w4a16_linear(x32, qw), quant_linear_ref(x32, qw)) < 1e-5
