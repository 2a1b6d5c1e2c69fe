"""The dense int4 product on mma.sync (kernels/gluon_w4a16_mma.py) vs quant_linear_ref, fresh random inputs.

CUDA only (Gluon kernels do not run in Triton's interpreter). Int4 with group 32, 64, 128 and 256, zeros
absent and present, float16 / bfloat16 / float32 scales; x bf16 and fp16 with 1-16 rows (every row count
of each padded width: 1, 2, 3, 4, 5, 8, 11, 16); with and without bias; every config the sweep tries.
Tolerance: ||y - ref|| / ||ref|| <= 1e-2 (16-bit x, as tests/test_triton_w4a16.py): the products are exact
in float32; the differences are summation order, the float32 cancellation of the code offset (~1e-5)
and the output's 16-bit rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
    pytest.skip("mma.sync kernels need a CUDA GPU of compute capability >= 8.0", allow_module_level=True)

from test_triton_w4a16 import random_weight, rel_err

from ftransformers.kernels import gluon_w4a16_mma as mma
from ftransformers.kernels.quant_formats import quant_linear_ref

TOL = 1e-2
# (group, zeros, scale dtype)
WEIGHTS = [(128, False, torch.bfloat16), (128, True, torch.float16), (64, True, torch.bfloat16),
           (32, False, torch.float16), (256, True, torch.float32)]  # fmt: skip


def run(m: int, n: int, k: int, dtype: torch.dtype, seed: int, group: int, zeros: bool, sdt: torch.dtype,
        bias: bool = False, cfg: mma.MmaLinearConfig | None = None) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    qw = random_weight("int4", n, k, gen, group=group, zeros=zeros, scale_dtype=sdt)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    b = torch.randn(n, generator=gen).to("cuda", dtype) if bias else None
    cfg = cfg or mma.default_config(m, n, k)
    assert mma.supported(x, qw.qweight, group, cfg), (m, n, k, group, cfg)
    y = mma.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, group, b, cfg)
    return rel_err(y, quant_linear_ref(x, qw, b))


@pytest.mark.parametrize("w", range(len(WEIGHTS)))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(w: int, m: int, dtype: torch.dtype) -> None:
    group, zeros, sdt = WEIGHTS[w]
    assert run(m, 1024, 2048, dtype, 10 * w + m, group, zeros, sdt) <= TOL


@pytest.mark.parametrize(("m", "columns"), [(3, False), (5, True), (8, True), (12, True), (16, True)])
@pytest.mark.parametrize(("group", "zeros", "sdt"), [(32, False, torch.float16), (32, True, torch.bfloat16),
                                                     (64, True, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_weights_decoded_with_their_scales_before_the_mma(monkeypatch: pytest.MonkeyPatch, m: int, columns: bool,
                                                          group: int, zeros: bool, sdt: torch.dtype,
                                                          dtype: torch.dtype) -> None:  # fmt: skip
    # DEQUANT_MAX_SPANS at 8: where a span of one group leaves chunks under 128, spans cross groups (at 3 rows on 8
    # columns, 2 spans of 64 elements a chunk; at 9-16 rows one span of 128)
    monkeypatch.setattr(mma, "DEQUANT_MAX_SPANS", 8)
    monkeypatch.setattr(mma, "SMALL_GROUP_COLUMNS", columns)
    cfg = mma.default_config(m, 1024, 2048)
    want = m > 8 or group == 32
    assert mma.constexprs(m, 2048, group, zeros, False, cfg)["DEQUANT"] == want, (m, group)
    assert run(m, 1024, 2048, dtype, 7 * m + group, group, zeros, sdt, bias=m == 3) <= TOL


@pytest.mark.parametrize("m", [1, 3, 16])
def test_bias_and_model_shapes(m: int) -> None:
    for n, k in [(5120, 2048), (2048, 4096), (4096, 12288)]:  # Qwen3-30B-A3B qkv, o; Qwen3-8B down
        assert run(m, n, k, torch.bfloat16, seed=m + n, group=128, zeros=True, sdt=torch.float16, bias=True) <= TOL


@pytest.mark.parametrize("cfg", mma.SWEEP, ids=str)
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_every_sweep_config(cfg: mma.MmaLinearConfig, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).to("cuda", torch.bfloat16)
    qw = random_weight("int4", 2048, 4096, gen, group=128, zeros=True, scale_dtype=torch.float16)
    if not mma.supported(x, qw.qweight, 128, cfg):
        pytest.skip(f"{cfg} does not take M={m}")
    y = mma.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, 128, None, cfg)
    assert rel_err(y, quant_linear_ref(x, qw)) <= TOL


@pytest.mark.parametrize("m", [3, 16])
def test_split_k_sum_is_deterministic_and_resets(m: int) -> None:
    """Warps over N, programs over K: the last program of each row tile adds the float32 partials in split
    order and puts its ticket counter back to 0, so repeated calls (as in CUDA graph replays) give the same
    bits; with bias, and a weight the ticket pool's earlier users did not size."""
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, 12288, generator=gen).to("cuda", torch.bfloat16)
    qw = random_weight("int4", 4096, 12288, gen, group=128, zeros=True, scale_dtype=torch.float16)
    b = torch.randn(4096, generator=gen).to("cuda", torch.bfloat16)
    for cfg in (mma.MmaLinearConfig(32, 8, 128, 8), mma.MmaLinearConfig(16, 4, 128, 16)):
        ys = [mma.w4a16_mma(x, qw.qweight, qw.scales, qw.zeros, 128, b, cfg) for _ in range(3)]
        assert rel_err(ys[0], quant_linear_ref(x, qw, b)) <= TOL
        assert all(torch.equal(ys[0], y) for y in ys[1:]), cfg


def test_supported_rejects_what_it_cannot_run() -> None:
    cfg = mma.MmaLinearConfig()
    q = torch.zeros(1024, 2048 // 8, dtype=torch.int32, device="cuda")
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert mma.supported(x, q, 128, cfg)
    assert not mma.supported(x.float(), q, 128, cfg)  # float32 x
    assert not mma.supported(x.cpu(), q, 128, cfg)
    assert not mma.supported(torch.randn(17, 2048, device="cuda", dtype=torch.bfloat16), q, 128, cfg)  # > 16 rows
    assert not mma.supported(x, q[:1000], 128, cfg)  # N not a multiple of ROWS
    assert not mma.supported(x, q[:992], 128, mma.MmaLinearConfig(32, 8, 128, 2))  # nor of W x ROWS (split)
    assert not mma.supported(x, q, 128, mma.MmaLinearConfig(32, 8, 128, 64))  # K / 64: no span of 8 words
    assert not mma.supported(x, q, 12, cfg)  # no span of whole words inside a group of 12
