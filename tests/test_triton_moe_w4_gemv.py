"""One token's 4-bit MoE on the GEMV-form kernels (kernels/triton_moe_w4_gemv.py) vs quant_moe_ref.

Fresh random words, scales (bf16 / fp16 / float32), zeros present or not, groups 32-128, top-k 2-8; mxfp4 and
nvfp4 experts (random E8M0 / E4M3 scales, nvfp4's global scales) on the same tiles,
hidden bf16 / fp16; tiles that divide D and I and tiles that leave tails (masked words and rows), the
down kernel's slots grouped 1 to 8 a tile. CPU: TRITON_INTERPRET=1 on small shapes; CUDA: Qwen3-30B-A3B's
experts (E=128, D=2048, I=768) too. Tolerance as tests/test_triton_moe_w4.py: ||out - ref|| / ||ref|| <=
1e-2 (the same float32 weights; the differences are summation order and act's 16-bit rounding, which
both round identically only up to that order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_w4 import CUDA, DEV, TOL, make_routing, random_qw, rel_err

from ftransformers.kernels import triton_fused_moe_w4 as w4
from ftransformers.kernels import triton_moe_w4_gemv as token
from ftransformers.kernels.quant_formats import quant_moe_ref
from ftransformers.kernels.triton_w4a16 import gemv_words

CFG = token.TokenGemvConfig
# gate-up rows a program where a test is about the down kernel: the default on CUDA, more on the CPU, where the
# interpreter's time goes with the programs
UP_N = CFG.up_n if CUDA else 16


def run(d: int, inter: int, e: int, k: int, dtype: torch.dtype, seed: int, cfg: CFG | None, fmt: str = "int4",
        t: int = 1, **qkw) -> float:  # fmt: skip
    gen = torch.Generator(DEV).manual_seed(seed)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(dtype)
    w13 = random_qw(fmt, e, 2 * inter, d, gen, **qkw)
    w2 = random_qw(fmt, e, d, inter, gen, **qkw)
    weights, ids = make_routing(t, e, k, gen)
    out = token.moe_w4_token(hidden, w13, w2, weights.reshape(-1).float().contiguous(), ids, cfg)
    assert out.shape == hidden.shape and out.dtype == dtype
    return rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids))


# (D, I, E, top-k, hidden dtype, quantization kwargs, config): the first rows the default tiles, then tails:
# D and I not multiples of the K tiles nor of the rows a program
SMALL = [
    (128, 128, 8, 8, torch.bfloat16, {"group": 128, "zeros": True}, None),
    (128, 128, 8, 8, torch.float16, {"group": 32}, None),
    (256, 192, 16, 4, torch.bfloat16, {"group": 64, "zeros": True, "scale_dtype": torch.float16},
     CFG(up_n=16, up_k=128, up_warps=2, down_n=4, down_k=128, down_slots=2, down_warps=2)),
    (160, 96, 8, 2, torch.bfloat16, {"group": 32, "zeros": True, "scale_dtype": torch.float32},
     CFG(up_n=8, up_k=64, up_warps=1, down_n=8, down_k=64, down_slots=1, down_warps=1)),
    (200, 104, 8, 4, torch.float16, {"group": 8}, CFG(up_n=16, up_k=64, up_warps=1, down_n=16, down_k=32, down_slots=4,
                                                       down_warps=1)),
    # two words a lane (int64 loads): whole tiles, then tails in D, I and the rows
    (256, 128, 8, 8, torch.bfloat16, {"group": 128, "zeros": True}, CFG(up_k=256, up_words=2, down_k=128, down_words=2)),
    (256, 192, 16, 4, torch.float16, {"group": 32, "scale_dtype": torch.float32},
     CFG(up_n=4, up_k=128, up_warps=2, down_n=8, down_k=64, down_slots=2, down_warps=1, up_words=2, down_words=2)),
    (224, 176, 8, 2, torch.bfloat16, {"group": 16, "zeros": True, "scale_dtype": torch.float16},
     CFG(up_n=16, up_k=64, up_warps=1, down_n=16, down_k=128, down_slots=1, down_warps=2, up_words=2, down_words=2)),
]  # fmt: skip
QWEN = (2048, 768, 128, 8)


@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"{c[0]}x{c[1]}-k{c[3]}-{c[5]}-{c[6] is not None}")
def test_token_path_matches_reference(case: tuple) -> None:
    d, inter, e, k, dtype, qkw, cfg = case
    err = run(d, inter, e, k, dtype, seed=d + inter + k, cfg=cfg, **qkw)
    assert err <= TOL, (case, err)


# FP4 (group 32 / 16 fixed by the format): the default tiles, one word a lane with tails, two words with tails
FP4_CFGS = [
    None,
    CFG(up_n=8, up_k=64, up_warps=1, down_n=8, down_k=64, down_slots=2, down_warps=1, up_words=1, down_words=1),
    CFG(up_n=64, up_k=64, up_warps=1, down_n=64, down_k=128, down_slots=1, down_warps=2, up_words=2, down_words=2),
]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape_cfg", [((128, 128, 8, 8), 0), ((160, 96, 8, 4), 1), ((224, 160, 8, 2), 2)],
                         ids=["default", "one-word-tails", "two-word-tails"])  # fmt: skip
def test_fp4_token_path_matches_reference(fmt: str, shape_cfg: tuple) -> None:
    (d, inter, e, k), c = shape_cfg
    dtype = torch.float16 if c == 1 else torch.bfloat16
    err = run(d, inter, e, k, dtype, seed=d + c, cfg=FP4_CFGS[c], fmt=fmt)
    assert err <= TOL, (fmt, shape_cfg, err)


def test_fp4_preload_and_slot_groups_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    # nvfp4's global scales are read before the PDL wait with the preload and per slot group without it
    d, inter, e, k = (128, 64, 8, 8) if not CUDA else QWEN
    errs = []
    for preload, slots in ((True, 8), (False, 8), (False, 2)):
        monkeypatch.setattr(token, "DOWN_PRELOAD", preload)
        errs.append(run(d, inter, e, k, torch.bfloat16, seed=11, cfg=CFG(up_n=UP_N, down_slots=slots), fmt="nvfp4"))
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("t", [2, 3])
def test_several_tokens_match_reference(fmt: str, t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each token's pairs on their own rows of act and its own output row, with and without the down preload; a
    # strided hidden (a row of a wider buffer) too. On the CPU 16 rows a program (the interpreter's time goes with
    # the programs; the default tiles are SMALL's first rows)
    d, inter, e, k = (128, 64, 8, 4) if not CUDA else QWEN
    qkw = {"group": 32, "zeros": True} if fmt == "int4" else {}
    cfg = CFG(down_slots=k) if CUDA else CFG(up_n=16, down_n=16, down_slots=k)
    for preload in (True, False):
        monkeypatch.setattr(token, "DOWN_PRELOAD", preload)
        err = run(d, inter, e, k, torch.bfloat16, seed=t + preload, cfg=cfg, fmt=fmt, t=t, **qkw)
        assert err <= TOL, (fmt, t, preload, err)
    gen = torch.Generator(DEV).manual_seed(t)
    wide = torch.randn(t, d + 64, generator=gen, device=DEV).to(torch.bfloat16)
    hidden = wide[:, 32 : 32 + d]
    w13, w2 = random_qw(fmt, e, 2 * inter, d, gen, **qkw), random_qw(fmt, e, d, inter, gen, **qkw)
    weights, ids = make_routing(t, e, k, gen)
    out = token.moe_w4_token(hidden, w13, w2, weights.reshape(-1).float().contiguous(), ids, None if CUDA else cfg)
    assert rel_err(out, quant_moe_ref(hidden.contiguous(), w13, w2, weights, ids)) <= TOL


@pytest.mark.skipif(not CUDA, reason="the real expert shapes are slow in the interpreter")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("cfg", [None, CFG(up_words=1, down_words=2, down_k=512)])
def test_fp4_token_path_qwen3_experts(fmt: str, cfg: CFG | None) -> None:
    d, inter, e, k = QWEN
    assert run(d, inter, e, k, torch.bfloat16, seed=7, cfg=cfg, fmt=fmt) <= TOL


@pytest.mark.skipif(not CUDA, reason="the real expert shapes are slow in the interpreter")
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cfg",
    [
        None,
        CFG(up_n=4, up_k=1024, up_warps=4),
        CFG(up_n=2, up_k=2048, up_warps=2, down_n=8, down_k=1024),
        CFG(up_k=1024, up_words=2, down_k=512, down_words=2),
    ],
)
def test_token_path_qwen3_experts(zeros: bool, dtype: torch.dtype, cfg: CFG | None) -> None:
    d, inter, e, k = QWEN
    err = run(d, inter, e, k, dtype, seed=int(zeros) + 2, cfg=cfg, group=128, zeros=zeros)
    assert err <= TOL, (zeros, dtype, cfg, err)


def test_down_slot_groups_agree() -> None:
    # The down kernel's word axis holds 1, 2, 4 or 8 slots a tile: the same sums in another order.
    d, inter, e, k = (128, 64, 8, 8) if not CUDA else QWEN
    errs = [
        run(d, inter, e, k, torch.bfloat16, seed=5, cfg=CFG(up_n=UP_N, down_slots=s), group=32, zeros=True)
        for s in (1, 2, 4, 8)
    ]
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize(
    "d,inter,cfg",
    [
        (128, 96, CFG(down_k=32, down_words=1)),  # three tiles, the last one masked
        (96, 64, CFG(down_n=8, down_k=64, down_words=2)),  # one tile: nothing after the preloaded one
        (80, 48, CFG(down_n=32, down_k=64, down_warps=2)),  # one tile, partly masked, rows past D
    ],
)
def test_down_preload_matches(d: int, inter: int, cfg: CFG, monkeypatch: pytest.MonkeyPatch) -> None:
    # The down kernel with its routing and first K tile read ahead of the PDL wait (moe_w4_token's default)
    # gives what the kernel without gives, and both match the reference.
    errs = []
    cfg = dataclasses.replace(cfg, up_n=UP_N)
    for preload in (True, False):
        monkeypatch.setattr(token, "DOWN_PRELOAD", preload)
        errs.append(run(d, inter, 8, 8, torch.bfloat16, seed=inter, cfg=cfg, group=16, zeros=preload))
    assert max(errs) <= TOL, errs


def test_two_words_a_lane_only_where_the_layout_allows() -> None:
    # The int64 view (triton_w4a16.gemv_words, shared with the dense GEMV) is taken for groups and K tiles of
    # whole 16-element pairs on contiguous words; group 8, an odd row stride or a sliced (misaligned) stack fall
    # back to one word a lane and still match.
    gen = torch.Generator(DEV).manual_seed(3)
    qw = random_qw("int4", 4, 64, 128, gen, group=32)
    q, words = gemv_words(qw, 2, 128)
    assert words == 2 and q.dtype == torch.int64 and q.shape[-1] * 2 == qw.qweight.shape[-1]
    assert q.stride() == tuple(st // 2 for st in qw.qweight.stride()[:-1]) + (1,)
    assert gemv_words(qw, 1, 128)[1] == 1 and gemv_words(qw, 2, 8)[1] == 1
    assert gemv_words(random_qw("int4", 4, 64, 128, gen, group=8), 2, 128)[1] == 1
    odd_rows = torch.zeros(4, 64, 17, dtype=torch.int32, device=DEV)[:, :, :16]
    assert gemv_words(dataclasses.replace(qw, qweight=odd_rows), 2, 128)[1] == 1
    sliced = dataclasses.replace(qw, qweight=qw.qweight[:, :, 1:3])
    assert gemv_words(sliced, 2, 16)[1] == 1
    wide = CFG(up_k=64, up_words=2, down_k=32, down_words=2)
    assert run(128, 64, 8, 4, torch.bfloat16, seed=4, cfg=wide, group=8, zeros=True) <= TOL


def test_fused_moe_w4_takes_int4_and_fp4_tokens_here(monkeypatch: pytest.MonkeyPatch) -> None:
    # fused_moe_w4 sends up to INT4_MAX_TOKENS tokens of int4 experts here, and up to FP4_MAX_TOKENS of FP4 experts
    # no wider than FP4_MAX_HIDDEN (FP4_WIDE_MAX_TOKENS past MAX_HIDDEN); more tokens, FP4 with FP4 off, hidden
    # wider than the limits or ENABLED off go elsewhere. A call taken here must match the reference; the paths it
    # falls to are stubs that count (their numerics are test_triton_moe_w4.py's), and exactly one path runs. Wide
    # tiles (32 rows a program) keep the interpreter quick; the default tiles are SMALL's first rows.
    calls: list[int] = []
    fell: list[str] = []
    real = token.moe_w4_token
    monkeypatch.setattr(token, "moe_w4_token", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for name, owner in (("_pair_path", w4), ("moe_w4_mma", w4.mma_path)):
        monkeypatch.setattr(owner, name, lambda hidden, *a, _n=name, **kw: fell.append(_n) or torch.zeros_like(hidden))
    monkeypatch.setattr(token, "UP_N", 32)
    monkeypatch.setattr(token, "DOWN_N", 32)
    gen = torch.Generator(DEV).manual_seed(9)
    d, inter, e, k = 128, 128, 8, 4

    def taken(t: int, fmt: str = "int4") -> bool:  # whether the call ran here (and then matched the reference)
        before, fell_before = len(calls), len(fell)
        hidden = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
        w13, w2 = random_qw(fmt, e, 2 * inter, d, gen), random_qw(fmt, e, d, inter, gen)
        weights, ids = make_routing(t, e, k, gen)
        out = w4.fused_moe_w4(hidden, w13, w2, weights, ids)
        here = len(calls) > before
        assert here != (len(fell) > fell_before), (t, fmt, len(calls) - before, fell[fell_before:])
        if here:
            assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL, (t, fmt)
        return here

    assert taken(1) and taken(token.INT4_MAX_TOKENS) and not taken(token.INT4_MAX_TOKENS + 1)
    monkeypatch.setattr(token, "INT4_MAX_TOKENS", 2)
    assert taken(2) and not taken(3)
    assert taken(1, "mxfp4") and taken(1, "nvfp4")
    monkeypatch.setattr(token, "FP4_MAX_TOKENS", 2)  # FP4 up to FP4_MAX_TOKENS tokens, then the pair path
    assert taken(2, "nvfp4") and not taken(3, "mxfp4")
    monkeypatch.setattr(token, "MAX_HIDDEN", d // 2)  # past int4's width, FP4 goes up to FP4_WIDE_MAX_TOKENS
    monkeypatch.setattr(token, "FP4_WIDE_MAX_TOKENS", 3)
    assert taken(3, "mxfp4") and not taken(4, "nvfp4") and not taken(1)
    monkeypatch.setattr(token, "MAX_HIDDEN", d)
    monkeypatch.setattr(token, "FP4_MAX_HIDDEN", d // 2)
    assert not taken(1, "mxfp4") and taken(1)
    monkeypatch.setattr(token, "FP4_MAX_HIDDEN", d)
    monkeypatch.setattr(token, "FP4", False)
    assert not taken(1, "mxfp4") and taken(1)
    monkeypatch.setattr(token, "ENABLED", False)
    assert not taken(1) and not taken(1, "nvfp4")


def test_default_config_is_the_module_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # moe_w4_token runs TokenGemvConfig's defaults unless ab_decode's `set=` changed the module's names
    assert token.default_config() == CFG()
    monkeypatch.setattr(token, "UP_WORDS", 1)
    monkeypatch.setattr(token, "DOWN_SLOTS", 2)
    assert token.default_config() == dataclasses.replace(CFG(), up_words=1, down_slots=2)


def test_odd_top_k_and_bad_slot_groups() -> None:
    # Top-3 and top-6 run with 1 and 2 slots a down tile (the largest power of two dividing top-k); a slot
    # count that is not a power of two is refused.
    for k, seed in ((3, 1), (6, 2)):
        assert run(128, 64, 8, k, torch.bfloat16, seed=seed, cfg=None, group=32, zeros=True) <= TOL
    gen = torch.Generator(DEV).manual_seed(1)
    w13, w2 = random_qw("int4", 4, 128, 64, gen, group=32), random_qw("int4", 4, 64, 64, gen, group=32)
    hidden = torch.randn(1, 64, device=DEV).to(torch.bfloat16)
    weights, ids = torch.full((2,), 0.5, device=DEV), torch.tensor([[0, 1]], device=DEV)
    with pytest.raises(ValueError, match="down_slots must be a power of two"):
        token.moe_w4_token(hidden, w13, w2, weights, ids, dataclasses.replace(CFG(), down_slots=3))
    # a TokenGemvConfig forces this path: too many tokens or experts of two formats get a clear error, not a wrong
    # answer
    many = token.MAX_TOKENS + 1
    refused = f"1 to {token.MAX_TOKENS} tokens of 4-bit experts in one format .*, got {many}"
    with pytest.raises(ValueError, match=refused):
        w4.fused_moe_w4(hidden.expand(many, -1).contiguous(), w13, w2, weights.expand(many, -1),
                        ids.expand(many, -1), CFG())  # fmt: skip
    fp4 = random_qw("mxfp4", 4, 64, 64, gen)
    with pytest.raises(ValueError, match="experts int4 / mxfp4"):
        token.moe_w4_token(hidden, w13, fp4, weights, ids)
