"""kernels/triton_mla_rope.py against DeepseekRotaryEmbedding + torch.cat (the PyTorch path it replaces).

CPU: TRITON_INTERPRET=1 (conftest). Inputs are views as the model passes them (q_pe inside q's rows, k_pe inside
the kv_a projection's rows), YaRN with DeepSeek-V3's parameters and positions up to 160K, both pair layouts.
float32 within 1e-5, bf16 within 1e-2, and bf16 bit for bit at DeepSeek-V3's shapes (the kernel rounds every
intermediate as PyTorch's bf16 ops do). The c_kv half of the latent is a copy, so exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ftransformers.kernels.triton_mla_rope import mla_rope
from ftransformers.layers import rotary_yarn
from ftransformers.layers.rotary_yarn import DeepseekRotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("t,h,r,lat", [(1, 16, 64, 512), (3, 5, 8, 40), (2, 130, 64, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("yarn", [True, False])
def test_mla_rope_matches_the_module(t: int, h: int, r: int, lat: int, dtype: torch.dtype, interleaved: bool,
                                     yarn: bool) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(t * 1000 + h + r)
    params = YARN if yarn else {"rope_type": "default", "rope_theta": 10000.0}
    rope = DeepseekRotaryEmbedding(r, params, 163840, interleaved=interleaved).to(DEV)
    nope = 24
    q = torch.randn(t, h, nope + r, generator=gen).to(DEV, dtype)  # q_pe: the last R of each head's row
    kv_a = torch.randn(t, lat + r, generator=gen).to(DEV, dtype)  # c_kv | k_pe, as the projection splits it
    c_kv = torch.randn(t, lat, generator=gen).to(DEV, dtype)  # the normalised c_kv (a fresh tensor)
    q_pe, k_pe = q[..., nope:], kv_a[:, lat:]
    positions = torch.randint(0, 163840, (t,), generator=gen).to(DEV)
    ref_q, ref_k = rope(positions, q_pe, k_pe)
    q_out, latent = mla_rope(positions, rope.inv_freq.float(), rope.attention_factor, q_pe, c_kv, k_pe, interleaved)
    assert q_out.shape == (t, h, r) and latent.shape == (t, lat + r) and latent.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(q_out, ref_q) <= tol
    assert rel_err(latent[:, lat:], ref_k) <= tol
    assert torch.equal(latent[:, :lat], c_kv)


@pytest.mark.parametrize("h,interleaved", [(128, True), (16, True), (16, False)])
def test_mla_rope_is_bitwise_the_module_in_bf16(h: int, interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(h)
    rope = DeepseekRotaryEmbedding(64, YARN, 163840, interleaved=interleaved).to(DEV)
    t, lat = 37, 512
    q_pe = torch.randn(t, h, 192, generator=gen).to(DEV, torch.bfloat16)[..., 128:]
    kv_a = torch.randn(t, lat + 64, generator=gen).to(DEV, torch.bfloat16)
    c_kv, k_pe = torch.randn(t, lat, generator=gen).to(DEV, torch.bfloat16), kv_a[:, lat:]
    positions = torch.randint(0, 163840, (t,), generator=gen).to(DEV)
    ref_q, ref_k = rope(positions, q_pe, k_pe)
    q_out, latent = mla_rope(positions, rope.inv_freq.float(), rope.attention_factor, q_pe, c_kv, k_pe, interleaved)
    assert torch.equal(q_out, ref_q) and torch.equal(latent, torch.cat([c_kv, ref_k], -1))


def test_mla_rope_layer_path_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    # rope_latent: the kernel (CUDA, or the interpreter here), or with FUSED_MLA_ROPE off the module and a concatenation
    monkeypatch.setattr(rotary_yarn, "MLA_ROPE_ON_CPU", True)
    gen = torch.Generator().manual_seed(1)
    rope = DeepseekRotaryEmbedding(8, YARN, 163840).to(DEV)
    q_pe, c_kv, k_pe = (torch.randn(*s, generator=gen).to(DEV) for s in [(2, 3, 8), (2, 16), (2, 8)])
    positions = torch.tensor([5, 70000], device=DEV)
    q_out, latent = rope.rope_latent(positions, q_pe, c_kv, k_pe)
    ref_q, ref_k = rope(positions, q_pe, k_pe)
    assert rel_err(q_out, ref_q) <= 1e-5 and rel_err(latent, torch.cat([c_kv, ref_k], -1)) <= 1e-5
    monkeypatch.setattr(rotary_yarn, "FUSED_MLA_ROPE", False)
    q_off, latent_off = rope.rope_latent(positions, q_pe, c_kv, k_pe)
    assert torch.equal(q_off, ref_q) and torch.equal(latent_off, torch.cat([c_kv, ref_k], -1))
    with pytest.raises(ValueError, match="mla_rope"):
        mla_rope(positions, rope.inv_freq.float(), 1.0, torch.randn(2, 3, 7, device=DEV), c_kv, k_pe[:, :7], True)
    with pytest.raises(ValueError, match="mla_rope"):
        mla_rope(positions, rope.inv_freq.double(), 1.0, q_pe, c_kv, k_pe, True)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_rope_latent_stores_into_the_pool(
    monkeypatch: pytest.MonkeyPatch, fused: bool, pool_dtype: torch.dtype
) -> None:
    """With a pool and loc, rope_latent (the kernel in the same launch, or the module path) leaves pool[loc] exactly
    as MLAKVPool.set_latent would (latent.to(pool dtype)), touches no other row, and returns the same q and latent."""
    monkeypatch.setattr(rotary_yarn, "MLA_ROPE_ON_CPU", True)
    monkeypatch.setattr(rotary_yarn, "FUSED_MLA_ROPE", fused)
    gen = torch.Generator().manual_seed(7 + fused)
    rope = DeepseekRotaryEmbedding(8, YARN, 163840, interleaved=True).to(DEV)
    t, lat = 3, 40
    q_pe = torch.randn(t, 5, 24, generator=gen).to(DEV, torch.bfloat16)[..., 16:]
    c_kv = torch.randn(t, lat, generator=gen).to(DEV, torch.bfloat16)
    k_pe = torch.randn(t, lat + 8, generator=gen).to(DEV, torch.bfloat16)[:, lat:]
    positions = torch.tensor([3, 900, 70000], device=DEV)
    pool = torch.randn(12, lat + 8, generator=gen).to(DEV, pool_dtype)
    before = pool.clone()
    loc = torch.tensor([7, 2, 10], device=DEV)
    q_ref, latent_ref = rope.rope_latent(positions, q_pe, c_kv, k_pe)
    q_out, latent = rope.rope_latent(positions, q_pe, c_kv, k_pe, pool, loc)
    assert torch.equal(q_out, q_ref) and torch.equal(latent, latent_ref)
    expect = before.clone()
    expect[loc] = latent_ref.to(pool_dtype)
    assert torch.equal(pool, expect)
    if fused:
        with pytest.raises(ValueError, match="pool"):
            mla_rope(positions, rope.inv_freq.float(), 1.0, q_pe, c_kv, k_pe, True, pool, None)
