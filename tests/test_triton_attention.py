"""Triton attention kernels and backend against plain-PyTorch references and the torch_native backend.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set before any triton code is imported), tiny shapes,
float32. CUDA: real kernels, bigger shapes, bfloat16. Every check draws fresh random inputs, poisons
the output with NaN first, and measures ||out - ref|| / ||ref|| against a float32 reference:
float32 <= 1e-4 (IEEE dots), bfloat16 <= 1e-2.
"""

from __future__ import annotations


import math

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.attention.backend import create_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode
from ftransformers.cache.kv_pool import MHAKVPool, MHAKVSpec, MLAKVPool, MLAKVSpec
from ftransformers.kernels.cluster import cluster_supported
from ftransformers.kernels.triton_decode_attention import (
    decode_attention_fwd,
    decode_attention_ref,
    decode_scratch,
)
from ftransformers.kernels.triton_extend_attention import extend_attention_fwd, extend_attention_ref
from ftransformers.kernels.triton_mla_attention import (
    gluon_mla_unsupported,
    latent_views,
    mla_attention_ref,
    mla_decode_fwd,
    mla_decode_kernel,
    mla_extend_fwd,
)

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten rows?)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged(lens: list[int], pool_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """req_to_token [B+1, max_len] with each sequence's slots drawn at random from 1..pool_size, rows
    assigned in reverse (req_pool_indices [B] != arange)."""
    perm = torch.randperm(pool_size, generator=gen)[: sum(lens)] + 1
    r2t = torch.zeros(len(lens) + 1, max(lens) + 3, dtype=torch.int64)
    rows = torch.arange(len(lens), 0, -1)
    start = 0
    for row, n in zip(rows.tolist(), lens):
        r2t[row, :n] = perm[start : start + n]
        start += n
    return r2t.to(DEV), rows.to(DEV)


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEV, DTYPE)


DECODE_LENS = [1, 37, 5, 130] if not CUDA else [1, 17, 300, 4097, 1000, 64, 8191]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_gqa(group: int, head_dim: int) -> None:
    """Several split counts and minimum split lengths, so rows of one split (written by stage 1), of
    several and of a partial last split all occur; and the previous behaviour (direct=False: every
    row through the partials and stage 2)."""
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    h_kv = 2 if not CUDA else 8
    H, B, N = h_kv * group, len(DECODE_LENS), sum(DECODE_LENS) + 50
    r2t, rows = paged(DECODE_LENS, N, gen)
    seq_lens = torch.tensor(DECODE_LENS, device=DEV)
    q = randn(B, H, head_dim, gen=gen)
    k_buf, v_buf = randn(N + 1, h_kv, head_dim, gen=gen), randn(N + 1, h_kv, head_dim, gen=gen)
    scale = head_dim**-0.5
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rows, seq_lens, scale)
    block_n = 16 if not CUDA else 64
    # (splits, min_split_len, direct, cluster, block_n, stages); 3 and 6: split counts of no power of two, as the
    # backend's gqa_decode_launch takes them
    cases = [(1, 0, True, 1, block_n, 2), (4, 0, True, 1, block_n, 2), (4, 0, False, 1, block_n, 2)]
    cases += [(4, 32, True, 1, block_n, 2), (3, 0, True, 1, block_n, 2)]
    if CUDA:
        cases = [(s, m, True, 1, 64, 2) for s in (1, 3, 6, 8, 64) for m in (0, 512)] + [(64, 0, False, 1, 64, 2)]
        cases += [(s, 0, True, 1, n, 3) for s in (1, 3) for n in (32, 64)]  # the launch rule's other tiles
    if cluster_supported(DEV):  # the splits merged in thread-block clusters (kernels/cluster.py), 16 non-portable
        cases += [(c, m, True, c, block_n, 2) for c in (2, 4, 8, 16) for m in (0, 512)]
    for splits, min_split_len, direct, cluster, tile, stages in cases:
        mid_o, mid_lse = decode_scratch(B, H, head_dim, splits, DEV)
        out = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale, block_n=tile,
                             num_stages=stages, min_split_len=min_split_len, direct=direct,
                             cluster=cluster)  # fmt: skip
        assert rel_err(out, ref) <= TOL, (splits, min_split_len, direct, cluster, tile, stages, rel_err(out, ref))


@pytest.mark.parametrize("direct", [True, False])
def test_decode_padded_row_is_zero(direct: bool) -> None:
    """A CUDA-graph padding row (seq_len 0) gets zeros, not NaN; the real rows are unaffected."""
    gen = torch.Generator().manual_seed(5)
    lens = [9, 1]
    r2t, rows = paged(lens, 32, gen)
    q, k_buf, v_buf = randn(3, 4, 16, gen=gen), randn(33, 2, 16, gen=gen), randn(33, 2, 16, gen=gen)
    seq_lens = torch.tensor(lens + [0], device=DEV)
    rows = torch.cat([rows, rows[:1]])
    for splits, cluster in ((1, 1), (4, 1)) + (((4, 4),) if cluster_supported(DEV) else ()):
        mid_o, mid_lse = decode_scratch(3, 4, 16, splits, DEV)
        out = torch.full_like(q, float("nan"))
        decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, 0.25, block_n=16,
                             direct=direct, cluster=cluster)  # fmt: skip
        ref = decode_attention_ref(q[:2], k_buf, v_buf, r2t, rows[:2], seq_lens[:2], 0.25)
        assert rel_err(out[:2], ref) <= TOL and torch.equal(out[2], torch.zeros_like(out[2]))


