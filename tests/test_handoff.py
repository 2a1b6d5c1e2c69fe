"""The fused router handing its picks to the few-token 4-bit MoE through flags (kernels/handoff.py).

The handoff changes when the gate-up kernel may read the routing, never what it computes: with it the MoE's
output must equal, bit for bit, the same kernels' output without it, on fresh random hidden states, gates and
int4 experts. CPU: TRITON_INTERPRET=1 (programs run one after another, so only the protocol's bookkeeping is
exercised: the flags' reset and publish, the arming and disarming). CUDA: with PDL, in a CUDA graph of several
router -> MoE layers replayed many times, where a consumer reading before the publish would show as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_w4 import CUDA, DEV, random_qw

from ftransformers.kernels import triton_router
from ftransformers.kernels.handoff import FLAG_COPIES, FLAG_STRIDE, RouteHandoff, route_handoff
from ftransformers.kernels.triton_moe_w4_gemv import moe_w4_token
from ftransformers.kernels.triton_router import fused_router_topk

# Qwen3-30B-A3B's experts on the GPU; a small model of them in the interpreter
D, I, E, K = (2048, 768, 128, 8) if CUDA else (128, 128, 16, 4)


def new_handoff() -> RouteHandoff:
    return RouteHandoff(torch.zeros(FLAG_COPIES * FLAG_STRIDE, dtype=torch.int32, device=DEV))


def layer_inputs(seed: int, t: int = 1) -> tuple[torch.Tensor, torch.Tensor, object, object]:
    gen = torch.Generator(DEV).manual_seed(seed)
    hidden = torch.randn(t, D, generator=gen, device=DEV).to(torch.bfloat16)
    gate = (torch.randn(E, D, generator=gen, device=DEV) * 2 / D**0.5).to(torch.bfloat16)
    w13 = random_qw("int4", E, 2 * I, D, gen, zeros=True)
    w2 = random_qw("int4", E, D, I, gen, zeros=True)
    return hidden, gate, w13, w2


def route_and_moe(hidden, gate, w13, w2, handoff: RouteHandoff | None) -> torch.Tensor:
    w, ids = fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    return moe_w4_token(hidden, w13, w2, w.reshape(-1), ids, handoff=handoff)


@pytest.mark.parametrize("t", [1, 2])
def test_handoff_gives_the_same_bits(t: int) -> None:
    hidden, gate, w13, w2 = layer_inputs(5 + t, t)
    plain = route_and_moe(hidden, gate, w13, w2, None)
    handoff = new_handoff()
    handoff.flags.view(FLAG_COPIES, FLAG_STRIDE)[:, 0] = 1  # an earlier layer's publish: the router resets it first
    w, ids = fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    assert handoff.armed and bool((handoff.flags.view(FLAG_COPIES, FLAG_STRIDE)[:, 0] == 1).all())
    out = moe_w4_token(hidden, w13, w2, w.reshape(-1), ids, handoff=handoff)
    assert not handoff.armed  # the gate-up kernel took it
    assert int(handoff.flags.count_nonzero()) == FLAG_COPIES  # one flag a line, the rest of each line untouched
    assert torch.equal(out, plain)


def test_router_without_handoff_leaves_the_consumer_on_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, gate, w13, w2 = layer_inputs(11)
    plain = route_and_moe(hidden, gate, w13, w2, None)
    monkeypatch.setattr(triton_router, "HANDOFF", False)
    handoff = new_handoff()
    out = route_and_moe(hidden, gate, w13, w2, handoff)
    assert not handoff.armed and int(handoff.flags.count_nonzero()) == 0
    assert torch.equal(out, plain)


def test_route_handoff_only_on_a_gpu() -> None:
    assert route_handoff(torch.device("cpu")) is None
    if CUDA:
        a, b = route_handoff(torch.device(DEV)), route_handoff(torch.device(DEV))
        assert a is not None and b is not None and a.flags.data_ptr() == b.flags.data_ptr() and not a.armed


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and PDL need a GPU")
def test_handoff_in_a_replayed_graph_of_layers() -> None:
    from ftransformers.kernels.triton_norm import rms_norm

    layers = [layer_inputs(100 + i) for i in range(6)]
    hidden = layers[0][0].clone()
    norm_weight = torch.ones(D, dtype=torch.bfloat16, device=DEV)

    def step(handoff: RouteHandoff | None) -> torch.Tensor:
        x = hidden
        for _, gate, w13, w2 in layers:  # each layer's normed output is the next one's input, as in a model
            x = route_and_moe(rms_norm(x, norm_weight, 1e-6), gate, w13, w2, handoff)
        return x

    want = step(None)
    assert bool(want.isfinite().all())
    handoff = route_handoff(torch.device(DEV))
    assert handoff is not None
    step(handoff)  # warm-up: compile the SIGNAL / HANDOFF variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(handoff)
    for _ in range(50):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
