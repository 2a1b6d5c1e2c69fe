"""The dense int4 product with the words streamed by TMA through a shared-memory ring
(kernels/gluon_w4a16_tma.py) vs quant_linear_ref, fresh random inputs.

Hopper only (compute capability 9.x; Gluon kernels do not run in Triton's interpreter). Int4 with group 32, 64,
128 and 256, zeros absent and present, float16 / bfloat16 / float32 scales; x bf16 and fp16 with 1-16 rows (8 and
16 columns of wgmma, padding included); with and without bias; one and two tiles, chunks of 32-128, 2-8 stages
(fewer chunks than stages too: the ring's refill and its phases), unsplit and split K. Tolerance as
tests/test_gluon_w4a16_wgmma.py: ||y - ref|| / ||ref|| <= 1e-2 (16-bit x): the products are exact in float32; the
differences are summation order, the float32 cancellation of the code offset (~1e-5) and the output's 16-bit
rounding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("TMA and wgmma kernels need a Hopper GPU (compute capability 9.x)", allow_module_level=True)

from test_triton_w4a16 import random_weight, rel_err

from ftransformers.kernels import gluon_w4a16_tma as tm
from ftransformers.kernels.quant_formats import quant_linear_ref

TOL = 1e-2
# (group, zeros, scale dtype)
WEIGHTS = [(128, False, torch.bfloat16), (128, True, torch.float16), (64, True, torch.bfloat16),
           (32, False, torch.float16), (256, True, torch.float32)]  # fmt: skip
# (tiles, most KC, split, stages, x ahead, halves) over K 2048: 16, 8, 4 and 32 chunks a program, against 2-8
# stages; halves only where chunks are 128 (groups of 128 and 256)
CONFIGS = [(2, 128, 1, 4, 1, False), (1, 128, 2, 2, 2, False), (2, 64, 4, 8, 1, False), (1, 64, 1, 3, 2, False),
           (2, 128, 8, 4, 1, False), (1, 128, 16, 4, 2, False), (2, 128, 2, 4, 1, True),
           (1, 128, 4, 3, 2, True)]  # fmt: skip


def config(group: int, tiles: int, kc: int, split: int, stages: int, x_ahead: int, halves: bool) -> tm.TmaLinearConfig:
    return tm.TmaLinearConfig(tiles, min(kc, group), split, stages, x_ahead, halves)


def run(m: int, n: int, k: int, dtype: torch.dtype, seed: int, group: int, zeros: bool, sdt: torch.dtype,
        cfg: tm.TmaLinearConfig, bias: bool = False) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    qw = random_weight("int4", n, k, gen, group=group, zeros=zeros, scale_dtype=sdt)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    b = torch.randn(n, generator=gen).to("cuda", dtype) if bias else None
    assert tm.supported(x, qw.qweight, group, cfg), (m, n, k, group, cfg)
    y = tm.w4a16_tma(x, qw.qweight, qw.scales, qw.zeros, group, b, cfg)
    return rel_err(y, quant_linear_ref(x, qw, b))


@pytest.mark.parametrize("c", CONFIGS, ids=str)
@pytest.mark.parametrize("w", range(len(WEIGHTS)))
@pytest.mark.parametrize("m", [1, 3, 8, 11, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(c: tuple[int, int, int, int, int, bool], w: int, m: int, dtype: torch.dtype) -> None:
    group, zeros, sdt = WEIGHTS[w]
    cfg = config(group, *c)
    if not tm.fits(m, 1024, 2048, group, cfg):  # a group of 256 over a share of 128, or halves of smaller chunks
        pytest.skip(f"{cfg} does not fit group {group}")
    assert run(m, 1024, 2048, dtype, 10 * w + m, group, zeros, sdt, cfg) <= TOL


@pytest.mark.parametrize("m", [1, 9, 16])
def test_bias_and_model_shapes(m: int) -> None:
    # Qwen3-30B-A3B qkv, Qwen3-8B gate_up, Qwen3-8B down, DeepSeek-V3 o: default configs
    for n, k in [(5120, 2048), (24576, 4096), (4096, 12288), (7168, 16384)]:
        cfg = tm.default_config(m, n, k, 128)
        assert run(m, n, k, torch.bfloat16, m + n, 128, True, torch.float16, cfg, bias=True) <= TOL


def test_split_k_sum_is_deterministic_and_resets() -> None:
    """The last program of each row tile adds the float32 partials in split order and puts its ticket counter
    back to 0, so repeated calls give the same bits."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 8192, generator=gen).to("cuda", torch.bfloat16)
    qw = random_weight("int4", 2048, 8192, gen, group=128, zeros=True, scale_dtype=torch.float16)
    cfg = tm.TmaLinearConfig(2, 128, 8, 4, 2, True)
    ys = [tm.w4a16_tma(x, qw.qweight, qw.scales, qw.zeros, 128, None, cfg) for _ in range(3)]
    assert rel_err(ys[0], quant_linear_ref(x, qw)) <= TOL
    assert all(torch.equal(ys[0], y) for y in ys[1:])


