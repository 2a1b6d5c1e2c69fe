"""The Gluon MLA decode kernel compiles for Hopper on any machine (no GPU needed: Triton lowers it to
sm_90 PTX and cubin offline), so CI catches a Triton that no longer takes it. Its GPU results are
checked in tests/test_triton_attention.py::test_mla_decode on an H100. The compile runs in a child
process: the test session runs Triton's interpreter (conftest), which replaces the standard library's
jit functions the compiler needs.

What the compiled kernel must show: it fits the 227 KiB of shared memory a Hopper block may use; the
scores are computed once, 36 wgmmas for the 576-deep q . [c_kv | k_pe]: by one warpgroup as m64n64
(SCORES_ONE_WG, the default), or as m64n32, each of the two warpgroups taking half of a 64-token tile
(the Triton kernel's duplicated QK product would be m64n64 in both); P V as m64n256 (each warpgroup half
of the 512 latent columns); the gather as cp.async tracked by mbarriers in a load partition that hands
its registers to the compute warps.
ptxas (the one Triton runs for sm_90, with -v) must keep the wgmmas asynchronous and spill nothing: a
wgmma left in flight across the loop's back edge once made the ptxas of Triton 3.6 (the H100 image's)
serialise every wgmma of the kernel (its info C7515); Triton 3.9's ptxas did not, so on CI this check
guards only against the newer compiler doing so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")

SM90_MAX_SHARED = 227 * 1024


def _compile(heads_n: int = 0, stamped: bool = False, early: int = -1, one_wg: bool = True) -> dict:
    # in this process: shared bytes, PTX, ptxas -v log
    """heads_n 0: gluon_mla_decode's kernel; 8 / 16 / 32: gluon_mla_few_heads' kernel at that wgmma N (stamped:
    with its diagnostic timestamps, kernels/stamps.py; early: its EARLY_TILES, or gluon_mla_decode's EARLY_TILE,
    -1 the module's; one_wg: gluon_mla_decode's SCORES_ONE_WG)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    from ftransformers.kernels import gluon_mla_decode, gluon_mla_few_heads

    g = gluon_mla_few_heads if heads_n else gluon_mla_decode

    sig = {n: "*bf16" for n in ("Q_NOPE", "Q_ROPE", "KV", "O")}
    sig |= {
        "req_to_token": "*i64",
        "req_pool_indices": "*i64",
        "seq_lens": "*i64",
        "mid_o": "*fp32",
        "mid_lse": "*fp32",
    }
    sig |= {"sm_scale": "fp32", "num_kv_splits": "i32", "min_split_len": "i32", "num_heads": "i32"}
    strides = [
        "s_qn_b",
        "s_qn_h",
        "s_qr_b",
        "s_qr_h",
        "s_kv",
        "s_r2t",
        "s_o_b",
        "s_o_h",
        "s_mo_b",
        "s_mo_h",
        "s_mo_s",
        "s_ml_b",
        "s_ml_h",
    ]
    sig |= dict.fromkeys(strides, "i32")
    consts = {"L": 512, "R": 64} | ({"HN": heads_n} if heads_n else {"BLOCK_H": g.BLOCK_H})
    consts |= {"BLOCK_N": g.BLOCK_N, "LOAD_WARPS": g.LOAD_WARPS, "LOAD_REGS": g.LOAD_REGS, "LOAD_ROWS": g.LOAD_ROWS}
    if heads_n:
        consts["EARLY_TILES"] = g.EARLY_TILES if early < 0 else early
    consts |= {"USE_PDL": True, "DIAG": 0}
    if not heads_n:
        consts |= {"ONE_WG": one_wg, "HALF_REGS": g.HALF_REGS}
        consts["EARLY"] = one_wg and bool(g.EARLY_TILE if early < 0 else early)
    if heads_n and stamped:
        sig["stamps"] = "*i64"
        consts["STAMPS"] = True
    elif heads_n:
        consts |= {"stamps": None, "STAMPS": False}
    sig |= dict.fromkeys(consts, "constexpr")
    names = list(sig)
    # what the JIT specialises at run time: 16-byte aligned pointers, strides divisible by 16 (576, ...)
    aligned = [n for n in names if sig[n].startswith("*") or n in strides]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    fn = g.mla_decode_stage1_few_heads if heads_n else g.mla_decode_stage1_gluon
    src = gluon_runtime.GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": 4 if not heads_n and one_wg else g.NUM_WARPS, "maxnreg": g.maxnreg()}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = get_ptxas(90).path  # the ptxas Triton itself runs for sm_90
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    return {"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"], "ptxas": log, "load_regs": g.LOAD_REGS,
            "half_regs": getattr(g, "HALF_REGS", 0)}  # fmt: skip


