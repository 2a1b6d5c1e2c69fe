"""Where w4a16_linear sends int4 products to the mma kernel (kernels/gluon_w4a16_mma.py `takes`), the
kernel's default config must fit the shape (`fits`), or the product silently falls back to the older
kernels that the rule was measured against. Checked for every linear of the issue's models (Qwen3-30B-A3B,
Qwen3-8B, DeepSeek-V3 with its dense layers), 1-16 rows, groups 32-128. CPU only: no kernel runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("triton.experimental.gluon")

from ftransformers.kernels import gluon_w4a16_mma as mma

LINEARS = {  # name: (N, K)
    "qwen3-30b qkv": (5120, 2048), "qwen3-30b o": (2048, 4096),
    "qwen3-8b qkv": (6144, 4096), "qwen3-8b o": (4096, 4096), "qwen3-8b gate_up": (24576, 4096),
    "qwen3-8b down": (4096, 12288),
    "dsv3 q_a": (1536, 7168), "dsv3 q_b": (24576, 1536), "dsv3 kv_a": (576, 7168), "dsv3 o": (7168, 16384),
    "dsv3 shared gate_up": (4096, 7168), "dsv3 shared down": (7168, 2048), "dsv3 dense gate_up": (36864, 7168),
    "dsv3 dense down": (7168, 18432),
}  # fmt: skip


@pytest.mark.parametrize("group", [32, 64, 128])
def test_default_config_fits_wherever_the_kernel_takes_the_product(group: int) -> None:
    missed = [(name, m, mma.default_config(m, n, k)) for name, (n, k) in LINEARS.items() for m in range(1, 17)
              for zero in (False, True) if mma.takes(m, n, k, zero)
              and not mma.fits(m, n, k, group, mma.default_config(m, n, k))]  # fmt: skip
    assert not missed, missed


def test_rule_takes_the_measured_wins_only() -> None:
    assert mma.takes(4, 24576, 4096, False) and mma.takes(16, 7168, 16384, False)  # large: 2-16 rows
    # one row: zero points, or symmetric on wide weights only
    assert mma.takes(1, 7168, 16384, True) and not mma.takes(1, 7168, 16384, False)
    assert mma.takes(1, 24576, 4096, False) and mma.takes(1, 24576, 1536, False)
    assert not mma.takes(1, 4096, 12288, False)
    assert mma.takes(3, 5120, 2048, True) and not mma.takes(1, 5120, 2048, True)  # small: 2-8 rows
    assert (
        mma.takes(8, 2048, 4096, True) and not mma.takes(9, 2048, 4096, True) and not mma.takes(17, 24576, 4096, True)
    )
    assert mma.takes(16, 6144, 4096, False) and not mma.takes(1, 4096, 7168, True)  # medium: 2-16 rows
    assert mma.takes(12, 24576, 1536, True) and mma.takes(16, 24576, 1536, False)  # shallow K too, since _warp_sum


def test_two_rows_come_here_with_the_register_caps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """At two rows the capped 16-row forms beat the GEMV on small and medium weights (register_cap's figures);
    without the caps they did not, and the GEMV takes them."""
    assert all(mma.takes(2, n, k, zero) for n, k in LINEARS.values() for zero in (False, True))
    monkeypatch.setattr(mma, "REGISTER_CAPS", False)
    assert not mma.takes(2, 5120, 2048, True) and not mma.takes(2, 4096, 7168, False)
    assert mma.takes(2, 24576, 4096, False)  # large weights took two rows before the caps


def test_register_caps_keep_the_programs_an_sm_and_turn_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cap is within the register file for its warps (65536 a multiprocessor) and is the measured one for
    its form (register_cap's docstring); REGISTER_CAPS False leaves every config uncapped."""
    cfgs = [mma.default_config(m, n, k) for n, k in LINEARS.values() for m in range(1, 17)]
    assert all(c.maxnreg == 0 or c.maxnreg * 32 * c.warps <= 65536 for c in cfgs)
    assert {c.maxnreg for c in cfgs} == {0, 128, 168, 255}
    assert mma.default_config(1, 24576, 4096).maxnreg == 168  # 32 rows, 4 warps, chunks of 256
    assert mma.default_config(1, 4096, 12288).maxnreg == 128 == mma.default_config(4, 7168, 16384).maxnreg
    assert mma.default_config(8, 4096, 12288).maxnreg == 128  # 32 rows, 8 warps, chunks of 256
    assert mma.default_config(4, 4096, 4096).maxnreg == 255 == mma.default_config(16, 6144, 4096).maxnreg  # split
    assert mma.default_config(1, 5120, 2048).maxnreg == 128 and mma.default_config(12, 5120, 2048).maxnreg == 0
    assert mma.default_config(1, 7168, 16384).maxnreg == 0 and mma.default_config(4, 24576, 1536).maxnreg == 0
    monkeypatch.setattr(mma, "REGISTER_CAPS", False)
    assert all(mma.default_config(m, n, k).maxnreg == 0 for n, k in LINEARS.values() for m in range(1, 17))


def test_rule_uses_64_rows_where_they_measured_faster() -> None:
    assert mma.form(8, 24576, 4096).rows == 64 and mma.form(16, 7168, 16384).rows == 64
    assert mma.form(2, 24576, 4096).rows != 64 and mma.form(16, 4096, 12288).rows != 64
    # 1-4 rows (H200, span-masked x): wide weights at 3-4 rows or with K < 4096; not deep or narrow ones
    assert mma.form(4, 24576, 4096).rows == 64 and mma.form(3, 36864, 7168).rows == 64
    assert all(mma.form(m, 24576, 1536) == mma.MmaLinearConfig(64, 4, 128) for m in (1, 2, 3, 4))
    assert mma.form(1, 7168, 16384) == mma.MmaLinearConfig(32, 4, 512) == mma.form(2, 7168, 16384)
    assert mma.form(4, 7168, 16384) == mma.MmaLinearConfig(32, 8, 128)
    assert mma.form(1, 4096, 12288) == mma.MmaLinearConfig(32, 16, 128)
    assert mma.form(4, 4096, 12288) == mma.MmaLinearConfig(32, 16, 128)
    assert mma.form(5, 4096, 12288) == mma.MmaLinearConfig(32, 8, 256)  # 5-8 rows: the H100's rule
    assert mma.form(1, 24576, 4096) == mma.MmaLinearConfig(32, 4, 256)  # wide weights at 1-2 rows
    # 9-16 rows: wide weights too (4 warps where K < 4096), and 16 warps on narrow, deep ones
    assert mma.form(12, 24576, 4096) == mma.MmaLinearConfig(64, 8, 128)
    assert mma.form(16, 24576, 1536) == mma.MmaLinearConfig(64, 4, 128)
    assert mma.form(16, 4096, 12288) == mma.MmaLinearConfig(32, 16, 128)


def test_medium_weights_split_k_in_one_wave() -> None:
    """Medium weights past 8 rows: warps over N, K split into the most programs of one wave (<= WAVE); at 3-8
    rows only where K >= N (measured faster there, slower on Qwen3-8B qkv)."""
    for n, k in [(6144, 4096), (4096, 4096), (4096, 7168)]:
        cfg = mma.default_config(16, n, k)
        assert cfg.split >= 1 and n // cfg.tile() * cfg.split <= mma.WAVE < n // cfg.tile() * cfg.split * 2, (n, k, cfg)
    assert mma.default_config(4, 4096, 7168).split == 8 and mma.default_config(4, 6144, 4096).split == 0


def test_small_groups_take_16_columns_where_a_chunk_would_be_under_128(monkeypatch: pytest.MonkeyPatch) -> None:
    # group 32 at 3-8 rows and 64 at 5-8: twice the spans, so chunks of 64-128 elements, not 32-64
    assert [mma.tokens_and_spans(m, 32) for m in (1, 2, 3, 4, 5, 8, 16)] == [(1, 8), (2, 4), (4, 4), (4, 4), (8, 2),
                                                                            (8, 2), (16, 1)]  # fmt: skip
    assert mma.tokens_and_spans(8, 64) == (8, 2) and mma.tokens_and_spans(4, 64) == (4, 2)
    assert all(mma.tokens_and_spans(m, 128)[1] == max(1, 8 // mma.tokens_and_spans(m, 128)[0]) for m in range(1, 17))
    cfg = mma.default_config(8, 7168, 16384)
    assert mma.constexprs(8, 16384, 32, False, False, cfg)["KC"] == 64
    monkeypatch.setattr(mma, "DEQUANT_MAX_SPANS", 0)  # the spans' own chunks (one span a column decodes otherwise)
    monkeypatch.setattr(mma, "SMALL_GROUP_COLUMNS", False)  # the knob, read at call time
    assert mma.tokens_and_spans(8, 32) == (8, 1) and mma.constexprs(8, 16384, 32, False, False, cfg)["KC"] == 32


def test_small_chunks_of_one_span_decode_with_their_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    # DEQUANT_MAX_SPANS (1, measured faster in the step): group 32 at 9-16 rows (one span of 32) takes chunks of 128
    # whose lane runs of 32 elements each lie in one group; 8 rows (16 columns of 2 spans, chunks of 64) only past 1
    cfg = mma.default_config(16, 7168, 16384)
    assert mma.dequant_chunk(16384 // cfg.warps, 32, 1, cfg.kc) == 128 and mma.dequant_chunk(2048, 16, 1, 128) == 64
    assert mma.DEQUANT_MAX_SPANS == 1
    on = mma.constexprs(16, 16384, 32, False, False, cfg)
    assert on["DEQUANT"] and on["KC"] == 128
    assert not mma.constexprs(16, 16384, 128, True, False, cfg)["DEQUANT"]  # g128 chunks are 128 already
    cfg8 = mma.default_config(8, 7168, 16384)
    assert mma.constexprs(8, 16384, 32, False, False, cfg8)["KC"] == 64
    monkeypatch.setattr(mma, "DEQUANT_MAX_SPANS", 2)  # the knob, read at call time
    assert mma.constexprs(8, 16384, 32, False, False, cfg8)["DEQUANT"]
    cfg4 = mma.default_config(4, 7168, 16384)
    assert not mma.constexprs(4, 16384, 32, False, False, cfg4)["DEQUANT"]  # 4 spans: chunks of 128 already
    monkeypatch.setattr(mma, "DEQUANT_MAX_SPANS", 0)
    off = mma.constexprs(16, 16384, 32, False, False, cfg)
    assert not off["DEQUANT"] and off["KC"] == 32


def test_the_decoded_form_only_where_its_chunk_is_larger() -> None:
    # a K share of 192 (K 1536 over 8 warps) leaves chunks of 64 at group 128 either way: the plain form stays
    cfg = mma.MmaLinearConfig(rows=32, warps=8, kc=128)
    plain = mma.constexprs(16, 1536, 128, True, False, cfg)
    assert plain["KC"] == 64 and not plain["DEQUANT"]
    assert mma.constexprs(16, 1536, 32, True, False, cfg)["DEQUANT"]  # group 32: chunks of 32 -> 64


def test_ws_rule_takes_prefill_sizes_with_enough_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warp-specialised kernel's rule (kernels/gluon_w4a16_ws.py, H200 sessions 77-78): from ENGINE_MIN_ROWS rows, in
    256 x 128 tiles where they number at least ENGINE_MIN_TILES, else 128 x 128 ones where those number at least
    SMALL_MIN_TILES; at FEW_MIN_ROWS-511 rows where those leave a product, the few-tile form with K split to one wave;
    never with the rules off; never off a Hopper GPU."""
    import torch

    from ftransformers.kernels import gluon_w4a16_ws as ws

    assert ws.engine_config(255, 24576, 4096) is None  # under the rows; 384 few tiles would take two waves
    assert ws.engine_config(256, 24576, 4096) == ws.WsConfig()  # 192 large tiles: Qwen3-8B gate_up
    assert ws.engine_config(384, 6144, 4096) == ws.WsConfig()  # 2 x 48: Qwen3-8B qkv
    assert ws.engine_config(256, 6144, 4096) is None  # 48 large, 96 small or few, no split fits: codes kernel
    assert ws.engine_config(512, 5120, 2048) == ws.WsConfig()  # 2 x 40: Qwen3-30B-A3B qkv
    assert ws.engine_config(512, 4096, 4096) == ws.SMALL  # 2 x 32 large, 4 x 32 small: Qwen3-8B o
    assert ws.engine_config(512, 2048, 4096) is None  # 2 x 16 large, 4 x 16 small: Qwen3-30B-A3B o
    assert ws.engine_config(1024, 2048, 4096) == ws.SMALL  # 4 x 16 large, 8 x 16 small
    assert ws.engine_config(8192, 2048, 4096) == ws.WsConfig()  # 32 x 16
    # few tiles at 128-511 rows: one wave of 100-132 programs, the form and split of least few_cost
    narrow, wide = (t for t, _ in ws.FEW_TILES)
    assert ws.engine_config(128, 4096, 4096) == replace(narrow, split=2)  # Qwen3-8B o: 64 narrow tiles
    assert ws.engine_config(128, 4096, 12288) == replace(narrow, split=2)  # Qwen3-8B down
    assert ws.engine_config(256, 4096, 12288) == replace(wide, split=2)  # 128 narrow tiles would walk all 96 K tiles
    assert ws.engine_config(256, 4096, 4096) == narrow  # 128 narrow tiles, 32 K tiles each
    assert ws.engine_config(128, 2048, 4096) == replace(narrow, split=4)  # Qwen3-30B-A3B o: 32 narrow tiles
    assert ws.engine_config(128, 2048, 1024) is None  # 8 K tiles: 32 narrow tiles split 2 at most, 64 programs
    assert ws.engine_config(384, 4096, 4096) is None  # 192 narrow tiles (two waves), 96 wide ones (under a wave)
    assert ws.engine_config(127, 2048, 4096) is None  # under FEW_MIN_ROWS
    costs = [ws.few_cost(replace(narrow, split=s), 96, 0.82) for s in (1, 2, 4, 8)]
    assert costs == sorted(costs, reverse=True)  # splitting a long K pays for its partials
    assert ws.few_cost(replace(wide, split=2), 8, 1.37) > ws.few_cost(wide, 8, 1.37) - 4 * 1.37  # short K: partials
    monkeypatch.setattr(ws, "FEW_MIN_PROGRAMS", 129)  # the cached search follows the rule's values (A/Bs set them)
    assert ws.engine_config(128, 4096, 4096) is None
    monkeypatch.setattr(ws, "FEW_MIN_PROGRAMS", 100)
    assert ws.engine_config(128, 4096, 4096) == replace(narrow, split=2)
    monkeypatch.setattr(ws, "FEW_MIN_ROWS", 0)
    assert ws.engine_config(128, 4096, 4096) is None
    monkeypatch.setattr(ws, "ENGINE_MIN_ROWS", 0)
    assert ws.engine_config(8192, 24576, 4096) is None
    x = torch.randn(1024, 4096, dtype=torch.bfloat16)  # a CPU tensor: the kernel never takes it
    assert not ws.supported(x, torch.zeros(4096, 512, dtype=torch.int32), 128, ws.WsConfig())


def test_ws_config_round_trips_through_the_linear_dict() -> None:
    """w4a16_linear's config dict carries every field of the warp-specialised kernel's config but `diag` (session 77's
    first form dropped the producer warps, so a test of 8 producer warps ran 4)."""
    from ftransformers.kernels import gluon_w4a16_ws as ws

    for cfg in (ws.WsConfig(), ws.SMALL, ws.WsConfig(256, 128, 64, 3, 4, 8, 80, False, 0, split=3)):
        assert ws.from_dict(ws.as_dict(cfg)) == cfg


def test_ws_split_leaves_no_part_empty() -> None:
    """The kernel gives each of a tile's parts cdiv(k_tiles, parts) K tiles, the last the rest: the split it runs
    (`effective_split`) is never more than asked or than the K tiles, and every part gets at least one tile."""
    from ftransformers.kernels import gluon_w4a16_ws as ws
    from ftransformers.kernels.launch import cdiv

    assert ws.effective_split(64, 4) == 4 and ws.effective_split(64, 1) == 1 and ws.effective_split(3, 8) == 3
    assert ws.effective_split(10, 6) == 5  # parts of 2: six would leave the sixth empty
    for k_tiles in range(1, 70):
        for asked in range(1, 12):
            parts = ws.effective_split(k_tiles, asked)
            per = cdiv(k_tiles, parts)
            assert 1 <= parts <= min(asked, k_tiles) and (parts - 1) * per < k_tiles <= parts * per


def test_rs_rule_takes_large_weights_at_17_to_128_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """gluon_w4a16_rs.engine_config: the register-operand kernel takes the weights and row counts it measured faster
    on (session 79), with a config that fits every row count it takes, and none past its bounds or with it off."""
    from ftransformers.kernels import gluon_w4a16_rs as rs

    taken = {name for name, (n, k) in LINEARS.items() if rs.engine_config(32, n, k, 128) is not None}
    assert taken == {
        "qwen3-8b qkv",
        "qwen3-8b gate_up",
        "qwen3-8b down",
        "dsv3 q_b",
        "dsv3 o",
        "dsv3 shared gate_up",
        "dsv3 dense gate_up",
        "dsv3 dense down",
    }
    wide = {name for name, (n, k) in LINEARS.items() if rs.engine_config(128, n, k, 128) is not None}
    assert wide == {"qwen3-8b gate_up", "dsv3 o", "dsv3 dense gate_up", "dsv3 dense down"}
    for name, (n, k) in LINEARS.items():
        for m in range(1, 140):
            cfg = rs.engine_config(m, n, k, 128)
            if cfg is not None:
                assert 17 <= m <= 128 and rs.fits(m, n, k, 128, cfg) and cfg.scale_after and not cfg.in_flight
                assert (cfg.regs, cfg.stages == rs.ENGINE_STAGES) == ((3, True) if m <= 64 else (2, False)), (name, m)
                assert cfg.shared_bytes(rs.columns(m)) * cfg.regs <= 227 * 1024, (name, m, cfg)  # its programs fit
        assert rs.engine_config(32, n, k, 32) is None  # K tiles of 128 need groups of 128
    monkeypatch.setattr(rs, "ENGINE_STAGES", 2)  # the cached configs follow the rule's values
    assert rs.engine_config(32, 24576, 4096, 128).stages == 2
    monkeypatch.setattr(rs, "ENGINE_MIN_ROWS", 0)
    assert rs.engine_config(32, 24576, 4096, 128) is None


def test_rs_fits_only_the_register_and_in_flight_forms_that_built_right() -> None:
    from ftransformers.kernels import gluon_w4a16_rs as rs

    assert rs.fits(64, 1024, 2048, 128, rs.RsConfig(regs=3)) and not rs.fits(65, 1024, 2048, 128, rs.RsConfig(regs=3))
    assert not rs.fits(16, 1024, 2048, 128, rs.RsConfig(8, regs=2)) and rs.fits(
        16, 1024, 2048, 128, rs.RsConfig(8, regs=1)
    )
    assert rs.fits(32, 1024, 2048, 128, rs.RsConfig(in_flight=1))
    assert not rs.fits(33, 1024, 2048, 128, rs.RsConfig(in_flight=1))  # wrong on the H200 at 64-128 columns
    assert not rs.fits(16, 1000, 2048, 128, rs.RsConfig()) and not rs.fits(16, 1024, 2048, 64, rs.RsConfig(bk=128))