EXTEND = (
    ([0, 9, 20, 4], [7, 1, 18, 33]) if not CUDA else ([0, 300, 0, 1000, 77], [513, 1, 129, 700, 64])
)  # (prefix_lens, extend_lens): fresh prompts, a decode, cached prefixes of several lengths


@pytest.mark.parametrize("group", [1, 4])
def test_extend(group: int) -> None:
    gen = torch.Generator().manual_seed(7 + group)
    prefix, ext = EXTEND
    h_kv, D = 2, 64 if not CUDA else 128
    H, T = h_kv * group, sum(ext)
    lens = [p + e for p, e in zip(prefix, ext)]
    N = sum(lens) + 10
    r2t, rows = paged(lens, N, gen)
    k_buf, v_buf = randn(N + 1, h_kv, D, gen=gen), randn(N + 1, h_kv, D, gen=gen)
    q, k_new, v_new = randn(T, H, D, gen=gen), randn(T, h_kv, D, gen=gen), randn(T, h_kv, D, gen=gen)
    loc = torch.cat([r2t[r, p : p + e] for r, p, e in zip(rows.tolist(), prefix, ext)])
    k_buf[loc], v_buf[loc] = k_new, v_new
    ext_t = torch.tensor(ext, device=DEV)
    start = torch.cumsum(ext_t, 0) - ext_t
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(
        q, k_new, v_new, out, k_buf, v_buf, r2t, rows, torch.tensor(prefix, device=DEV), ext_t, start, max(ext), D**-0.5
    )
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, rows, prefix, ext, D**-0.5)
    assert rel_err(out, ref) <= TOL


# (H, L, R); on CUDA 128 heads (DeepSeek-V3 on one GPU), 32 / 16 (it at tensor parallel 4 / 8), 8 (Kimi-K2 at
# tensor parallel 8) and 12 (a block padded to the few-heads kernel's wgmma N of 16)
_MLA_GPU_HEADS = (128, 64, 32, 16, 12, 8)
MLA_SHAPES = [(16, 64, 16), (32, 48, 16)] if not CUDA else [(h, 512, 64) for h in _MLA_GPU_HEADS]
# + a padded CUDA-graph row (0): zeros; lengths off the block size, a length-1 row, one over a split
MLA_LENS = [1, 37, 5, 130, 64, 0] if not CUDA else [1, 17, 300, 4097, 1000, 64, 8191, 0]


@pytest.mark.parametrize("shape", MLA_SHAPES)
def test_mla_decode(shape: tuple[int, int, int]) -> None:
    """The MLA decode kernel (one latent tile per head block, split-K) against mla_attention_ref, at
    split counts and minimum split lengths that give rows of one split (written by stage 1) and of
    several (merged by stage 2); the Gluon kernel where it applies; and the generic GQA kernel on the
    latent views (the old path)."""
    H, L, R = shape
    gen = torch.Generator().manual_seed(H + L)
    B, N = len(MLA_LENS), sum(MLA_LENS) + 20
    r2t, rows = paged([max(n, 1) for n in MLA_LENS], N, gen)
    seq_lens = torch.tensor(MLA_LENS, device=DEV)
    q_nope, q_rope, buf = randn(B, H, L, gen=gen), randn(B, H, R, gen=gen), randn(N + 1, L + R, gen=gen)
    scale = (L + R) ** -0.5
    real = B - 1
    ref = mla_attention_ref(q_nope[:real], q_rope[:real], buf, r2t, rows[:real], [n - 1 for n in MLA_LENS[:real]],
                            [1] * real, scale)  # fmt: skip
    cases = [(1, 0), (3, 0), (4, 32)] if not CUDA else [(1, 0), (2, 0), (33, 0), (64, 0), (128, 0), (16, 512)]
    # the Gluon kernels where they apply (Hopper; the few-heads one up to 32 heads), one of which "auto" picks;
    # the few-heads one also on blocks of 8 / 16 / 32 heads, two to four programs a tile (the last block padded
    # at 12 heads)
    gluon = [k for k, few in (("gluon", False), ("gluon_few", True)) if gluon_mla_unsupported(q_nope, buf, few) is None]
    kernels = [("triton", None), ("auto", None), *((k, None) for k in gluon)]
    if gluon_mla_unsupported(q_nope, buf, True, 8) is None:
        kernels += [("gluon_few", hb) for hb in (8, 16, 32) if hb < H <= 4 * hb]
    for kernel, block_h in kernels:
        for splits, min_split_len in cases:
            mid_o, mid_lse = decode_scratch(B, H, L, splits, DEV)
            out = torch.full_like(q_nope, float("nan"))
            mla_decode_fwd(q_nope, q_rope, buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale,
                           min_split_len=min_split_len, kernel=kernel, block_h=block_h)  # fmt: skip
            err = rel_err(out[:real], ref)
            assert err <= TOL, (kernel, block_h, splits, min_split_len, err)
            assert torch.equal(out[real], torch.zeros_like(out[real]))
    c_kv, k_pe = latent_views(buf, L)
    splits = 4 if not CUDA else 32
    mid_o, mid_lse = decode_scratch(B, H, L, splits, DEV)
    out = torch.full_like(q_nope, float("nan"))
    decode_attention_fwd(q_nope, c_kv, c_kv, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, scale,
                         q_pe=q_rope, kpe_buf=k_pe, block_n=16 if not CUDA else 32)  # fmt: skip
    assert rel_err(out[:real], ref) <= TOL


