"""The warp-specialised int4 product (kernels/gluon_w4a16_ws.py) vs quant_linear_ref, fresh random inputs.

Hopper only (compute capability 9.x; Gluon kernels do not run in Triton's interpreter). Int4 with group 64, 128 and
256, zeros absent and present, float16 / bfloat16 scales; x bf16 and fp16; M and N that leave partial tiles; with and
without bias; rings of 2-5 stages (the barriers' parity over many K tiles), 128- and 256-column tiles, x by TMA and by
cp.async, 4 and 8 producer warps, K split 3 and 4 ways (parts starting inside a group), the weight's words in
registers or through a ring in shared memory. Tolerance as
tests/test_triton_w4a16.py's decoded form: the weights are (code - zero) * scale rounded once to x's dtype, as a
16-bit copy of the weight would be, so ||y - ref|| / ||ref|| stays under `tol` (1e-2 for 16-bit x).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("wgmma kernels need a Hopper GPU (compute capability 9.x)", allow_module_level=True)

from test_triton_w4a16 import random_weight, rel_err, tol

from ftransformers.kernels import gluon_w4a16_ws as ws
from ftransformers.kernels.quant_formats import quant_linear_ref
from ftransformers.kernels.tickets import POOL_SIZE, ticket_counters
from ftransformers.kernels.triton_w4a16 import w4a16_linear

# the default (x by TMA, y through x's ring); cp.async x; 256 columns; 8 producer warps; 2 and 5 stages; K split 3
# ways (16 K tiles: parts of 6, 6 and 4, the second starting inside a group of 256) and 4 ways on 64 columns; the
# words through a shared ring 7 and 2 tiles ahead
CONFIGS = [ws.WsConfig(), ws.WsConfig(256, 128, 64, 3, x_tma=False), ws.WsConfig(128, 256, 64, 3, producer_regs=152),
           ws.WsConfig(256, 128, 64, 4, producer_warps=8, producer_regs=80), ws.WsConfig(128, 128, 64, 2, 1),
           ws.WsConfig(128, 128, 64, 5, 4, x_tma=False), ws.WsConfig(128, 128, 64, 4, split=3),
           ws.WsConfig(128, 64, 64, 4, x_tma=False, split=4), ws.WsConfig(128, 128, 64, 4, split=2, words_ahead=8),
           ws.WsConfig(256, 128, 64, 4, words_ahead=3)]  # fmt: skip
# (M, N, K, group, zeros, scale dtype is x's): partial row and column tiles, 2 .. 192 K tiles, one row
CASES = [(300, 5120, 2048, 128, True, True), (1024, 2048 + 128, 4096, 64, False, False),
         (129, 1029, 1024, 256, True, False), (1, 4096, 12288, 128, True, True),
         (2048, 6144, 4096, 128, False, True)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[
    f"{c.bm}x{c.bn}x{c.bk}s{c.stages}p{c.producer_warps}t{int(c.x_tma)}k{c.split}q{c.words_ahead}" for c in CONFIGS
])  # fmt: skip
def test_ws_matches_reference(cfg: ws.WsConfig, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(77)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    for m, n, k, group, zeros, same in CASES:
        qw = random_weight("int4", n, k, gen, group, zeros, dtype if same else other)
        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
        for b in (None, torch.randn(n, generator=gen).to("cuda", dtype)):
            y = w4a16_linear(x, qw, b, config=ws.as_dict(cfg))
            assert rel_err(y, quant_linear_ref(x, qw, b)) < tol(dtype), (m, n, k, group, zeros, cfg)


def test_ws_equals_decoded_codes_form() -> None:
    """The same decoded weights as the codes kernel's decoded form: the two differ by summation order only."""
    gen = torch.Generator().manual_seed(78)
    qw = random_weight("int4", 4096, 4096, gen, 128, True, torch.bfloat16)
    x = torch.randn(512, 4096, generator=gen).to("cuda", torch.bfloat16)
    codes = {"CODES": 1, "DEQUANT": 1, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "GROUP_M": 8,
             "num_warps": 4, "num_stages": 3}  # fmt: skip
    got = w4a16_linear(x, qw, config=ws.as_dict(ws.WsConfig())).float()
    want = w4a16_linear(x, qw, config=codes).float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3


