"""Which int4 MoE calls fused_moe_w4 sends to the mma kernels (kernels/gluon_moe_w4_mma.py `takes`), pinned on
the CPU: the measured bounds beside MIN_TOKENS, NARROW_MAX_PAIRS and WIDE_MAX_PAIRS, and triton_moe_w4_gemv's
INT4_MAX_TOKENS taking one token first on narrow models. The GPU check of `mma_capable` is stubbed; shapes are what
the bounds read (D narrow or past 4096, top-k, T), with small expert counts. On a GPU,
tests/test_gluon_moe_w4_mma.py checks `takes` unstubbed."""

from __future__ import annotations

import pytest
import torch
from test_triton_moe_w4 import DEV, random_qw

from ftransformers.kernels import gluon_moe_w4_mma as mma
from ftransformers.kernels import triton_moe_w4_gemv as token
from ftransformers.kernels.quant_formats import QuantizedWeight


def _takes(t: int, d: int, top_k: int = 8, zeros: bool = True) -> tuple[bool, bool]:
    # (the token kernels take it, the mma kernels take it), on DEV's weights (the CPU in CI)
    gen = torch.Generator(device=DEV).manual_seed(t * 31 + d)
    inter, e = 256, 8
    w13 = random_qw("int4", e, 2 * inter, d, gen, group=128, zeros=zeros)
    w2 = random_qw("int4", e, d, inter, gen, group=128, zeros=zeros)
    hidden = torch.zeros(t, d, dtype=torch.bfloat16, device=w13.qweight.device)
    return token.takes(hidden, w13, w2, top_k), mma.takes(hidden, w13, w2, top_k)


@pytest.fixture(autouse=True)
def _capable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mma, "mma_capable", lambda t: True)


def test_narrow_experts_one_token_on_the_token_kernels_then_mma_up_to_64_tokens() -> None:
    # Qwen3-30B-A3B's width: one token on the GEMV-form kernels, 2 to 64 at top-8 (512 pairs) here with zero points,
    # 56 (448 pairs) without, then the aligned path
    assert token.INT4_MAX_TOKENS == 1 and mma.MIN_TOKENS == 2
    assert mma.NARROW_MAX_PAIRS == 512 and mma.NARROW_MAX_PAIRS_SYM == 448
    assert _takes(1, 2048) == (True, False)
    for t in (2, 8, 24, 32, 40, 48, 56, 64):
        assert _takes(t, 2048) == (False, True), t
    assert _takes(65, 2048) == (False, False)
    assert _takes(128, 2048, top_k=4) == (False, True) and _takes(129, 2048, top_k=4) == (False, False)
    assert _takes(16, 2048, zeros=False) == (False, True) and _takes(56, 2048, zeros=False) == (False, True)
    assert _takes(57, 2048, zeros=False) == (False, False)  # symmetric weights: 448 pairs


def test_wide_experts_on_mma_from_one_token_to_512_pairs() -> None:
    # DeepSeek-V3's width (past the token kernels' 4096): every count up to WIDE_MAX_PAIRS pairs
    assert mma.WIDE_MAX_PAIRS == 512
    assert _takes(1, 7168) == (False, True)
    assert _takes(64, 7168) == (False, True)
    assert _takes(65, 7168) == (False, False)


def test_the_grouped_gate_up_from_16_tokens_with_spans_by_width_and_symmetry() -> None:
    # measured faster from 16 tokens in the W4A16 step on both widths, slower at 8 on DeepSeek-V3's experts
    assert mma.GROUPED_FROM_TOKENS == 16 and mma.GROUPED_SPANS_WIDE == 2 and mma.GROUPED_FROM_TOKENS_NARROW == 8
    assert mma.GROUPED_SPANS_NARROW == 2 and mma.GROUPED_SPANS_NARROW_FEW == 4
    gen = torch.Generator(device=DEV).manual_seed(5)
    asym, sym = (random_qw("int4", 4, 512, 2048, gen, group=128, zeros=z) for z in (True, False))

    def spans(t: int, d: int, w13: QuantizedWeight) -> int:
        return mma.grouped_spans(torch.zeros(t, d, dtype=torch.bfloat16, device=w13.qweight.device), w13)

    # narrow experts: 4 spans below 16 tokens with zero points, below 40 without (from 48 the compact grid takes)
    assert mma.GROUPED_NARROW_FEW_BELOW == 16 and mma.GROUPED_NARROW_FEW_BELOW_SYM == 40
    assert spans(8, 2048, asym) == 4 and spans(15, 4096, asym) == 4
    assert spans(16, 2048, asym) == 2 and spans(16, 4096, asym) == 2 and spans(64, 2048, asym) == 2
    assert spans(16, 2048, sym) == 4 and spans(39, 2048, sym) == 4 and spans(40, 2048, sym) == 2
    assert spans(16, 7168, sym) == 2 and spans(16, 7168, asym) == 2 and spans(8, 7168, sym) == 2
    for d, t, want in [(7168, 16, True), (7168, 32, True), (7168, 15, False), (7168, 8, False), (2048, 16, True),
                       (2048, 32, True), (2048, 8, True), (2048, 7, False), (2048, 2, False)]:  # fmt: skip
        w13 = random_qw("int4", 4, 512, d, gen, group=128, zeros=True)
        hidden = torch.zeros(t, d, dtype=torch.bfloat16, device=w13.qweight.device)
        assert mma.grouped_takes(hidden, w13, mma.default_config(t, d)) == want, (d, t)
    # Kimi-K2's groups of 32 leave no span of a 128-wide chunk inside a group: the pair form
    w13 = random_qw("int4", 4, 512, 7168, gen, group=32, zeros=True)
    hidden = torch.zeros(32, 7168, dtype=torch.bfloat16, device=w13.qweight.device)
    assert not mma.grouped_takes(hidden, w13, mma.default_config(32, 7168))