def _compile_in_child(heads_n: int = 0, stamped: bool = False, early: int = -1, one_wg: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, sys; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}; "
    code += f"from test_gluon_mla_compile import _compile; print(json.dumps(_compile({heads_n}, {stamped}, {early}, {one_wg})))"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("one_wg", "early"), [(True, 1), (False, 0), (True, 0)])
def test_gluon_mla_decode_compiles_for_hopper(one_wg: bool, early: int) -> None:
    """SCORES_ONE_WG: one warpgroup's m64n64 scores, and each warpgroup's m64n256 half of P V in its own partition
    (so twice in the PTX), the second warpgroup on HALF_REGS; otherwise both warpgroups' m64n32 scores. EARLY_TILE
    (one-warpgroup form only): the first tile's copies ahead of the PDL wait's griddepcontrol.wait, else none."""
    kernel = _compile_in_child(one_wg=one_wg, early=early)
    assert 0 < kernel["shared"] <= SM90_MAX_SHARED
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", kernel["ptx"])
    scores = "m64n64k16" if one_wg else "m64n32k16"
    assert sorted(set(shapes)) == sorted(["m64n256k16", scores]), shapes
    assert shapes.count(scores) == (512 + 64) // 16  # one loop body: the scores
    assert shapes.count("m64n256k16") == (2 if one_wg else 1) * 64 // 16  # P V over a 64-token tile
    if one_wg:
        assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{kernel['half_regs']};", kernel["ptx"])
    assert "cp.async.cg.shared.global" in kernel["ptx"]  # the paged gather, 16 bytes a copy
    # each load thread's copies tracked by the stage's mbarrier; the load warps' registers handed back
    assert "cp.async.mbarrier.arrive.noinc" in kernel["ptx"]
    assert re.search(rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{kernel['load_regs']};", kernel["ptx"])
    before = kernel["ptx"][: kernel["ptx"].index("griddepcontrol.wait")]
    assert before.count("cp.async.mbarrier.arrive.noinc") == early  # tile 0's arrivals, where it is copied early
    log = kernel["ptxas"]
    assert "C7515" not in log and "serialized" not in log, log  # every wgmma stays asynchronous
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log


@pytest.mark.parametrize(("heads_n", "early"), [(8, -1), (16, -1), (32, -1), (16, 0), (16, 1), (16, 2)])
def test_gluon_mla_few_heads_compiles_for_hopper(heads_n: int, early: int) -> None:
    """The few-heads kernel: the tokens are the wgmma M and the heads its N, so both dots are m64nHN (36
    for the 576-deep scores, 32 for O^T = c_kv^T P^T: 8 row blocks of 512 x 4 steps of the 64-token tile,
    the tile read M-major, i.e. transposed, which the wgmma's A and B flags say); the same load partition;
    no spills, every wgmma asynchronous; with none, one or both stages' first tiles copied before the PDL wait
    (EARLY_TILES), the copies before the wait's griddepcontrol.wait in the PTX."""
    kernel = _compile_in_child(heads_n, early=early)
    assert 0 < kernel["shared"] <= SM90_MAX_SHARED
    mmas = re.findall(
        rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads_n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, (%\w+), (%\w+), [^;]*, (\d), (\d);",
        kernel["ptx"],
    )
    assert len(re.findall(r"wgmma\.mma_async", kernel["ptx"])) == len(mmas) == 36 + 32, len(mmas)
    assert sum(m[2:] == ("0", "0") for m in mmas) == 36  # the scores: the tile and q both K-major
    assert sum(m[2:] == ("1", "1") for m in mmas) == 32  # O^T: the tile M-major, P^T N-major
    assert "cp.async.mbarrier.arrive.noinc" in kernel["ptx"]
    ptx = kernel["ptx"]
    if early >= 0:  # one noinc arrival a copied tile, and only the early ones ahead of the wait
        before = ptx[: ptx.index("griddepcontrol.wait")]
        assert before.count("cp.async.mbarrier.arrive.noinc") == early, early
    log = kernel["ptxas"]
    assert "C7515" not in log and "serialized" not in log, log
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log


def test_gluon_mla_few_heads_stamps_compile_for_hopper() -> None:
    """With its diagnostic timestamps (benchmarks/diag_mla_phases.py) the kernel still builds: the 7 stamps'
    %globaltimer and %clock64 reads, the same wgmmas, nothing spilled; without them (above) none of it is in."""
    kernel = _compile_in_child(16, stamped=True)
    ptx = kernel["ptx"]
    assert ptx.count("%globaltimer") == ptx.count("%clock64") == 7
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 36 + 32
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", kernel["ptxas"]), kernel["ptxas"]
    assert "%globaltimer" not in _compile_in_child(16)["ptx"]