@pytest.mark.skipif(not CUDA, reason="the stamps' asm and the few-heads Gluon kernel need a GPU")
def test_mla_few_heads_stamps_keep_the_output_and_their_order() -> None:
    """The few-heads MLA decode with its diagnostic timestamps (kernels/stamps.py, benchmarks/diag_mla_phases.py):
    the output bit for bit as without them; every stage-1 program stamps its entry and its wait, those with a
    non-empty split all seven slots in order, the others none past their wait; every stage-2 program its three in
    order, its wait returning after stage 1's last store. A slot holds one of the program's threads' reads, so "in
    order" allows SKEW_NS / SKEW_CYCLES between warps."""
    from ftransformers.kernels import gluon_mla_few_heads as few
    from ftransformers.kernels.launch import cdiv
    from ftransformers.kernels.stamps import stamp_buffer
    from ftransformers.kernels.triton_decode_attention import COMBINE_STAMP_SLOTS, combine_launch

    skew_ns, skew_cycles = 200, 400
    H, L, R, splits = 16, 512, 64, 32
    lens = [3000, 5000]
    gen = torch.Generator().manual_seed(45)
    r2t, rows = paged(lens, sum(lens) + 8, gen)
    seq_lens = torch.tensor(lens, device=DEV)
    q_nope, q_rope, buf = randn(2, H, L, gen=gen), randn(2, H, R, gen=gen), randn(sum(lens) + 9, L + R, gen=gen)
    if gluon_mla_unsupported(q_nope, buf, True) is not None:
        pytest.skip("the few-heads Gluon kernel does not run here")
    mid_o, mid_lse = decode_scratch(2, H, L, splits, DEV)
    plain, stamped = torch.full_like(q_nope, float("nan")), torch.full_like(q_nope, float("nan"))
    s1 = stamp_buffer(2 * splits, few.STAMP_SLOTS, DEV)
    s2 = stamp_buffer(math.prod(combine_launch(2, H, L, splits)[0]), COMBINE_STAMP_SLOTS, DEV)
    args = (r2t, rows, seq_lens, mid_o, mid_lse, splits, 0.1, 0)
    few.mla_decode_few_heads(q_nope, q_rope, buf, plain, *args)
    few.mla_decode_few_heads(q_nope, q_rope, buf, stamped, *args, None, (s1, s2))
    torch.cuda.synchronize()
    assert torch.equal(plain, stamped)
    a, b = s1.cpu(), s2.cpu()
    split_lens = [max(cdiv(cdiv(n, splits), few.BLOCK_N) * few.BLOCK_N, few.BLOCK_N) for n in lens]
    assert (a[:, :2] >= 0).all() and (b >= 0).all()
    done = a[:, 6, 0] >= 0
    assert int(done.sum()) == sum(cdiv(n, sl) for n, sl in zip(lens, split_lens)) and (a[~done, 2:] == -1).all()
    for t, skew in ((a[done], (skew_ns, skew_cycles)), (b, (skew_ns, skew_cycles))):
        steps = t.diff(dim=1)  # [programs, slots - 1, (ns, cycles)]
        assert (steps[..., 0] >= -skew[0]).all() and (steps[..., 1] >= -skew[1]).all()
    assert b[:, 1, 0].min() >= a[done, 6, 0].max()


