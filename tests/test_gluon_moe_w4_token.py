"""One token's int4 MoE in one launch (kernels/gluon_moe_w4_token.py) vs quant_moe_ref, fresh random inputs.

CUDA only (Gluon kernels do not run in Triton's interpreter; the offline sm_90 compile is in
tests/test_gluon_mma_compile.py). Int4 with groups 32 to 256, zeros absent and present, bf16 / fp16 /
float32 scales; hidden bf16 and fp16; top-k 2 to 8; shapes (D, I, E) = (1024, 512, 32) and
Qwen3-30B-A3B's (2048, 768, 128); every config of the module's SWEEP.
Tolerance: ||out - ref|| / ||ref|| <= 1e-2, as for the other 4-bit MoE kernels (tests/test_triton_moe_w4.py).
Also: bitwise equal results for equal inputs (the partials are added in a fixed order), the grid
barrier's counters back at zero after each launch, and the same results inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
    pytest.skip("mma.sync kernels need a CUDA GPU of compute capability >= 8.0", allow_module_level=True)

from test_triton_moe_w4 import TOL, make_routing, random_qw, rel_err

from ftransformers.kernels import gluon_moe_w4_token as tok
from ftransformers.kernels.quant_formats import quant_moe_ref
from ftransformers.kernels.tickets import ticket_counters

DEV = "cuda"
QUANT = [
    {"group": 128},
    {"group": 128, "zeros": True},
    {"group": 256, "zeros": True, "scale_dtype": torch.float16},
    {"group": 64, "scale_dtype": torch.float32},
    {"group": 32, "zeros": True},  # Kimi-K2's grid: the down chunk's spans of 8 lie in one group
]


def inputs(e: int, k: int, d: int, inter: int, dtype: torch.dtype, seed: int, **qkw):
    gen = torch.Generator(DEV).manual_seed(seed)
    hidden = torch.randn(1, d, generator=gen, device=DEV).to(dtype)
    w13 = random_qw("int4", e, 2 * inter, d, gen, **qkw)
    w2 = random_qw("int4", e, d, inter, gen, **qkw)
    weights, ids = make_routing(1, e, k, gen)
    return hidden, w13, w2, weights, ids


def run(
    e: int, k: int, d: int, inter: int, dtype: torch.dtype, seed: int, cfg: tok.TokenConfig | None = None, **qkw
) -> float:
    hidden, w13, w2, weights, ids = inputs(e, k, d, inter, dtype, seed, **qkw)
    cfg = cfg or tok.TokenConfig()
    assert tok.supported(hidden, w13, w2, k, cfg)
    out = tok.moe_w4_token(hidden, w13, w2, weights.reshape(-1).contiguous(), ids, cfg)
    assert out is not None and out.shape == hidden.shape and out.dtype == dtype
    assert (ticket_counters(hidden.device, "moe_w4_token", 2) == 0).all()
    return rel_err(out, quant_moe_ref(hidden, w13, w2, weights, ids))


@pytest.mark.parametrize("q", range(len(QUANT)))
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_shapes(q: int, k: int, dtype: torch.dtype) -> None:
    assert run(32, k, 1024, 512, dtype, seed=10 * q + k + 5, **QUANT[q]) <= TOL


@pytest.mark.parametrize("cfg", tok.SWEEP, ids=str)
@pytest.mark.parametrize("q", [0, 1])
def test_qwen3_30b_shape_every_config(cfg: tok.TokenConfig, q: int) -> None:
    if not tok.fits(2048, 768, 8, 128, 128, cfg, torch.cuda.get_device_properties(0).multi_processor_count):
        pytest.skip(f"{cfg} does not fit this GPU")
    assert run(128, 8, 2048, 768, torch.bfloat16, seed=q + 3, cfg=cfg, **QUANT[q]) <= TOL


def test_deterministic_and_graph_replay() -> None:
    hidden, w13, w2, weights, ids = inputs(128, 8, 2048, 768, torch.bfloat16, seed=11, group=128, zeros=True)
    flat = weights.reshape(-1).contiguous()
    first = tok.moe_w4_token(hidden, w13, w2, flat, ids)
    for _ in range(3):
        assert torch.equal(tok.moe_w4_token(hidden, w13, w2, flat, ids), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tok.moe_w4_token(hidden, w13, w2, flat, ids)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    # new routing and hidden in the captured buffers: the replay follows them
    hidden2, _, _, weights2, ids2 = inputs(128, 8, 2048, 768, torch.bfloat16, seed=12, group=128, zeros=True)
    hidden.copy_(hidden2)
    flat.copy_(weights2.reshape(-1))
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, quant_moe_ref(hidden, w13, w2, weights2, ids)) <= TOL
    assert (ticket_counters(hidden.device, "moe_w4_token", 2) == 0).all()


def test_supported_rejects_what_it_cannot_run() -> None:
    gen = torch.Generator(DEV).manual_seed(5)
    hidden = torch.randn(1, 1024, device=DEV, dtype=torch.bfloat16)
    w13 = random_qw("int4", 4, 512, 1024, gen, group=128)
    w2 = random_qw("int4", 4, 1024, 256, gen, group=128)
    assert tok.supported(hidden, w13, w2, 4)
    assert not tok.supported(torch.randn(2, 1024, device=DEV, dtype=torch.bfloat16), w13, w2, 4)  # two tokens
    assert not tok.supported(hidden.float(), w13, w2, 4)
    assert not tok.supported(hidden, w13, w2, 4, tok.TokenConfig(ic=512))  # IC does not divide I
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    many = sms // (256 // 64) + 1  # top-k so large that top_k * I / IC exceeds the SMs
    assert not tok.supported(hidden, w13, w2, many)
    fp4 = random_qw("mxfp4", 4, 512, 1024, gen, group=32)
    assert not tok.supported(hidden, fp4, w2, 4)