def test_ws_split_k_is_deterministic_and_leaves_its_counters_zero() -> None:
    """A tile's K parts are added in split order by whichever ends last: the same bits every call, within summation
    order of the unsplit product; the ticket counters are back to zero after each launch (tickets.py's invariant)."""
    gen = torch.Generator().manual_seed(81)
    qw = random_weight("int4", 4096, 12288, gen, 128, True, torch.bfloat16)
    x = torch.randn(256, 12288, generator=gen).to("cuda", torch.bfloat16)
    cfg = ws.WsConfig(128, 128, 64, 4, split=4)
    first = w4a16_linear(x, qw, config=ws.as_dict(cfg))
    for _ in range(3):
        assert torch.equal(w4a16_linear(x, qw, config=ws.as_dict(cfg)), first)
    unsplit = w4a16_linear(x, qw, config=ws.as_dict(replace(cfg, split=1))).float()
    assert ((first.float() - unsplit).norm() / unsplit.norm()).item() < 4e-3
    torch.cuda.synchronize()
    assert int(ticket_counters(x.device, "w4a16_ws", POOL_SIZE).abs().sum()) == 0


def test_ws_split_k_replays_in_a_cuda_graph() -> None:
    """Captured once the counters exist, the split launch replays on new inputs (its partials in the graph's pool)."""
    gen = torch.Generator().manual_seed(82)
    qw = random_weight("int4", 2048, 4096, gen, 128, True, torch.bfloat16)
    x = torch.randn(192, 4096, generator=gen).to("cuda", torch.bfloat16)
    cfg = ws.WsConfig(128, 128, 64, 4, split=4)
    w4a16_linear(x, qw, config=ws.as_dict(cfg))  # compiles, and makes the counters before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(x, qw, config=ws.as_dict(cfg))
    for _ in range(2):
        x.copy_(torch.randn(192, 4096, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, quant_linear_ref(x, qw)) < tol(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_few_tile_forms_match_reference(dtype: torch.dtype) -> None:
    """The rule's few-tile forms (FEW_TILES: K tiles of 128, the words ring) unsplit and split 2 and 4 ways, on partial
    row and column tiles, with zeros and bias; and the engine's route at 128 and 256 rows is the rule's config."""
    gen = torch.Generator().manual_seed(83)
    for m, n, k, group in ((200, 2112, 4096, 128), (130, 1000, 3072, 256)):
        qw = random_weight("int4", n, k, gen, group, True, dtype)
        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
        b = torch.randn(n, generator=gen).to("cuda", dtype)
        ref = quant_linear_ref(x, qw, b)
        for tile, _ in ws.FEW_TILES:
            for split in (1, 2, 4):
                y = w4a16_linear(x, qw, b, config=ws.as_dict(replace(tile, split=split)))
                assert rel_err(y, ref) < tol(dtype), (m, n, k, tile, split)
    for m, n, k in ((128, 4096, 4096), (256, 4096, 12288)):
        qw = random_weight("int4", n, k, gen, 128, True, dtype)
        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
        cfg = ws.engine_config(m, n, k)
        assert cfg is not None and cfg.words_ahead and cfg.split > 1
        routed = w4a16_linear(x, qw)
        assert torch.equal(routed, w4a16_linear(x, qw, config=ws.as_dict(cfg)))
        assert rel_err(routed, quant_linear_ref(x, qw)) < tol(dtype)


def test_ws_rejects_what_it_cannot_take() -> None:
    gen = torch.Generator().manual_seed(79)
    qw = random_weight("int4", 256, 1024, gen, 32, True, torch.bfloat16)  # group 32 < the K tile of 64
    x = torch.randn(256, 1024, generator=gen).to("cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="warp-specialised"):
        w4a16_linear(x, qw, config=ws.as_dict(ws.WsConfig()))


def test_engine_takes_it_at_prefill_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_linear without a config runs the kernel from ENGINE_MIN_ROWS rows (the codes kernel's decoded form below,
    or with the rule off): both agree with the reference, and the route is the kernel's (its result bit for bit)."""
    gen = torch.Generator().manual_seed(80)
    qw = random_weight("int4", 4096, 4096, gen, 128, True, torch.bfloat16)
    x = torch.randn(1024, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert ws.engine_config(1024, 4096, 4096) == ws.WsConfig()
    routed = w4a16_linear(x, qw)
    assert torch.equal(routed, w4a16_linear(x, qw, config=ws.as_dict(ws.WsConfig())))
    monkeypatch.setattr(ws, "ENGINE_MIN_ROWS", 0)
    other = w4a16_linear(x, qw)
    ref = quant_linear_ref(x, qw)
    assert rel_err(routed, ref) < tol(torch.bfloat16) and rel_err(other, ref) < tol(torch.bfloat16)