def test_gqa_decode_launch_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """From 2 rows on, the GQA decode's splits give one program an SM (a power of two); 64-token tiles over 3 stages
    without the first-tile preload, 2 with it; 32-token tiles where the (row, head block) pairs alone outnumber the
    SMs' 3-an-SM programs. One row keeps the rule of GQA_WAVES."""
    from ftransformers.attention import triton_backend as tb

    sms = 132
    assert tb.gqa_decode_launch(1, 8, sms) == (tb.num_kv_splits(1, 8, sms, tb.GQA_WAVES), tb.GQA_BLOCK_N, tb.GQA_STAGES)
    assert tb.gqa_decode_launch(8, 8, sms) == (4, 64, 2)  # Qwen3-8B: preload up to batch 8
    assert tb.gqa_decode_launch(8, 4, sms) == (8, 64, 2)  # Qwen3-30B-A3B
    assert tb.gqa_decode_launch(16, 8, sms) == (2, 64, 3)
    assert tb.gqa_decode_launch(32, 8, sms) == (1, 64, 3)
    assert tb.gqa_decode_launch(64, 4, sms) == (1, 64, 3)  # 256 pairs: 3 programs an SM hold them
    assert tb.gqa_decode_launch(64, 8, sms) == (1, 32, 2)  # 512 pairs > 396: 32-token tiles
    assert tb.gqa_decode_launch(128, 4, sms) == (1, 32, 2)
    assert tb.gqa_decode_launch(2, 1, sms) == (tb.MAX_KV_SPLITS, 64, 2)  # capped
    for b in range(2, 257):
        for hb in (1, 2, 4, 8, 16):
            splits, tile, stages = tb.gqa_decode_launch(b, hb, sms)
            assert splits == 1 or b * hb * splits < 2 * sms, (b, hb, splits)  # about one program an SM
            assert tile == 64 or (splits == 1 and b * hb > tb.GQA_SLOTS * sms), (b, hb, tile)
            assert stages == (3 if tile == 64 and b > tb.GQA_PRELOAD_MAX_BS else 2), (b, hb, stages)
    monkeypatch.setattr(tb, "GQA_FILL", 0)  # the rule before: GQA_WAVES programs an SM, 64-token tiles, 2 stages
    assert tb.gqa_decode_launch(8, 8, sms) == (8, 64, 2)


def test_mla_split_rule() -> None:
    # one wave of (batch x head-block x split) programs on 132 SMs, at most the cap for the head count and
    # kernel (128 up to MLA_FEW_HEADS heads on the 64-head kernels, else 64; 64 on the few-heads kernel unless the
    # GPU has at least MLA_FEW_WIDE_SPLITS_GBPS_PER_SM of peak bandwidth an SM), a power of two above 64
    from types import SimpleNamespace

    from ftransformers.attention.triton_backend import (
        MLA_FEW_HEADS,
        mla_64_head_kernel_from,
        mla_block_h,
        mla_context_bounds,
        mla_decode_launch,
        mla_max_kv_splits,
        mla_num_kv_splits,
        peak_gbps_per_sm,
    )

    assert [mla_max_kv_splits(8), mla_max_kv_splits(MLA_FEW_HEADS), mla_max_kv_splits(64)] == [128, 128, 64]
    assert [mla_max_kv_splits(8, "gluon"), mla_max_kv_splits(8, "gluon_few"), mla_max_kv_splits(32, "gluon_few")] == [
        128, 64, 64]  # fmt: skip
    # peak bandwidth an SM from CUDA's properties: an H100 SXM's (2619 MHz, 5120 bits) and an H200's (3201, 6016)
    h100 = SimpleNamespace(memory_clock_rate=2619000, memory_bus_width=5120, multi_processor_count=132)
    h200 = SimpleNamespace(memory_clock_rate=3201000, memory_bus_width=6016, multi_processor_count=132)
    assert round(peak_gbps_per_sm(h100), 1) == 25.4 and round(peak_gbps_per_sm(h200), 1) == 36.5
    assert peak_gbps_per_sm(SimpleNamespace(multi_processor_count=132)) == 0.0  # a torch without the fields
    few = [mla_max_kv_splits(h, "gluon_few", peak_gbps_per_sm(p)) for h in (8, 16, 32) for p in (h100, h200)]
    assert few == [64, 128, 64, 128, 64, 64]
    # the few-heads kernel runs 17-64 heads as two blocks of half up to batch 4, else one block (all heads)
    assert [mla_block_h(32, 1), mla_block_h(32, 4), mla_block_h(32, 5), mla_block_h(64, 1), mla_block_h(64, 5)] == [
        16, 16, 64, 32, 64]  # fmt: skip
    assert [mla_block_h(16, 1), mla_block_h(24, 2), mla_block_h(128, 1)] == [64, 16, 64]
    # the few-heads kernel forced: blocks it can take
    assert [mla_block_h(64, 5, "gluon_few"), mla_block_h(128, 1, "gluon_few"), mla_block_h(32, 1, "gluon_few")] == [
        32, 32, 16]  # fmt: skip
    # an H200 (>= MLA_FEW_WIDE_SPLITS_GBPS_PER_SM an SM): one block from the batch's longest sequence in
    # MLA_ONE_BLOCK_FROM, and the 64-head kernel on 128 splits at 33-64 heads; an H100 keeps two blocks everywhere
    fast, slow = peak_gbps_per_sm(h200), peak_gbps_per_sm(h100)
    assert [mla_block_h(64, b, "auto", fast, c) for b, c in ((1, 49151), (1, 49152), (2, 24576), (4, 16383))] == [
        32, 64, 64, 32]  # fmt: skip
    assert [mla_block_h(32, b, "auto", fast, c) for b, c in ((1, 1 << 20), (2, 16383), (2, 16384), (3, 0))] == [
        16, 16, 64, 64]  # fmt: skip
    assert [mla_block_h(64, 1, "auto", slow, 1 << 20), mla_block_h(64, 1, "gluon_few", fast, 1 << 20)] == [32, 32]
    assert [mla_block_h(16, 1, "auto", fast, 1 << 20), mla_block_h(64, 5, "auto", fast, 0)] == [64, 64]
    assert [mla_context_bounds(64, b, "auto", fast) for b in (1, 2, 3, 4, 5)] == [(49152,), (24576,), (16384,),
                                                                                (16384,), ()]  # fmt: skip
    assert [mla_context_bounds(32, b, "auto", fast) for b in (1, 2, 4)] == [(49152,), (16384,), ()]
    assert [mla_64_head_kernel_from(24, 1, fast), mla_64_head_kernel_from(24, 2, fast)] == [49152, None]
    assert [mla_64_head_kernel_from(24, 1, slow), mla_64_head_kernel_from(48, 1, fast)] == [None, None]
    # where the Gluon kernels cannot run (here: the CPU) the rules fall back to the Triton kernel, at any context
    q, latent = torch.zeros(1, 32, 512, dtype=torch.bfloat16), torch.zeros(4, 576, dtype=torch.bfloat16)
    assert mla_decode_launch(q, latent, 1, 1 << 17, 132, fast) == ("triton", 16, 64)
    assert mla_context_bounds(64, 1, "auto", slow) == mla_context_bounds(64, 1, "gluon", fast) == ()
    assert mla_context_bounds(16, 1, "auto", fast) == mla_context_bounds(128, 1, "auto", fast) == ()
    assert [mla_max_kv_splits(64, "gluon", fast), mla_max_kv_splits(64, "gluon", slow)] == [128, 64]
    assert [mla_max_kv_splits(128, "gluon", fast), mla_max_kv_splits(64, "gluon_few", fast)] == [64, 64]
    assert [mla_num_kv_splits(1, 1, 132, 128), mla_num_kv_splits(1, 1, 132, 64), mla_num_kv_splits(1, 2, 132, 64)] == [
        128, 64, 64]  # fmt: skip
    assert [mla_num_kv_splits(2, 1, 132, 128), mla_num_kv_splits(3, 1, 132, 128), mla_num_kv_splits(64, 2, 132)] == [
        64, 44, 1]  # fmt: skip
    for b in range(1, 300):
        for hb, cap in ((1, 128), (1, 64), (2, 64)):
            n = mla_num_kv_splits(b, hb, 132, cap)
            assert 1 <= n <= cap and (b * hb * n <= 132 or n == 1)
            assert n <= 64 or n & (n - 1) == 0


