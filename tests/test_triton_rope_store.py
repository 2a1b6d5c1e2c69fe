"""Fused q/k RMSNorm + neox rotary + K/V store (kernels/triton_rope_store.py) vs the eager layers.

Reference: layers/norm.RMSNorm per head, layers/rotary.get_rope, index assignment into a pool; then the
triton backend's fused method vs norm + rope + its forward_mha. CPU: TRITON_INTERPRET=1, tiny shapes.
Fresh random inputs; ||out - ref|| / ||ref||: float32 <= 1e-5, bfloat16 <= 1e-2. Pool rows not in
out_cache_loc must stay bit-identical.
"""

from __future__ import annotations


import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.attention.backend import create_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode
from ftransformers.cache.kv_pool import MHAKVPool, MHAKVSpec
from ftransformers.kernels.cluster import cluster_supported
from ftransformers.kernels.triton_rope_store import rope_store, rope_store_ref
from ftransformers.layers.attention import fusable_rope
from ftransformers.layers.norm import RMSNorm
from ftransformers.layers.rotary import get_rope

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _interpreter_rounds_bf16_to_nearest():
    """Triton 3.6's interpreter casts float32 -> bfloat16 by truncation; the GPU rounds to nearest
    even. With several roundings per element (norm, weight, rope) truncation biases bf16 results by
    up to ~3 ulps toward zero, so on CPU the casts are made to round as the GPU does."""
    if CUDA:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            a = np.asarray(src.data, dtype=np.float32)
            b = torch.from_numpy(a.reshape(-1).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(b.reshape(a.shape), dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    yield
    interpreter.InterpreterBuilder.cast_impl = original


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _inputs(T: int, H: int, H_kv: int, D: int, dtype: torch.dtype, gen: torch.Generator):
    rnd = lambda *s: (torch.randn(*s, generator=gen) * 2 + 0.5).to(DEV, dtype)
    qkv = rnd(T, (H + 2 * H_kv) * D)  # q/k/v are strided views, as from the qkv projection
    q, k, v = qkv.split([H * D, H_kv * D, H_kv * D], dim=-1)
    return q.reshape(T, H, D), k.reshape(T, H_kv, D), v.reshape(T, H_kv, D)


SHAPES = [(1, 4, 2, 16), (5, 8, 2, 32), (3, 2, 2, 64)] if not CUDA else [(1, 32, 8, 128), (64, 32, 4, 128), (7, 16, 16, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rope_kind", list(ROPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_store_matches_layers(dtype: torch.dtype, norm: bool, rope_kind: str, shape: tuple[int, ...]) -> None:
    T, H, H_kv, D = shape
    gen = torch.Generator().manual_seed(T * 1000 + H * 10 + D + 7 * norm + 13 * len(rope_kind))
    max_pos, N = 4096, 4 * T + 8
    rope = get_rope(D, D, max_pos, ROPES[rope_kind]).to(DEV)
    assert fusable_rope(rope, D)
    q, k, v = _inputs(T, H, H_kv, D, dtype, gen)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEV)
    loc = (torch.randperm(N, generator=gen)[:T] + 1).to(DEV)
    qn, kn = RMSNorm(D, eps=1e-6).to(DEV, dtype), RMSNorm(D, eps=1e-5).to(DEV, dtype)
    for m in (qn, kn):
        m.weight.data = (torch.rand(D, generator=gen) + 0.5).to(DEV, dtype)
    # reference: the eager layers
    qr, kr = (qn(q), kn(k)) if norm else (q, k)
    qr, kr = rope(positions, qr, kr)
    pool_k = torch.randn(N + 1, H_kv, D, generator=gen).to(DEV, dtype)
    pool_v = torch.randn(N + 1, H_kv, D, generator=gen).to(DEV, dtype)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    ref_k[loc], ref_v[loc] = kr, v
    args = (qn.weight, kn.weight, 1e-6, 1e-5) if norm else (None, None)
    q_out, k_out = rope_store(q, k, v, positions, rope.cos_sin_cache, pool_k, pool_v, loc, *args, write_k=True)
    tol = TOL[dtype]
    assert rel_err(q_out, qr) <= tol
    assert k_out is not None and rel_err(k_out, kr) <= tol
    assert rel_err(pool_k[loc], kr) <= tol
    assert torch.equal(pool_v[loc], v)
    untouched = torch.ones(N + 1, dtype=torch.bool, device=DEV)
    untouched[loc] = False
    assert torch.equal(pool_k[untouched], ref_k[untouched]) and torch.equal(pool_v[untouched], ref_v[untouched])
    # the module's own plain-PyTorch reference agrees too
    pk2, pv2 = pool_k.clone(), pool_v.clone()
    q2, _ = rope_store_ref(q, k, v, positions, rope.cos_sin_cache, pk2, pv2, loc, *args)
    assert rel_err(q_out, q2) <= tol and rel_err(pk2, pool_k) <= tol


def test_pool_dtype_cast_and_no_k_out() -> None:
    gen = torch.Generator().manual_seed(3)
    T, H, H_kv, D = 3, 4, 2, 16
    rope = get_rope(D, D, 64, None).to(DEV)
    q, k, v = _inputs(T, H, H_kv, D, torch.float32, gen)
    positions, loc = torch.tensor([0, 7, 63], device=DEV), torch.tensor([2, 5, 1], device=DEV)
    pool_k, pool_v = torch.zeros(8, H_kv, D, dtype=torch.bfloat16, device=DEV), torch.zeros(8, H_kv, D, dtype=torch.bfloat16, device=DEV)
    _, k_out = rope_store(q, k, v, positions, rope.cos_sin_cache, pool_k, pool_v, loc)
    assert k_out is None
    _, kr = rope(positions, q, k)
    assert torch.equal(pool_k[loc], kr.to(torch.bfloat16)) or rel_err(pool_k[loc], kr.to(torch.bfloat16)) <= 1e-2
    assert torch.equal(pool_v[loc], v.to(torch.bfloat16))
    assert not pool_k[[0, 3, 4, 6, 7]].any()


def test_fusable_rope() -> None:
    assert not fusable_rope(get_rope(16, 8, 64, None), 16)  # partial rotary
    assert not fusable_rope(get_rope(16, 16, 64, None, is_neox_style=False), 16)
    assert fusable_rope(get_rope(16, 16, 64, {"rope_type": "linear", "factor": 2.0}), 16)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("norm", [False, True])
def test_backend_fused_matches_unfused(mode: ForwardMode, norm: bool) -> None:
    """TritonAttentionBackend.forward_mha_fused_rope == norm + rope + forward_mha (output and pool)."""
    gen = torch.Generator().manual_seed(21 + norm)
    dtype = torch.bfloat16 if CUDA else torch.float32
    prefix, ext = ([3, 0, 9], [1, 1, 1]) if mode == ForwardMode.DECODE else ([0, 4], [5, 3])
    H, H_kv, D, N = 4, 2, 32, 64
    T, lens = sum(ext), [p + e for p, e in zip(prefix, ext)]
    r2t = torch.zeros(len(lens) + 1, max(lens) + 2, dtype=torch.int64)
    slots = torch.randperm(N, generator=gen)[: sum(lens)] + 1
    start = 0
    for i, n in enumerate(lens):
        r2t[i + 1, :n], start = slots[start : start + n], start + n
    rows = torch.arange(1, len(lens) + 1)
    loc = torch.cat([r2t[r, p : p + e] for r, p, e in zip(rows.tolist(), prefix, ext)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)])
    rope = get_rope(D, D, 128, None).to(DEV)
    qn, kn = RMSNorm(D, eps=1e-6).to(DEV, dtype), RMSNorm(D, eps=1e-6).to(DEV, dtype)
    q, k, v = _inputs(T, H, H_kv, D, dtype, gen)
    outs, pools = {}, {}
    for fused in (False, True):
        pool = MHAKVPool(MHAKVSpec(1, H_kv, D, D), N, dtype, DEV)
        for buf in (pool.k_buffers[0], pool.v_buffers[0]):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(buf.numel())))
        be = create_attention_backend("triton")
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)
        fb = ForwardBatch(
            mode=mode, input_ids=torch.zeros_like(loc).to(DEV), positions=positions.to(DEV), out_cache_loc=loc.to(DEV),
            req_pool_indices=rows.to(DEV), seq_lens=t(lens), prefix_lens=t(prefix), extend_lens=t(ext),
            seq_lens_cpu=lens, prefix_lens_cpu=prefix, extend_lens_cpu=ext, logits_indices=t([0]),
            req_to_token=r2t.to(DEV), kv_pool=pool, attn_backend=be,  # type: ignore[arg-type]
        )  # fmt: skip
        be.init_forward_metadata(fb)
        if fused:
            args = (qn.weight, kn.weight, 1e-6, 1e-6) if norm else ()
            outs[fused] = be.forward_mha_fused_rope(q, k, v, fb.positions, rope.cos_sin_cache, 0, D**-0.5, fb, *args)
        else:
            qq, kk = (qn(q), kn(k)) if norm else (q, k)
            qq, kk = rope(fb.positions, qq, kk)
            outs[fused] = be.forward_mha(qq, kk, v, 0, D**-0.5, fb)
        pools[fused] = pool
    tol = TOL[dtype]
    assert rel_err(outs[True], outs[False]) <= tol
    assert rel_err(pools[True].k_buffers[0], pools[False].k_buffers[0]) <= tol
    assert torch.equal(pools[True].v_buffers[0], pools[False].v_buffers[0])


