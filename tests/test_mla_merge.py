"""The few-heads MLA decode merging its splits in stage 1 (kernels/gluon_mla_few_heads.MERGE), on a Hopper GPU: each
program counts itself in on its row's counter, waits for the row's other live splits, then merges a share of the
row's output. Checked against the float32 reference and against the same launch with stage 2 merging, over rows of one
split (no merge), several, a padded row, one and two head blocks; many launches back to back, each on fresh partials
poisoned with NaN, so that a program reading a partial before its writer stored it, or a counter left non-zero for
the next launch, shows."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from ftransformers.kernels.triton_decode_attention import decode_scratch
from ftransformers.kernels.triton_mla_attention import gluon_mla_unsupported, mla_attention_ref

if not torch.cuda.is_available():
    pytest.skip("the few-heads Gluon kernel needs a GPU", allow_module_level=True)

DEV = torch.device("cuda")
L, R = 512, 64
NAN = float("nan")
# (row lengths, KV splits, min split length, heads, heads a program)
CASES = [
    ([4097], 128, 0, 16, None),
    ([32768], 128, 0, 16, None),
    ([32768], 128, 0, 8, None),
    ([4097], 64, 0, 64, 32),
    ([1, 300, 4097, 0], 33, 0, 16, None),
    ([65, 129, 2000, 1000], 16, 512, 32, None),
    ([7000, 64], 2, 0, 16, None),
]


def _inputs(lens: list[int], heads: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens) + 20
    perm = torch.randperm(n, generator=gen)
    r2t = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    at = 0
    for i, m in enumerate(lens):
        r2t[i, :m] = perm[at : at + m]
        at += m
    q_nope = torch.randn(len(lens), heads, L, generator=gen).to(DEV, torch.bfloat16)
    q_rope = torch.randn(len(lens), heads, R, generator=gen).to(DEV, torch.bfloat16)
    buf = torch.randn(n + 1, L + R, generator=gen).to(DEV, torch.bfloat16)
    return q_nope, q_rope, buf, r2t.to(DEV), torch.arange(len(lens), device=DEV), torch.tensor(lens, device=DEV)


def _launch(few: ModuleType, inputs: tuple, splits: int, min_split_len: int, block_h: int | None) -> torch.Tensor:
    q_nope, q_rope, buf, r2t, rows, seq_lens = inputs
    mid_o, mid_lse = decode_scratch(len(rows), q_nope.shape[1], L, splits, DEV)
    mid_o.fill_(NAN)
    mid_lse.fill_(NAN)
    out = torch.full_like(q_nope, NAN)
    few.mla_decode_few_heads(q_nope, q_rope, buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, L**-0.5,
                             min_split_len, block_h)  # fmt: skip
    return out


def _check(out: torch.Tensor, inputs: tuple, lens: list[int], what: tuple) -> None:
    q_nope, q_rope, buf, r2t, rows, _ = inputs
    real = [i for i, m in enumerate(lens) if m > 0]
    ref = mla_attention_ref(q_nope[real], q_rope[real], buf, r2t, rows[real], [lens[i] - 1 for i in real],
                            [1] * len(real), L**-0.5)  # fmt: skip
    err = ((out[real].float() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()
    assert err <= 1e-2, (*what, err)
    for i, m in enumerate(lens):
        if m == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), what


@pytest.mark.parametrize(("lens", "splits", "min_split_len", "heads", "block_h"), CASES)
def test_merge_in_stage1_matches_stage2(
    lens: list[int], splits: int, min_split_len: int, heads: int, block_h: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ftransformers.kernels import gluon_mla_few_heads as few

    inputs = _inputs(lens, heads, splits + heads)
    if gluon_mla_unsupported(inputs[0], inputs[2], True, block_h) is not None:
        pytest.skip("the few-heads Gluon kernel does not run here")
    hn = few.heads_block(heads if block_h is None else block_h)
    monkeypatch.setattr(few, "MERGE", 1)
    if not few.merges(len(lens), heads, hn, splits, DEV):
        pytest.skip("this GPU has fewer SMs than the case's programs")
    merged = _launch(few, inputs, splits, min_split_len, block_h)
    monkeypatch.setattr(few, "MERGE", 0)
    staged = _launch(few, inputs, splits, min_split_len, block_h)
    torch.cuda.synchronize()
    what = (lens, splits, min_split_len, heads, block_h)
    _check(merged, inputs, lens, what)
    # float32 sums in another order, rounded to bf16: at most a unit or two in the last place apart
    torch.testing.assert_close(merged, staged, rtol=8e-3, atol=1e-5, msg=str(what))
    assert int(few.merge_counters(DEV).abs().sum()) == 0  # every launch leaves its counters at zero


def test_merge_back_to_back_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twelve launches in a row, no host sync between them, each on its own inputs and NaN-poisoned partials: each
    launch's programs wait for their own row's partials and leave the counters at zero for the next."""
    from ftransformers.kernels import gluon_mla_few_heads as few

    lens, splits, heads = [3000, 5000], 64, 16
    runs = [_inputs(lens, heads, 100 + i) for i in range(12)]
    if gluon_mla_unsupported(runs[0][0], runs[0][2], True) is not None:
        pytest.skip("the few-heads Gluon kernel does not run here")
    monkeypatch.setattr(few, "MERGE", 1)
    if not few.merges(len(lens), heads, few.heads_block(heads), splits, DEV):
        pytest.skip("this GPU has fewer SMs than the case's programs")
    outs = [_launch(few, inputs, splits, 0, None) for inputs in runs]
    torch.cuda.synchronize()
    for i, (out, inputs) in enumerate(zip(outs, runs, strict=True)):
        _check(out, inputs, lens, ("launch", i))
    assert int(few.merge_counters(DEV).abs().sum()) == 0