@pytest.mark.parametrize("shape", MLA_SHAPES[:1])
def test_mla_extend(shape: tuple[int, int, int]) -> None:
    H, L, R = shape
    gen = torch.Generator().manual_seed(3)
    prefix, ext = EXTEND
    if not CUDA:
        prefix, ext = prefix[:3], ext[:3]
    T, lens = sum(ext), [p + e for p, e in zip(prefix, ext)]
    N = sum(lens) + 10
    r2t, rows = paged(lens, N, gen)
    buf = randn(N + 1, L + R, gen=gen)
    q_nope, q_rope, latent = randn(T, H, L, gen=gen), randn(T, H, R, gen=gen), randn(T, L + R, gen=gen)
    loc = torch.cat([r2t[r, p : p + e] for r, p, e in zip(rows.tolist(), prefix, ext)])
    buf[loc] = latent
    ext_t = torch.tensor(ext, device=DEV)
    out = torch.full_like(q_nope, float("nan"))
    scale = (L + R) ** -0.5
    mla_extend_fwd(q_nope, q_rope, latent, out, buf, r2t, rows, torch.tensor(prefix, device=DEV), ext_t,
                   torch.cumsum(ext_t, 0) - ext_t, max(ext), scale)  # fmt: skip
    ref = mla_attention_ref(q_nope, q_rope, buf, r2t, rows, prefix, ext, scale)
    assert rel_err(out, ref) <= TOL


