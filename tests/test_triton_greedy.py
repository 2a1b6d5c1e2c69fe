"""The ends of a captured decode step (`kernels/triton_greedy.py`) against plain PyTorch.

CPU: TRITON_INTERPRET=1, small vocabularies. Fresh random logits; the kernel only compares values, so
tokens must equal torch.argmax exactly (the first column of each row's max, ties included), in every
dtype and with one or many programs per row. NaN counts as +inf (rows with NaN but no +inf agree with
torch). `decode_inputs` against torch.where / index_put on random rows with placeholders.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.triton_greedy import BLOCK, decode_inputs, greedy_split, greedy_tokens
from ftransformers.runtime.cuda_graph_runner import FIELDS
from ftransformers.runtime.sampler import resolve_future

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
VOCABS = [1000, BLOCK * 3 + 17, 151936] if CUDA else [1000, BLOCK * 3 + 17]


def random_logits(s: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(s, v, generator=gen) * 4).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("s", [1, 3, 16])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_matches_torch_argmax(dtype: torch.dtype, v: int, s: int, split: int | None) -> None:
    logits = random_logits(s, v, dtype, seed=v + 31 * s + (split or 0))
    assert torch.equal(greedy_tokens(logits, split=split), logits.argmax(dim=-1))


@pytest.mark.parametrize("split", [1, 3])
def test_ties_take_the_first_column(split: int) -> None:
    v = BLOCK * 3 + 5
    logits = random_logits(4, v, torch.bfloat16, seed=5).clamp(max=1.0)
    logits[0, [7, BLOCK + 1, v - 1]] = 8.0  # the same max in several tiles and splits
    logits[1, [v - 2, v - 1]] = 8.0  # in the last, partial tile only
    logits[2] = 1.0  # one value everywhere
    logits[3, [BLOCK * 2 + 3, BLOCK + 9]] = 8.0  # the later split holds the smaller column
    tokens = greedy_tokens(logits, split=split)
    assert tokens.tolist() == [7, v - 2, 0, BLOCK + 9]
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("split", [1, 3])
def test_infinities_and_nan(split: int) -> None:
    v = BLOCK * 2 + 100
    logits = random_logits(3, v, torch.float32, seed=9)
    logits[0] = float("-inf")  # every value -inf: column 0, as torch
    logits[1, BLOCK + 50] = float("nan")  # torch ranks NaN first
    logits[2, [11, BLOCK * 2 + 1]] = float("inf")
    tokens = greedy_tokens(logits, split=split)
    assert tokens.tolist() == [0, BLOCK + 50, 11]
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_rows_of_a_wider_buffer_and_out() -> None:
    buf = random_logits(8, 3000, torch.bfloat16, seed=2)
    logits = buf[:5, :2500]  # row stride 3000
    out = torch.full((8,), -7, dtype=torch.int64, device=DEV)
    got = greedy_tokens(logits, out=out[:5])
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:5], logits.argmax(dim=-1)) and (out[5:] == -7).all()


@pytest.mark.parametrize("split", [1, 4])
def test_future_slots(split: int) -> None:
    logits = random_logits(4, 5000, torch.bfloat16, seed=3)
    future = torch.full((10,), -5, dtype=torch.int64, device=DEV)
    slots = torch.tensor([6, -1, 0, 9], dtype=torch.int64, device=DEV)  # row 1 has no slot
    tokens = greedy_tokens(logits, future=future, slots=slots, split=split)
    expect = torch.full((10,), -5, dtype=torch.int64)
    expect[[6, 0, 9]] = logits.argmax(dim=-1).cpu()[[0, 2, 3]]
    assert torch.equal(tokens, logits.argmax(dim=-1)) and torch.equal(future.cpu(), expect)


def test_split_choice() -> None:
    assert greedy_split(1, 151936) == -(-151936 // BLOCK)  # one program per tile at one row
    assert greedy_split(128, 151936) == 4
    assert greedy_split(1024, 151936) == 1
    assert greedy_split(1, 100) == 1


@pytest.mark.parametrize("n", [1, 5, 8])
def test_decode_inputs(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    rows, ctx, nfut = 6, 40, 12
    future = torch.randint(0, 1000, (nfut,), generator=gen)
    req_to_token = torch.randint(0, 500, (rows + 1, ctx), generator=gen)
    req_to_token[rows] = 0  # the dummy row padding rows name
    inputs = torch.zeros(len(FIELDS), n, dtype=torch.int64)
    ids = torch.randint(0, 1000, (n,), generator=gen)
    ids[::2] = -torch.randint(1, nfut + 1, (len(ids[::2]),), generator=gen)  # future placeholders
    pool = torch.randperm(rows, generator=gen)[:n] if n <= rows else torch.arange(n) % rows
    pos = torch.randint(0, ctx, (n,), generator=gen)
    loc = torch.randint(1, 500, (n,), generator=gen)
    for name, col in (("input_ids", ids), ("positions", pos), ("out_cache_loc", loc), ("req_pool_indices", pool)):
        inputs[FIELDS.index(name)] = col
    if n == 8:  # the last two rows are padding
        inputs[FIELDS.index("req_pool_indices"), 6:] = rows
        inputs[FIELDS.index("positions"), 6:] = 0
        inputs[FIELDS.index("out_cache_loc"), 6:] = 0
        inputs[FIELDS.index("input_ids"), 6:] = 0
    expect_r2t = req_to_token.clone()
    i = FIELDS.index
    expect_r2t[inputs[i("req_pool_indices")], inputs[i("positions")]] = inputs[i("out_cache_loc")]
    expect_ids = resolve_future(inputs[i("input_ids")].clone(), future)
    inputs_d, future_d, r2t_d = inputs.to(DEV), future.to(DEV), req_to_token.to(DEV)
    decode_inputs(inputs_d, FIELDS, future_d, r2t_d)
    assert torch.equal(inputs_d[i("input_ids")].cpu(), expect_ids)
    assert torch.equal(r2t_d.cpu(), expect_r2t) and (r2t_d[rows] == 0).all()
    assert torch.equal(inputs_d[1:].cpu(), inputs[1:]) and torch.equal(future_d.cpu(), future)
