"""Generic layers against plain-PyTorch / transformers references on fresh random inputs."""

from __future__ import annotations

from collections.abc import Iterator
import random

import pytest
import torch
import torch.nn.functional as F

from ftransformers.attention.backend import create_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode, forward_context
from ftransformers.cache.kv_pool import MHAKVSpec, make_kv_pool
from ftransformers.layers.activation import SiluAndMul
from ftransformers.layers.attention import Attention
from ftransformers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from ftransformers.layers.moe import FusedMoE, select_experts_softmax
from ftransformers.layers.norm import RMSNorm
from ftransformers.layers.rotary import get_rope, rope_parameters_of, share_rotary_caches
from ftransformers.layers.weight_utils import WeightShapeError
from tests.model_harness import single_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def test_rmsnorm_matches_reference_with_and_without_residual() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, res, w = torch.randn(7, 48), torch.randn(7, 48), torch.randn(48)
    ours, ref = RMSNorm(48, eps=1e-5), LlamaRMSNorm(48, eps=1e-5)
    ours.weight.data.copy_(w)
    ref.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), ref(x))
    out, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, ref(x + res))
    xb = x.bfloat16()
    assert ours.bfloat16()(xb).dtype == torch.bfloat16


def test_silu_and_mul() -> None:
    x = torch.randn(5, 3, 2 * 16)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[..., :16]) * x[..., 16:])


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_matches_transformers(case: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    heads, kv_heads, head_dim = 4, 2, 32
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        max_position_embeddings=512,
        rope_theta=50000.0,
        rope_scaling=ROPE_CASES[case],
    )
    rope = get_rope(head_dim, head_dim, 512, rope_parameters_of(config))
    positions = torch.randint(0, 512, (9,))
    q, k = torch.randn(9, heads * head_dim), torch.randn(9, kv_heads, head_dim)
    q_out, k_out = rope(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(1, 9, heads, head_dim).transpose(1, 2), k.view(1, 9, kv_heads, head_dim).transpose(1, 2), cos, sin
    )
    torch.testing.assert_close(q_out.view(9, heads, head_dim), q_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_rope_interleaved_and_partial() -> None:
    head_dim, rot = 16, 8
    rope = get_rope(head_dim, rot, 64, {"rope_theta": 100.0}, is_neox_style=False)
    pos = torch.randint(0, 64, (5,))
    q, k = torch.randn(5, 3, head_dim), torch.randn(5, 1, head_dim)
    q_out, _ = rope(pos, q, k)
    inv = 1.0 / (100.0 ** (torch.arange(0, rot, 2).float() / rot))
    ang = pos.float()[:, None, None] * inv  # [T, 1, rot/2]
    x1, x2 = q[..., 0:rot:2], q[..., 1:rot:2]
    ref = torch.stack((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), -1).flatten(-2)
    torch.testing.assert_close(q_out[..., :rot], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q_out[..., rot:], q[..., rot:])


def test_layers_share_one_rotary_cache_where_equal() -> None:
    # a model's layers keep one cos|sin cache per distinct rope: equal ones are shared, any difference is kept
    class Attn(torch.nn.Module):
        def __init__(self, rope: torch.nn.Module | None) -> None:
            super().__init__()
            self.rotary_emb = rope

    params = {"rope_theta": 100.0}
    same = [Attn(get_rope(16, 16, 64, params)) for _ in range(3)]
    others = [
        Attn(get_rope(16, 16, 64, {"rope_theta": 200.0})),  # other frequencies
        Attn(get_rope(16, 16, 64, params, is_neox_style=False)),  # other pair layout
        Attn(get_rope(16, 16, 32, params)),  # a shorter cache
        Attn(get_rope(16, 16, 64, {"rope_type": "linear", "factor": 2.0, **params})),  # another class
        Attn(None),
    ]
    before = [a.rotary_emb for a in same + others]
    freed = share_rotary_caches([*same, *others, None])
    assert same[0].rotary_emb is before[0] and same[1].rotary_emb is before[0] and same[2].rotary_emb is before[0]
    assert all(a.rotary_emb is b for a, b in zip(others, before[3:]))
    assert freed == 2 * 64 * 16 * 4
    q, k, pos = torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randint(0, 64, (5,))
    assert torch.equal(same[2].rotary_emb(pos, q, k)[0], before[2](pos, q, k)[0])
    with torch.device("meta"):  # a model skeleton (ftransformers quantize builds one): no values to compare
        meta = [Attn(get_rope(16, 16, 64, params)) for _ in range(2)]
    assert share_rotary_caches(meta) == 0 and meta[0].rotary_emb is not meta[1].rotary_emb


def test_rope_unknown_type_raises() -> None:
    with pytest.raises(ValueError, match="unsupported rope type 'longrope'"):
        get_rope(16, 16, 64, {"rope_type": "longrope"})


def test_fused_linears_load_shards_and_check_shapes() -> None:
    qkv = QKVParallelLinear(32, 8, 4, 2, bias=True)
    q, k, v = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, w, shard)
    torch.testing.assert_close(qkv.weight.data, torch.cat([q, k, v]))
    with pytest.raises(WeightShapeError, match=r"expected \(16, 32\), got \(32, 32\)"):
        qkv.weight.weight_loader(qkv.weight, q, "k")
    merged = MergedColumnParallelLinear(32, [24, 24])
    g, u = torch.randn(24, 32), torch.randn(24, 32)
    merged.weight.weight_loader(merged.weight, u, 1)
    merged.weight.weight_loader(merged.weight, g, 0)
    x = torch.randn(3, 32)
    torch.testing.assert_close(merged(x), torch.cat([x @ g.t(), x @ u.t()], -1))