def test_w4a16_linear_takes_it_at_9_to_16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_linear runs 9-16 rows of a DeepSeek-V3 q_b weight here (engine_config's rule), with bias; 8 rows not."""
    from ftransformers.kernels.triton_w4a16 import w4a16_linear

    calls: list[int] = []
    kernel = tm.w4a16_tma
    monkeypatch.setattr(tm, "w4a16_tma", lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw))
    gen = torch.Generator().manual_seed(9)
    qw = random_weight("int4", 24576, 1536, gen, group=128, zeros=True, scale_dtype=torch.float16)
    b = torch.randn(24576, generator=gen).to("cuda", torch.bfloat16)
    for m in (8, 12, 16):
        x = torch.randn(m, 1536, generator=gen).to("cuda", torch.bfloat16)
        assert rel_err(w4a16_linear(x, qw, b), quant_linear_ref(x, qw, b)) <= TOL
    assert calls == [12, 16]


def test_a_capture_without_ticket_counters_takes_another_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a CUDA-graph capture before this family's ticket counters exist (none can be allocated there),
    w4a16_linear takes the split kernel only where it fits unsplit (`runs_now`); here it does not, another kernel
    runs instead, and the graph replays to the reference."""
    from ftransformers.kernels import tickets
    from ftransformers.kernels.triton_w4a16 import w4a16_linear

    monkeypatch.setattr(tm, "MAX_SHARED", 48 * 1024)  # K 4096 unsplit takes 64 KB here (32 KB of scales): no fit
    calls: list[int] = []
    kernel = tm.w4a16_tma
    monkeypatch.setattr(tm, "w4a16_tma", lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw))
    gen = torch.Generator().manual_seed(11)
    qw = random_weight("int4", 16384, 4096, gen, group=128, zeros=True, scale_dtype=torch.float16)
    x = torch.randn(12, 4096, generator=gen).to("cuda", torch.bfloat16)
    cfg = tm.engine_config(12, 16384, 4096, 128)
    assert cfg is not None and cfg.split > 1 and not tm.fits(12, 16384, 4096, 128, replace(cfg, split=1))
    monkeypatch.setattr(tm, "ENGINE_MIN_ROWS", 0)
    w4a16_linear(x, qw)  # the kernel taken instead, compiled (and its counters allocated) outside the capture
    torch.cuda.synchronize()
    monkeypatch.setattr(tm, "ENGINE_MIN_ROWS", 9)
    monkeypatch.setattr(tickets, "_POOLS", {key: v for key, v in tickets._POOLS.items() if key[0] != "w4a16_tma"})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(x, qw)
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [] and ("w4a16_tma", x.device) not in tickets._POOLS
    assert rel_err(y, quant_linear_ref(x, qw)) <= TOL