def test_merge_only_where_the_grid_fits_the_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftransformers.kernels import gluon_mla_few_heads as few

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    monkeypatch.setattr(few, "MERGE", 1)
    assert few.merges(1, 16, 16, sms, DEV)
    assert not few.merges(1, 16, 16, sms + 1, DEV)
    assert not few.merges(2, 64, 32, sms // 2, DEV)  # two head blocks: twice the programs
    assert not few.merges(1, 16, 16, 1, DEV)  # one split: nothing to merge
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert not few.merges(1, 16, 16, 64, DEV)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    monkeypatch.setattr(few, "MERGE", 0)
    assert not few.merges(1, 16, 16, 64, DEV)


def test_merge_stamp_follows_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the diagnostic stamps (benchmarks/diag_mla_phases.py): the output bit for bit as without them, and every
    live split's program stamps its merge (slot 7) after its partial's store (slot 6)."""
    from ftransformers.kernels import gluon_mla_few_heads as few
    from ftransformers.kernels.stamps import stamp_buffer

    lens, splits, heads = [3000, 5000], 32, 16
    inputs = _inputs(lens, heads, 7)
    if gluon_mla_unsupported(inputs[0], inputs[2], True) is not None:
        pytest.skip("the few-heads Gluon kernel does not run here")
    monkeypatch.setattr(few, "MERGE", 1)
    if not few.merges(len(lens), heads, few.heads_block(heads), splits, DEV):
        pytest.skip("this GPU has fewer SMs than the case's programs")
    q_nope, q_rope, buf, r2t, rows, seq_lens = inputs
    mid_o, mid_lse = decode_scratch(len(lens), heads, L, splits, DEV)
    plain, stamped = torch.full_like(q_nope, NAN), torch.full_like(q_nope, NAN)
    s1 = stamp_buffer(len(lens) * splits, few.STAMP_SLOTS, DEV)
    args = (r2t, rows, seq_lens, mid_o, mid_lse, splits, L**-0.5, 0)
    few.mla_decode_few_heads(q_nope, q_rope, buf, plain, *args)
    few.mla_decode_few_heads(q_nope, q_rope, buf, stamped, *args, None, (s1, None))
    torch.cuda.synchronize()
    assert torch.equal(plain, stamped)
    a = s1.cpu()
    live = a[:, 6, 0] >= 0
    assert int(live.sum()) > len(lens) and (a[live, 7, 0] >= a[live, 6, 0]).all() and (a[~live, 7] == -1).all()
