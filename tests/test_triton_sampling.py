"""The sort-free sampling kernel against a float64 reference that replays its uniforms.

`draw_uniforms` returns the uniforms the kernel draws for a seed, so the reference below knows them:
it computes the kept set by a stable descending sort (top-k, top-p on the renormalised top-k mass,
min-p), then draws as the kernel does (inverse CDF over the allowed tokens in column order, redrawn
among the tokens above a draw that top-p rejects) and must name the very token the kernel names.
"""

from __future__ import annotations

import math

import pytest
import torch

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.kernels.triton_sampling import MAX_ROUNDS, draw_uniforms, sample_tokens
from ftransformers.runtime.sampler import Sampler
from ftransformers.runtime.step_io import SeqStep

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def kept_sets(x: list[float], t: float, k: int, p: float, min_p: float) -> tuple[list[int], set[int], set[int]]:
    """(best-first order, allowed = top-k and min-p, kept = allowed and top-p) of one row."""
    V = len(x)
    order = sorted(range(V), key=lambda j: (-x[j], j))  # stable descending
    m = max(x)
    w = [math.exp((v - m) / t) for v in x]
    top_k = order[:k] if 1 < k < V else order
    total = sum(w[j] for j in top_k)
    kept_p, mass = set(), 0.0
    for j in top_k:
        if p < 1.0 and mass >= p * total:
            break
        kept_p.add(j)
        mass += w[j]
    allowed = {j for j in top_k if w[j] >= min_p}
    return order, allowed, allowed & kept_p


def ref_token(x: list[float], t: float, k: int, p: float, min_p: float, uniforms: list[float]) -> int:
    if t == 0.0 or k == 1:
        return max(range(len(x)), key=lambda j: (x[j], -j))
    order, allowed, kept = kept_sets(x, t, k, p, min_p)
    rank = {j: r for r, j in enumerate(order)}
    m = max(x)
    w = [math.exp((v - m) / t) for v in x]
    pool = allowed
    for u in uniforms:
        cols = sorted(pool)
        target = u * sum(w[j] for j in cols)
        acc, tok = 0.0, cols[-1]
        for j in cols:
            acc += w[j]
            if acc > target:
                tok = j
                break
        if tok in kept:
            return tok
        pool = {j for j in pool if rank[j] < rank[tok]}
    raise AssertionError("more rejection rounds than the kernel allows")


def row_params(gen: torch.Generator, V: int) -> tuple[float, int, float, float]:
    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return (
        pick([0.0, 0.5, 1.0, 1.0, 1.7]),
        pick([0, 0, 1, 2, 7, V - 1, V]),
        pick([1.0, 0.95, 0.6, 0.3, 0.05]),
        pick([0.0, 0.0, 0.02, 0.2]),
    )


