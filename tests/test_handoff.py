"""The fused router handing its picks to the few-token 4-bit MoE through flags (kernels/handoff.py).

The handoff changes when the gate-up kernel may read the routing, never what it computes: with it the MoE's
output must equal, bit for bit, the same kernels' output without it, on fresh random hidden states, gates and
int4 experts. CPU: TRITON_INTERPRET=1 (programs run one after another, so only the protocol's bookkeeping is
exercised: the publish, the down kernel's reset, the arming and disarming). CUDA: with PDL, in a CUDA graph of
several router -> MoE layers replayed many times, where a consumer reading before the publish (or a stale flag
left by the layer before) would show as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_w4 import CUDA, DEV, random_qw

from ftransformers.kernels import triton_router
from ftransformers.kernels import handoff as handoff_mod
from ftransformers.kernels.handoff import FLAG_STRIDE, MAX_COPIES, RouteHandoff, route_handoff
from ftransformers.kernels.triton_moe_w4_gemv import moe_w4_token
from ftransformers.kernels.triton_router import fused_router_topk

# Qwen3-30B-A3B's experts on the GPU; a small model of them in the interpreter
D, I, E, K = (2048, 768, 128, 8) if CUDA else (128, 128, 16, 4)


def new_handoff() -> RouteHandoff:
    return RouteHandoff(torch.zeros(MAX_COPIES * FLAG_STRIDE, dtype=torch.int32, device=DEV))


def flag_words(handoff: RouteHandoff) -> torch.Tensor:
    return handoff.flags.view(MAX_COPIES, FLAG_STRIDE)[:, 0]


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
@pytest.mark.parametrize("copies", [1, 8])
def test_handoff_gives_the_same_bits(t: int, copies: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff_mod, "COPIES", copies)
    hidden, gate, w13, w2 = layer_inputs(5 + t, t)
    plain = route_and_moe(hidden, gate, w13, w2, None)
    handoff = new_handoff()
    w, ids = fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    published = flag_words(handoff)
    assert handoff.armed and bool((published[:copies] == 1).all()) and int(published[copies:].count_nonzero()) == 0
    assert int(handoff.flags.count_nonzero()) == copies  # one flag a line, the rest of each line untouched
    out = moe_w4_token(hidden, w13, w2, w.reshape(-1), ids, handoff=handoff)
    assert not handoff.armed  # the gate-up kernel took it
    assert int(handoff.flags.count_nonzero()) == 0  # and the down kernel put the flags back
    assert torch.equal(out, plain)


def test_router_without_handoff_leaves_the_consumer_on_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, gate, w13, w2 = layer_inputs(11)
    plain = route_and_moe(hidden, gate, w13, w2, None)
    monkeypatch.setattr(triton_router, "HANDOFF", False)
    handoff = new_handoff()
    out = route_and_moe(hidden, gate, w13, w2, handoff)
    assert not handoff.armed and int(handoff.flags.count_nonzero()) == 0
    assert torch.equal(out, plain)


def test_consumer_on_its_wait_still_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    # CONSUME off (an A/B): the router publishes, the gate-up keeps its PDL wait, the down kernel resets
    hidden, gate, w13, w2 = layer_inputs(13)
    plain = route_and_moe(hidden, gate, w13, w2, None)
    monkeypatch.setattr(handoff_mod, "CONSUME", False)
    handoff = new_handoff()
    out = route_and_moe(hidden, gate, w13, w2, handoff)
    assert not handoff.armed and int(handoff.flags.count_nonzero()) == 0
    assert torch.equal(out, plain)


def test_an_untaken_publish_is_cleared() -> None:
    hidden, gate, w13, w2 = layer_inputs(17)
    handoff = new_handoff()
    fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    assert handoff.armed and int(handoff.flags.count_nonzero()) > 0
    handoff.discard()  # a path that does not poll (fused_moe_w4's other paths)
    assert not handoff.armed and int(handoff.flags.count_nonzero()) == 0
    fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    assert handoff.armed  # the second router launch found the first's publish untaken and cleared it first
    plain = route_and_moe(hidden, gate, w13, w2, None)
    w, ids = fused_router_topk(hidden, gate, K, softmax=True, renormalize=True, round_logits=True, handoff=handoff)
    assert torch.equal(moe_w4_token(hidden, w13, w2, w.reshape(-1), ids, handoff=handoff), plain)
    assert not handoff.armed and int(handoff.flags.count_nonzero()) == 0


def test_route_handoff_only_on_a_gpu() -> None:
    assert route_handoff(torch.device("cpu")) is None
    if CUDA:
        a, b = route_handoff(torch.device(DEV)), route_handoff(torch.device(DEV))
        assert a is not None and a is b and not a.armed  # one handoff a device: its arming is the device's


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and PDL need a GPU")
@pytest.mark.parametrize(("copies", "sleep_ns"), [(8, 0), (1, 64)])
def test_handoff_in_a_replayed_graph_of_layers(copies: int, sleep_ns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftransformers.kernels.triton_norm import rms_norm

    monkeypatch.setattr(handoff_mod, "COPIES", copies)
    monkeypatch.setattr(handoff_mod, "POLL_SLEEP_NS", sleep_ns)

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
    assert not handoff.armed and int(handoff.flags.count_nonzero()) == 0