DECODE_FUSED = [  # (lens, H, H_kv, D, splits); 0 = a padded CUDA-graph row
    ([1, 37, 0, 16], 4, 2, 32, 4),
    ([3, 50], 64, 2, 16, 2),  # group 32: two head blocks per KV head (block 0 stores)
    ([70, 49], 4, 2, 32, 4),  # splits of two tiles (70); a split holding the new token alone (49 = 3 x 16 + 1)
] if not CUDA else [([1, 17, 300, 4097, 0, 64], 32, 4, 128, 16), ([9, 1000], 64, 8, 64, 8), ([513], 16, 16, 128, 1)]


@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.float32])  # the interpreter's bf16 dot is wrong
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("case", range(len(DECODE_FUSED)))
@pytest.mark.parametrize("new_tile", [False, True])
def test_decode_attention_fused_rope(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, norm: bool, case: int, new_tile: bool
) -> None:
    """decode_attention_fwd(rope=...) == rope_store then decode_attention_fwd: output, pool, and the
    new token's K/V slot; a padded row (seq_len 0) gives zeros and stores nothing. The fused kernel with its
    first K/V tile read before the PDL wait (the default) and after it; the new token's k and v as vectors and as
    tiles of identical rows (NEW_TOKEN_TILE), masked in every program and behind a branch (NEW_TOKEN_BRANCH, with the
    second tile's L2 hint, PREFETCH_SECOND_TILE, on a GPU)."""
    from ftransformers.kernels import triton_decode_attention as tda
    from ftransformers.kernels.triton_decode_attention import DecodeRope, decode_attention_fwd, decode_scratch

    monkeypatch.setattr(tda, "NEW_TOKEN_TILE", new_tile)

    lens, H, H_kv, D, splits = DECODE_FUSED[case]
    B, N = len(lens), sum(lens) + 8
    gen = torch.Generator().manual_seed(100 * case + 10 * norm + (dtype == torch.float32))
    rope = get_rope(D, D, 8192, ROPES["default"]).to(DEV)
    q, k, v = _inputs(B, H, H_kv, D, dtype, gen)
    r2t = torch.zeros(B + 1, max(lens) + 2, dtype=torch.int64)
    slots = torch.randperm(N, generator=gen)[: sum(lens)] + 1
    start = 0
    for i, n in enumerate(lens):
        r2t[i + 1, :n], start = slots[start : start + n], start + n
    rows = torch.arange(1, B + 1)
    loc = torch.tensor([int(r2t[i + 1, n - 1]) if n else 0 for i, n in enumerate(lens)])
    positions = torch.tensor([max(n - 1, 0) for n in lens])
    qw = (torch.rand(D, generator=gen) + 0.5).to(DEV, dtype) if norm else None
    kw = (torch.rand(D, generator=gen) + 0.5).to(DEV, dtype) if norm else None
    pool_k = torch.randn(N + 1, H_kv, D, generator=gen).to(DEV, dtype)
    pool_v = torch.randn(N + 1, H_kv, D, generator=gen).to(DEV, dtype)
    r2t, rows, loc, positions = r2t.to(DEV), rows.to(DEV), loc.to(DEV), positions.to(DEV)
    seq_lens = torch.tensor(lens, device=DEV)
    block_n = 16 if not CUDA else 64
    outs, pools = [], []
    # (fused, preload, cluster, branch): on Hopper also the splits merged in thread-block clusters (kernels/cluster.py)
    variants = [(False, False, 1, False), (True, True, 1, False), (True, False, 1, False), (True, True, 1, True)]
    if cluster_supported(DEV):
        variants += [(True, True, 2, False), (True, True, 8, False), (True, False, 16, False), (True, True, 8, True)]
    for fused, preload, cluster, branch in variants:
        monkeypatch.setattr(tda, "NEW_TOKEN_BRANCH", branch)
        monkeypatch.setattr(tda, "PREFETCH_SECOND_TILE", branch)
        pk, pv = pool_k.clone(), pool_v.clone()
        out = torch.full((B, H, D), float("nan"), dtype=dtype, device=DEV)
        mid_o, mid_lse = decode_scratch(B, H, D, splits, DEV)
        if fused:
            fr = DecodeRope(k, v, positions, rope.cos_sin_cache, loc, qw, kw, 1e-6, 1e-5)
            n = cluster if cluster > 1 else splits
            decode_attention_fwd(q, pk, pv, out, r2t, rows, seq_lens, mid_o, mid_lse, n, D**-0.5,
                                 block_n=block_n, rope=fr, preload=preload, cluster=cluster)  # fmt: skip
        else:
            qr, _ = rope_store(q, k, v, positions, rope.cos_sin_cache, pk, pv, loc, qw, kw, 1e-6, 1e-5)
            decode_attention_fwd(qr, pk, pv, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, D**-0.5,
                                 block_n=block_n)  # fmt: skip
        outs.append(out)
        pools.append((pk, pv))
    tol = TOL[dtype]
    live = torch.tensor(lens, device=DEV) > 0
    written = loc[live]
    keep = torch.ones(N + 1, dtype=torch.bool, device=DEV)
    keep[written] = False
    keep[0] = False  # the padded row's slot: rope_store writes it, the fused kernel does not
    for i in range(1, len(variants)):
        assert rel_err(outs[i][live], outs[0][live]) <= tol, variants[i]
        assert not outs[i][~live].any()
        assert rel_err(pools[i][0][written], pools[0][0][written]) <= tol
        assert torch.equal(pools[i][1][written], pools[0][1][written])
        assert torch.equal(pools[i][0][keep], pool_k[keep]) and torch.equal(pools[i][1][keep], pool_v[keep])