# programs per row: on the CPU always 1 (the interpreter runs programs one after another)
SPLITS = [1, 2, 3, None] if DEV == "cuda" else [1]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    ("dtype", "V", "block", "rows"),
    [
        (torch.float32, 300, 64, 24),  # five tiles, the last one partial
        (torch.bfloat16, 77, 32, 24),  # 16-bit keys, many ties (values on a 1/4 grid)
        (torch.float16, 130, 128, 12),  # 32-bit keys of float16 values, one tile and a bit
    ],
)
def test_matches_reference_draw_for_draw(
    dtype: torch.dtype, V: int, block: int, rows: int, split: int | None
) -> None:
    if DEV != "cuda":  # Triton's interpreter: half the rows (each still draws its own sampling settings)
        rows //= 2
    gen = torch.Generator().manual_seed(V)
    scale = torch.rand(rows, 1, generator=gen) * 3 + 0.05  # flat rows too: many rejection rounds
    x = torch.randn(rows, V, generator=gen) * scale
    if dtype == torch.bfloat16:
        x = (x * 4).round() / 4
    x = x.to(dtype)
    params = [row_params(gen, V) for _ in range(rows)]
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    dev = torch.device(DEV)
    got = sample_tokens(
        x.to(dev),
        torch.tensor([q[0] for q in params], device=dev),
        torch.tensor([q[1] for q in params], dtype=torch.int32, device=dev),
        torch.tensor([q[2] for q in params], device=dev),
        torch.tensor([q[3] for q in params], device=dev),
        seeds.to(dev),
        block=block,
        split=split,
    ).cpu()
    uniforms = draw_uniforms(seeds.to(dev), MAX_ROUNDS).cpu().tolist()
    for i, (t, k, p, mp) in enumerate(params):
        want = ref_token(x[i].double().tolist(), t, k, p, mp, uniforms[i])
        assert int(got[i]) == want, (i, t, k, p, mp)


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids() -> None:
    # every logit equal: top-k keeps exactly the first k ids; top-p 0.5 of 8 equal tokens keeps 4 (16 seeded rows
    # draw each kept id; 64 took 27 s under the interpreter)
    S, V = 16, 40
    x = torch.zeros(S, V, dtype=torch.bfloat16, device=DEV)
    ones = torch.ones(S, device=DEV)
    seeds = torch.arange(S, dtype=torch.int64, device=DEV) * 977 + 5
    k3 = sample_tokens(x, ones, torch.full((S,), 3, dtype=torch.int32, device=DEV), ones, 0 * ones, seeds, block=32)
    assert set(k3.tolist()) == {0, 1, 2}
    k8p = sample_tokens(x, ones, torch.full((S,), 8, dtype=torch.int32, device=DEV), 0.5 * ones, 0 * ones, seeds)
    assert set(k8p.tolist()) == {0, 1, 2, 3}


def test_uniforms_are_seeded() -> None:
    seeds = torch.tensor([1, 1, 2, 3], dtype=torch.int64, device=DEV)
    u = draw_uniforms(seeds, 8).cpu()
    assert torch.equal(u[0], u[1])
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[2], u[3])
    assert bool(((u >= 0) & (u < 1)).all())
    assert len(set(u[0].tolist())) == 8


def seq(sp: SamplingParams, output: list[int] | None = None, banned: list[int] | None = None) -> SeqStep:
    return SeqStep(rid="r", req_pool_idx=0, input_ids=[1], prefix_len=0, slots_start=0, slots=[1], sample=True,
                   sampling=sp, prompt_ids=[0], output_ids=list(output or []),
                   banned_token_ids=list(banned or []))  # fmt: skip


def test_sampler_triton_backend_rows() -> None:
    """Sampler(backend="triton"): greedy rows, penalties and bans applied first, seeded rows repeat."""
    gen = torch.Generator().manual_seed(11)
    V = 200
    logits = (torch.randn(5, V, generator=gen) * 2).to(DEV)
    top = logits.argmax(-1).tolist()
    seqs = [
        seq(SamplingParams(temperature=0.0)),
        seq(SamplingParams(temperature=0.0), banned=[top[1]]),
        seq(SamplingParams(temperature=0.8, top_k=1, repetition_penalty=100.0), output=[top[2]]),
        seq(SamplingParams(temperature=0.9, top_p=0.5, seed=3), output=[7, 8]),
        seq(SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=4), banned=list(range(0, V, 2))),
    ]
    sampler = Sampler(DEV, seed=1, backend="triton")
    before = logits.clone()
    out = [r.token_id for r in sampler(logits, seqs)]
    assert torch.equal(logits, before)
    assert out[0] == top[0]
    assert out[1] == int(logits[1].clone().index_fill_(0, torch.tensor([top[1]], device=DEV), -1e9).argmax())
    assert out[2] != top[2] or logits[2, top[2]] <= 0
    assert out[4] % 2 == 1
    again = [r.token_id for r in Sampler(DEV, seed=99, backend="triton")(logits, seqs)]
    assert again[3:] == out[3:]  # seeded rows: the engine seed does not matter
    single = [Sampler(DEV, seed=1, backend="triton")(logits[i : i + 1], [s])[0].token_id for i, s in enumerate(seqs)]
    assert single[3:] == out[3:]
