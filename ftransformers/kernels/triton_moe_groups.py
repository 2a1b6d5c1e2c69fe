"""A few tokens' MoE pairs grouped by expert, for a gate-up that decodes an expert's rows once a group of pairs.

Pair j = t * top_k + k is (token t, its k-th expert ids[t, k]). Among the pairs of one expert, in pair order, pair
j's rank is the number of earlier pairs with its expert; j leads a group where its rank is a multiple of P, and the
group is j and the next P - 1 pairs of its expert after it (fewer at the end). Every pair is in exactly one group.

`group_pairs(ids, P)` -> groups [T * top_k, 1 + P] int32: row j = (expert, j, the group's other pairs in pair order,
-1 past its last) where j leads, (-1, j, ...) where it does not (the rest of that row is not meant to be read).
So a consumer launched over pairs runs a group in the program of its leader and leaves at once in the others; no
count, no compaction, graph-safe.

`_group_pairs_kernel`: program over BLOCK_J pairs j against all pairs i ([BLOCK_J, BLOCK_I] comparisons): the rank
is a sum over i < j, the group's s-th other pair the i > j of its expert with s of them in (j, i].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2
from ftransformers.kernels.pdl import pdl_enter, pdl_launch

# Pairs j a program, and its warps. H200 (benchmarks/results/group_pairs_shapes_s64_h200.log, a graph of 8 launches,
# uniform routings at top-8): 16 / 24 / 32 tokens 3.3 / 4.1 / 4.2 us at 8 pairs on 2 warps, against 5.7 / 8.3 / 8.1
# at 32 on 4 (the first form); 4 pairs on 1 warp 3.0 / 4.5 / 4.5.
BLOCK_J = 8
WARPS = 2
MAX_PAIRS = 1024  # one [BLOCK_J, next_pow2(pairs)] tile a program; a decode step's few tokens are far below


@cached_launch
@triton.jit
def _group_pairs_kernel(ids_ptr, out_ptr, num_pairs, P: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr,
                        USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(USE_PDL)
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    i = tl.arange(0, BLOCK_I)
    jv = j < num_pairs
    ej = tl.load(ids_ptr + j, mask=jv, other=-1)
    ei = tl.load(ids_ptr + i, mask=i < num_pairs, other=-2)  # never equal to a pair's or the padding's -1
    same = ej[:, None] == ei[None, :]  # [BJ, BI]
    rank = tl.sum((same & (i[None, :] < j[:, None])).to(tl.int32), axis=1)
    after = same & (i[None, :] > j[:, None])
    seen = tl.cumsum(after.to(tl.int32), axis=1)  # pairs of j's expert in (j, i]
    row = out_ptr + j.to(tl.int64) * (1 + P)
    tl.store(row, tl.where(rank % P == 0, ej, -1).to(tl.int32), mask=jv)
    tl.store(row + 1, j, mask=jv)
    for s in tl.static_range(1, P):
        tl.store(row + 1 + s, tl.max(tl.where(after & (seen == s), i[None, :], -1), axis=1), mask=jv)


def group_pairs(ids: torch.Tensor, p: int) -> torch.Tensor:
    """[T * top_k, 1 + p] int32 groups of up to p pairs of one expert (module docstring) from ids [T, top_k]."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    assert 0 < n <= MAX_PAIRS and p >= 1, (n, p)
    out = torch.empty(n, 1 + p, dtype=torch.int32, device=ids.device)
    _group_pairs_kernel[(cdiv(n, BLOCK_J),)](
        flat, out, n, P=p, BLOCK_J=BLOCK_J, BLOCK_I=max(16, next_pow2(n)), num_warps=WARPS, **pdl_launch(ids.device)
    )
    return out


@cached_launch
@triton.jit
def _leaders_kernel(groups_ptr, out_ptr, num_pairs, P: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    j = tl.arange(0, BLOCK)
    lead = (tl.load(groups_ptr + j.to(tl.int64) * (1 + P), mask=j < num_pairs, other=-1) >= 0).to(tl.int32)
    pos = tl.cumsum(lead, axis=0) - 1
    tl.store(out_ptr + 1 + pos, j, mask=lead > 0)
    tl.store(out_ptr, tl.sum(lead, axis=0))


def group_leaders(groups: torch.Tensor) -> torch.Tensor:
    """[1 + pairs] int32 from group_pairs' groups [pairs, 1 + P]: the number of groups, then the pairs that lead one,
    in pair order (the rest unwritten). One launch of one program, so a consumer can run a program per group instead
    of one per pair."""
    n, width = groups.shape
    out = torch.empty(1 + n, dtype=torch.int32, device=groups.device)
    _leaders_kernel[(1,)](groups, out, n, P=width - 1, BLOCK=max(16, next_pow2(n)), num_warps=4,
                          **pdl_launch(groups.device))  # fmt: skip
    return out


def group_pairs_ref(ids: torch.Tensor, p: int) -> torch.Tensor:
    """group_pairs in plain PyTorch (the leaders' rows in full; other rows (-1, j, then -1))."""
    flat = ids.reshape(-1).tolist()
    out = torch.full((len(flat), 1 + p), -1, dtype=torch.int32)
    members: dict[int, list[int]] = {}
    for j, e in enumerate(flat):
        members.setdefault(e, []).append(j)
        out[j, 1] = j
    for e, js in members.items():
        for start in range(0, len(js), p):
            group = js[start : start + p]
            out[group[0], 0] = e
            out[group[0], 1 : 1 + len(group)] = torch.tensor(group, dtype=torch.int32)
    return out.to(ids.device)
