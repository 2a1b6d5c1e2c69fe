"""The reference backend's one-query path (a decode row on the CPU) against SDPA over K/V repeated to every query
head, on fresh random inputs: float32 to 1e-5, bfloat16 inputs to one bf16 step of the output (2^-8 relative) plus
float32 noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftransformers.attention.torch_native import one_query_attention

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 8e-3)}  # (atol, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "keys"), [(9, 3, 700), (4, 4, 33), (8, 1, 1), (16, 2, 257)])
def test_one_query_matches_sdpa(dtype: torch.dtype, heads: int, kv_heads: int, keys: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + keys)
    q = torch.randn(heads, 64, generator=gen).to(dtype)
    k = torch.randn(keys, kv_heads, 64, generator=gen).to(dtype)
    v = torch.randn(keys, kv_heads, 48, generator=gen).to(dtype)
    group = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.float()[:, None], k.float().repeat_interleave(group, 1).transpose(0, 1),
                                         v.float().repeat_interleave(group, 1).transpose(0, 1), scale=0.125)[:, 0]
    got = one_query_attention(q, k, v, 0.125)
    assert got.dtype == dtype and got.shape == (heads, 48)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol)
