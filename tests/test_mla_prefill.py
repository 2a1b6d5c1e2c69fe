"""MLA extend in the non-absorbed (MHA) form against the absorbed form and plain references.

Fresh random inputs (pool, weights, queries), cached prefixes of 0 and > 0 tokens, several sequences,
prefill chunks mixed with decodes. ||out - ref|| / ||ref|| <= 1e-4 in float32 on CPU (Triton through
its interpreter, tiny shapes), <= 1e-2 in bfloat16 on CUDA (DeepSeek-V3 head widths). The whole
tiny DeepSeek-V3 with the MHA form forced matches transformers within 1e-3 (float32).
"""

from __future__ import annotations


import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.attention.backend import create_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode
from ftransformers.cache.kv_pool import MLAKVPool, MLAKVSpec
from ftransformers.kernels.triton_mla_prefill import mla_prefill_fwd, mla_prefill_ref, mla_prefill_sdpa

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-4
# (H, L, R, N, V): DeepSeek-V3 widths on CUDA (fewer heads), tiny on CPU
SHAPE = (32, 512, 64, 128, 128) if CUDA else (4, 32, 16, 16, 16)
# (prefix_lens, extend_lens): a fresh prompt; chunks with and without prefix mixed with decodes
CASES = [([0], [19]), ([0, 5, 12, 0, 30], [6, 1, 9, 1, 17]), ([7, 0, 3], [1, 8, 1])]
if CUDA:
    CASES += [([0, 700, 1], [1025, 300, 1]), ([2048], [513])]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten rows?)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEV, DTYPE)


def make_batch(
    prefix: list[int], ext: list[int], pool: MLAKVPool, backend: object, gen: torch.Generator
) -> ForwardBatch:
    """Random slots per sequence (rows of req_to_token in reverse order), EXTEND mode."""
    lens = [p + e for p, e in zip(prefix, ext)]
    perm = torch.randperm(pool.size, generator=gen)[: sum(lens)] + 1
    r2t = torch.zeros(len(lens) + 1, max(lens) + 2, dtype=torch.int64)
    rows = list(range(len(lens), 0, -1))
    off = 0
    for row, n in zip(rows, lens):
        r2t[row, :n] = perm[off : off + n]
        off += n
    loc = torch.cat([r2t[r, p : p + e] for r, p, e in zip(rows, prefix, ext)])
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros_like(loc).to(DEV),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]).to(DEV), out_cache_loc=loc.to(DEV),
        req_pool_indices=t(rows), seq_lens=t(lens), prefix_lens=t(prefix), extend_lens=t(ext), seq_lens_cpu=lens,
        prefix_lens_cpu=prefix, extend_lens_cpu=ext, logits_indices=t([0]), req_to_token=r2t.to(DEV), kv_pool=pool,
        attn_backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_match_reference(case: int) -> None:
    prefix, ext = CASES[case]
    H, _, R, N, V = SHAPE
    gen = torch.Generator().manual_seed(case)
    T, P = sum(ext), sum(prefix)
    q_nope, q_rope = randn(T, H, N, gen=gen), randn(T, H, R, gen=gen)
    kv, k_rope = randn(P + T, H, N + V, gen=gen), randn(P + T, R, gen=gen)
    scale = (N + R) ** -0.5
    ref = mla_prefill_ref(q_nope, q_rope, kv, k_rope, prefix, ext, scale)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)
    ext_t, pre_t = t(ext), t(prefix)
    out = torch.full((T, H, V), float("nan"), dtype=DTYPE, device=DEV)
    mla_prefill_fwd(q_nope, q_rope, kv, k_rope, out, torch.arange(max(P, 1), device=DEV), torch.cumsum(pre_t, 0) - pre_t,
                    pre_t, ext_t, torch.cumsum(ext_t, 0) - ext_t, max(ext), scale)  # fmt: skip
    assert rel_err(out, ref) <= TOL
    out = torch.full((T, H, V), float("nan"), dtype=DTYPE, device=DEV)
    mla_prefill_sdpa(q_nope, q_rope, kv, k_rope, out, prefix, ext, scale)
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("backend_name", ["torch_native", "triton-triton", "triton-sdpa"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_mha_form_matches_absorbed_form(backend_name: str, case: int) -> None:
    """The two forms through one backend on identical pools: same stored rows, same [T, H, V] output
    (absorbed: W_UK into latent space, forward_mla, W_UV back; MHA: rows, kv_b_proj, forward_mla_mha)."""
    prefix, ext = CASES[case]
    H, L, R, N, V = SHAPE
    gen = torch.Generator().manual_seed(100 + case)
    T = sum(ext)
    w = randn(H * (N + V), L, gen=gen, scale=L**-0.5)  # kv_b_proj.weight
    w_uk, w_uv = w.view(H, N + V, L)[:, :N], w.view(H, N + V, L)[:, N:]
    q_nope, q_rope, latent = randn(T, H, N, gen=gen), randn(T, H, R, gen=gen), randn(T, L + R, gen=gen)
    scale = (N + R) ** -0.5
    outs, pools = [], []
    for form in ("absorbed", "mha"):
        pool = MLAKVPool(MLAKVSpec(2, L, R), sum(prefix) + T + 16, DTYPE, DEV)
        pool.latent_buffers[1].copy_(
            torch.randn(pool.latent_buffers[1].shape, generator=torch.Generator().manual_seed(7))
        )
        be = create_attention_backend(backend_name.split("-")[0])
        if backend_name.startswith("triton-"):
            be.mla_prefill_kernel = backend_name.split("-")[1]  # type: ignore[attr-defined]
        fb = make_batch(prefix, ext, pool, be, torch.Generator().manual_seed(99))
        be.init_forward_metadata(fb)
        if form == "absorbed":
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
            o_lat = be.forward_mla(q_lat, q_rope, latent, 1, scale, fb)  # [T, H, L]
            out = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, V]
        else:
            rows = be.mla_extend_rows(latent, 1, fb)  # [P+T, L+R]
            assert rows.shape[0] == sum(prefix) + T
            kv = (rows[:, :L] @ w.t()).view(-1, H, N + V)
            out = be.forward_mla_mha(q_nope, q_rope, kv, rows[:, L:], scale, fb)  # [T, H, V]
        outs.append(out)
        pools.append(pool.latent_buffers[1])
    assert torch.equal(pools[0], pools[1])
    assert rel_err(outs[1], outs[0]) <= TOL, rel_err(outs[1], outs[0])


@pytest.mark.parametrize("form", ["mha", "absorbed"])
def test_model_parity_with_forced_form(
    form: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole tiny DeepSeek-V3, float32, chunked prefill mixing chunks and decodes: greedy tokens equal
    transformers' and logits within 1e-3 with every EXTEND step forced into one MLA form."""
    from ftransformers.models.deepseek_v3 import DeepseekV3Attention
    from tests.model_harness import hf_greedy_reference, make_tiny_checkpoint, random_prompts, run_engineless_greedy

    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp(f"ds_{form}"), seed=3)
    prompts = random_prompts(3, 384, [5, 23, 40], seed=5)
    ref_tokens, ref_logits = hf_greedy_reference(path, prompts, 8)
    monkeypatch.setattr(DeepseekV3Attention, "prefill_form", form)
    tokens, logits = run_engineless_greedy(path, prompts, 8, chunk_size=16, device=DEV.type,
                                           attention_backend="triton" if CUDA else "torch_native")  # fmt: skip
    for i in range(len(prompts)):
        assert tokens[i] == ref_tokens[i]
        assert (logits[i] - ref_logits[i].to(logits[i].device)).abs().max().item() <= 1e-3
