"""The dense int4 product with the weights decoded as wgmma's register operand (kernels/gluon_w4a16_rs.py) vs
quant_linear_ref, fresh random inputs.

Hopper only (compute capability 9.x; Gluon kernels do not run in Triton's interpreter). Int4 with group 32, 64, 128
and 256 (K tiles of the group or less), zeros absent and present, float16 / bfloat16 / float32 scales; x bf16 and fp16
with 1-128 rows (wgmma N of 8-128, TMA's zero fill past M); one and two consumer warpgroups; a tile's wgmmas in flight
or waited; unsplit and split K; with and without bias. Tolerance as tests/test_gluon_w4a16_wgmma.py:
||y - ref|| / ||ref|| <= 1e-2 (16-bit x): each weight is rounded once to x's dtype, as a 16-bit copy would be, and the
products are summed in float32; the differences are summation order and the output's 16-bit rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("wgmma kernels need a Hopper GPU (compute capability 9.x)", allow_module_level=True)

from test_triton_w4a16 import random_weight, rel_err

from ftransformers.kernels import gluon_w4a16_rs as rs
from ftransformers.kernels.quant_formats import quant_linear_ref

TOL = 1e-2
# (group, zeros, scale dtype)
WEIGHTS = [(128, True, torch.float16), (128, False, torch.bfloat16), (256, True, torch.float32),
           (64, True, torch.bfloat16), (32, False, torch.float16)]  # fmt: skip
# one warpgroup in flight / waited, two warpgroups, split K 2 and 4 ways, K tiles of 64 and 32, the scale after each
# tile (three programs an SM's registers, split)
CONFIGS = [rs.RsConfig(4, 128, 4, 1), rs.RsConfig(4, 128, 3, 1, in_flight=0), rs.RsConfig(8, 128, 4, 1, regs=1),
           rs.RsConfig(4, 128, 4, 2), rs.RsConfig(8, 64, 6, 4, regs=1), rs.RsConfig(4, 32, 8, 2),
           rs.RsConfig(4, 128, 3, 1, 0, scale_after=True), rs.RsConfig(4, 64, 4, 2, 0, 3, True)]  # fmt: skip


def run(m: int, n: int, k: int, dtype: torch.dtype, seed: int, group: int, zeros: bool, sdt: torch.dtype,
        cfg: rs.RsConfig, bias: bool = False) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    qw = random_weight("int4", n, k, gen, group=group, zeros=zeros, scale_dtype=sdt)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    b = torch.randn(n, generator=gen).to("cuda", dtype) if bias else None
    assert rs.supported(x, qw.qweight, group, cfg), (m, n, k, group, cfg)
    y = rs.w4a16_rs(x, qw.qweight, qw.scales, qw.zeros, group, b, cfg)
    return rel_err(y, quant_linear_ref(x, qw, b))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("m", [1, 5, 8, 16, 23, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(cfg: rs.RsConfig, m: int, dtype: torch.dtype) -> None:
    if not rs.fits(m, 1024, 2048, 128, cfg):
        pytest.skip(f"{cfg} does not take {m} rows")
    for w, (group, zeros, sdt) in enumerate(WEIGHTS):
        if group % cfg.bk == 0:
            assert run(m, 1024, 2048, dtype, 10 * w + m, group, zeros, sdt, cfg) <= TOL, (group, zeros, sdt)


@pytest.mark.parametrize("m", [1, 16, 48])
def test_bias_and_model_shapes(m: int) -> None:
    # Qwen3-30B-A3B qkv, Qwen3-8B o, Qwen3-8B down, each on default_config (the split it picks included)
    for n, k in [(5120, 2048), (4096, 4096), (4096, 12288)]:
        cfg = rs.default_config(m, n, k, 128)
        assert run(m, n, k, torch.bfloat16, m + n, 128, True, torch.float16, cfg, bias=True) <= TOL, cfg


def test_split_k_sum_is_deterministic_and_resets() -> None:
    """The last program of each row tile adds the float32 partials in split order and puts its ticket counter back
    to 0, so repeated calls give the same bits; the same in a CUDA graph's replays."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 8192, generator=gen).to("cuda", torch.bfloat16)
    qw = random_weight("int4", 2048, 8192, gen, group=128, zeros=True, scale_dtype=torch.float16)
    cfg = rs.RsConfig(4, 128, 4, 8)
    ys = [rs.w4a16_rs(x, qw.qweight, qw.scales, qw.zeros, 128, None, cfg) for _ in range(3)]
    assert rel_err(ys[0], quant_linear_ref(x, qw)) <= TOL
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rs.w4a16_rs(x, qw.qweight, qw.scales, qw.zeros, 128, None, cfg)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ys[0])


def test_fits_rejects_what_it_cannot_take() -> None:
    assert not rs.fits(129, 1024, 2048, 128, rs.RsConfig())  # rows past MAX_ROWS
    assert not rs.fits(16, 1000, 2048, 128, rs.RsConfig())  # N not whole programs
    assert not rs.fits(16, 1024, 2048, 64, rs.RsConfig(bk=128))  # a K tile across groups
    assert not rs.fits(16, 1024, 2048, 128, rs.RsConfig(split=32))  # K not in whole tiles a part
    assert not rs.fits(128, 1024, 2048, 128, rs.RsConfig(regs=3))  # too few registers for N = 128
    assert not rs.fits(16, 1024, 2048, 128, rs.RsConfig(8, regs=2))  # two warpgroups: one program an SM
