"""The dense int4 product on wgmma with the weights as register operands (kernels/gluon_w4a16_wgmma.py, which
w4a16_linear takes at 9-16 rows) vs quant_linear_ref, fresh random inputs.

Hopper only (compute capability 9.x; Gluon kernels do not run in Triton's interpreter). Int4 with group 32,
64, 128 and 256, zeros absent and present, float16 / bfloat16 / float32 scales; x bf16 and fp16 with 1-16
rows (8 and 16 columns of wgmma, padding included); with and without bias; unsplit and split K. Tolerance as
tests/test_gluon_w4a16_mma.py: ||y - ref|| / ||ref|| <= 1e-2 (16-bit x): the products are exact in float32; the
differences are summation order, the float32 cancellation of the code offset (~1e-5) and the output's 16-bit
rounding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("wgmma kernels need a Hopper GPU (compute capability 9.x)", allow_module_level=True)

from test_triton_w4a16 import random_weight, rel_err

from ftransformers.kernels import gluon_w4a16_wgmma as wg
from ftransformers.kernels.quant_formats import quant_linear_ref

TOL = 1e-2
# (group, zeros, scale dtype)
WEIGHTS = [(128, False, torch.bfloat16), (128, True, torch.float16), (64, True, torch.bfloat16),
           (32, False, torch.float16), (256, True, torch.float32)]  # fmt: skip
# then: words two chunks ahead over 16 chunks, three ahead over 2 (the reads past the last chunk clamp); one tile
# with scales ahead and words two chunks ahead over 8 chunks, three over 2
CONFIGS = [wg.WgmmaLinearConfig(1, 128, 1), wg.WgmmaLinearConfig(2, 128, 2), wg.WgmmaLinearConfig(2, 64, 4),
           wg.WgmmaLinearConfig(4, 64, 2), wg.WgmmaLinearConfig(2, 128, 2, scales_ahead=True),
           wg.WgmmaLinearConfig(1, 128, 1, words_ahead=2), wg.WgmmaLinearConfig(2, 128, 8, words_ahead=3),
           wg.WgmmaLinearConfig(1, 128, 2, scales_ahead=True, words_ahead=2),
           wg.WgmmaLinearConfig(1, 128, 8, scales_ahead=True, words_ahead=3)]  # fmt: skip


def run(m: int, n: int, k: int, dtype: torch.dtype, seed: int, group: int, zeros: bool, sdt: torch.dtype,
        cfg: wg.WgmmaLinearConfig, bias: bool = False) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    qw = random_weight("int4", n, k, gen, group=group, zeros=zeros, scale_dtype=sdt)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    b = torch.randn(n, generator=gen).to("cuda", dtype) if bias else None
    assert wg.supported(x, qw.qweight, group, cfg), (m, n, k, group, cfg)
    y = wg.w4a16_wgmma(x, qw.qweight, qw.scales, qw.zeros, group, b, cfg)
    return rel_err(y, quant_linear_ref(x, qw, b))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("w", range(len(WEIGHTS)))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(cfg: wg.WgmmaLinearConfig, w: int, m: int, dtype: torch.dtype) -> None:
    group, zeros, sdt = WEIGHTS[w]
    assert run(m, 1024, 2048, dtype, 10 * w + m, group, zeros, sdt, cfg) <= TOL


@pytest.mark.parametrize("m", [1, 4, 16])
def test_bias_and_model_shapes(m: int) -> None:
    # Qwen3-30B-A3B qkv, Qwen3-8B o, Qwen3-8B down (K split to fit x's share in shared memory)
    for n, k, split in [(5120, 2048, 1), (4096, 4096, 2), (4096, 12288, 8)]:
        cfg = wg.WgmmaLinearConfig(2, 128, split)
        assert run(m, n, k, torch.bfloat16, m + n, 128, True, torch.float16, cfg, bias=True) <= TOL


def test_split_k_sum_is_deterministic_and_resets() -> None:
    """The last program of each row tile adds the float32 partials in split order and puts its ticket counter
    back to 0, so repeated calls give the same bits."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 8192, generator=gen).to("cuda", torch.bfloat16)
    qw = random_weight("int4", 2048, 8192, gen, group=128, zeros=True, scale_dtype=torch.float16)
    cfg = wg.WgmmaLinearConfig(2, 128, 8)
    ys = [wg.w4a16_wgmma(x, qw.qweight, qw.scales, qw.zeros, 128, None, cfg) for _ in range(3)]
    assert rel_err(ys[0], quant_linear_ref(x, qw)) <= TOL
    assert all(torch.equal(ys[0], y) for y in ys[1:])