def _batch(mode: ForwardMode, prefix: list[int], ext: list[int], pool: object, backend: object, gen: torch.Generator) -> ForwardBatch:
    lens = [p + e for p, e in zip(prefix, ext)]
    r2t, rows = paged(lens, pool.size, gen)  # type: ignore[attr-defined]
    loc = torch.cat([r2t[r, p : p + e] for r, p, e in zip(rows.tolist(), prefix, ext)])
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros_like(loc), positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)]).to(DEV),
        out_cache_loc=loc, req_pool_indices=rows, seq_lens=t(lens), prefix_lens=t(prefix), extend_lens=t(ext),
        seq_lens_cpu=lens, prefix_lens_cpu=prefix, extend_lens_cpu=ext, logits_indices=t([0]), req_to_token=r2t,
        kv_pool=pool, attn_backend=backend,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_matches_torch_native(mode: ForwardMode) -> None:
    """Both backends on one ForwardBatch and identical pools: the stored K/V and outputs agree."""
    gen = torch.Generator().manual_seed(11)
    prefix, ext = ([0, 5, 12], [6, 1, 9]) if mode == ForwardMode.EXTEND else ([0, 5, 40], [1, 1, 1])
    T = sum(ext)
    triton_be, native_be = create_attention_backend("triton"), create_attention_backend("torch_native")
    mha_spec, mla_spec = MHAKVSpec(1, 2, 32, 32), MLAKVSpec(1, 32, 16)
    pools = {}
    for name in ("triton", "native"):
        torch.manual_seed(5)
        pools[name] = (MHAKVPool(mha_spec, 128, DTYPE, DEV), MLAKVPool(mla_spec, 128, DTYPE, DEV))
        for buf in (*pools[name][0].k_buffers, *pools[name][0].v_buffers, *pools[name][1].latent_buffers):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(buf.numel())))
    q, k, v = randn(T, 8, 32, gen=gen), randn(T, 2, 32, gen=gen), randn(T, 2, 32, gen=gen)
    q_nope, q_rope, latent = randn(T, 16, 32, gen=gen), randn(T, 16, 16, gen=gen), randn(T, 48, gen=gen)
    outs = {}
    for name, be in (("triton", triton_be), ("native", native_be)):
        mha_pool, mla_pool = pools[name]
        fb = _batch(mode, prefix, ext, mha_pool, be, torch.Generator().manual_seed(99))
        be.init_forward_metadata(fb)
        o_mha = be.forward_mha(q, k, v, 0, 32**-0.5, fb)
        fb.kv_pool = mla_pool
        o_mla = be.forward_mla(q_nope, q_rope, latent, 0, 48**-0.5, fb)
        outs[name] = (o_mha, o_mla)
    assert rel_err(outs["triton"][0], outs["native"][0]) <= TOL
    assert rel_err(outs["triton"][1], outs["native"][1]) <= TOL
    assert torch.equal(pools["triton"][0].k_buffers[0], pools["native"][0].k_buffers[0])
    assert torch.equal(pools["triton"][1].latent_buffers[0], pools["native"][1].latent_buffers[0])


def test_backend_decode_context_bounds() -> None:
    """The triton backend reports the MLA launch's context bounds for the heads its decodes ran, on the GPU it
    ran them on (none before a decode, none on a GPU without the bandwidth an SM, none for GQA); a decode's context
    is its graph's (ForwardBatch.decode_context), else its longest sequence."""
    from types import SimpleNamespace

    from ftransformers.attention.triton_backend import MLA_64_HEAD_KERNEL_FROM, MLA_ONE_BLOCK_FROM

    be = create_attention_backend("triton")
    assert be.decode_context_bounds(1) == ()
    be._gpu_facts, be._mla_heads = (132, 36.5), {64}  # an H200, after a decode of 64 heads
    assert [be.decode_context_bounds(b) for b in (1, 2, 4, 8)] == [
        (MLA_ONE_BLOCK_FROM[64][1],), (MLA_ONE_BLOCK_FROM[64][2],), (MLA_ONE_BLOCK_FROM[64][4],), ()]  # fmt: skip
    be._mla_heads = {64, 24}  # two models' decodes: every bound of either
    assert be.decode_context_bounds(2) == tuple(sorted({MLA_ONE_BLOCK_FROM[64][2], MLA_ONE_BLOCK_FROM[32][2]}))
    assert be.decode_context_bounds(1) == tuple(sorted({MLA_ONE_BLOCK_FROM[64][1], MLA_64_HEAD_KERNEL_FROM[32][1]}))
    be._gpu_facts = (132, 25.4)  # an H100
    assert be.decode_context_bounds(1) == be.decode_context_bounds(2) == ()
    # a GQA decode where clusters are supported: batch 1 of at most GQA_CLUSTER_MAX_HEAD_BLOCKS head blocks gets
    # a graph below and one from GQA_CLUSTER_BELOW
    from ftransformers.attention import triton_backend as tb

    be._gqa_clustered = 4  # Qwen3-30B-A3B: 4 KV heads of 8 query heads, one block each
    assert be.decode_context_bounds(1) == (tb.GQA_CLUSTER_BELOW,) and be.decode_context_bounds(2) == ()
    be._gqa_clustered = tb.GQA_CLUSTER_MAX_HEAD_BLOCKS + 1
    assert be.decode_context_bounds(1) == ()
    batch = SimpleNamespace(decode_context=None, seq_lens_cpu=[7, 300, 12])
    assert be._decode_context(batch) == 300
    batch.decode_context = 0  # a graph of the shortest range, whatever its placeholder lengths
    assert be._decode_context(batch) == 0


