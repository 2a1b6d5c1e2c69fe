"""The router's selection run by the MoE kernels (kernels/triton_router.DeferredTopK) against the router's own.

The deferred router launch stops after its GEMV phase; the pair gate-up and the token down kernel sum the
partials and select with the router's code. So the picks must be the router's exactly: ids equal, weights within
float32 rounding (1e-6: the 8 picks' sum may add in another order), and the MoE output equal to the same kernels
fed the router's routing (bf16 rounding of the same float32 sums: 1e-6 relative), and within bf16's 1e-2 of the
torch_native experts on float32 upcasts. CPU: TRITON_INTERPRET=1, tiny shapes; CUDA: Qwen3-30B-A3B's shape too.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels import triton_fused_moe as tfm
from ftransformers.kernels import triton_moe_token_down as td
from ftransformers.kernels import triton_router
from ftransformers.kernels.triton_router import can_defer_router, fused_router_deferred, fused_router_topk
from ftransformers.layers.moe.experts import moe_forward_native

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (E, D, I, K): 128 experts top-8 (Qwen3-MoE), 60 of top-4 (a partial expert block); Qwen3-30B-A3B on a GPU
SHAPES = [(128, 256, 40, 8), (60, 72, 24, 4)] + ([(128, 2048, 768, 8)] if CUDA else [])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def inputs(e: int, d: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, d, generator=gen).to(DEV, dtype)
    gate = (torch.randn(e, d, generator=gen) * 2 / d**0.5).to(DEV, dtype)
    w13 = (torch.randn(e, 2 * inter, d, generator=gen) / d**0.5).to(DEV, dtype)
    w2 = (torch.randn(e, d, inter, generator=gen) / inter**0.5).to(DEV, dtype)
    return hidden, gate, w13, w2


# (dtype, renormalise, token down's PRELOAD): every combination on a GPU, three on the (slow) interpreter
COMBOS = [(dt, rn, pre) for dt in (torch.bfloat16, torch.float16) for rn in (True, False) for pre in (True, False)]
if not CUDA:
    COMBOS = [(torch.bfloat16, True, True), (torch.bfloat16, False, False), (torch.float16, True, False)]


@pytest.mark.parametrize("e,d,inter,k", SHAPES)
@pytest.mark.parametrize("dtype,renorm,preload", COMBOS)
def test_moe_selects_as_the_router(e: int, d: int, inter: int, k: int, dtype: torch.dtype, renorm: bool,
                                   preload: bool, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(td, "PRELOAD", preload)
    for seed in range(3 if CUDA else 1):
        hidden, gate, w13, w2 = inputs(e, d, inter, dtype, 31 * seed + e)
        assert can_defer_router(hidden, gate) and tfm.takes_deferred(1, d, k)
        w_ref, ids_ref = fused_router_topk(hidden, gate, k, softmax=True, renormalize=renorm, round_logits=True)
        ref = tfm.fused_moe(hidden, w13, w2, w_ref, ids_ref)
        routing = fused_router_deferred(hidden, gate, k, renormalize=renorm)
        routing.weights.fill_(float("nan")), routing.ids.fill_(-1)  # whatever the router left: the MoE writes them
        out = tfm.fused_moe(hidden, w13, w2, routing.weights, routing.ids, deferred=routing)
        assert torch.equal(routing.ids, ids_ref), (routing.ids, ids_ref)
        torch.testing.assert_close(routing.weights, w_ref, atol=1e-6, rtol=1e-6)
        assert out.shape == hidden.shape and out.dtype == dtype
        assert rel_err(out, ref) <= 1e-6
        native = moe_forward_native(hidden.float(), w13.float(), w2.float(), w_ref, ids_ref)
        assert rel_err(out, native) <= 1e-2


def test_deferred_router_takes_no_ticket() -> None:
    # Only the selecting launch takes (and hands back) the router's ticket; a deferred launch leaves it alone,
    # so a ticket taken there and never reset would show here.
    hidden, gate, _, _ = inputs(128, 256, 40, torch.bfloat16, 0)
    counter = triton_router._router_counter(hidden.device)
    counter.fill_(5)
    fused_router_deferred(hidden, gate, 8, renormalize=True)
    assert counter.item() == 5
    counter.zero_()
    fused_router_topk(hidden, gate, 8, softmax=True, renormalize=True, round_logits=True)
    assert counter.item() == 0


def test_when_routing_defers(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, gate, _, _ = inputs(128, 256, 40, torch.bfloat16, 1)
    assert can_defer_router(hidden, gate)
    assert not can_defer_router(hidden.float(), gate.float())  # float32 logits: the float selection
    assert not can_defer_router(hidden.repeat(2, 1), gate)  # DEFER_MAX_TOKENS
    monkeypatch.setattr(triton_router, "SELECT_IN_MOE", False)
    assert not can_defer_router(hidden, gate)
    assert tfm.takes_deferred(1, 2048, 8) and not tfm.takes_deferred(2, 2048, 8)  # 16 pairs: the aligned path
    assert not tfm.takes_deferred(1, 2048, 8, tfm.PairConfig(token_down=False))
    monkeypatch.setattr(td, "ENABLED", False)
    assert not tfm.takes_deferred(1, 2048, 8)


def _calls(fn) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    return {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}


def test_deferred_selection_only_loads() -> None:
    # deferred_slots runs ahead of the token down kernel's PDL wait (tests/test_pdl.py READ_ONLY_CALLS): it and
    # every helper it calls may load and compute, never store
    helpers = [triton_router.deferred_slots, triton_router.deferred_topk, triton_router._packed_softmax_topk,
               triton_router._round_logits, triton_router._key_logit]  # fmt: skip
    called = set().union(*(_calls(f) for f in helpers))
    assert not {c for c in called if "store" in c or "atomic" in c}, called
    jit_helpers = {c for c in called if not c.startswith("tl.") and "." not in c and c != "range"}
    assert jit_helpers <= {"deferred_topk", "_packed_softmax_topk", "_round_logits", "_key_logit"}, jit_helpers