def test_moe_topk_and_experts_match_dense_reference() -> None:
    T, E, K, D, I = 11, 6, 2, 16, 12
    moe = FusedMoE(E, D, I, backend="torch_native")
    gates, ups, downs = torch.randn(E, I, D), torch.randn(E, I, D), torch.randn(E, D, I)
    for e in range(E):
        moe.weight_loader(moe.w13_weight, gates[e], e, "w1")
        moe.weight_loader(moe.w13_weight, ups[e], e, "w3")
        moe.weight_loader(moe.w2_weight, downs[e], e, "w2")
    logits, x = torch.randn(T, E), torch.randn(T, D)
    for renorm in (False, True):
        w, ids = select_experts_softmax(logits, K, renorm)
        probs = logits.softmax(-1)
        dense = torch.zeros(T, E).scatter(1, ids, probs.gather(1, ids))
        if renorm:
            dense = dense / dense.sum(-1, keepdim=True)
        assert w.dtype == torch.float32 and set(ids[0].tolist()) == set(probs[0].topk(K).indices.tolist())
        ref = sum(
            dense[:, e : e + 1] * ((F.silu(x @ gates[e].t()) * (x @ ups[e].t())) @ downs[e].t()) for e in range(E)
        )
        torch.testing.assert_close(moe(x, w, ids), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(WeightShapeError, match="expert 2 w2"):
        moe.weight_loader(moe.w2_weight, gates[2], 2, "w2")


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [L, H, D], k/v: [L, H_kv, D] full sequences -> causal attention output [L, H, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = q.shape[0]
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_torch_native_backend_mixed_batch_matches_full_attention() -> None:
    H, H_kv, D, layer = 4, 2, 8, 1
    rng = random.Random()
    seqs = [(0, 6), (5, 1), (9, 4), (0, 1), (13, 1)]  # (prefix_len, extend_len): chunks and decodes
    full = [(torch.randn(p + e, H, D), torch.randn(p + e, H_kv, D), torch.randn(p + e, H_kv, D)) for p, e in seqs]
    total = sum(p + e for p, e in seqs)
    pool = make_kv_pool(MHAKVSpec(2, H_kv, D, D), total + 3, torch.float32, "cpu")
    slots = list(range(1, total + 4))
    rng.shuffle(slots)
    req_to_token = torch.zeros(len(seqs) + 2, 32, dtype=torch.int64)
    rows = rng.sample(range(len(seqs) + 2), len(seqs))
    qs, ks, vs, locs = [], [], [], []
    for (p, e), (q, k, v), row in zip(seqs, full, rows):
        own = [slots.pop() for _ in range(p + e)]
        req_to_token[row, : p + e] = torch.tensor(own)
        pool.set_kv(layer, torch.tensor(own[:p], dtype=torch.int64), k[:p], v[:p])  # the cached prefix
        qs.append(q[p:])
        ks.append(k[p:])
        vs.append(v[p:])
        locs += own[p:]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    pre, ext = [p for p, _ in seqs], [e for _, e in seqs]
    lens = [p + e for p, e in seqs]
    fb = ForwardBatch(
        ForwardMode.EXTEND, t([0] * sum(ext)), t([0] * sum(ext)), t(locs), t(rows), t(lens), t(pre), t(ext),
        lens, pre, ext, t([]), req_to_token, pool, create_attention_backend("torch_native"),
    )  # fmt: skip
    attn = Attention(H, D, H_kv, D**-0.5, layer)
    q_all, k_all, v_all = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    with forward_context(fb):
        out = attn(q_all.reshape(-1, H * D), k_all.reshape(-1, H_kv * D), v_all.reshape(-1, H_kv * D))
    refs = [_ref_attention(q, k, v, D**-0.5)[p:] for (p, _), (q, k, v) in zip(seqs, full)]
    torch.testing.assert_close(out.view(-1, H, D), torch.cat(refs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.get_kv(layer)[0][t(locs)], k_all)