@pytest.mark.skipif(not (CUDA and cluster_supported(DEV)), reason="thread-block clusters need a Hopper GPU")
@pytest.mark.parametrize("context", [None, 1 << 12])
def test_backend_gqa_decode_in_clusters(context: int | None) -> None:
    """The backend's batch-1 GQA decode of 4 KV heads (Qwen3-30B-A3B's shape) runs in clusters below
    GQA_CLUSTER_BELOW (decode_context None: its short sequence) and as 64 splits from it (a long range's graph over
    the same sequence): both equal torch_native, and the decode records its head blocks for the graph bounds."""
    from ftransformers.attention import triton_backend as tb

    gen = torch.Generator().manual_seed(47)
    prefix, H_kv, group, D = [300], 4, 8, 128
    triton_be, native_be = create_attention_backend("triton"), create_attention_backend("torch_native")
    q, k, v = randn(1, H_kv * group, D, gen=gen), randn(1, H_kv, D, gen=gen), randn(1, H_kv, D, gen=gen)
    outs = {}
    for name, be in (("triton", triton_be), ("native", native_be)):
        pool = MHAKVPool(MHAKVSpec(1, H_kv, D, D), 320, DTYPE, DEV)
        for buf in (*pool.k_buffers, *pool.v_buffers):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(buf.numel())))
        fb = _batch(ForwardMode.DECODE, prefix, [1], pool, be, torch.Generator().manual_seed(99))
        fb.decode_context = context if name == "triton" else None
        be.init_forward_metadata(fb)
        outs[name] = be.forward_mha(q, k, v, 0, D**-0.5, fb)
    assert rel_err(outs["triton"], outs["native"]) <= TOL
    assert triton_be._gqa_clustered == H_kv and triton_be.decode_context_bounds(1) == (tb.GQA_CLUSTER_BELOW,)


