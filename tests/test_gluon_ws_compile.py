"""The warp-specialised int4 kernel (kernels/gluon_w4a16_ws.py) compiles for Hopper on any machine, offline to sm_90
PTX and cubin, in a child process (the test session runs Triton's interpreter). Its GPU results are checked in
tests/test_gluon_w4a16_ws.py on a Hopper GPU.

What each compiled kernel must show: m64nBNk16 wgmmas whose A and B are both shared-memory descriptors, one tile's
left in flight (`wgmma.wait_group 1`); x by TMA with its bytes expected on the stage's mbarrier, or by 16-byte cp.async
arriving on it (noinc); the producer's
decode (the LOP3 of the codes kernel's decoded form and its packed 16-bit FMAs); the partitions' registers set by
setmaxnreg to the config's producer count; ptxas spilling at most a few words and not serialising the wgmmas (its C751x
advisories); shared memory within what the config says it takes plus barriers.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

from test_gluon_mma_compile import compile_for_hopper, compiled_in_child

# (BM, BN, BK, stages, producer warps and registers, x by TMA, zeros and bias, x dtype, K parts, words ring): the
# default; cp.async x; 256 columns (y's own tile); 8 producer warps; fp16 x; K split 4 ways on 64 columns; the rule's
# two few-tile forms (kernels/gluon_w4a16_ws.py's FEW_TILES), split
JOBS = [(256, 128, 64, 4, 4, 128, True, True, "bf16", 1, 0), (256, 128, 64, 3, 4, 128, False, False, "bf16", 1, 0),
        (128, 256, 64, 2, 4, 152, True, True, "bf16", 1, 0), (256, 128, 64, 4, 8, 80, True, False, "bf16", 1, 0),
        (128, 128, 64, 5, 4, 128, False, True, "fp16", 1, 0), (128, 64, 64, 4, 4, 128, True, True, "bf16", 4, 0),
        (128, 64, 128, 3, 4, 128, True, True, "bf16", 2, 6), (128, 128, 128, 2, 4, 128, True, False, "fp16", 4, 4)]  # fmt: skip


def _compile() -> list[dict]:  # in this process, per job: its name, config, PTX and ptxas log
    from triton.experimental.gluon import language as gl

    from ftransformers.kernels import gluon_w4a16_ws as ws

    out = []
    for bm, bn, bk, stages, warps, regs, x_tma, zb, dt, split, words in JOBS:
        cfg = ws.WsConfig(bm, bn, bk, stages, producer_warps=warps, producer_regs=regs, x_tma=x_tma, split=split,
                          words_ahead=words)  # fmt: skip
        box = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16 if dt == "bf16" else gl.float16)
        types = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "b_ptr": f"*{dt}", "part_ptr": "*fp32", "cnt_ptr": "*i32",
                 "x_desc": f"tensordesc<{dt}[{bm}, {bk}],{box!r}>" if x_tma else f"*{dt}"}  # fmt: skip
        res = compile_for_hopper(ws._w4a16_ws_kernel, ws.constexprs(128, zb, zb, cfg), ws.CONSUMER_WARPS,
                                 ws.maxnreg(cfg), types)  # fmt: skip
        out.append({"name": f"{cfg} zeros/bias {zb} {dt}", "bn": bn, "regs": regs, "dt": dt, "tma": x_tma,
                    "split": split, "words": words, "bytes": cfg.shared_bytes(), **res})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_ws_compile")


def test_ws_kernel_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == len(JOBS)
    for k in kernels:
        ptx, log, name = k["ptx"], k["ptxas"], k["name"]
        t = "bf16" if k["dt"] == "bf16" else "f16"
        both_shared = rf"wgmma\.mma_async\.sync\.aligned\.m64n{k['bn']}k16\.f32\.{t}\.{t} \{{[^}}]*\}}, %rd\d+, %rd\d+"
        assert re.search(both_shared, ptx), name
        assert "wgmma.wait_group.sync.aligned 1;" in ptx, name
        if k["tma"]:  # x by one bulk tensor copy a tile, its bytes expected on the stage's barrier
            assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.arrive.expect_tx" in ptx, name
            assert k["words"] or "cp.async.cg.shared.global" not in ptx, name  # (the words ring's own, below)
        else:
            assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx and "cp.async.cg.shared.global" in ptx, name
        fma = "fma.rn.bf16x2" if k["dt"] == "bf16" else "fma.rn.f16x2"
        assert re.search(r"lop3\.b32\s+\S+, \S+, 0x000F000F, \S+, 0xEA;", ptx) and fma in ptx, name
        assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{k['regs']};", ptx), name
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        # a few words at most (the 3-stage cp.async form spills 28 bytes under Triton 3.9's ptxas, as the 256-column
        # form under the H200's Triton 3.6: both measured, docs/performance.md session 77)
        assert spilled and max(map(int, spilled.groups())) <= 32, (name, log)
        assert not re.search(r"C751\d", log), (name, log)
        assert k["bytes"] <= k["shared"] <= k["bytes"] + 1024, (name, k["shared"])
        # split K: one thread's acq_rel ticket between two of the consumer partition's own (named, 256-thread)
        # barriers, the partials read back from L2 (.cg); unsplit: no atomics at all
        no_bar = r"(?:(?!bar\.sync).)*"
        ticket = rf"bar\.sync\s+0, 256;{no_bar}atom\.global\.gpu\.acq_rel\.add\.u32{no_bar}bar\.sync\s+0, 256;"
        if k["split"] > 1:
            assert re.search(ticket, ptx, re.DOTALL) and "ld.global.cg" in ptx, name
        else:
            assert "atom." not in ptx, name
        # the words ring: 16-byte cp.asyncs into shared memory, waited down to words - 1 groups in flight
        if k["words"]:
            assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10, 0x10;", ptx), name
            assert f"cp.async.wait_group \t{k['words'] - 1};" in ptx, name
        else:
            assert "cp.async.wait_group" not in ptx, name