def test_supported_rejects_what_it_cannot_run() -> None:
    cfg = wg.WgmmaLinearConfig()
    q = torch.zeros(1024, 2048 // 8, dtype=torch.int32, device="cuda")
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert wg.supported(x, q, 128, cfg)
    assert not wg.supported(x.float(), q, 128, cfg)  # float32 x
    assert not wg.supported(x.cpu(), q, 128, cfg)
    assert not wg.supported(torch.randn(17, 2048, device="cuda", dtype=torch.bfloat16), q, 128, cfg)  # > 16 rows
    assert not wg.supported(x, q[:1000], 128, cfg)  # N not a multiple of a program's rows
    assert not wg.supported(x, q, 12, cfg)  # no chunk of 32-128 inside a group of 12
    assert not wg.supported(x, q, 128, replace(cfg, words_ahead=4))  # at most 3 chunks of words ahead
    wide = torch.randn(16, 65536, device="cuda", dtype=torch.bfloat16)
    assert not wg.supported(wide, torch.zeros(1024, 65536 // 8, dtype=torch.int32, device="cuda"), 128, cfg)


def test_w4a16_linear_takes_it_at_9_to_16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_linear runs 9-16 rows of a Qwen3-8B o weight here (engine_config's rule), with bias; 8 rows not."""
    from ftransformers.kernels.triton_w4a16 import w4a16_linear

    calls: list[int] = []
    kernel = wg.w4a16_wgmma
    monkeypatch.setattr(wg, "w4a16_wgmma", lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw))
    gen = torch.Generator().manual_seed(9)
    qw = random_weight("int4", 4096, 4096, gen, group=128, zeros=True, scale_dtype=torch.float16)
    b = torch.randn(4096, generator=gen).to("cuda", torch.bfloat16)
    for m in (8, 12):
        x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
        assert rel_err(w4a16_linear(x, qw, b), quant_linear_ref(x, qw, b)) <= TOL
    assert calls == [12]


def test_a_capture_without_ticket_counters_takes_the_mma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a CUDA-graph capture before the wgmma family's ticket counters exist (none can be allocated there),
    w4a16_linear does not take the split wgmma kernel, whose K 4096 unsplit does not fit (`runs_now`): the
    mma.sync kernel runs instead, and the graph replays to the reference."""
    from ftransformers.kernels import gluon_w4a16_mma as mma
    from ftransformers.kernels import tickets
    from ftransformers.kernels.triton_w4a16 import mma_rows_config, w4a16_linear

    monkeypatch.setattr(tickets, "_POOLS", {key: v for key, v in tickets._POOLS.items() if key[0] != "w4a16_wgmma"})
    calls: list[int] = []
    kernel = wg.w4a16_wgmma
    monkeypatch.setattr(wg, "w4a16_wgmma", lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw))
    gen = torch.Generator().manual_seed(11)
    qw = random_weight("int4", 4096, 4096, gen, group=128, zeros=True, scale_dtype=torch.float16)
    x = torch.randn(12, 4096, generator=gen).to("cuda", torch.bfloat16)
    cfg = wg.engine_config(12, 4096, 4096, 128)
    assert cfg is not None and cfg.split > 1 and not wg.fits(12, 4096, 4096, 128, replace(cfg, split=1))
    # compiled, and the mma kernel's own counters allocated, outside the capture
    mma.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, 128, None, mma_rows_config(qw, 12))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(x, qw)
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [] and ("w4a16_wgmma", x.device) not in tickets._POOLS
    assert rel_err(y, quant_linear_ref(x, qw)) <= TOL
