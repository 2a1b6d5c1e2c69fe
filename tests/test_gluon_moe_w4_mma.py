"""The int4 MoE pair path on mma.sync (kernels/gluon_moe_w4_mma.py) vs quant_moe_ref, fresh random inputs.

CUDA only (Gluon kernels do not run in Triton's interpreter). Int4 with group 32, 128 and 256, zeros absent and present,
bf16 / fp16 / float32 scales; hidden bf16 and fp16; T in {1, 2, 5, 16}; top-k 2, 4, 8; shapes
(D, I, E) = (512, 256, 16) and Qwen3-30B-A3B's (2048, 768, 128) (T 1, 5 and 24, the engine's bound there).
Tolerance: ||out - ref|| / ||ref|| <= 1e-2, as for the other 4-bit MoE kernels (tests/test_triton_moe_w4.py):
the products are exact in float32; the differences are summation order, the 16-bit rounding of act
and of the output, and the float32 cancellation of the code offset (~1e-5).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
    pytest.skip("mma.sync kernels need a CUDA GPU of compute capability >= 8.0", allow_module_level=True)

from test_triton_moe_w4 import TOL, make_routing, random_qw, rel_err

from ftransformers.kernels import gluon_moe_w4_mma as mma
from ftransformers.kernels.quant_formats import quant_moe_ref
from ftransformers.kernels.tickets import POOL_SIZE, ticket_counters
from ftransformers.kernels.triton_moe_groups import group_pairs

DEV = "cuda"
QUANT = [
    {"group": 128},
    {"group": 128, "zeros": True},
    {"group": 256, "zeros": True, "scale_dtype": torch.float16},
    {"group": 128, "scale_dtype": torch.float32},
    {"group": 32, "zeros": True},  # Kimi-K2's grid: spans of 32 (chunks of 256)
]


def run(t: int, e: int, k: int, d: int, inter: int, dtype: torch.dtype, seed: int, **qkw) -> float:
    gen = torch.Generator(DEV).manual_seed(seed)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(dtype)
    w13 = random_qw("int4", e, 2 * inter, d, gen, **qkw)
    w2 = random_qw("int4", e, d, inter, gen, **qkw)
    weights, ids = make_routing(t, e, k, gen)
    assert mma.supported(hidden, w13, w2, k)
    out = mma.moe_w4_mma(hidden, w13, w2, weights.reshape(-1).contiguous(), ids)
    assert out.shape == hidden.shape and out.dtype == dtype
    return rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids))


@pytest.mark.parametrize("q", range(len(QUANT)))
@pytest.mark.parametrize("t", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_shape(q: int, t: int, k: int, dtype: torch.dtype) -> None:
    assert run(t, 16, k, 512, 256, dtype, seed=100 * q + 10 * t + k, **QUANT[q]) <= TOL


@pytest.mark.parametrize("q", [0, 1])
@pytest.mark.parametrize("t", [1, 5, 24])
def test_qwen3_30b_shape(q: int, t: int) -> None:
    assert run(t, 128, 8, 2048, 768, torch.bfloat16, seed=q + 7 * t, **QUANT[q]) <= TOL


def test_gate_up_alone_matches_reference_act() -> None:
    gen = torch.Generator(DEV).manual_seed(3)
    d, inter, e = 512, 256, 8
    hidden = torch.randn(2, d, generator=gen, device=DEV).to(torch.bfloat16)
    w13 = random_qw("int4", e, 2 * inter, d, gen, group=128, zeros=True)
    _, ids = make_routing(2, e, 4, gen)
    act = mma.gate_up(hidden, w13, ids.contiguous())
    from ftransformers.kernels.quant_formats import dequantize

    w = dequantize(w13)  # [E, 2I, D] float32
    x = hidden.float()[torch.arange(2, device=DEV).repeat_interleave(4)]  # [pairs, D]
    gu = torch.einsum("pd,pnd->pn", x, w[ids.reshape(-1)])
    ref = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(torch.bfloat16)
    assert rel_err(act, ref) <= TOL


def test_supported_rejects_what_it_cannot_run() -> None:
    gen = torch.Generator(DEV).manual_seed(5)
    hidden = torch.randn(1, 512, device=DEV, dtype=torch.bfloat16)
    ok = (random_qw("int4", 4, 512, 512, gen, group=32), random_qw("int4", 4, 512, 256, gen, group=32))
    assert mma.supported(hidden, *ok, 8)
    assert not mma.supported(hidden, *ok, 6)  # top-k not a power of two
    assert not mma.supported(hidden.float(), *ok, 8)
    odd_i = (random_qw("int4", 4, 2 * 200, 512, gen, group=8), random_qw("int4", 4, 512, 200, gen, group=8))
    assert not mma.supported(hidden, *odd_i, 8)  # no chunk divides I = 200
    fp4 = (random_qw("mxfp4", 4, 512, 512, gen), random_qw("mxfp4", 4, 512, 256, gen))
    assert not mma.supported(hidden, *fp4, 8)


@pytest.mark.parametrize("cfg", [
    mma.MmaMoEConfig(up_kc=256, up_ahead=2, down_kc=128, down_ahead=2),
    mma.MmaMoEConfig(up_kc=128, up_rows=16, up_warps=2, down_kc=512, down_rows=32),
    mma.MmaMoEConfig(up_warps=1, up_ahead=2, down_ahead=2),
], ids=str)
def test_other_configs(cfg: mma.MmaMoEConfig) -> None:
    gen = torch.Generator(DEV).manual_seed(11)
    hidden = torch.randn(3, 1024, generator=gen, device=DEV).to(torch.bfloat16)
    w13 = random_qw("int4", 8, 2 * 512, 1024, gen, group=128, zeros=True)
    w2 = random_qw("int4", 8, 1024, 512, gen, group=128, zeros=True)
    weights, ids = make_routing(3, 8, 4, gen)
    assert mma.supported(hidden, w13, w2, 4, cfg)
    out = mma.moe_w4_mma(hidden, w13, w2, weights.reshape(-1).contiguous(), ids, cfg)
    assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids)) <= TOL


def test_takes_where_measured_faster() -> None:
    # on this GPU (the bounds on the CPU: tests/test_moe_w4_mma_rule.py)
    gen = torch.Generator(DEV).manual_seed(9)
    qwen = (random_qw("int4", 4, 2 * 768, 2048, gen), random_qw("int4", 4, 2048, 768, gen))
    one, two = (torch.randn(t, 2048, device=DEV, dtype=torch.bfloat16) for t in (1, 2))
    assert not mma.takes(one, *qwen, 8)  # one token, small experts: the GEMV-form token kernels
    assert mma.takes(two, *qwen, 8)
    assert mma.takes(torch.randn(56, 2048, device=DEV, dtype=torch.bfloat16), *qwen, 8)
    assert not mma.takes(torch.randn(57, 2048, device=DEV, dtype=torch.bfloat16), *qwen, 8)  # symmetric: aligned path
    awq = (random_qw("int4", 4, 2 * 768, 2048, gen, zeros=True), random_qw("int4", 4, 2048, 768, gen, zeros=True))
    assert mma.takes(torch.randn(64, 2048, device=DEV, dtype=torch.bfloat16), *awq, 8)
    assert not mma.takes(torch.randn(65, 2048, device=DEV, dtype=torch.bfloat16), *awq, 8)
    wide = (random_qw("int4", 2, 2 * 256, 8192, gen), random_qw("int4", 2, 8192, 256, gen))
    assert mma.takes(torch.randn(1, 8192, device=DEV, dtype=torch.bfloat16), *wide, 8)
    assert mma.takes(torch.randn(64, 8192, device=DEV, dtype=torch.bfloat16), *wide, 8)
    assert not mma.takes(torch.randn(65, 8192, device=DEV, dtype=torch.bfloat16), *wide, 8)


def test_moe_at_the_pair_bounds() -> None:
    # the largest calls `takes` sends here: Qwen3-30B-A3B's experts at 64 tokens (512 pairs) with zero points and
    # 56 (448) without, DeepSeek-V3's width at 64 tokens (512 pairs) on fewer, smaller experts; the grouped gate-up and
    # down run on all but g32
    assert run(64, 128, 8, 2048, 768, torch.bfloat16, seed=81, group=128, zeros=True) <= TOL
    assert run(56, 128, 8, 2048, 768, torch.bfloat16, seed=84, group=128) <= TOL
    assert run(64, 32, 8, 7168, 256, torch.bfloat16, seed=82, group=128, zeros=True) <= TOL
    assert run(64, 32, 8, 7168, 256, torch.bfloat16, seed=83, group=32) <= TOL  # Kimi-K2's groups: the pair form


@pytest.mark.parametrize(("t", "e", "k", "d", "inter"), [
    (1, 16, 8, 512, 256), (5, 16, 8, 512, 256), (16, 16, 8, 512, 256), (24, 128, 8, 2048, 768), (9, 16, 2, 1024, 256),
    (3, 8, 4, 7168, 256),
])  # fmt: skip
@pytest.mark.parametrize("q", [0, 1, 2])
@pytest.mark.parametrize("spans", [1, 2, 4, 8])
def test_grouped_gate_up_matches_reference_act(t: int, e: int, k: int, d: int, inter: int, q: int, spans: int) -> None:
    # gate_up_grouped's act against the reference act, pair by pair: 16 experts at top-8 put up to 16 pairs on an
    # expert (several groups of 8 / spans on it); group 256 with one span has no chunk (skipped)
    quant = [{"group": 128}, {"group": 128, "zeros": True}, {"group": 256, "zeros": True, "scale_dtype": torch.float16}]
    cfg = mma.default_config(t, d)
    if not mma.chunk_k(d // cfg.up_warps, quant[q]["group"], cfg.up_kc, spans):
        pytest.skip("no chunk for this group and span count")
    gen = torch.Generator(DEV).manual_seed(1000 * q + 10 * t + spans)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
    w13 = random_qw("int4", e, 2 * inter, d, gen, **quant[q])
    _, ids = make_routing(t, e, k, gen)
    act = mma.gate_up_grouped(hidden, w13, ids.contiguous(), cfg, spans=spans)
    from ftransformers.kernels.quant_formats import dequantize

    w = dequantize(w13)  # [E, 2I, D] float32
    x = hidden.float()[torch.arange(t, device=DEV).repeat_interleave(k)]  # [pairs, D]
    gu = torch.einsum("pd,pnd->pn", x, w[ids.reshape(-1)])
    ref = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(torch.bfloat16)
    for p in range(t * k):
        assert rel_err(act[p : p + 1], ref[p : p + 1]) <= TOL, (p, ids.reshape(-1)[p].item())


def test_moe_with_the_grouped_gate_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mma, "GROUPED_FROM_TOKENS", 2)
    monkeypatch.setattr(mma, "GROUPED_FROM_TOKENS_NARROW", 2)
    for spans in (2, 4):
        for knob in ("GROUPED_SPANS_NARROW", "GROUPED_SPANS_NARROW_FEW", "GROUPED_SPANS_WIDE"):
            monkeypatch.setattr(mma, knob, spans)
        assert run(16, 128, 8, 2048, 768, torch.bfloat16, seed=77, group=128, zeros=True) <= TOL
        assert run(5, 16, 8, 512, 256, torch.float16, seed=78, group=128) <= TOL
        assert run(2, 64, 8, 7168, 256, torch.bfloat16, seed=79, group=128) <= TOL


def _down_ref(act: torch.Tensor, w2, weights: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # out[t] = sum_k weights[t, k] * act[t K + k] @ w2[ids[t, k]]^T in float32, rounded once
    from ftransformers.kernels.quant_formats import dequantize

    w = dequantize(w2)[ids.reshape(-1)]  # [pairs, D, I]
    y = torch.einsum("pi,pdi->pd", act.float(), w) * weights.reshape(-1, 1).float()
    return y.reshape(*ids.shape, -1).sum(1).to(dtype)


@pytest.mark.parametrize(("t", "e", "k", "d", "inter"), [
    (16, 16, 8, 512, 256), (24, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (9, 16, 2, 1024, 256),
    (5, 8, 4, 7168, 256), (48, 32, 8, 7168, 512),
])  # fmt: skip
@pytest.mark.parametrize("q", [0, 1, 2])
@pytest.mark.parametrize("spans", [1, 2, 4, 8])
def test_grouped_down_matches_reference(t: int, e: int, k: int, d: int, inter: int, q: int, spans: int) -> None:
    # down_grouped on random act against the reference down, token by token: 16 experts at top-8 put up to 16
    # pairs on an expert (several groups on it), 128 at 64 tokens about 4; fp16 where the scales are
    quant = [{"group": 128}, {"group": 128, "zeros": True}, {"group": 256, "zeros": True, "scale_dtype": torch.float16}]
    dtype = torch.float16 if q == 2 else torch.bfloat16
    cfg = mma.default_config(t, d)
    if not mma.chunk_k(inter, quant[q]["group"], cfg.down_kc, spans):
        pytest.skip("no chunk for this group and span count")
    gen = torch.Generator(DEV).manual_seed(2000 * q + 10 * t + spans)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(dtype)
    act = torch.randn(t * k, inter, generator=gen, device=DEV).to(dtype)
    w2 = random_qw("int4", e, d, inter, gen, **quant[q])
    weights, ids = make_routing(t, e, k, gen)
    flat, ids = weights.reshape(-1).contiguous(), ids.contiguous()
    groups = group_pairs(ids, 8 // spans)
    out = mma.down_grouped(act, hidden, w2, flat, ids, groups, spans, cfg)
    ref = _down_ref(act, w2, weights, ids, dtype)
    assert out.dtype == dtype
    for i in range(t):
        assert rel_err(out[i : i + 1], ref[i : i + 1]) <= TOL, i
    again = mma.down_grouped(act, hidden, w2, flat, ids, groups, spans, cfg)
    assert torch.equal(out, again)  # the partials are added in slot order, whichever program comes last
    assert not ticket_counters(hidden.device, "moe_w4_grouped_down", POOL_SIZE).any()  # every counter back to 0


@pytest.mark.parametrize("t", [16, 64])
def test_grouped_down_in_graph_replays(t: int) -> None:
    # the whole MoE captured once (grouped gate-up and down at 16 tokens; at 64 on the compact grid), replayed over
    # six routings and hiddens
    gen = torch.Generator(DEV).manual_seed(31)
    e, k, d, inter = 128, 8, 2048, 768
    w13 = random_qw("int4", e, 2 * inter, d, gen, group=128, zeros=True)
    w2 = random_qw("int4", e, d, inter, gen, group=128, zeros=True)
    hidden = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
    weights, ids = make_routing(t, e, k, gen)
    flat = weights.reshape(-1).contiguous()
    assert mma.grouped_takes(hidden, w13, mma.default_config(t, d))
    mma.moe_w4_mma(hidden, w13, w2, flat, ids)  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mma.moe_w4_mma(hidden, w13, w2, flat, ids)
    for _ in range(6):
        new_w, new_ids = make_routing(t, e, k, gen)
        hidden.copy_(torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16))
        flat.copy_(new_w.reshape(-1))
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, quant_moe_ref(hidden, w13, w2, new_w, new_ids)) <= TOL
    assert not ticket_counters(hidden.device, "moe_w4_grouped_down", POOL_SIZE).any()
    assert mma.compact_takes(t * k, e, 4) == (t == 64)


def test_moe_grouped_down_against_per_token_down(monkeypatch: pytest.MonkeyPatch) -> None:
    # the whole MoE with the grouped down and with the per-token one: both against the reference
    for grouped in (True, False):
        monkeypatch.setattr(mma, "GROUPED_DOWN", grouped)
        assert run(32, 128, 8, 2048, 768, torch.bfloat16, seed=91, group=128, zeros=True) <= TOL
        assert run(24, 64, 8, 7168, 256, torch.bfloat16, seed=92, group=128) <= TOL


def test_grouped_kernels_a_program_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # GROUPED_COMPACT: the grouped gate-up and down over group_leaders' list, up to group_bound programs a row tile
    monkeypatch.setattr(mma, "GROUPED_COMPACT", 1)
    assert mma.compact_takes(64 * 8, 128, 4)
    assert run(64, 128, 8, 2048, 768, torch.bfloat16, seed=101, group=128, zeros=True) <= TOL
    assert mma.compact_takes(40 * 8, 32, 2)
    assert run(40, 32, 8, 2048, 768, torch.float16, seed=102, group=128) <= TOL  # spans 4: 2 pairs a group
    assert run(64, 32, 8, 7168, 256, torch.bfloat16, seed=103, group=128, zeros=True) <= TOL  # many groups an expert
    assert run(24, 16, 8, 512, 256, torch.bfloat16, seed=104, group=128) <= TOL
    assert not ticket_counters(torch.device(DEV), "moe_w4_grouped_down", POOL_SIZE).any()