def test_the_grouped_gate_up_reads_its_knobs_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # the benches' A/B knobs (bench_moe_w4_mma --ab, ab_decode set=) set the module values after import: a default
    # argument bound at definition time would ignore them
    gen = torch.Generator(device=DEV).manual_seed(6)
    w13 = random_qw("int4", 4, 512, 2048, gen, group=128, zeros=True)
    hidden = torch.zeros(16, 2048, dtype=torch.bfloat16, device=w13.qweight.device)
    cfg = mma.default_config(16, 2048)
    monkeypatch.setattr(mma, "GROUPED_SPANS_NARROW", 8)
    assert mma.grouped_spans(hidden, w13) == 8
    monkeypatch.setattr(mma, "GROUPED_FROM_TOKENS_NARROW", 0)
    assert not mma.grouped_takes(hidden, w13, cfg)
    monkeypatch.setattr(mma, "GROUPED_FROM_TOKENS_NARROW", 17)
    assert not mma.grouped_takes(hidden, w13, cfg)
    monkeypatch.setattr(mma, "GROUPED_FROM_TOKENS_NARROW", 16)
    seen: list[int] = []

    class Grouped(Exception):
        pass

    def group_pairs(ids: torch.Tensor, p: int) -> torch.Tensor:
        seen.append(p)
        raise Grouped  # before the GPU launch

    monkeypatch.setattr(mma, "group_pairs", group_pairs)
    with pytest.raises(Grouped):
        mma.gate_up_grouped(hidden, w13, torch.zeros(16, 8, dtype=torch.int32, device=hidden.device), cfg)
    assert seen == [1]  # 8 / GROUPED_SPANS_NARROW pairs a group


def test_the_grouped_down_with_the_grouped_gate_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # the down runs over the gate-up's groups where a chunk of I has spans inside the groups, D splits into the
    # program's 4 x 32 rows and the pool holds a counter for each (token, row tile); GROUPED_DOWN read at call time
    assert mma.GROUPED_DOWN and mma.GROUPED_DOWN_ROWS == 32 and mma.GROUPED_DOWN_WARPS == 4
    gen = torch.Generator(device=DEV).manual_seed(7)
    w2 = random_qw("int4", 4, 2048, 768, gen, group=128, zeros=True)
    hidden = torch.zeros(16, 2048, dtype=torch.bfloat16, device=w2.qweight.device)
    cfg = mma.default_config(16, 2048)
    assert cfg.gdown_rows == 32 and cfg.gdown_warps == 4
    assert mma.grouped_down_takes(hidden, w2, cfg, 2) and mma.grouped_down_takes(hidden, w2, cfg, 4)
    g32 = random_qw("int4", 4, 2048, 768, gen, group=32, zeros=True)
    assert not mma.grouped_down_takes(hidden, g32, cfg, 2)  # spans of 128 cross groups of 32
    odd = random_qw("int4", 4, 2112, 768, gen, group=128)
    assert not mma.grouped_down_takes(torch.zeros(16, 2112, dtype=torch.bfloat16, device=hidden.device), odd, cfg, 2)
    many = torch.zeros(4097, 2048, dtype=torch.bfloat16, device=hidden.device)  # 4097 x 16 tiles > 65536 counters
    assert not mma.grouped_down_takes(many, w2, cfg, 2)
    monkeypatch.setattr(mma, "GROUPED_DOWN", 0)
    assert not mma.grouped_down_takes(hidden, w2, cfg, 2)


def test_a_program_per_group_where_fewer_groups_than_pairs_can_form(monkeypatch: pytest.MonkeyPatch) -> None:
    # ceil(n_e / p) <= floor(n_e / p) + 1 groups an expert: at most E + pairs // p, and never more than the pairs
    assert mma.group_bound(512, 128, 4) == 256 and mma.group_bound(256, 128, 4) == 192
    assert mma.group_bound(128, 128, 4) == 128 and mma.group_bound(512, 256, 4) == 384
    gen = torch.Generator().manual_seed(3)
    for pairs, e, p in [(512, 128, 4), (256, 128, 2), (40, 8, 4), (64, 4, 8)]:
        ids = torch.randint(0, e, (pairs,), generator=gen)
        groups = sum(-(-int(c) // p) for c in torch.bincount(ids, minlength=e))
        assert groups <= mma.group_bound(pairs, e, p)
    # measured faster where at most 0.6 of the pairs can lead a group (48-64 tokens at 4 pairs a group), level or
    # slower at 0.75-0.83
    assert mma.GROUPED_COMPACT and mma.COMPACT_MAX_SHARE == 0.6
    assert mma.compact_takes(512, 128, 4) and mma.compact_takes(384, 128, 4)  # 64, 48 tokens: 0.5, 0.58
    assert not mma.compact_takes(256, 128, 4) and not mma.compact_takes(384, 128, 2)  # 0.75, 0.83
    assert not mma.compact_takes(512, 256, 4) and not mma.compact_takes(128, 128, 4)  # DeepSeek-V3 at 64: 0.75
    monkeypatch.setattr(mma, "GROUPED_COMPACT", 0)
    assert not mma.compact_takes(512, 128, 4)
