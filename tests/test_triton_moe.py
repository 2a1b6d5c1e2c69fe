"""Fused Triton MoE vs the torch_native backend, and the alignment invariants.

CPU: TRITON_INTERPRET=1 with tiny shapes, float32 (tolerance 1e-4, IEEE dots) and bfloat16 (1e-2).
CUDA: real-ish shapes in bfloat16 against torch_native on float32 upcasts (relative error <= 1e-2),
plus a CUDA-graph capture replayed on refilled inputs. Errors are ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels import triton_fused_moe as tfm
from ftransformers.kernels.tickets import ticket_counters
from ftransformers.layers.moe.experts import get_moe_backend, moe_forward_native

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate-free top-k ids [T, K] over a random subset of experts (the rest unused), weights [T, K]."""
    allowed = torch.randperm(e, generator=gen)[: max(k, (3 * e) // 4)]
    pick = torch.rand(t, allowed.numel(), generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(DEV), allowed[pick].to(DEV)


def make_experts(t: int, d: int, inter: int, e: int, dtype: torch.dtype, gen: torch.Generator):
    hidden = torch.randn(t, d, generator=gen).to(DEV, dtype)
    w13 = (torch.randn(e, 2 * inter, d, generator=gen) / d**0.5).to(DEV, dtype)
    w2 = (torch.randn(e, d, inter, generator=gen) / inter**0.5).to(DEV, dtype)
    return hidden, w13, w2


def check_alignment(topk_ids: torch.Tensor, e: int, block_m: int, sorted_ids, expert_ids, num_post) -> None:
    flat = topk_ids.reshape(-1).cpu()
    n = flat.numel()
    s, ex, used = sorted_ids.cpu().long(), expert_ids.cpu().long(), int(num_post.item())
    assert s.numel() == tfm.max_padded_rows(n, e, block_m) and ex.numel() == s.numel() // block_m
    counts = torch.bincount(flat, minlength=e)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = s[s < n]
    assert torch.equal(real.sort().values, torch.arange(n)), "every pair exactly once"
    assert bool((s[s >= n] == n).all()) and bool((s[used:] == n).all())
    for b in range(s.numel() // block_m):
        rows = s[b * block_m : (b + 1) * block_m]
        if b * block_m >= used:
            assert int(ex[b]) == e
            continue
        assert rows[0] < n, "every used block starts with a real pair"
        rows = rows[rows < n]
        assert bool((flat[rows] == ex[b]).all())
        assert bool((rows[1:] > rows[:-1]).all()), "stable order within an expert"
    assert bool((ex[: used // block_m][1:] >= ex[: used // block_m][:-1]).all())


@pytest.mark.parametrize(
    "t,e,k,block_m", [(1, 8, 2, 16), (3, 128, 8, 16), (17, 16, 4, 32), (64, 64, 6, 16), (40, 8, 2, 64), (700, 16, 2, 16)]
)
def test_alignment_invariants(t: int, e: int, k: int, block_m: int) -> None:
    # (700, 16, 2): 1400 pairs, more than one CHUNK of the multi-program kernel
    gen = torch.Generator().manual_seed(t * 1000 + e)
    _, ids = make_routing(t, e, k, gen)
    out = tfm.moe_align(ids, e, block_m)
    ref = tfm.align_reference(ids, e, block_m)
    check_alignment(ids, e, block_m, *out)
    check_alignment(ids, e, block_m, *ref)
    for a, b in zip(out, ref):
        assert torch.equal(a.cpu(), b.cpu())


# fused_moe's default path (aligned; the pair path only for T*K <= tfm.PAIR_MAX_PAIRS).
CPU_CASES = [(1, 8, 2), (3, 16, 4), (17, 8, 2), (64, 32, 8), (3, 128, 8)]
CUDA_CASES = [(t, e, k) for t in (1, 3, 8, 17, 64, 1024) for (e, k) in ((8, 2), (64, 6), (128, 8))]


@pytest.mark.parametrize("t,e,k", CUDA_CASES if CUDA else CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_native(t: int, e: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7 * t + e + k)
    d, inter = (1024, 384) if CUDA else (48, 40)
    hidden, w13, w2 = make_experts(t, d, inter, e, dtype, gen)
    weights, ids = make_routing(t, e, k, gen)
    ref = moe_forward_native(hidden.float(), w13.float(), w2.float(), weights, ids)
    out = get_moe_backend("triton")(hidden, w13, w2, weights, ids)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert rel_err(out, ref) <= (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "cfg",
    [tfm.MoEConfig(32, 16, 16, 32, 32, 8, 4, 2), tfm.MoEConfig(64, 32, 32, 16, 16, 2, 4, 2)],
)
def test_fused_moe_aligned_configs(cfg: tfm.MoEConfig) -> None:
    # The aligned path with tiles smaller than D and I (several N and K steps), grouped launch order.
    gen = torch.Generator().manual_seed(11)
    t, e, k = 21, 8, 3
    hidden, w13, w2 = make_experts(t, 72, 40, e, torch.float32, gen)
    weights, ids = make_routing(t, e, k, gen)
    ref = moe_forward_native(hidden, w13, w2, weights, ids)
    assert rel_err(tfm.fused_moe(hidden, w13, w2, weights, ids, cfg), ref) <= 1e-4


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 4, 3), (9, 16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", ["small", "default", "split"])
def test_pair_path_repeated_experts(t: int, e: int, k: int, dtype: torch.dtype, tiles: str) -> None:
    # The pair path forced by a PairConfig (also at 9 * 8 = 72 pairs) with tiles smaller than D and
    # I and odd sizes (D=72, I=40: partial N and K tiles); with E < T*K many tokens share an expert.
    # "split": the down kernel over slot groups (2 or 4 of top-8, 3 of top-3), last program out adds.
    gen = torch.Generator().manual_seed(5 * t + e)
    hidden, w13, w2 = make_experts(t, 72, 40, e, dtype, gen)
    weights, ids = make_routing(t, e, k, gen)
    ref = moe_forward_native(hidden.float(), w13.float(), w2.float(), weights, ids)
    cfg = tfm.PairConfig(up_n=16, up_k=32, down_n=16, down_k=16) if tiles == "small" else tfm.default_pair_config(t, 72)
    if tiles == "split":
        cfg = tfm.PairConfig(up_n=16, up_k=32, down_n=16, down_k=16, down_split={2: 2, 3: 3, 8: 4}[k])
    out = tfm.fused_moe(hidden, w13, w2, weights, ids.int(), cfg)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert rel_err(out, ref) <= (1e-4 if dtype == torch.float32 else 1e-2)
    if tiles == "split":  # every ticket handed back
        assert not ticket_counters(torch.device(DEV), "moe_down", t * 5).any()


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (1, 16, 8), (2, 6, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n,block_k,preload", [(2, 16, True), (4, 64, False), (1, 64, True)])
def test_token_down_matches_reference(t: int, e: int, k: int, dtype: torch.dtype, block_n: int, block_k: int,
                                      preload: bool) -> None:  # fmt: skip
    # The token down kernel against the pair path's function: D=72, I=40 (partial N and K tiles at block_k 16 and
    # 64: I < block_k leaves one masked tile), top-k 3 padded to 4 slots, several K tiles, routing read before
    # the wait or after it.
    from ftransformers.kernels import triton_moe_token_down as td

    gen = torch.Generator().manual_seed(7 * t + k + block_n)
    hidden, w13, w2 = make_experts(t, 72, 40, e, dtype, gen)
    weights, ids = make_routing(t, e, k, gen)
    act = tfm.pair_gate_up(hidden, w13, ids.int().contiguous(), weights.reshape(-1).float().contiguous(),
                           tfm.PairConfig(up_n=16, up_k=32))  # fmt: skip
    ref = torch.einsum("tki,tkdi->td", act.float().view(t, k, -1), w2.float()[ids])
    out = torch.full((t, 72), float("nan"), dtype=dtype, device=DEV)
    td.moe_token_down(act, w2, ids.int().contiguous(), out, td.TokenDownConfig(block_n, block_k, 4, preload))
    assert rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_fused_moe_one_token_takes_the_token_down_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default pair config sends one token's down projection to triton_moe_token_down; with it off, to
    # pair_down_sum; both give the reference. A kernel that dropped a slot or its routing weight would fail here.
    from ftransformers.kernels import triton_moe_token_down as td

    gen = torch.Generator().manual_seed(3)
    hidden, w13, w2 = make_experts(1, 72, 40, 16, torch.float32, gen)
    weights, ids = make_routing(1, 16, 8, gen)
    ref = moe_forward_native(hidden, w13, w2, weights, ids)
    calls = []
    real = td.moe_token_down

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(td, "moe_token_down", spy)
    assert tfm.default_pair_config(1, 72).token_down and td.takes(1, 8)
    assert rel_err(tfm.fused_moe(hidden, w13, w2, weights, ids), ref) <= 1e-4 and calls == [1]
    monkeypatch.setattr(td, "ENABLED", False)
    assert rel_err(tfm.fused_moe(hidden, w13, w2, weights, ids), ref) <= 1e-4 and calls == [1]
    with pytest.raises(ValueError, match="moe_token_down"):
        real(torch.empty(3, 40, device=DEV), w2, ids.int(), torch.empty(1, 72, device=DEV))


def test_moe_sum() -> None:
    x = torch.randn(5, 3, 70, generator=torch.Generator().manual_seed(3)).to(DEV)
    out = tfm.moe_sum(x, torch.empty(5, 70, device=DEV))
    assert rel_err(out, x.sum(1)) <= 1e-6


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 8, 64])
def test_fused_moe_cuda_graph_replay(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    e, k = 128, 8
    hidden, w13, w2 = make_experts(t, 2048, 768, e, torch.bfloat16, gen)
    weights, ids = make_routing(t, e, k, gen)
    fn = get_moe_backend("triton")
    fn(hidden, w13, w2, weights, ids)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(hidden, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(hidden, w13, w2, weights, ids)
    for _ in range(3):
        new_hidden, _, _ = make_experts(t, 2048, 768, 1, torch.bfloat16, gen)
        new_weights, new_ids = make_routing(t, e, k, gen)
        hidden.copy_(new_hidden), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        ref = fn(hidden, w13, w2, weights, ids)
        assert torch.equal(out, ref)
        assert rel_err(out, moe_forward_native(hidden.float(), w13.float(), w2.float(), weights, ids)) <= 1e-2