@pytest.mark.skipif(not CUDA, reason="the Gluon MLA kernels and their launch rules need a GPU")
@pytest.mark.parametrize("heads", [8, 32, 64])
@pytest.mark.parametrize("batch", [1, 2, 3, 6])
@pytest.mark.parametrize("context", [None, 1 << 17])
def test_backend_mla_decode_launch_rules(heads: int, batch: int, context: int | None) -> None:
    """The triton backend's MLA decode at DeepSeek's latent widths (512 + 64), where it picks the stage-1
    kernel, the heads a program (32 heads: two programs of 16 up to batch 4, fewer on an H200) and the split
    count, against torch_native on the same batch; also as a graph of the longest contexts would launch it
    (decode_context 128K: on an H200 one block of all heads, 32 heads at batch 1 on the 64-head kernel) over these
    short sequences."""
    gen = torch.Generator().manual_seed(heads * 10 + batch)
    prefix = [700 + 611 * i for i in range(batch)]
    triton_be, native_be = create_attention_backend("triton"), create_attention_backend("torch_native")
    outs, pools = {}, {}
    q_nope, q_rope = randn(batch, heads, 512, gen=gen), randn(batch, heads, 64, gen=gen)
    latent = randn(batch, 576, gen=gen)
    for name, be in (("triton", triton_be), ("native", native_be)):
        pools[name] = pool = MLAKVPool(MLAKVSpec(1, 512, 64), sum(prefix) + batch + 8, DTYPE, DEV)
        cache = pool.latent_buffers[0]
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(3)))
        fb = _batch(ForwardMode.DECODE, prefix, [1] * batch, pool, be, torch.Generator().manual_seed(99))
        fb.decode_context = context if name == "triton" else None
        be.init_forward_metadata(fb)
        outs[name] = be.forward_mla(q_nope, q_rope, latent, 0, 576**-0.5, fb)
    assert rel_err(outs["triton"], outs["native"]) <= TOL
    assert torch.equal(pools["triton"].latent_buffers[0], pools["native"].latent_buffers[0])


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_llm_end_to_end_matches_torch_native(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Greedy tokens and top-5 log-probs of `LLM(attention_backend="triton")` equal torch_native's
    (float32, 1e-3), with chunked prefill mixing chunks and decodes, then a radix-cache hit."""
    from ftransformers import LLM, SamplingParams
    from tests.model_harness import make_tiny_checkpoint

    path = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in ([3, 11, 20] if not CUDA else [3, 11, 26, 47])]
    params = SamplingParams(temperature=0.0, max_tokens=6 if not CUDA else 24, ignore_eos=True, logprobs=5)
    results = {}
    for backend in ("triton", "torch_native"):
        llm = LLM(str(path), dtype="float32", device=DEV.type, chunked_prefill_size=8, max_total_tokens=1024,
                  skip_tokenizer_init=True, attention_backend=backend, moe_backend="torch_native")  # fmt: skip
        results[backend] = [llm.generate(prompt_token_ids=prompts, sampling_params=params) for _ in range(2)]
    for run_t, run_n in zip(results["triton"], results["torch_native"]):
        for a, b in zip(run_t, run_n):
            assert a.token_ids == b.token_ids
            for ea, eb in zip(a.logprobs or [], b.logprobs or []):
                assert abs(ea.logprob - eb.logprob) <= 1e-3
                for (ta, la), (tb, lb) in zip(ea.top_logprobs, eb.top_logprobs):
                    assert ta == tb and abs(la - lb) <= 1e-3
    assert all(o.cached_tokens > 0 for o in results["triton"][1])


def test_mla_decode_kernel_choice() -> None:
    """A bad kernel name, and asking for the Gluon kernel where it cannot run, are errors that say why."""
    q_nope, q_rope = torch.zeros(1, 16, 64), torch.zeros(1, 16, 16)
    buf, out = torch.zeros(4, 80), torch.zeros(1, 16, 64)
    args = (buf, out, torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64), *decode_scratch(1, 16, 64, 1, "cpu"), 1, 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="kernel must be"):
        mla_decode_fwd(q_nope, q_rope, *args, kernel="cuda")
    assert mla_decode_kernel(q_nope, buf, "auto") == mla_decode_kernel(q_nope, buf, "triton") == "triton"
    with pytest.raises(ValueError, match="Gluon MLA decode kernel does not apply here: it needs a Hopper GPU"):
        mla_decode_fwd(q_nope, q_rope, *args, kernel="gluon")
    with pytest.raises(ValueError, match="Gluon MLA decode kernel does not apply here: it needs a Hopper GPU"):
        mla_decode_fwd(q_nope, q_rope, *args, kernel="gluon_few")
    wide = torch.zeros(1, 64, 64), torch.zeros(1, 64, 16)  # more heads than the few-heads kernel's widest N
    args = (buf, torch.zeros(1, 64, 64), *args[2:5], *decode_scratch(1, 64, 64, 1, "cpu"), 1, 0.1)
    too_many = "does not apply here: the few-heads kernel takes at most 32 heads a program, not 64"
    with pytest.raises(ValueError, match=too_many):
        mla_decode_fwd(*wide, *args, kernel="gluon_few")
    if CUDA and torch.cuda.get_device_capability()[0] == 9:  # what "auto" takes on Hopper, by head count
        latent = torch.zeros(4, 576, dtype=torch.bfloat16, device="cuda")
        queries = [torch.zeros(1, h, 512, dtype=torch.bfloat16, device="cuda") for h in (8, 32, 64)]
        assert [mla_decode_kernel(q, latent) for q in queries] == ["gluon_few", "gluon_few", "gluon"]
        assert mla_decode_kernel(queries[2], latent, "auto", 32) == "gluon_few"  # 64 heads in blocks of 32


@pytest.mark.skipif(not (CUDA and cluster_supported(DEV)), reason="the stamps' asm and clusters need a Hopper GPU")
def test_gqa_stage1_stamps_keep_the_output_and_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's clustered batch-1 GQA decode with stage 1's diagnostic timestamps (STAGE1_STAMP_SINK,
    benchmarks/ab_decode.py --stamps): the output bit for bit as without them, and every program (clusters run each
    to the end) stamps all STAGE1_PHASES in order, within a skew between warps."""
    from ftransformers.attention import triton_backend as tb
    from ftransformers.kernels import triton_decode_attention as tda
    from ftransformers.kernels.cluster import max_cluster_size
    from ftransformers.kernels.stamps import StampSink

    gen = torch.Generator().manual_seed(52)
    prefix, H_kv, group, D = [300], 4, 8, 128
    be = create_attention_backend("triton")
    q, k, v = randn(1, H_kv * group, D, gen=gen), randn(1, H_kv, D, gen=gen), randn(1, H_kv, D, gen=gen)
    pool = MHAKVPool(MHAKVSpec(1, H_kv, D, D), 320, DTYPE, DEV)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(buf.numel())))
    fb = _batch(ForwardMode.DECODE, prefix, [1], pool, be, torch.Generator().manual_seed(99))
    be.init_forward_metadata(fb)
    plain = be.forward_mha(q, k, v, 0, D**-0.5, fb).clone()
    sink = StampSink(4096, int(tda.STAGE1_STAMP_SLOTS), torch.device(DEV))
    monkeypatch.setattr(tda, "STAGE1_STAMP_SINK", sink)
    stamped = be.forward_mha(q, k, v, 0, D**-0.5, fb)
    torch.cuda.synchronize()
    assert torch.equal(plain, stamped) and len(sink.views) == 1
    t = sink.views[0].cpu()  # [programs, slots, (ns, cycles)]
    assert t.shape[0] == H_kv * min(tb.GQA_CLUSTER, max_cluster_size(torch.device(DEV)))  # head blocks x splits
    assert (t >= 0).all(), "a program skipped a phase"
    steps = t.diff(dim=1)
    assert (steps[..., 0] >= -200).all() and (steps[..., 1] >= -400).all()


def test_stamp_sink_gives_each_launch_its_own_rows() -> None:
    """StampSink (kernels/stamps.py): consecutive views of one buffer, in launch order, filled with -1; a launch that
    does not fit, or asks for other slots, is refused."""
    from ftransformers.kernels.stamps import StampSink

    sink = StampSink(10, 3, torch.device("cpu"))
    a, b = sink.take(4, 3), sink.take(6, 3)
    assert a.shape == (4, 3, 2) and b.shape == (6, 3, 2) and (a == -1).all() and (b == -1).all()
    b.fill_(7)
    assert (sink.buf[4:] == 7).all() and (sink.buf[:4] == -1).all() and [v.data_ptr() for v in sink.views] == [
        a.data_ptr(), b.data_ptr()]  # fmt: skip
    with pytest.raises(ValueError, match="do not fit"):
        sink.take(1, 3)
    with pytest.raises(ValueError, match="do not fit"):
        StampSink(4, 3, torch.device("cpu")).take(2, 5)
