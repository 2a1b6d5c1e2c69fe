"""The MLA decode's first tiles copied before its PDL wait, on a Hopper GPU: the few-heads kernel's
(kernels/gluon_mla_few_heads.EARLY_TILES, also on fewer registers, LAUNCH_REGS) and the 64-head kernel's first tile
(gluon_mla_decode.EARLY_TILE). The output is bit for bit the one of the copies after the wait, and a tile that holds
the new token is never copied ahead of the wait. For the second, a PDL
predecessor lets the kernel launch at once, then writes the new token's latent row only milliseconds later: a copy of
that row before the wait reads the stale one."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ftransformers.kernels.triton_decode_attention import decode_scratch
from ftransformers.kernels.triton_mla_attention import gluon_mla_unsupported, mla_attention_ref

if not torch.cuda.is_available():
    pytest.skip("the Gluon MLA kernels and PDL need a GPU", allow_module_level=True)

DEV = torch.device("cuda")
L, R = 512, 64
# the few-heads kernel at 16 heads, the 64-head kernel at 64 (its module's knob: the early tiles)
HEADS = {"few": 16, "wide": 64}
# new tokens in tile 0 and tile 1 of their split, splits of one tile, rows of several splits, a padded row (0)
LENS = [1, 30, 64, 65, 100, 128, 129, 300, 4097, 0]
CASES = [(1, 0), (2, 0), (33, 0), (128, 0), (16, 512)]  # (KV splits, min split length)
NAN = float("nan")


@triton.jit
def _late_writer(src, dst, slots, s_row, n, WAIT_NS: tl.constexpr, BLOCK: tl.constexpr):
    # a program a row: lets its PDL dependent launch now, spins WAIT_NS on %globaltimer, then copies src's row into
    # dst's row at its slot
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)  # fmt: skip
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = t0
    while now - t0 < WAIT_NS:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    row = tl.program_id(0)
    slot = tl.load(slots + row)
    offs = tl.arange(0, BLOCK)
    tl.store(dst + slot * s_row + offs, tl.load(src + row * s_row + offs, mask=offs < n), mask=offs < n)


def _inputs(seed: int, H: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    n = sum(LENS) + 20
    perm = torch.randperm(n, generator=gen)
    r2t = torch.zeros(len(LENS), max(LENS), dtype=torch.int64)
    at = 0
    for i, m in enumerate(LENS):
        r2t[i, :m] = perm[at : at + m]
        at += m
    q_nope = torch.randn(len(LENS), H, L, generator=gen).to(DEV, torch.bfloat16)
    q_rope = torch.randn(len(LENS), H, R, generator=gen).to(DEV, torch.bfloat16)
    buf = torch.randn(n + 1, L + R, generator=gen).to(DEV, torch.bfloat16)
    rows = torch.arange(len(LENS), device=DEV)
    return q_nope, q_rope, buf, r2t.to(DEV), rows, torch.tensor(LENS, device=DEV)


def _run(kernel, q_nope, q_rope, buf, r2t, rows, seq_lens, splits, min_split_len, scratch=None) -> torch.Tensor:
    from ftransformers.kernels import gluon_mla_decode as wide
    from ftransformers.kernels import gluon_mla_few_heads as few

    # scratch: preallocated and poisoned, so that no torch op runs between a PDL predecessor and the kernel
    H = q_nope.shape[1]
    mid_o, mid_lse, out = scratch or (*decode_scratch(len(LENS), H, L, splits, DEV), torch.full_like(q_nope, NAN))
    launch = few.mla_decode_few_heads if kernel == "few" else wide.mla_decode
    launch(q_nope, q_rope, buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits, L**-0.5, min_split_len)
    return out


def _set_early(kernel: str, early: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftransformers.kernels import gluon_mla_decode as wide
    from ftransformers.kernels import gluon_mla_few_heads as few

    if kernel == "few":
        monkeypatch.setattr(few, "EARLY_TILES", early)
    else:
        monkeypatch.setattr(wide, "EARLY_TILE", early)


def _ref(q_nope, q_rope, buf, r2t, rows) -> torch.Tensor:
    real = len(LENS) - 1
    return mla_attention_ref(q_nope[:real], q_rope[:real], buf, r2t, rows[:real], [m - 1 for m in LENS[:real]],
                             [1] * real, L**-0.5)  # fmt: skip


@pytest.mark.parametrize(
    ("kernel", "early", "regs"), [("few", 1, 0), ("few", 2, 0), ("few", 1, 152), ("few", 2, 152), ("wide", 1, 0)]
)
def test_early_tiles_keep_the_output_bit_for_bit(
    kernel: str, early: int, regs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The few-heads kernel also launched on all the SM's registers and on fewer (LAUNCH_REGS, which its warpgroups'
    setmaxnreg redistribute)."""
    from ftransformers.kernels import gluon_mla_few_heads as few

    q_nope, q_rope, buf, r2t, rows, seq_lens = _inputs(early, HEADS[kernel])
    if gluon_mla_unsupported(q_nope, buf, kernel == "few") is not None:
        pytest.skip("the Gluon kernel does not run here")
    ref = _ref(q_nope, q_rope, buf, r2t, rows)
    for splits, min_split_len in CASES:
        _set_early(kernel, 0, monkeypatch)
        monkeypatch.setattr(few, "LAUNCH_REGS", 0)
        after = _run(kernel, q_nope, q_rope, buf, r2t, rows, seq_lens, splits, min_split_len)
        _set_early(kernel, early, monkeypatch)
        monkeypatch.setattr(few, "LAUNCH_REGS", regs)
        before = _run(kernel, q_nope, q_rope, buf, r2t, rows, seq_lens, splits, min_split_len)
        torch.cuda.synchronize()
        assert torch.equal(before, after), (splits, min_split_len)
        err = ((before[:-1].float() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()
        assert err <= 1e-2, (splits, min_split_len, err)
        assert torch.equal(before[-1], torch.zeros_like(before[-1]))


@pytest.mark.parametrize(("kernel", "early"), [("few", 0), ("few", 1), ("few", 2), ("wide", 0), ("wide", 1)])
def test_the_new_tokens_tile_waits_for_its_writer(kernel: str, early: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftransformers.kernels.pdl import pdl_launch

    q_nope, q_rope, buf, r2t, rows, seq_lens = _inputs(10 + early, HEADS[kernel])
    if gluon_mla_unsupported(q_nope, buf, kernel == "few") is not None or not pdl_launch(DEV):
        pytest.skip("the Gluon kernel or PDL does not run here")
    _set_early(kernel, early, monkeypatch)
    news = torch.tensor([int(r2t[i, m - 1]) for i, m in enumerate(LENS) if m > 0], device=DEV)
    fresh = (torch.randn(len(news), L + R, device=DEV) * 4).to(torch.bfloat16)
    final = buf.clone()
    final[news] = fresh
    ref = _ref(q_nope, q_rope, final, r2t, rows)
    for splits, min_split_len in CASES:
        stale = buf.clone()
        scratch = (*decode_scratch(len(LENS), HEADS[kernel], L, splits, DEV), torch.full_like(q_nope, NAN))
        torch.cuda.synchronize()
        # 2 ms: the host's launch of the attention behind it takes far less
        _late_writer[(len(news),)](fresh, stale, news, L + R, L + R, WAIT_NS=2_000_000, BLOCK=1024)
        out = _run(kernel, q_nope, q_rope, stale, r2t, rows, seq_lens, splits, min_split_len, scratch)
        torch.cuda.synchronize()
        assert torch.equal(stale, final)
        err = ((out[:-1].float() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()  # the worst row
        assert err <= 1e-2, (early, splits, min_split_len, err)
