"""Sampler against plain-PyTorch references on fresh random logits."""

from __future__ import annotations

import math

import pytest
import torch

from ftransformers.config.sampling_params import SamplingParams, SamplingParamsError
from ftransformers.runtime.sampler import Sampler, apply_penalties, argmax_suffices, top_k_top_p_min_p_mask
from ftransformers.runtime.step_io import SeqStep, future_placeholder


def seq(
    sampling: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    banned: list[int] | None = None,
) -> SeqStep:
    return SeqStep(
        rid="r",
        req_pool_idx=0,
        input_ids=[1],
        prefix_len=0,
        slots_start=0,
        slots=[1],
        sample=True,
        sampling=sampling,
        prompt_ids=list(prompt or [0]),
        output_ids=list(output or []),
        banned_token_ids=list(banned or []),
    )


def ref_keep(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Kept token set of one row: top-k, then top-p on the renormalised top-k set, and min-p."""
    x = logits.double()
    V = x.numel()
    order = x.argsort(descending=True).tolist()
    k = V if top_k <= 0 else min(top_k, V)
    kept_k = order[:k]
    p = torch.softmax(x[kept_k], dim=0).tolist()
    kept_p, mass = [], 0.0
    for tok, prob in zip(kept_k, p):
        kept_p.append(tok)
        mass += prob
        if mass >= top_p:
            break
    full = torch.softmax(x, dim=0)
    kept_min = {t for t in range(V) if full[t] >= min_p * full.max()}
    return set(kept_p) & kept_min


def test_top_k_top_p_min_p_mask_exact_sets() -> None:
    gen = torch.Generator().manual_seed(1)
    S, V = 12, 64
    logits = torch.randn(S, V, generator=gen) * 2.0
    ks = torch.randint(1, V + 1, (S,), generator=gen)
    ps = torch.rand(S, generator=gen) * 0.9 + 0.05
    mps = torch.rand(S, generator=gen) * 0.2
    ps[0], mps[0], ks[0] = 1.0, 0.0, 3  # top-k only
    ps[1], mps[1], ks[1] = 0.5, 0.0, V  # top-p only
    ps[2], mps[2], ks[2] = 1.0, 0.1, V  # min-p only
    keep = top_k_top_p_min_p_mask(logits, ks, ps, mps)
    for i in range(S):
        got = set(keep[i].nonzero().flatten().tolist())
        assert got == ref_keep(logits[i], int(ks[i]), float(ps[i]), float(mps[i])), i
    # A row of top_k=3 keeps exactly 3, and the top token is always kept.
    assert int(keep[0].sum()) == 3
    assert bool(keep[torch.arange(S), logits.argmax(-1)].all())


def test_penalties_exact_values() -> None:
    gen = torch.Generator().manual_seed(2)
    V = 40
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
        SamplingParams(),
    ]
    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=gen).tolist()

    seqs = [seq(p, prompt=ids(7), output=ids(9)) for p in params]
    logits = torch.randn(len(seqs), V, generator=gen)
    got = apply_penalties(logits.clone(), seqs)
    want = logits.clone()
    for i, s in enumerate(seqs):
        sp = s.sampling
        for t in set(s.prompt_ids) | set(s.output_ids):
            x = want[i, t]
            want[i, t] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        for t in set(s.output_ids):
            want[i, t] -= sp.frequency_penalty * s.output_ids.count(t) + sp.presence_penalty
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.equal(got[:4], logits[:4])
    assert torch.equal(got[4], logits[4])

    # Overlap scheduling: the last output ids may still be future placeholders on the host.
    future = torch.randint(0, V, (11,), generator=gen)
    for i, s in enumerate(seqs):
        slot = (3 * i) % 11
        s.output_ids[-1] = future_placeholder(slot)
        s.prompt_ids[0] = future_placeholder((slot + 1) % 11)  # resolved wherever an id appears
    resolved = [
        seq(s.sampling, prompt=[int(future[(3 * i + 1) % 11])] + s.prompt_ids[1:],
            output=s.output_ids[:-1] + [int(future[(3 * i) % 11])])
        for i, s in enumerate(seqs)
    ]  # fmt: skip
    torch.testing.assert_close(
        apply_penalties(logits.clone(), seqs, future), apply_penalties(logits.clone(), resolved), rtol=0, atol=0
    )


def test_greedy_is_argmax_after_penalties_and_bans() -> None:
    gen = torch.Generator().manual_seed(3)
    S, V = 8, 100
    logits = torch.randn(S, V, generator=gen)
    top = logits.argmax(-1).tolist()
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(S)]
    seqs[1] = seq(SamplingParams(temperature=0.0), banned=[top[1]])
    seqs[2] = seq(SamplingParams(temperature=0.0, repetition_penalty=50.0), output=[top[2]])
    seqs[3] = seq(SamplingParams(temperature=0.9, top_k=1))
    out = [r.token_id for r in Sampler("cpu")(logits, seqs)]
    masked = logits.clone()
    masked[1, top[1]] = float("-inf")
    x = masked[2, top[2]]
    masked[2, top[2]] = x / 50.0 if x > 0 else x * 50.0
    assert out == masked.argmax(-1).tolist()
    assert out[1] != top[1]


@pytest.mark.parametrize("backend", ["torch_native", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_logit_bias_adds_to_the_logits_after_penalties(backend: str) -> None:
    gen = torch.Generator().manual_seed(10)
    S, V = 6, 80
    dev = "cuda" if backend == "triton" else "cpu"
    logits = torch.randn(S, V, generator=gen).to(dev)
    before = logits.clone()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    top = logits.argmax(-1).tolist()
    biases = [{second[0]: 100.0}, {top[1]: -100.0}, {top[2]: -0.5, second[2]: 0.25}, {}, {second[4]: 100.0}]
    seqs = [seq(SamplingParams(temperature=0.0, logit_bias=b or None)) for b in biases]
    seqs.append(seq(SamplingParams(temperature=0.0, logit_bias={top[5]: -100.0, second[5]: 5.0}), banned=[second[5]]))
    seqs[4] = seq(SamplingParams(temperature=0.0, repetition_penalty=3.0, logit_bias=biases[4]), output=[second[4]])
    assert not argmax_suffices(seqs) and argmax_suffices([seqs[3]])
    out = [r.token_id for r in Sampler(dev, backend=backend)(logits, seqs)]
    ref = logits.cpu().clone()
    x = ref[4, second[4]]
    ref[4, second[4]] = x / 3.0 if x > 0 else x * 3.0  # the penalty first, then the bias
    for i, b in enumerate(biases + [{top[5]: -100.0, second[5]: 5.0}]):
        for t, v in b.items():
            ref[i, t] += v
    ref[5, second[5]] = float("-inf")  # a ban wins over a bias
    assert out == ref.argmax(-1).tolist()
    assert out[0] == second[0] and out[1] != top[1] and out[4] == second[4] and out[5] not in (top[5], second[5])
    assert torch.equal(logits, before)
    # sampled rows: +100 all but forces a token, whatever the temperature
    hot = SamplingParams(temperature=1.5, logit_bias={7: 100.0})
    forced = Sampler(dev, seed=3, backend=backend)(logits[:1].repeat(50, 1), [seq(hot)] * 50)
    assert {r.token_id for r in forced} == {7}


@pytest.mark.parametrize(("bias", "message"), [({"x": 1.0}, "token ids to numbers"), ({3: 101.0}, "[-100, 100]"),
                                               ({-1: 1.0}, "ids >= 0"), ({3: "big"}, "token ids to numbers")])
def test_logit_bias_validation(bias: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError, match="logit_bias") as err:
        SamplingParams(logit_bias=bias)
    assert message in str(err.value)
    assert SamplingParams(logit_bias={"12": 3}).logit_bias == {12: 3.0}  # JSON's string keys


@pytest.mark.parametrize("case", ["greedy", "banned", "penalty", "banned+penalty", "sampled+banned"])
def test_sample_leaves_the_logits_untouched(case: str) -> None:
    # the sampler reads the CUDA graph's logits buffer in place (no copy for a plain greedy step)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    banned = [int(logits[0].argmax())] if "banned" in case else None
    params = SamplingParams(temperature=0.7 if "sampled" in case else 0.0, frequency_penalty=1.5 if "penalty" in case else 0.0)
    out = [r.token_id for r in Sampler("cpu", seed=1)(logits, [seq(params, output=[3, 3], banned=banned) for _ in range(4)])]
    assert torch.equal(logits, before)
    if banned:
        assert banned[0] not in out[:1]


def test_banned_tokens_never_chosen() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, -1.0, 0.5]]).repeat(2000, 1)
    sampler = Sampler("cpu", seed=4)
    seqs = [seq(SamplingParams(temperature=1.5), banned=[0, 1]) for _ in range(2000)]
    toks = torch.tensor([r.token_id for r in sampler(logits, seqs)])
    assert not ((toks == 0) | (toks == 1)).any()
    assert len(set(toks.tolist())) == 4


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    gen = torch.Generator().manual_seed(5)
    V = 1000
    logits = torch.randn(1, V, generator=gen) * 0.1  # nearly flat: different seeds should disagree
    history = [3, 4, 5]
    a, b = Sampler("cpu", seed=0), Sampler("cpu", seed=123)
    for s in range(10):
        sp = SamplingParams(temperature=1.0, seed=s)
        t1 = a(logits, [seq(sp, output=history)])[0].token_id
        t2 = b(logits, [seq(sp, output=history)])[0].token_id  # different engine seed, same request seed
        assert t1 == t2
    by_seed = {a(logits, [seq(SamplingParams(seed=s), output=history)])[0].token_id for s in range(30)}
    assert len(by_seed) >= 20
    # The step (len(output_ids)) enters the seed: one request's successive draws differ.
    by_step = {a(logits, [seq(SamplingParams(seed=7), output=[1] * n)])[0].token_id for n in range(30)}
    assert len(by_step) >= 20
    # Unseeded requests draw from the engine generator: repeated calls differ.
    unseeded = {a(logits, [seq(SamplingParams(), output=history)])[0].token_id for _ in range(30)}
    assert len(unseeded) >= 20


@pytest.mark.parametrize(
    "backend",
    [
        "torch_native",
        # 30000 draws are too slow in Triton's interpreter; tests/test_triton_sampling.py replays its draws
        pytest.param("triton", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
    ],
)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.7, min_p=0.05),
    ],
)
def test_sampled_distribution_matches_softmax(params: SamplingParams, backend: str) -> None:
    gen = torch.Generator().manual_seed(6)
    V, N = 6, 30000
    logits = torch.randn(1, V, generator=gen)
    scaled = logits[0].double() / params.temperature
    keep = ref_keep(scaled, params.top_k, params.top_p, params.min_p)
    probs = torch.zeros(V, dtype=torch.float64)
    idx = torch.tensor(sorted(keep))
    probs[idx] = torch.softmax(scaled[idx], dim=0)
    dev = "cuda" if backend == "triton" else "cpu"
    toks = [r.token_id for r in Sampler(dev, seed=7, backend=backend)(logits.to(dev).repeat(N, 1), [seq(params)] * N)]
    freq = torch.bincount(torch.tensor(toks), minlength=V).double() / N
    # ~6 standard errors at worst: fails on a wrong temperature or a wrong kept set.
    assert (freq - probs).abs().max().item() < 6 * math.sqrt(0.25 / N)
    assert (freq[probs == 0] == 0).all()


def test_logprobs_are_raw_log_softmax() -> None:
    gen = torch.Generator().manual_seed(8)
    S, V = 4, 50
    logits = torch.randn(S, V, generator=gen) * 3
    seqs = [
        seq(SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0), output=[1, 2]),
        seq(SamplingParams(temperature=0.8, logprobs=0)),
        seq(SamplingParams(temperature=0.8)),
        seq(SamplingParams(temperature=1.0, top_p=0.5, logprobs=2, seed=1)),
    ]
    out = Sampler("cpu")(logits, seqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i in (0, 1, 3):
        k = seqs[i].sampling.logprobs
        assert out[i].logprob == pytest.approx(ref[i, out[i].token_id].item(), abs=1e-5)
        vals, ids = ref[i].topk(k)
        assert [t for t, _ in out[i].top_logprobs] == ids.tolist()
        assert [v for _, v in out[i].top_logprobs] == pytest.approx(vals.tolist(), abs=1e-5)
    assert out[1].top_logprobs == []
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_mixed_batch_equals_per_row() -> None:
    gen = torch.Generator().manual_seed(9)
    V = 300
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=20, seed=11),
        SamplingParams(temperature=1.2, top_p=0.7, seed=12, frequency_penalty=0.5),
        SamplingParams(temperature=0.6, min_p=0.05, seed=13, repetition_penalty=1.2, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=1),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=14),
    ]
    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=gen).tolist()

    seqs = [seq(p, prompt=ids(5), output=ids(6), banned=ids(1)) for p in params]
    logits = torch.randn(len(seqs), V, generator=gen) * 2
    sampler = Sampler("cpu")
    batched = sampler(logits, seqs)
    single = [sampler(logits[i : i + 1], [s])[0] for i, s in enumerate(seqs)]
    assert [r.token_id for r in batched] == [r.token_id for r in single]
    for b, s in zip(batched, single):
        assert (b.logprob is None) == (s.logprob is None)
        if b.logprob is not None:
            assert b.logprob == pytest.approx(s.logprob, abs=1e-6)
            assert [t for t, _ in b.top_logprobs] == [t for t, _ in s.top_logprobs]
